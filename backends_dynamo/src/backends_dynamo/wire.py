"""Dynamo 1.6.1's OpenAI frontend, token-in/token-out: request bodies and the mapping of answers to core types.

Requests. The frontend rejects unknown keys at the top level and inside ``nvext`` (400 naming the field), so
only fields it accepts are sent, and every sampling field is sent explicitly::

    POST /v1/chat/completions {"model", "messages": [one placeholder], "max_completion_tokens", "n": 1,
        "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "ignore_eos", "min_tokens",
        "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs": true, "top_logprobs",
        ["return_tokens_as_token_ids": true], "stream",
        "nvext": {"token_data": [prompt ids], "extra_fields": [...], ["cache_salt"], ["agent_hints": {"priority"}]}}
    POST /v1/completions {"model", "prompt": [prompt ids], "max_tokens", ...same sampling..., "logprobs": k,
        "nvext": {"extra_fields": [...], ...}}

``nvext.token_data`` replaces the prompt (the chat message is only there because the frontend needs one).

Answers: ``choices[0]`` (``finish_reason``, OpenAI logprobs) and ``nvext``, holding what ``extra_fields``
asked for: ``engine_data`` (the vLLM worker's own record, on the final chunk: ``prompt_token_ids``,
``completion_token_ids``, ``completion_logprobs``, ``prompt_logprobs``, ``routed_experts``), and the
frontend's ``completion_token_ids``, ``stop_reason``, ``prompt_logprobs``, ``routed_experts``,
``worker_id``, ``timing``.

Rules, each an error when broken: completion ids come from ``engine_data.completion_token_ids``, else
``nvext.completion_token_ids`` (never from text; absent is an error, ``[]`` a valid empty completion), and
the two must agree when both are there; logprobs come from ``engine_data.completion_logprobs`` when present
(the engine's channel wins), else from the OpenAI logprobs matched by token id, one per id; alternatives need
``token_id:<id>`` tokens (``return_tokens_as_token_ids``); ``usage.prompt_tokens`` and
``engine_data.prompt_token_ids`` must match the ids sent.

The abort trap: Dynamo 1.6.1 ends aborted requests with ``finish_reason: "stop"``. A ``stop`` without a stop
reason is reported as ``"abort"`` when it cannot be anything else (an empty completion, or ``ignore_eos``
without a matched stop id) or when this client aborted the request while it was in flight
(:attr:`Sample.aborted`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from backends_core.types import (
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    TeacherLogprobs,
    TeacherRequest,
    TopLogprob,
)
from backends_dynamo import answer
from backends_dynamo._json import U32, Node

__all__ = [
    "CHAT_PATH",
    "COMPLETIONS_PATH",
    "MAX_STOP_TOKEN_IDS",
    "PLACEHOLDER_MESSAGES",
    "Exchange",
    "Sample",
    "extra_fields_for",
    "generation_payload",
    "parse_generation",
    "parse_sample",
    "parse_prompt_ids",
    "parse_teacher",
    "teacher_payload",
    "tokenize_payload",
]

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
#: The chat route needs one message even when ``nvext.token_data`` replaces the prompt; it is ignored.
PLACEHOLDER_MESSAGES = ({"role": "user", "content": "(prompt in nvext.token_data)"},)
#: Dynamo 1.6.1 answers 400 to more stop token ids than this.
MAX_STOP_TOKEN_IDS = 32
_BASE_FIELDS = ("engine_data", "completion_token_ids", "stop_reason")


@attrs.frozen
class Sample:
    """One answer body and what the client knows about the time it was in flight.

    :ivar body: the decoded answer (a folded stream looks the same).
    :ivar aborted: this client aborted it while it was in flight (pause with mode abort, abort by id or all).
    :ivar weight_version: the weight version this client set on the server, when it did not change while the
        request was in flight (Dynamo does not attach it to answers).
    """

    body: Any
    aborted: bool = False
    weight_version: str | None = None


@attrs.frozen
class Exchange:
    """What ``post_generate`` hands to ``parse_response``: one :class:`Sample` per request sent (``n > 1`` fans
    out into ``n`` requests)."""

    samples: tuple[Sample, ...]


# -- requests -------------------------------------------------------------------------------------------


def extra_fields_for(request: GenerateRequest, metadata: Sequence[str] = ()) -> list[str]:
    """``nvext.extra_fields`` of a generation: the engine record, the ids, the stop reason, routed experts when
    asked, and any metadata fields (``worker_id``, ``timing``)."""
    fields = list(_BASE_FIELDS)
    if request.return_routed_experts:
        fields.append("routed_experts")
    fields.extend(f for f in metadata if f not in fields)
    return fields


def _sampling(s: SamplingParams) -> dict[str, Any]:
    return {
        "n": 1,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "min_p": s.min_p,
        "seed": s.seed,
        "stop_token_ids": list(s.stop_token_ids),
        "ignore_eos": s.ignore_eos,
        "min_tokens": s.min_tokens,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "repetition_penalty": s.repetition_penalty,
    }


def _nvext(request: GenerateRequest, extra_fields: list[str], *, token_data: bool) -> dict[str, Any]:
    nvext: dict[str, Any] = {}
    if token_data:
        nvext["token_data"] = list(request.prompt_ids)
    nvext["extra_fields"] = extra_fields
    if request.cache_salt is not None:
        nvext["cache_salt"] = request.cache_salt
    if request.priority is not None:
        nvext["agent_hints"] = {"priority": request.priority}
    return nvext


def generation_payload(
    request: GenerateRequest, model: str, *, transport: str, metadata: Sequence[str] = (), stream: bool = False
) -> tuple[str, dict[str, Any]]:
    """Path and body of one generation (``request.sampling.n`` must be 1: the caller fans out)."""
    s = request.sampling
    k = s.top_logprobs
    fields = extra_fields_for(request, metadata)
    body: dict[str, Any] = {"model": model}
    if transport == "chat":
        path = CHAT_PATH
        body["messages"] = [dict(m) for m in PLACEHOLDER_MESSAGES]
        body["max_completion_tokens"] = s.max_tokens
        body.update(_sampling(s))
        body["logprobs"] = True
        body["top_logprobs"] = k
    else:
        path = COMPLETIONS_PATH
        body["prompt"] = list(request.prompt_ids)
        body["max_tokens"] = s.max_tokens
        body.update(_sampling(s))
        body["logprobs"] = k
    if k:
        body["return_tokens_as_token_ids"] = True  # alternatives are only identifiable as "token_id:<id>"
    body["stream"] = stream
    if stream:
        body["stream_options"] = {"include_usage": True}
    body["nvext"] = _nvext(request, fields, token_data=transport == "chat")
    return path, body


def teacher_payload(request: TeacherRequest, model: str, *, transport: str) -> tuple[str, dict[str, Any]]:
    """Path and body scoring ``request.token_ids`` with ``prompt_logprobs``. ``max_tokens`` is 1 because the
    frontend rejects 0 (the generated token is ignored); sampling is neutral so processed logprobs equal raw."""
    neutral = {"n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "seed": 0}
    nvext: dict[str, Any] = {"extra_fields": ["engine_data", "prompt_logprobs"]}
    body: dict[str, Any] = {"model": model}
    if transport == "chat":
        body["messages"] = [dict(m) for m in PLACEHOLDER_MESSAGES]
        body["max_completion_tokens"] = 1
        nvext = {"token_data": list(request.token_ids), **nvext}
        path = CHAT_PATH
    else:
        body["prompt"] = list(request.token_ids)
        body["max_tokens"] = 1
        path = COMPLETIONS_PATH
    body.update(neutral)
    body["prompt_logprobs"] = request.top_logprobs
    body["stream"] = False
    body["nvext"] = nvext
    return path, body


def tokenize_payload(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    chat_template_kwargs: Mapping[str, Any],
    model: str,
) -> tuple[str, dict[str, Any]]:
    """Path and body that make the frontend render and tokenize ``messages`` with its own chat template: a one-token
    chat request whose ``engine_data.prompt_token_ids`` are the ids the worker received (1.6.1 has no
    ``/tokenize``)."""
    body: dict[str, Any] = {"model": model, "messages": [dict(m) for m in messages]}
    if tools:
        body["tools"] = [dict(t) for t in tools]
    if chat_template_kwargs:
        body["chat_template_kwargs"] = dict(chat_template_kwargs)
    body.update({"max_completion_tokens": 1, "n": 1, "temperature": 0.0, "stream": False})
    body["nvext"] = {"extra_fields": ["engine_data"]}
    return CHAT_PATH, body


# -- answers: whole results -----------------------------------------------------------------------------


def _only_choice(body: Node) -> Node:
    choices = body.get("choices").items()
    if len(choices) != 1:
        raise body.get("choices").fail(f"expected one choice (requests are sent with n=1), got {len(choices)}")
    return choices[0]


def _is_chat(body: Node) -> bool:
    kind = body.get("object").string()
    if kind not in ("chat.completion", "text_completion"):
        raise body.get("object").fail(f"expected 'chat.completion' or 'text_completion', got {kind!r}")
    return kind == "chat.completion"


def parse_sample(sample: Sample, request: GenerateRequest, server_url: str | None) -> GenerateResult:
    """One :class:`GenerateResult` from one answer of ``n=1``."""
    body = Node(sample.body, "$", server_url)
    chat = _is_chat(body)
    choice = _only_choice(body)
    nvext = answer.nvext_of(body)
    ids = answer.completion_ids(nvext)
    answer.check_prompt(nvext, request.prompt_ids)
    k = request.sampling.top_logprobs
    reason = answer.stop_reason(nvext)
    from backends_dynamo import extras  # extras reads Exchange from this module

    served_by = {
        "worker_id": extras.worker_ids(sample.body, server_url),
        "timing": extras.timing(sample.body, server_url),
    }
    return GenerateResult(
        prompt_ids=request.prompt_ids,
        completion_ids=ids,
        logprobs=answer.completion_logprobs(nvext, choice, ids, chat=chat),
        finish_reason=answer.finish_reason(choice, request, ids, reason, aborted=sample.aborted),
        stop_reason=reason,
        top_logprobs=answer.top_logprobs(choice, len(ids), k, chat=chat) if k else None,
        routed_experts=answer.routed_experts(nvext, request, ids),
        weight_version=sample.weight_version,
        usage=answer.usage(body, request.prompt_ids, len(ids)),
        request_id=body.get("id").string(),
        server=server_url,
        metadata={key: value for key, value in served_by.items() if value is not None},
    )


def parse_generation(raw: Any, request: GenerateRequest, server_url: str | None) -> list[GenerateResult]:
    """Results of a generation: ``raw`` is an :class:`Exchange` (what ``post_generate`` returns) or one answer
    body (golden tests, ``n == 1``)."""
    samples = raw.samples if isinstance(raw, Exchange) else (Sample(raw),)
    if len(samples) != request.sampling.n:
        raise Node(None, "$", server_url).fail(f"{len(samples)} answer(s) for n={request.sampling.n}")
    return [parse_sample(sample, request, server_url) for sample in samples]


def parse_prompt_ids(raw: Any, server_url: str | None) -> list[int]:
    """The prompt ids the worker received: ``engine_data.prompt_token_ids``, checked against ``usage``."""
    body = Node(raw, "$", server_url)
    engine = answer.engine_data(answer.nvext_of(body))
    if engine is None or not engine.has("prompt_token_ids"):
        raise answer.nvext_of(body).fail(
            "no nvext.engine_data.prompt_token_ids: the server's tokenization is only visible through the engine "
            "record of Dynamo's vLLM worker (the mocker has none)"
        )
    ids = engine.get("prompt_token_ids").token_ids()
    answer.usage(body, ids, 0)
    return list(ids)


def _prompt_rows(body: Node) -> Node:
    nvext = answer.nvext_of(body)
    engine = answer.engine_data(nvext)
    if engine is not None and engine.has("prompt_logprobs"):
        return engine.get("prompt_logprobs")
    if nvext.has("prompt_logprobs"):
        return nvext.get("prompt_logprobs")
    if body.has("prompt_logprobs"):
        return body.get("prompt_logprobs")
    raise nvext.fail(
        "no prompt logprobs: neither nvext.engine_data.prompt_logprobs, nvext.prompt_logprobs nor prompt_logprobs "
        "is in the answer (the Dynamo mocker never returns them)"
    )


def _key_id(row: Node, key: str) -> int:
    if not key.isdigit() or int(key) >= U32:
        raise row.fail(f"expected a token id as key, got {key!r}")
    return int(key)


def parse_teacher(
    raw: Any, request: TeacherRequest, server_url: str | None, *, weight_version: str | None = None
) -> TeacherLogprobs:
    """Teacher logprobs from ``prompt_logprobs``: ``[null, {"<id>": {logprob, rank}}, ...]``, one entry per id;
    position 0 becomes NaN."""
    body = Node(raw, "$", server_url)
    ids = request.token_ids
    answer.check_prompt(answer.nvext_of(body), ids)
    field = _prompt_rows(body)
    rows = field.items()
    if len(rows) != len(ids):
        raise field.fail(f"{len(rows)} entries for {len(ids)} token ids")
    if rows[0].value is not None:
        raise rows[0].fail("the first entry must be null (the first token has no prefix)")
    logprobs = np.full(len(ids), np.nan, dtype=np.float32)
    top: list[tuple[TopLogprob, ...]] = [()]
    k = request.top_logprobs
    for i in range(1, len(ids)):
        entries = rows[i].obj()
        key = str(ids[i])
        if key not in entries:
            raise rows[i].fail(f"no entry for token {ids[i]} (has {sorted(entries)})")
        logprobs[i] = rows[i].get(key).get("logprob").logprob()
        if k:
            alts = [
                TopLogprob(
                    token_id=_key_id(rows[i], t),
                    logprob=answer.f32(rows[i].get(t).get("logprob")),
                    rank=rows[i].get(t).get("rank").integer(),
                )
                for t in entries
            ]
            top.append(answer.best_alternatives(alts, k, rows[i]))
    return TeacherLogprobs(
        token_ids=ids, logprobs=logprobs, top_logprobs=tuple(top) if k else None, weight_version=weight_version
    )
