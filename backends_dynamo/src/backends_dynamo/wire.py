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

Streaming. Server-sent events are read into chunks, and the chunks folded into the shape of a non-streamed
answer.

Dynamo streams ``data: {chunk}`` events ending with ``data: [DONE]``. Per chunk, ``nvext.completion_token_ids``
holds that chunk's new ids (the final chunk of the mocker carries ``[]``); ``engine_data``, ``timing`` and
``stop_reason`` come on the chunk that carries ``finish_reason``; usage comes last when
``stream_options.include_usage`` is set. :func:`fold` concatenates the deltas (text, OpenAI logprobs, ids) and
keeps the last value of everything else, so :func:`parse_sample` reads a folded stream
like any answer, including the check that the concatenated ids equal ``engine_data.completion_token_ids``.
Streamed to the caller (``Client.stream``), :class:`StreamFold` reads the chunks one by one as they arrive (each
chunk's new ids and their OpenAI logprobs become a delta) and folds them the same way at the end.

Metadata. What Dynamo adds to an answer when asked (``nvext.extra_fields``): which worker served it, and timing.

Every result carries them in ``GenerateResult.metadata`` (``"worker_id"``: :class:`WorkerIds`, ``"timing"``:
:class:`Timing`) when they were asked for with ``backend_options.extra_fields``; they can also be read from a raw
answer with :func:`worker_ids` and :func:`timing`. Worker ids are u64 (above 2**53 in practice) and stay exact
Python ints.

Limits. What Dynamo 1.6.1 cannot do, refused before anything is sent (:class:`InvalidRequestError` naming the limit).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from backends_core.converters import make_converter, structure_response
from backends_core.errors import InvalidRequestError, ResponseParseError, UnsupportedOperationError
from backends_core.jsonnode import U32, Node
from backends_core.multiturn.messages import part_texts
from backends_core.routed_experts import align_routed_experts, decode_routed_experts, decode_routed_object
from backends_core.types import (
    Choice,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    JsonSchema,
    Regex,
    RoutedExperts,
    SamplingParams,
    StreamDelta,
    TeacherLogprobs,
    TeacherRequest,
    TopLogprob,
    Usage,
)

__all__ = [
    "CHAT_PATH",
    "COMPLETIONS_PATH",
    "Exchange",
    "MAX_STOP_TOKEN_IDS",
    "PLACEHOLDER_MESSAGES",
    "Sample",
    "Timing",
    "U64",
    "WorkerIds",
    "best_alternatives",
    "check_generation",
    "check_prompt",
    "check_teacher",
    "completion_ids",
    "completion_logprobs",
    "context_windows",
    "engine_data",
    "extra_fields_for",
    "f32",
    "finish_reason",
    "StreamFold",
    "fold",
    "generation_payload",
    "nvext_of",
    "parse_generation",
    "parse_prompt_ids",
    "parse_sample",
    "parse_sse",
    "parse_teacher",
    "routed_experts",
    "served_name",
    "stop_reason",
    "teacher_payload",
    "timing",
    "tokenize_payload",
    "top_logprobs",
    "usage",
    "worker_ids",
]


# -- integer widths ---------------------------------------------------------------------------------------


#: Dynamo's worker ids are u64.
U64 = 2**64


# -- pieces of an answer, each read and checked on its own ------------------------------------------------


_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort", "tool_calls": "stop"}
_TOKEN_ID_PREFIX = "token_id:"


def nvext_of(body: Node) -> Node:
    """``$.nvext`` (its value is ``None`` when the answer has none)."""
    return body.get("nvext", required=False)


def engine_data(nvext: Node) -> Node | None:
    """``nvext.engine_data``, the worker's own record, when present."""
    return nvext.get("engine_data") if nvext.has("engine_data") else None


def completion_ids(nvext: Node) -> tuple[int, ...]:
    """The completion ids: ``engine_data.completion_token_ids`` (checked against ``nvext.completion_token_ids``
    when both are there), else ``nvext.completion_token_ids``."""
    engine = engine_data(nvext)
    frontend = nvext.get("completion_token_ids").token_ids() if nvext.has("completion_token_ids") else None
    if engine is not None and engine.has("completion_token_ids"):
        ids = engine.get("completion_token_ids").token_ids()
        if frontend is not None and frontend != ids:
            raise engine.get("completion_token_ids").fail(
                f"the engine's ids {list(ids)} disagree with nvext.completion_token_ids {list(frontend)}"
            )
        return ids
    if frontend is not None:
        return frontend
    raise nvext.fail(
        "no completion token ids: neither nvext.engine_data.completion_token_ids nor nvext.completion_token_ids "
        "is in the answer (both were asked for in nvext.extra_fields)"
    )


def _token_id_of(node: Node) -> int:
    text = node.string()
    if not text.startswith(_TOKEN_ID_PREFIX) or not text[len(_TOKEN_ID_PREFIX) :].isdigit():
        raise node.fail(
            f"expected 'token_id:<id>', got {text!r}: the frontend ignored return_tokens_as_token_ids, so the "
            "alternatives cannot be identified (ask for top_logprobs=0)"
        )
    return int(text[len(_TOKEN_ID_PREFIX) :])


def _openai_logprobs(choice: Node, ids: tuple[int, ...], *, chat: bool) -> list[Node]:
    """The per-token logprob nodes of the OpenAI channel, checked to belong to ``ids`` one to one."""
    block = choice.get("logprobs", required=False)
    if block.value is None and not ids:
        return []  # a request aborted before its first token: nothing to align (seen live on the completions route)
    if block.value is None:
        raise block.fail(
            "no logprobs: the answer has neither nvext.engine_data.completion_logprobs nor OpenAI logprobs "
            "(the backend always asks for them; the Dynamo mocker never returns logprobs)"
        )
    if chat:
        entries = block.get("content").items()
        if len(entries) != len(ids):
            raise block.get("content").fail(f"{len(entries)} logprob entries for {len(ids)} completion ids")
        for i, (token, entry) in enumerate(zip(ids, entries, strict=True)):
            claimed = entry.get("token_id").integer() if entry.has("token_id") else token
            if claimed != token:
                message = f"logprob entry is for token {claimed} but completion id {i} is {token}"
                raise entry.get("token_id").fail(message)
        return [entry.get("logprob") for entry in entries]
    values = block.get("token_logprobs").items()
    tokens = block.get("tokens").items()
    if not len(values) == len(tokens) == len(ids):
        raise block.fail(f"{len(tokens)} tokens and {len(values)} logprobs for {len(ids)} completion ids")
    for i, (token, node) in enumerate(zip(ids, tokens, strict=True)):
        if isinstance(node.value, str) and node.value.startswith(_TOKEN_ID_PREFIX) and _token_id_of(node) != token:
            raise node.fail(f"logprob entry is for {node.value!r} but completion id {i} is {token}")
    return values


def completion_logprobs(nvext: Node, choice: Node, ids: tuple[int, ...], *, chat: bool) -> npt.NDArray[np.float32]:
    """float32 logprob of every completion id; the engine's ``completion_logprobs`` win over the OpenAI channel."""
    engine = engine_data(nvext)
    if engine is not None and engine.has("completion_logprobs"):
        nodes = engine.get("completion_logprobs").items()
        if len(nodes) != len(ids):
            raise engine.get("completion_logprobs").fail(f"{len(nodes)} logprobs for {len(ids)} completion ids")
    else:
        nodes = _openai_logprobs(choice, ids, chat=chat)
    return np.asarray([n.logprob() for n in nodes], dtype=np.float32)


def f32(node: Node) -> float:
    """A logprob at float32 precision: the OpenAI channel prints float32 digits, the engine record doubles of
    the same float32 values, and alternatives must compare equal whichever channel they came from."""
    return float(np.float32(node.logprob()))


def best_alternatives(candidates: list[TopLogprob], k: int, where: Node) -> tuple[TopLogprob, ...]:
    unique = {c.token_id: c for c in candidates}
    ranked = all(c.rank is not None for c in unique.values())
    ordered = sorted(unique.values(), key=lambda c: (c.rank or 0, -c.logprob) if ranked else (0, -c.logprob))
    top = tuple(ordered[:k])
    if len(top) < k or (ranked and [c.rank for c in top] != list(range(1, k + 1))):
        raise where.fail(f"expected the top {k} alternatives, got {len(unique)} (ranks {[c.rank for c in ordered]})")
    return top


def top_logprobs(choice: Node, count: int, k: int, *, chat: bool) -> tuple[tuple[TopLogprob, ...], ...]:
    """The ``k`` best alternatives at each of ``count`` positions, from ``token_id:<id>`` entries."""
    block = choice.get("logprobs")
    rows: list[tuple[TopLogprob, ...]] = []
    if chat:
        entries = block.get("content").items()
        for entry in entries:
            alts = [
                TopLogprob(token_id=_token_id_of(a.get("token")), logprob=f32(a.get("logprob")))
                for a in entry.get("top_logprobs").items()
            ]
            rows.append(best_alternatives(alts, k, entry.get("top_logprobs")))
    else:
        for row in block.get("top_logprobs").items():
            alts = [
                TopLogprob(token_id=_token_id_of(Node(key, f"{row.path} key", row.url)), logprob=f32(row.get(key)))
                for key in row.obj()
            ]
            rows.append(best_alternatives(alts, k, row))
    if len(rows) != count:
        raise block.fail(f"{len(rows)} rows of alternatives for {count} completion ids")
    return tuple(rows)


def stop_reason(nvext: Node) -> int | str | None:
    """``nvext.stop_reason``: the matched stop token id (int) or stop string; None for EOS and length."""
    if not nvext.has("stop_reason"):
        return None
    node = nvext.get("stop_reason")
    if isinstance(node.value, str):
        return node.value
    return node.integer(below=U32)


def finish_reason(
    choice: Node, request: GenerateRequest, ids: tuple[int, ...], reason: int | str | None, *, aborted: bool
) -> FinishReason:
    """The finish reason, with Dynamo's ``stop`` for aborted requests turned back into ``abort`` where it can
    only mean that (see the module docstring)."""
    node = choice.get("finish_reason")
    raw = node.string()
    if raw not in _FINISH:
        raise node.fail(f"finish_reason {raw!r} is not one of {sorted(_FINISH)}")
    finish = _FINISH[raw]
    if finish == "stop" and reason is None and (aborted or not ids or request.sampling.ignore_eos):
        return "abort"
    return finish


def routed_experts(nvext: Node, request: GenerateRequest, ids: tuple[int, ...]) -> RoutedExperts | None:
    """Routing from ``nvext.routed_experts`` or ``engine_data.routed_experts`` (``{data: base64, shape, start,
    dtype}``, start and dtype optional: see :func:`decode_routed_object`), trimmed client-side to
    ``request.routed_experts_start`` (Dynamo has no request field for it)."""
    if not request.return_routed_experts:
        return None
    engine = engine_data(nvext)
    if nvext.has("routed_experts"):
        field = nvext.get("routed_experts")
    elif engine is not None and engine.has("routed_experts"):
        field = engine.get("routed_experts")
    else:
        raise nvext.fail(
            "routed experts were asked for but the answer has none: Dynamo's vLLM worker returns them only for "
            "MoE models started with --enable-return-routed-experts (vLLM's CPU build cannot)"
        )
    if isinstance(field.value, str | memoryview):  # a bare base64 payload: only a .npy file carries its own shape
        experts = decode_routed_experts(field.value, field=field.path, url=field.url)
        start = 0
    else:
        experts, named_start = decode_routed_object(field)
        start = 0 if named_start is None else named_start  # Dynamo sends no start to the worker: it routes from 0
    return align_routed_experts(
        experts,
        total_tokens=len(request.prompt_ids) + len(ids),
        server_start=start,
        wanted_start=request.routed_experts_start,
        field=field.path,
        url=field.url,
    )


def check_prompt(nvext: Node, prompt: tuple[int, ...]) -> None:
    engine = engine_data(nvext)
    if engine is not None and engine.has("prompt_token_ids"):
        seen = engine.get("prompt_token_ids").token_ids()
        if seen != prompt:
            raise engine.get("prompt_token_ids").fail(
                f"the worker received {len(seen)} prompt ids that differ from the {len(prompt)} sent"
            )


def usage(body: Node, prompt: tuple[int, ...], completion_tokens: int) -> Usage:
    """Token accounting; ``usage.prompt_tokens`` must equal the number of prompt ids sent (token-in echo)."""
    node = body.get("usage", required=False)
    cached = None
    if node.value is not None:
        reported = node.get("prompt_tokens").integer()
        if reported != len(prompt):
            raise node.get("prompt_tokens").fail(
                f"the frontend counted {reported} prompt tokens but {len(prompt)} prompt ids were sent: it did not "
                "generate from nvext.token_data / the token-id prompt"
            )
        if node.has("prompt_tokens_details") and node.get("prompt_tokens_details").has("cached_tokens"):
            cached = node.get("prompt_tokens_details").get("cached_tokens").integer()
    return Usage(prompt_tokens=len(prompt), completion_tokens=completion_tokens, cached_tokens=cached)


# -- request and answer types -----------------------------------------------------------------------------


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


# -- requests ---------------------------------------------------------------------------------------------


def extra_fields_for(request: GenerateRequest, metadata: Sequence[str] = ()) -> list[str]:
    """``nvext.extra_fields`` of a generation: the engine record, the ids, the stop reason, routed experts when
    asked, and any metadata fields (``worker_id``, ``timing``)."""
    fields = list(_BASE_FIELDS)
    if request.return_routed_experts:
        fields.append("routed_experts")
    fields.extend(f for f in metadata if f not in fields)
    return fields


#: Top-level fields the modelled parts of :class:`SamplingParams` use on Dynamo: ``extra`` may not set them.
MODELLED = frozenset(
    {"stop", "logit_bias", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "response_format"}
)
#: Top-level sampling fields of Dynamo 1.6.1 (``CommonExt``) ``extra`` may set.
EXTRA_KEYS = frozenset(
    {"include_stop_str_in_output", "skip_special_tokens", "guided_decoding_backend", "guided_whitespace_pattern"}
)


def _guided(s: SamplingParams) -> dict[str, Any]:
    """Dynamo's ``guided_*`` fields for ``s.structured`` (turned into vLLM ``StructuredOutputsParams`` by the vLLM
    worker)."""
    c = s.structured
    if c is None:
        return {}
    if isinstance(c, JsonSchema):
        return {"guided_json": dict(c.schema)}
    if isinstance(c, Regex):
        return {"guided_regex": c.pattern}
    if isinstance(c, Choice):
        return {"guided_choice": list(c.choices)}
    return {"guided_grammar": c.grammar}


def _optional(s: SamplingParams, fields: dict[str, Any]) -> dict[str, Any]:
    """Stop strings, structured output and ``extra`` (checked by name), only when used."""
    if s.stop:
        fields["stop"] = list(s.stop)
    fields.update(_guided(s))
    for key, value in s.extra.items():
        if key in fields or key in MODELLED:
            raise InvalidRequestError(f"extra key {key!r} collides with a field SamplingParams models: set it there")
        if key not in EXTRA_KEYS:
            raise InvalidRequestError(
                f"extra key {key!r} is not a sampling field Dynamo 1.6.1 forwards; known: {sorted(EXTRA_KEYS)}"
            )
        fields[key] = value
    return fields


def _sampling(s: SamplingParams) -> dict[str, Any]:
    return {
        "n": 1,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "min_p": s.min_p,
        "seed": s.seed,
        "stop_token_ids": list(s.stop_token_ids or ()),
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
    _optional(s, body)
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


def _text_parts(message: Mapping[str, Any]) -> dict[str, Any]:
    """``message`` with content parts as ``{"type": "text"}`` parts, the one text type the 1.6.1 frontend's chat route
    deserializes (``input_text`` and its kin are a 400 there; the client renders them all alike)."""
    out = dict(message)
    content = out.get("content")
    if isinstance(content, list | tuple):
        out["content"] = [{"type": "text", "text": t} for t in part_texts(content, "content")]
    return out


def tokenize_payload(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    chat_template_kwargs: Mapping[str, Any],
    model: str,
) -> tuple[str, dict[str, Any]]:
    """Path and body that make the frontend render and tokenize ``messages`` with its own chat template: a one-token
    chat request whose ``engine_data.prompt_token_ids`` are the ids the worker received (1.6.1 has no
    ``/tokenize``)."""
    body: dict[str, Any] = {"model": model, "messages": [_text_parts(m) for m in messages]}
    if tools:
        body["tools"] = [dict(t) for t in tools]
    if chat_template_kwargs:
        body["chat_template_kwargs"] = dict(chat_template_kwargs)
    body.update({"max_completion_tokens": 1, "n": 1, "temperature": 0.0, "stream": False})
    body["nvext"] = {"extra_fields": ["engine_data"]}
    return CHAT_PATH, body


# -- answers: whole results -------------------------------------------------------------------------------


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
    nvext = nvext_of(body)
    ids = completion_ids(nvext)
    check_prompt(nvext, request.prompt_ids)
    k = request.sampling.top_logprobs
    reason = stop_reason(nvext)
    served_by = {
        "worker_id": worker_ids(sample.body, server_url),
        "timing": timing(sample.body, server_url),
    }
    return GenerateResult(
        prompt_ids=request.prompt_ids,
        completion_ids=ids,
        logprobs=completion_logprobs(nvext, choice, ids, chat=chat),
        finish_reason=finish_reason(choice, request, ids, reason, aborted=sample.aborted),
        stop_reason=reason,
        top_logprobs=top_logprobs(choice, len(ids), k, chat=chat) if k else None,
        routed_experts=routed_experts(nvext, request, ids),
        weight_version=sample.weight_version,
        usage=usage(body, request.prompt_ids, len(ids)),
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
    engine = engine_data(nvext_of(body))
    if engine is None or not engine.has("prompt_token_ids"):
        raise nvext_of(body).fail(
            "no nvext.engine_data.prompt_token_ids: the server's tokenization is only visible through the engine "
            "record of Dynamo's vLLM worker (the mocker has none)"
        )
    ids = engine.get("prompt_token_ids").token_ids()
    usage(body, ids, 0)
    return list(ids)


def _prompt_rows(body: Node) -> Node:
    nvext = nvext_of(body)
    engine = engine_data(nvext)
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
    check_prompt(nvext_of(body), ids)
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
                    logprob=f32(rows[i].get(t).get("logprob")),
                    rank=rows[i].get(t).get("rank").integer(),
                )
                for t in entries
            ]
            top.append(best_alternatives(alts, k, rows[i]))
    return TeacherLogprobs(
        token_ids=ids, logprobs=logprobs, top_logprobs=tuple(top) if k else None, weight_version=weight_version
    )


# -- streamed answers -------------------------------------------------------------------------------------


_DONE = "[DONE]"


def parse_sse(text: str, url: str | None = None) -> list[Any]:
    """The decoded ``data`` payloads of an event stream, in order, without the closing ``[DONE]``.

    :raises ResponseParseError: an ``error`` event, a payload that is not JSON, or no ``[DONE]`` (truncated).
    """
    chunks: list[Any] = []
    for number, block in enumerate(text.replace("\r\n", "\n").split("\n\n")):
        event, data = "message", []
        for line in block.split("\n"):
            if not line or line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "event":
                event = value
            elif name == "data":
                data.append(value)
        if not data:
            continue
        payload = "\n".join(data)
        if payload == _DONE:
            return chunks
        if event == "error":
            raise ResponseParseError(f"the stream reported an error in event {number}: {payload}", url=url)
        try:
            chunks.append(json.loads(payload))
        except json.JSONDecodeError as exc:
            raise ResponseParseError(f"event {number} is not JSON ({exc.msg}): {payload[:200]!r}", url=url) from exc
    raise ResponseParseError(f"the stream ended without 'data: {_DONE}' after {len(chunks)} event(s)", url=url)


@attrs.define
class _Choice:
    pieces: list[str] = attrs.field(factory=list)
    finish_reason: Any = None
    content: list[Any] | None = None  # chat logprobs entries
    legacy: dict[str, list[Any]] | None = None  # completions logprobs lists


def _add_logprobs(acc: _Choice, block: Node, *, chat: bool) -> None:
    if block.value is None:
        return
    if chat:
        acc.content = (acc.content or []) + [e.value for e in block.get("content").items()]
        return
    acc.legacy = acc.legacy or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        acc.legacy[key].extend(n.value for n in block.get(key).items())


def _choice_body(index: int, acc: _Choice, *, chat: bool) -> dict[str, Any]:
    if chat:
        logprobs = None if acc.content is None else {"content": acc.content, "refusal": None}
        message = {"content": "".join(acc.pieces), "refusal": None, "role": "assistant"}
        return {"index": index, "message": message, "finish_reason": acc.finish_reason, "logprobs": logprobs}
    choice: dict[str, Any] = {"text": "".join(acc.pieces), "index": index, "finish_reason": acc.finish_reason}
    if acc.legacy is not None:
        choice["logprobs"] = acc.legacy
    return choice


def fold(chunks: list[Any], url: str | None = None) -> dict[str, Any]:
    """One answer with the shape of a non-streamed one, built from stream chunks.

    :raises ResponseParseError: no chunks, chunks of another kind, or id deltas for more than one choice.
    """
    if not chunks:
        raise ResponseParseError("the stream carried no chunks", url=url)
    first = Node(chunks[0], "$[0]", url)
    kind = first.get("object").string()
    if kind not in ("chat.completion.chunk", "text_completion"):
        raise first.get("object").fail(f"expected 'chat.completion.chunk' or 'text_completion', got {kind!r}")
    chat = kind == "chat.completion.chunk"
    choices: dict[int, _Choice] = {}
    nvext: dict[str, Any] = {}
    ids: list[int] | None = None
    top: dict[str, Any] = {}
    for i, raw in enumerate(chunks):
        chunk = Node(raw, f"$[{i}]", url)
        for choice in chunk.get("choices").items():
            acc = choices.setdefault(choice.get("index").integer(), _Choice())
            piece = choice.get("delta").get("content", required=False) if chat else choice.get("text", required=False)
            if piece.value is not None:
                acc.pieces.append(piece.string())
            if choice.has("finish_reason"):
                acc.finish_reason = choice.get("finish_reason").value
            _add_logprobs(acc, choice.get("logprobs", required=False), chat=chat)
        for key in ("usage", "prompt_logprobs"):
            if chunk.has(key):
                top[key] = chunk.get(key).value
        if chunk.has("nvext"):
            for key, value in chunk.get("nvext").obj().items():
                if key == "completion_token_ids":
                    ids = (ids or []) + list(value or [])
                elif value is not None:
                    nvext[key] = value
    if ids is not None:
        if len(choices) > 1:
            raise first.fail("completion id deltas cannot be assigned to one of several choices (send n=1)")
        nvext["completion_token_ids"] = ids
    body: dict[str, Any] = {
        "id": first.get("id").value,
        "choices": [_choice_body(index, choices[index], chat=chat) for index in sorted(choices)],
        "created": first.get("created", required=False).value,
        "model": first.get("model", required=False).value,
        "object": "chat.completion" if chat else "text_completion",
        **top,
    }
    if nvext:
        body["nvext"] = nvext
    return body


class StreamFold:
    """The chunks of one streamed generation (``n`` 1) read as they arrive (:meth:`chunk`), then folded with
    :func:`fold` into the answer :func:`parse_sample` reads (:meth:`result`)."""

    def __init__(self, request: GenerateRequest, server_url: str | None) -> None:
        self.request = request
        self.server_url = server_url
        self.chunks: list[Any] = []
        self.finished = False

    def chunk(self, raw: Any) -> StreamDelta | None:
        """One chunk: its new ids (``nvext.completion_token_ids``) and their logprobs, or ``None`` without any."""
        body = Node(raw, f"$[{len(self.chunks)}]", self.server_url)
        self.chunks.append(raw)
        choices = body.get("choices").items()
        if not choices:
            return None  # the usage chunk
        if len(choices) != 1 or choices[0].get("index").integer() != 0:
            raise body.get("choices").fail(f"expected the one choice of index 0, got {len(choices)} choice(s)")
        if self.finished:
            raise body.fail("a chunk with a choice after the one that finished")
        choice = choices[0]
        nvext = nvext_of(body)
        if nvext.value is None or not nvext.has("completion_token_ids"):
            raise nvext.fail("no nvext.completion_token_ids in the chunk (asked for in nvext.extra_fields)")
        ids = nvext.get("completion_token_ids").token_ids()
        self.finished = choice.get("finish_reason", required=False).value is not None
        if not ids:
            return None
        chat = body.get("object").value == "chat.completion.chunk"
        nodes = _openai_logprobs(choice, ids, chat=chat)
        return StreamDelta(completion_ids=ids, logprobs=np.asarray([n.logprob() for n in nodes], dtype=np.float32))

    def result(self, *, aborted: bool, weight_version: str | None) -> GenerateResult:
        """The generation as :func:`parse_sample` reads it answered whole."""
        if not self.finished:
            raise ResponseParseError(
                f"the stream ended after {len(self.chunks)} chunk(s) without a finish_reason", url=self.server_url
            )
        body = fold(self.chunks, self.server_url)
        return parse_sample(Sample(body, aborted=aborted, weight_version=weight_version), self.request, self.server_url)


# -- metadata asked for with extra_fields -----------------------------------------------------------------


_converter = make_converter()


def _u64(_instance: Any, attribute: attrs.Attribute[Any], value: int | None) -> None:
    if value is not None and not 0 <= value < U64:
        raise ValueError(f"{attribute.name} must be a u64, got {value}")


@attrs.frozen(kw_only=True)
class WorkerIds:
    """``nvext.worker_id``: the prefill and decode workers (the same one when serving is aggregated)."""

    prefill_worker_id: int = attrs.field(validator=_u64)
    decode_worker_id: int = attrs.field(validator=_u64)
    prefill_dp_rank: int | None = None
    decode_dp_rank: int | None = None


@attrs.frozen(kw_only=True)
class Timing:
    """``nvext.timing`` (final chunk only); ``kv_hit_rate`` and ``router_queue_depth`` come with the KV router."""

    request_received_ms: float | None = None
    prefill_wait_time_ms: float | None = None
    prefill_time_ms: float | None = None
    ttft_ms: float | None = None
    total_time_ms: float | None = None
    kv_hit_rate: float | None = None
    router_queue_depth: int | None = None


def _nvext_field(raw: Any, key: str, url: str | None) -> Any:
    body = raw.samples[0].body if isinstance(raw, Exchange) and raw.samples else raw
    if not isinstance(body, dict):
        raise ResponseParseError(f"expected an answer object, got {type(body).__name__} @ $", url=url)
    nvext = body.get("nvext")
    return nvext.get(key) if isinstance(nvext, dict) else None


def worker_ids(raw: Any, url: str | None = None) -> WorkerIds | None:
    """``nvext.worker_id`` of an answer (of the first sample of an exchange); ``None`` when not asked for."""
    value = _nvext_field(raw, "worker_id", url)
    return None if value is None else structure_response(_converter, value, WorkerIds, url=url)


def timing(raw: Any, url: str | None = None) -> Timing | None:
    """``nvext.timing`` of an answer (of the first sample of an exchange); ``None`` when not asked for."""
    value = _nvext_field(raw, "timing", url)
    return None if value is None else structure_response(_converter, value, Timing, url=url)


# -- limits refused before sending ------------------------------------------------------------------------


_I32 = 2**31
_I64 = 2**63


def context_windows(raw: Any, server_url: str) -> dict[str, int]:
    """``{model: context_window}`` of a frontend's ``GET /v1/models`` answer (0 when the worker did not say, as the
    mocker does; adapters carry their base model's window)."""
    windows = {}
    for entry in Node(raw, "$", server_url).get("data").items():
        window = entry.get("context_window", required=False).optional_integer()
        if window is not None and window < 0:
            raise entry.get("context_window").fail(f"context_window must be >= 0, got {window}")
        windows[entry.get("id").string() or ""] = window or 0
    return windows


def served_name(*candidates: str | None) -> str:
    """The first given model name (LoRA adapter, per-request model, ``ClientConfig.model``)."""
    for name in candidates:
        if name:
            return name
    raise InvalidRequestError("no model name: Dynamo needs one; set ClientConfig.model (or pass model=)")


def _ids(name: str, ids: Sequence[int]) -> None:
    bad = [t for t in ids if t >= U32]
    if bad:
        raise InvalidRequestError(f"{name} has token id {bad[0]}; Dynamo's token ids are u32 (< {U32})")


def check_generation(request: GenerateRequest, *, fan_out: bool) -> None:
    """Refuse a generation Dynamo would reject or mishandle.

    :raises UnsupportedOperationError: stop strings with ``ignore_eos`` (the frontend would ignore the strings).
    :raises InvalidRequestError: more than 32 stop token ids, ``n > 1`` without fan-out (Dynamo refuses ``n > 1``
        with completion ids), non-u32 ids, a priority outside i32, a seed that overflows i64. (Content parts that
        are not text never get here: the client refuses them before rendering.)
    """
    s = request.sampling
    stop_ids = s.stop_token_ids or ()
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError(f"{len(stop_ids)} stop_token_ids: Dynamo 1.6.1 accepts at most {MAX_STOP_TOKEN_IDS}")
    if s.n > 1 and not fan_out:
        raise InvalidRequestError(
            f"n={s.n}: Dynamo 1.6.1 refuses n > 1 together with completion token ids; "
            "set backend_options.fan_out_n = true to send n requests of one sample"
        )
    _ids("prompt_ids", request.prompt_ids)
    _ids("stop_token_ids", stop_ids)
    if s.stop and s.ignore_eos:
        raise UnsupportedOperationError(
            "dynamo",
            "sampling.stop",
            hint="Dynamo 1.6.1's frontend ignores stop strings when ignore_eos is set (verified live); "
            "send one of them only",
        )
    _optional(s, {})  # extra keys checked before any of the n requests goes out
    if request.priority is not None and not -_I32 <= request.priority < _I32:
        raise InvalidRequestError(f"priority {request.priority} does not fit nvext.agent_hints.priority (i32)")
    if s.seed is not None and not (s.seed >= -_I64 and s.seed + s.n - 1 < _I64):
        raise InvalidRequestError(f"seed {s.seed} (+ n - 1) does not fit an i64")


def check_teacher(request: TeacherRequest) -> None:
    """Refuse scoring ids Dynamo cannot take.

    :raises InvalidRequestError: a token id that is not u32.
    """
    _ids("token_ids", request.token_ids)
