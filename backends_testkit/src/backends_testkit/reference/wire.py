"""Wire types of the reference dialect and their mapping to the core types.

Requests::

    POST /generate {"model", "input_ids", "sampling": {...every SamplingParams field but structured and extra
                    (the reference engine has neither)...}, "request_id",
                    "cache_salt", "priority", "lora", "return_routed_experts", "routed_experts_start"}
    POST /score    {"model", "input_ids", "top_logprobs", "lora"}

    /generate -> {"request_id", "weight_version", "prompt_tokens", "cached_tokens",
                  "samples": [{"output_ids", "output_logprobs", "top_logprobs": [[[id, logprob], ...], ...] | null,
                               "finish_reason", "stop_reason", "routed_experts": base64 .npy | null,
                               "routed_experts_start", "weight_versions": [{"version", "start", "end"}]}]}
    /generate, streamed -> data: {"output_ids": [new ids], "output_logprobs": [their logprobs]}  (per step)
                           data: {"finish": {"request_id", "weight_version", "prompt_tokens", "cached_tokens",
                                             "finish_reason", "stop_reason", "top_logprobs", "routed_experts",
                                             "routed_experts_start", "weight_versions"}}  (last; the sample
                                             without its ids and logprobs)
                           data: {"error": message}  (a failure once streaming)
    /score    -> {"logprobs": [null, float, ...], "top_logprobs": [null, [[id, logprob], ...], ...] | null,
                  "weight_version"}
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from backends_core.converters import make_converter, structure_response
from backends_core.errors import ResponseParseError
from backends_core.routed_experts import align_routed_experts, decode_routed_experts
from backends_core.types import (
    GenerateRequest,
    GenerateResult,
    StreamDelta,
    TeacherLogprobs,
    TeacherRequest,
    TopLogprob,
    Usage,
    WeightVersionSpan,
)

converter = make_converter()


def _stop_reason(value: Any, _type: Any) -> int | str | None:
    """A stop token id, a stop string, or null."""
    if value is None or isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise ValueError(f"expected a token id, a string or null, got {value!r}")


converter.register_structure_hook(int | str | None, _stop_reason)


@attrs.frozen
class WireSpan:
    version: str
    start: int
    end: int


@attrs.frozen
class WireSample:
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str
    stop_reason: int | str | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    routed_experts: str | None = None
    routed_experts_start: int = 0
    weight_versions: list[WireSpan] = attrs.field(factory=list)


@attrs.frozen
class WireGenerateResponse:
    request_id: str
    weight_version: str
    prompt_tokens: int
    samples: list[WireSample]
    cached_tokens: int | None = None


@attrs.frozen
class WireScoreResponse:
    logprobs: list[float | None]
    weight_version: str
    top_logprobs: list[list[tuple[int, float]] | None] | None = None


_FINISH = {"stop", "length", "abort"}


def generate_payload(request: GenerateRequest, model: str | None) -> dict[str, Any]:
    """The JSON body for ``POST /generate``: every sampling field explicitly."""
    s = request.sampling
    return {
        "model": request.model or model,
        "input_ids": list(request.prompt_ids),
        "sampling": {
            "max_tokens": s.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "min_p": s.min_p,
            "seed": s.seed,
            "n": s.n,
            "stop_token_ids": list(s.stop_token_ids or ()),
            "ignore_eos": s.ignore_eos,
            "min_tokens": s.min_tokens,
            "top_logprobs": s.top_logprobs,
            "repetition_penalty": s.repetition_penalty,
            "presence_penalty": s.presence_penalty,
            "frequency_penalty": s.frequency_penalty,
            "stop": list(s.stop),
            "logit_bias": {str(token): bias for token, bias in s.logit_bias.items()},
        },
        "request_id": request.request_id,
        "cache_salt": request.cache_salt,
        "priority": request.priority,
        "lora": request.lora,
        "return_routed_experts": request.return_routed_experts,
        "routed_experts_start": request.routed_experts_start,
    }


def parse_generate(raw: Any, request: GenerateRequest, server_url: str) -> list[GenerateResult]:
    body = structure_response(converter, raw, WireGenerateResponse, url=server_url)
    if body.prompt_tokens != len(request.prompt_ids):
        raise ResponseParseError(
            f"$.prompt_tokens is {body.prompt_tokens} but {len(request.prompt_ids)} prompt ids were sent",
            url=server_url,
        )
    results = []
    for i, sample in enumerate(body.samples):
        where = f"$.samples[{i}]"
        if sample.finish_reason not in _FINISH:
            raise ResponseParseError(
                f"{where}.finish_reason is {sample.finish_reason!r}, expected one of {sorted(_FINISH)}", url=server_url
            )
        if len(sample.output_logprobs) != len(sample.output_ids):
            raise ResponseParseError(
                f"{where}: {len(sample.output_logprobs)} output_logprobs for {len(sample.output_ids)} output_ids",
                url=server_url,
            )
        routed = None
        if request.return_routed_experts:
            if sample.routed_experts is None:
                raise ResponseParseError(f"{where}.routed_experts is missing although it was requested", url=server_url)
            experts = decode_routed_experts(sample.routed_experts, field=f"{where}.routed_experts", url=server_url)
            routed = align_routed_experts(
                experts,
                total_tokens=len(request.prompt_ids) + len(sample.output_ids),
                server_start=sample.routed_experts_start,
                wanted_start=request.routed_experts_start,
                field=f"{where}.routed_experts",
                url=server_url,
            )
        top = None
        k = request.sampling.top_logprobs
        if k:
            rows = sample.top_logprobs
            if rows is None or len(rows) != len(sample.output_ids) or any(len(row) != k for row in rows):
                raise ResponseParseError(
                    f"{where}.top_logprobs must hold {k} alternatives for each of {len(sample.output_ids)} tokens",
                    url=server_url,
                )
            top = tuple(
                tuple(TopLogprob(token_id=t, logprob=lp, rank=r + 1) for r, (t, lp) in enumerate(row)) for row in rows
            )
        results.append(
            GenerateResult(
                prompt_ids=request.prompt_ids,
                completion_ids=tuple(sample.output_ids),
                logprobs=np.asarray(sample.output_logprobs, dtype=np.float32),
                finish_reason=sample.finish_reason,  # type: ignore[arg-type]
                stop_reason=sample.stop_reason,
                top_logprobs=top,
                routed_experts=routed,
                weight_version=body.weight_version,
                weight_versions=tuple(
                    WeightVersionSpan(version=s.version, start=s.start, end=s.end) for s in sample.weight_versions
                ),
                usage=Usage(
                    prompt_tokens=body.prompt_tokens,
                    completion_tokens=len(sample.output_ids),
                    cached_tokens=body.cached_tokens,
                ),
                request_id=body.request_id,
                server=server_url,
            )
        )
    return results


@attrs.frozen
class WireStreamStep:
    output_ids: list[int]
    output_logprobs: list[float]


#: Keys of the final event that belong to the response rather than to its one sample.
_RESPONSE_KEYS = ("request_id", "weight_version", "prompt_tokens", "cached_tokens")


@attrs.define
class StreamState:
    """What a streamed generation delivered so far: the ids and logprobs of its steps and its final event."""

    output_ids: list[int] = attrs.Factory(list)
    output_logprobs: list[float] = attrs.Factory(list)
    finish: dict[str, Any] | None = None
    events: int = 0


def stream_payload(request: GenerateRequest, model: str | None) -> dict[str, Any]:
    """The JSON body of a streamed ``POST /generate``."""
    return {**generate_payload(request, model), "stream": True}


def stream_event(raw: Any, state: StreamState, server_url: str) -> StreamDelta | None:
    """One event of a streamed generation: a step becomes a delta (and is kept for :func:`finish_stream`); the
    final event is kept. An ``error`` event is for the caller to raise (see the hook)."""
    where = f"stream event {state.events}"
    state.events += 1
    if not isinstance(raw, dict):
        raise ResponseParseError(f"{where}: expected a JSON object, got {type(raw).__name__} @ $", url=server_url)
    if state.finish is not None:
        raise ResponseParseError(f"{where}: an event after the final one @ $", url=server_url)
    if "finish" in raw:
        finish = raw["finish"]
        if not isinstance(finish, dict):
            raise ResponseParseError(f"{where}: expected an object @ $.finish", url=server_url)
        state.finish = finish
        return None
    step = structure_response(converter, raw, WireStreamStep, url=server_url)
    if len(step.output_logprobs) != len(step.output_ids):
        raise ResponseParseError(
            f"{where}: {len(step.output_logprobs)} output_logprobs for {len(step.output_ids)} output_ids @ $",
            url=server_url,
        )
    state.output_ids += step.output_ids
    state.output_logprobs += step.output_logprobs
    return StreamDelta(
        completion_ids=tuple(step.output_ids), logprobs=np.asarray(step.output_logprobs, dtype=np.float32)
    )


def finish_stream(state: StreamState, request: GenerateRequest, server_url: str) -> GenerateResult:
    """The result of a streamed generation: its steps' ids and logprobs with the final event's fields, read by
    :func:`parse_generate` as the same sample answered whole."""
    if state.finish is None:
        raise ResponseParseError("the stream ended without its final event ($.finish)", url=server_url)
    finish = state.finish
    sample = {k: v for k, v in finish.items() if k not in _RESPONSE_KEYS}
    sample["output_ids"], sample["output_logprobs"] = state.output_ids, state.output_logprobs
    body = {k: finish[k] for k in _RESPONSE_KEYS if k in finish}
    body["samples"] = [sample]
    (result,) = parse_generate(body, request, server_url)
    return result


def score_payload(request: TeacherRequest, model: str | None) -> dict[str, Any]:
    return {
        "model": request.model or model,
        "input_ids": list(request.token_ids),
        "top_logprobs": request.top_logprobs,
        "lora": request.lora,
    }


def parse_score(raw: Any, request: TeacherRequest, server_url: str) -> TeacherLogprobs:
    body = structure_response(converter, raw, WireScoreResponse, url=server_url)
    n = len(request.token_ids)
    if len(body.logprobs) != n:
        raise ResponseParseError(f"$.logprobs has {len(body.logprobs)} entries for {n} token ids", url=server_url)
    if body.logprobs[0] is not None:
        raise ResponseParseError("$.logprobs[0] must be null (the first token has no prefix)", url=server_url)
    missing = [i for i, v in enumerate(body.logprobs[1:], 1) if v is None]
    if missing:
        raise ResponseParseError(f"$.logprobs[{missing[0]}] is null", url=server_url)
    logprobs = np.array([np.nan, *body.logprobs[1:]], dtype=np.float32)
    top = None
    if body.top_logprobs is not None:
        if len(body.top_logprobs) != n:
            raise ResponseParseError(
                f"$.top_logprobs has {len(body.top_logprobs)} rows for {n} token ids", url=server_url
            )
        top = tuple(
            tuple(TopLogprob(token_id=t, logprob=lp, rank=r + 1) for r, (t, lp) in enumerate(row or ()))
            for row in body.top_logprobs
        )
    return TeacherLogprobs(
        token_ids=request.token_ids, logprobs=logprobs, top_logprobs=top, weight_version=body.weight_version
    )


@attrs.frozen
class WireState:
    paused: bool
    sleeping: bool
    weight_version: str
    in_flight: int
    loras: list[str]


@attrs.frozen
class WireAbort:
    aborted: int
