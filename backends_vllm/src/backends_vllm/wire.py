"""vLLM's wire format (vllm 0.32 OpenAI server) and its mapping to the core types.

Two generation transports:

* ``POST /inference/v1/generate``: ``{"token_ids", "sampling_params": {...}, "request_id", "cache_salt",
  "priority", "model"}`` -> ``choices[].token_ids``, ``choices[].logprobs.content[] = {token_id, logprob, rank,
  top_logprobs}``, ``choices[].weight_versions``, ``choices[].routed_experts``, top-level ``prompt_logprobs``.
  A prompt with images sends ``token_ids`` with one placeholder per image and ``content_parts: [{"type":
  "image_url", "url", "uuid"}]`` (images in prompt order; ``uuid`` keys vLLM's processor and encoder caches, so it
  is the image's digest salted with the request's ``cache_salt``) and asks ``return_token_ids``: the answer's
  top-level ``prompt_token_ids`` (after vLLM's processor widened each image's first placeholder) and
  ``mm_placeholders: {"image": [{offset, length}]}`` are the prompt the engine ran (streamed: in the first chunk).
* ``POST /v1/completions`` with a token-id ``prompt``: ``return_token_ids`` gives ``choices[].token_ids``;
  ``return_tokens_as_token_ids`` makes the legacy logprob tokens ``"token_id:<id>"``; ``prompt_logprobs`` is
  per choice.

Both stream with ``"stream": true`` (Server-Sent Events, ``[DONE]`` last): each chunk's one choice carries its new
``token_ids`` and their logprobs, the chunk of the last token the finish and stop reasons (and on generate
``weight_versions`` and routed experts), and with ``stream_options.include_usage`` a last chunk with no choices
holds the usage. :class:`StreamFold` reads the chunks and folds them back into the body the route answers
whole, which the route's parser then reads.

Every sampling field is sent explicitly: vLLM's OpenAI routes fill omitted fields from the model's
``generation_config.json`` (temperature 0.6, top_k 20, top_p 0.95 on Qwen3-style models).
Logprobs are checked against the ids they claim to belong to; NaN, infinities and vLLM's ``-9999``
placeholder are refused.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import numpy as np

from backends_core.errors import InvalidRequestError, ResponseParseError
from backends_core.images import Image, ImageSpan, check_expansion, collapse
from backends_core.jsonnode import PLACEHOLDER_LOGPROB, Node
from backends_core.routed_experts import align_routed_experts, decode_routed_experts, decode_routed_object
from backends_core.types import (
    Choice,
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
    WeightVersionSpan,
)

__all__ = [
    "COMPLETIONS_EXTRA",
    "GENERATE_EXTRA",
    "StreamFold",
    "abort_id",
    "completions_payload",
    "flag",
    "generate_payload",
    "integer",
    "lora_names",
    "max_model_len",
    "parse_completions",
    "parse_generate",
    "parse_prompt_logprobs",
    "stream_payload",
    "teacher_payload",
    "text",
    "token_list",
    "with_extra",
]

_FINISH = ("stop", "length", "abort")
Float32s = np.ndarray[Any, np.dtype[np.float32]]
_TOKEN_ID, _LOGPROB = operator.itemgetter("token_id"), operator.itemgetter("logprob")
#: vLLM's default ``--max-logprobs``.
MAX_LOGPROBS = 20


def _ids(body: Node) -> tuple[int, ...]:
    return tuple(b.integer() for b in body.items())


# -- requests -------------------------------------------------------------------------------------------


#: Fields of vLLM 0.32's ``SamplingParams`` (the generate route's ``sampling_params``) that
#: :class:`~backends_core.types.SamplingParams` does not model and that leave the answer's shape alone:
#: what ``SamplingParams.extra`` may set on that route. vLLM only logs keys it does not know, so anything else
#: is refused here rather than silently dropped there.
GENERATE_EXTRA = frozenset(
    {
        "allowed_token_ids",
        "bad_words",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "thinking_token_budget",
        "repetition_detection",
        "skip_reading_prefix_cache",
        "watermarking",
        "extra_args",
    }
)
#: The same for ``/v1/completions`` (``CompletionRequest`` fields; ``skip_special_tokens`` is set by the backend).
COMPLETIONS_EXTRA = frozenset(
    {
        "allowed_token_ids",
        "bad_words",
        "include_stop_str_in_output",
        "spaces_between_special_tokens",
        "thinking_token_budget",
        "repetition_detection",
        "truncate_prompt_tokens",
        "vllm_xargs",
    }
)


def _structured(s: SamplingParams) -> dict[str, Any] | None:
    """``structured_outputs`` (vLLM's ``StructuredOutputsParams``: one of ``json``, ``regex``, ``choice``,
    ``grammar``), or ``None``."""
    c = s.structured
    if c is None:
        return None
    if isinstance(c, JsonSchema):
        return {"json": dict(c.schema)}
    if isinstance(c, Regex):
        return {"regex": c.pattern}
    if isinstance(c, Choice):
        return {"choice": list(c.choices)}
    return {"grammar": c.grammar}


#: Wire names of what :class:`~backends_core.types.SamplingParams` models, set only when used.
MODELLED = frozenset(
    {"stop", "logit_bias", "structured_outputs", "response_format", "detokenize", "logprobs", "prompt_logprobs"}
)


def with_extra(fields: dict[str, Any], s: SamplingParams, allowed: frozenset[str], where: str) -> dict[str, Any]:
    """``fields`` plus ``s.extra``, each key checked: one a modelled field sets collides, one outside
    ``allowed`` is unknown (vLLM would only log it).

    :raises InvalidRequestError: naming the key.
    """
    for key, value in s.extra.items():
        if key in fields or key in MODELLED:
            raise InvalidRequestError(
                f"extra key {key!r} collides with a field SamplingParams models on {where}: set it there"
            )
        if key not in allowed:
            raise InvalidRequestError(
                f"extra key {key!r} is not a sampling field vllm takes on {where} (it would be ignored); "
                f"known: {sorted(allowed)}"
            )
        fields[key] = value
    return fields


def _sampling_fields(request: GenerateRequest) -> dict[str, Any]:
    s = request.sampling
    fields: dict[str, Any] = {
        "n": s.n,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "min_p": s.min_p,
        "seed": s.seed,
        "max_tokens": s.max_tokens,
        "min_tokens": s.min_tokens,
        "stop_token_ids": list(s.stop_token_ids or ()),
        "ignore_eos": s.ignore_eos,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "repetition_penalty": s.repetition_penalty,
    }
    # the optional features only when used (none of them has a generation_config default to override)
    if s.stop:
        fields["stop"] = list(s.stop)
    if s.logit_bias:
        fields["logit_bias"] = {str(token): bias for token, bias in s.logit_bias.items()}  # JSON keys: strings
    if s.structured is not None:
        fields["structured_outputs"] = _structured(s)
    return fields


def generate_payload(request: GenerateRequest, model: str | None) -> dict[str, Any]:
    """Body of ``POST /inference/v1/generate``."""
    sampling = _sampling_fields(request)
    # the generate route returns the sampled token first and truncates to ``logprobs`` entries, so one more
    # than the wanted alternatives guarantees the true top-k is among them
    sampling["logprobs"] = min(request.sampling.top_logprobs + 1, MAX_LOGPROBS) if request.sampling.top_logprobs else 0
    # vLLM checks stop strings on the detokenized text and refuses them without it
    sampling["detokenize"] = bool(request.sampling.stop)  # off otherwise: token ids only, less server work
    if request.return_routed_experts:
        sampling["routed_experts_prompt_start"] = request.routed_experts_start
    with_extra(sampling, request.sampling, GENERATE_EXTRA, "/inference/v1/generate sampling_params")
    body: dict[str, Any] = {
        "model": request.lora or request.model or model,
        "token_ids": request.prompt_ids,
        "sampling_params": sampling,
    }
    if request.images:
        _with_images(body, request.prompt_ids, request.images, request.image_spans, request.cache_salt)
    for key in ("request_id", "cache_salt", "priority"):
        if getattr(request, key) is not None:
            body[key] = getattr(request, key)
    return body


def _with_images(
    body: dict[str, Any],
    ids: tuple[int, ...],
    images: tuple[Image, ...],
    spans: tuple[ImageSpan, ...],
    salt: str | None,
) -> None:
    """``body`` carrying ``images``: the ids collapsed to one placeholder per image (vLLM widens them), the images
    as content parts keyed by their salted identity, and the engine's own prompt ids asked back."""
    body["token_ids"] = collapse(ids, spans)
    body["content_parts"] = [{"type": "image_url", "url": i.data_url(), "uuid": i.identity(salt)} for i in images]
    body["return_token_ids"] = True


def completions_payload(request: GenerateRequest, model: str | None) -> dict[str, Any]:
    """Body of ``POST /v1/completions`` with a token-id prompt."""
    body: dict[str, Any] = {
        "model": request.lora or request.model or model,
        "prompt": request.prompt_ids,
        **_sampling_fields(request),
        "logprobs": request.sampling.top_logprobs,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": False,
    }
    if request.return_routed_experts:
        body["routed_experts_prompt_start"] = request.routed_experts_start
    for key in ("request_id", "cache_salt", "priority"):
        if getattr(request, key) is not None:
            body[key] = getattr(request, key)
    return with_extra(body, request.sampling, COMPLETIONS_EXTRA, "/v1/completions")


def teacher_payload(request: TeacherRequest, model: str | None, *, transport: str) -> tuple[str, dict[str, Any]]:
    """Path and body scoring ``request.token_ids`` with ``prompt_logprobs``; ``max_tokens`` is 1 because vLLM
    rejects 0 (the one generated token is ignored)."""
    name = request.lora or request.model or model
    fields = {"max_tokens": 1, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "prompt_logprobs": request.top_logprobs}
    if transport == "generate":
        body: dict[str, Any] = {
            "model": name,
            "token_ids": request.token_ids,
            "sampling_params": {**fields, "detokenize": False},
        }
        if request.images:
            _with_images(body, request.token_ids, request.images, request.image_spans, request.cache_salt)
        path = "/inference/v1/generate"
    else:
        if request.images:
            raise InvalidRequestError(
                "vLLM's /v1/completions takes no images: score a sequence with images on transport 'generate'"
            )
        body = {"model": name, "prompt": request.token_ids, **fields}
        path = "/v1/completions"
    if request.request_id is not None:
        body["request_id"] = request.request_id
    return path, body


# -- responses ------------------------------------------------------------------------------------------


def _finish(choice: Node) -> Any:
    reason = choice.get("finish_reason").optional_string()
    if reason not in _FINISH:
        raise choice.get("finish_reason").fail(f"finish_reason {reason!r} is not one of {list(_FINISH)}")
    return reason


def _stop_reason(choice: Node) -> int | str | None:
    value = choice.get("stop_reason", required=False).value
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | str)):
        raise choice.get("stop_reason").fail(f"expected a token id, a string or null, got {value!r}")
    return value


def _top_k(candidates: list[TopLogprob], k: int, where: Node) -> tuple[TopLogprob, ...]:
    """The k most likely of ``candidates`` (deduplicated), checked to really be ranks 1..k when ranks are known."""
    unique = {c.token_id: c for c in candidates}
    ordered = sorted(unique.values(), key=lambda c: (c.rank if c.rank is not None else 0, -c.logprob))
    if any(c.rank is None for c in ordered):
        ordered = sorted(unique.values(), key=lambda c: -c.logprob)
    top = tuple(ordered[:k])
    if len(top) < k or (top and top[0].rank is not None and [c.rank for c in top] != list(range(1, k + 1))):
        raise where.fail(f"expected the top {k} alternatives, got ranks {[c.rank for c in ordered]}")
    return top


def _routed(
    choice: Node, request: GenerateRequest, completion: tuple[int, ...], prompt_tokens: int
) -> RoutedExperts | None:
    if not request.return_routed_experts:
        return None
    field = choice.get("routed_experts", required=False)
    if field.value is None:
        raise field.fail(
            "routed experts were requested but the server sent none; start vLLM with "
            "--enable-return-routed-experts (MoE models only)"
        )
    server_start = request.routed_experts_start
    if isinstance(field.value, Mapping):  # prime-rl's vLLM server
        experts, named_start = decode_routed_object(field)
        if named_start is not None:
            server_start = named_start
            needed = prompt_tokens + len(completion) - 1 - server_start
            if experts.shape[0] != needed:
                raise field.fail(
                    f"{experts.shape[0]} rows from start {server_start}; the sequence routed from there has {needed}"
                )
        # with no start named, align_routed_experts reads it from the row count, as for a .npy payload
    else:
        experts = decode_routed_experts(field.value, field=field.path, url=field.url)
    return align_routed_experts(
        experts,
        total_tokens=prompt_tokens + len(completion),
        server_start=server_start,
        wanted_start=request.routed_experts_start,
        field=field.path,
        url=field.url,
    )


def _usage(body: Node, completion_tokens: int, prompt_tokens: int) -> Usage:
    usage = body.get("usage", required=False)
    cached = None
    if isinstance(usage.value, Mapping):
        reported = usage.get("prompt_tokens").integer()
        if reported != prompt_tokens:
            raise usage.fail(f"prompt_tokens is {reported} but {prompt_tokens} prompt ids were sent")
        details = usage.get("prompt_tokens_details", required=False)
        if isinstance(details.value, Mapping):
            cached = details.get("cached_tokens", required=False).optional_integer()
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, cached_tokens=cached)


def _choices(body: Node, n: int) -> list[Node]:
    choices = body.get("choices").items()
    if len(choices) != n:
        raise body.get("choices").fail(f"expected {n} choice(s), got {len(choices)}")
    return sorted(choices, key=lambda c: c.get("index").integer())


def _all_of_type(values: list[Any], kind: type) -> bool:
    """Whether every value is exactly of type ``kind`` (no subclass such as ``bool``), in one C-level pass."""
    return set(map(type, values)) <= {kind}


def _logprobs_in_bulk(choice: Mapping[str, Any], completion: tuple[int, ...]) -> Float32s | None:
    """The completion's logprobs when every entry is a plain ``{"token_id": <its id>, "logprob": <float>}`` in
    range, checked with C-level passes (``map``, ``set``) and one numpy pass; ``None`` when anything needs a
    closer look."""
    block = choice.get("logprobs")
    content = block.get("content") if type(block) is dict else None
    if type(content) is not list or len(content) != len(completion):
        return None
    try:
        claimed = list(map(_TOKEN_ID, content))
        values = list(map(_LOGPROB, content))
    except (KeyError, TypeError):
        return None
    if claimed != choice["token_ids"] or not _all_of_type(claimed, int) or not _all_of_type(values, float):
        return None
    array = np.array(values, dtype=np.float64)
    # NaN makes min and max NaN and infinities land outside the bounds, so both comparisons refuse them too
    if array.size and not (array.min() > PLACEHOLDER_LOGPROB and array.max() <= 1e-3):
        return None
    return array.astype(np.float32)


def _logprobs(
    choice: Node, completion: tuple[int, ...], k: int
) -> tuple[Float32s, tuple[tuple[TopLogprob, ...], ...] | None]:
    """The completion's logprobs and, when ``k`` alternatives were asked for, the top ``k`` of each position.

    The usual answer (no alternatives, plain float entries) is taken in bulk; anything else goes entry by entry,
    which accepts what is unusual but valid (integer logprobs) and names the path of the first problem.
    """
    if not k:
        bulk = _logprobs_in_bulk(choice.obj(), completion)
        if bulk is not None:
            return bulk, None
    block = choice.get("logprobs")
    if block.value is None:
        raise block.fail("no logprobs in the answer (sampling_params.logprobs was sent)")
    entries = block.get("content").items()
    if len(entries) != len(completion):
        raise block.get("content").fail(f"{len(entries)} logprob entries for {len(completion)} token ids")
    logprobs = np.empty(len(completion), dtype=np.float32)
    top: list[tuple[TopLogprob, ...]] = []
    for i, (token, entry) in enumerate(zip(completion, entries, strict=True)):
        claimed, where = _entry_token(entry)
        if claimed != token:
            raise where.fail(f"logprob entry is for token {claimed} but completion id {i} is {token}")
        logprobs[i] = entry.get("logprob").logprob()
        if k:
            alts = [
                TopLogprob(
                    token_id=_entry_token(a)[0],
                    logprob=a.get("logprob").logprob(),
                    rank=a.get("rank", required=False).optional_integer(),
                )
                for a in entry.get("top_logprobs").items()
            ]
            top.append(_top_k(alts, k, entry.get("top_logprobs")))
    return logprobs, tuple(top) if k else None


def _entry_token(entry: Node) -> tuple[int, Node]:
    """The token id a logprob entry is for, and the field that says it: ``token_id``, or, in entries of vLLM's
    older tokens route that carry only a string, ``"token": "token_id:<id>"``."""
    if isinstance(entry.value, Mapping) and "token_id" not in entry.value and "token" in entry.value:
        where = entry.get("token")
        return _token_id_string(where), where
    where = entry.get("token_id")
    return where.integer(), where


def _spans(choice: Node) -> tuple[WeightVersionSpan, ...]:
    raw = choice.obj().get("weight_versions")
    if raw is None:
        return ()
    if type(raw) is list and all(
        type(s) is dict and type(s.get("version")) is str and type(s.get("start")) is int and type(s.get("end")) is int
        for s in raw
    ):
        return tuple(WeightVersionSpan(version=s["version"], start=s["start"], end=s["end"]) for s in raw)
    return tuple(
        WeightVersionSpan(version=s.get("version").string(), start=s.get("start").integer(), end=s.get("end").integer())
        for s in choice.get("weight_versions").items()
    )


def _cached_tokens(body: Node, prompt_tokens: int) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` once ``usage.prompt_tokens`` is checked against the prompt."""
    usage = body.obj().get("usage")
    if usage is None:
        return None
    if type(usage) is dict and usage.get("prompt_tokens") == prompt_tokens and type(usage["prompt_tokens"]) is int:
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if type(details) is dict else None
        if details is None or (type(details) is dict and (cached is None or type(cached) is int)):
            return cached
    return _usage(body, 0, prompt_tokens).cached_tokens


def parse_generate(raw: Any, request: GenerateRequest, server_url: str) -> list[GenerateResult]:
    """Results of ``/inference/v1/generate``; every refusal names its JSON path.

    Fields are checked in the order a reader meets them (request id, choices, then per choice: ids, logprobs,
    weight versions, finish and stop reasons, routed experts, usage), so the first problem is the one reported.
    Each check takes the usual shape in one step and looks closer through :class:`Node` only when that fails.
    """
    body = Node(raw, "$", server_url)
    request_id = raw.get("request_id") if type(raw) is dict else None
    if type(request_id) is not str:
        request_id = body.get("request_id").string()
    choices = raw.get("choices") if type(raw) is dict else None
    n = request.sampling.n
    if (
        type(choices) is list
        and len(choices) == n
        and all(type(c) is dict and type(c.get("index")) is int for c in choices)
    ):
        nodes = [
            Node(choices[i], f"$.choices[{i}]", server_url) for i in sorted(range(n), key=lambda i: choices[i]["index"])
        ]
    else:
        nodes = _choices(body, n)
    k = request.sampling.top_logprobs
    prompt_ids, image_spans = engine_prompt(body, request.images) if request.images else (request.prompt_ids, ())
    prompt_tokens = len(prompt_ids)
    results = []
    for choice in nodes:
        fields = choice.obj()
        ids: Any = fields.get("token_ids")
        plain = type(ids) is list and _all_of_type(ids, int)
        completion = tuple(ids) if plain else _ids(choice.get("token_ids"))
        logprobs, top = _logprobs(choice, completion, k)
        spans = _spans(choice)
        finish: Any = fields.get("finish_reason")
        if type(finish) is not str or finish not in _FINISH:
            finish = _finish(choice)
        stop = fields.get("stop_reason")
        if stop is not None and type(stop) is not int and type(stop) is not str:
            stop = _stop_reason(choice)
        routed = _routed(choice, request, completion, prompt_tokens)
        cached = _cached_tokens(body, prompt_tokens)
        results.append(
            GenerateResult(
                prompt_ids=prompt_ids,
                images=request.images,
                image_spans=image_spans,
                completion_ids=completion,
                logprobs=logprobs,
                finish_reason=finish,
                stop_reason=stop,
                top_logprobs=top,
                routed_experts=routed,
                weight_version=spans[-1].version if spans else None,
                weight_versions=spans,
                usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=len(completion), cached_tokens=cached),
                request_id=request_id,
                server=server_url,
            )
        )
    return results


def engine_prompt(body: Node, images: tuple[Image, ...]) -> tuple[tuple[int, ...], tuple[ImageSpan, ...]]:
    """The prompt ids vLLM ran and the span of each image, from ``prompt_token_ids`` and ``mm_placeholders``
    (asked with ``return_token_ids``); whether they are the prompt sent is the caller's proof."""
    ids = _ids(body.get("prompt_token_ids"))
    placed = body.get("mm_placeholders")
    modalities = sorted(placed.obj())
    if modalities != ["image"]:
        raise placed.fail(f"expected placeholders of images only, got modalities {modalities}")
    spans = []
    for entry in placed.get("image").items():
        offset, length = entry.get("offset").integer(), entry.get("length").integer()
        if offset < 0 or length < 1:
            raise entry.fail(f"offset {offset} and length {length} do not make a span")
        spans.append(ImageSpan(offset, offset + length))
    if len(spans) != len(images):
        raise placed.get("image").fail(f"{len(spans)} placeholder ranges for {len(images)} images")
    return ids, tuple(spans)


def _token_id_string(body: Node) -> int:
    text = body.string() or ""
    if not text.startswith("token_id:") or not text[9:].isdigit():
        raise body.fail(f"expected 'token_id:<id>' (send return_tokens_as_token_ids), got {text!r}")
    return int(text[9:])


def parse_completions(raw: Any, request: GenerateRequest, server_url: str) -> list[GenerateResult]:
    """Results of ``/v1/completions`` with ``return_token_ids`` and ``return_tokens_as_token_ids``."""
    body = Node(raw, "$", server_url)
    request_id = body.get("id").string()
    results = []
    k = request.sampling.top_logprobs
    for choice in _choices(body, request.sampling.n):
        ids_field = choice.get("token_ids")
        if ids_field.value is None:
            raise ids_field.fail("token_ids is null: the server ignored return_token_ids (vLLM >= 0.10.2 needed)")
        completion = _ids(ids_field)
        legacy = choice.get("logprobs")
        if legacy.value is None:
            raise legacy.fail("no logprobs in the answer (logprobs was sent)")
        tokens = legacy.get("tokens").items()
        values = legacy.get("token_logprobs").items()
        if not len(tokens) == len(values) == len(completion):
            raise legacy.fail(f"{len(tokens)} tokens and {len(values)} logprobs for {len(completion)} token ids")
        logprobs = np.empty(len(completion), dtype=np.float32)
        top: list[tuple[TopLogprob, ...]] = []
        rows = legacy.get("top_logprobs", required=False).optional_items() if k else None
        for i, token in enumerate(completion):
            claimed = _token_id_string(tokens[i])
            if claimed != token:
                raise tokens[i].fail(f"logprob entry is for token {claimed} but completion id {i} is {token}")
            logprobs[i] = values[i].logprob()
            if rows is not None:
                row = rows[i]
                alts = [
                    TopLogprob(
                        token_id=_token_id_string(Node(key, f"{row.path} key", server_url)),
                        logprob=Node(value, f"{row.path}[{key!r}]", server_url).logprob(),
                    )
                    for key, value in row.obj().items()
                ]
                top.append(_top_k(alts, k, row))
        if k and rows is None:
            raise legacy.get("top_logprobs").fail("top_logprobs missing although alternatives were requested")
        results.append(
            GenerateResult(
                prompt_ids=request.prompt_ids,
                completion_ids=completion,
                logprobs=logprobs,
                finish_reason=_finish(choice),
                stop_reason=_stop_reason(choice),
                top_logprobs=tuple(top) if k else None,
                routed_experts=_routed(choice, request, completion, len(request.prompt_ids)),
                usage=_usage(body, len(completion), len(request.prompt_ids)),
                request_id=request_id,
                server=server_url,
            )
        )
    return results


def parse_prompt_logprobs(raw: Any, request: TeacherRequest, server_url: str, *, transport: str) -> TeacherLogprobs:
    """Teacher logprobs from vLLM's ``prompt_logprobs``: ``[null, {"<id>": {logprob, rank, decoded_token}}, ...]``."""
    body = Node(raw, "$", server_url)
    holder = body if transport == "generate" else _choices(body, 1)[0]
    field = holder.get("prompt_logprobs")
    rows = field.optional_items()
    if rows is None:
        raise field.fail("prompt_logprobs is null (the server ignored prompt_logprobs)")
    ids = request.token_ids
    if request.images:
        answered, spans = engine_prompt(body, request.images)
        check_expansion(
            ids,
            request.image_spans,
            answered,
            spans,
            images=len(request.images),
            where="teacher",
            server_url=server_url,
        )
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
                    token_id=int(t),
                    logprob=rows[i].get(t).get("logprob").logprob(),
                    rank=rows[i].get(t).get("rank").optional_integer(),
                )
                for t in entries
            ]
            top.append(_top_k(alts, k, rows[i]))
    return TeacherLogprobs(token_ids=ids, logprobs=logprobs, top_logprobs=tuple(top) if k else None)


def max_model_len(raw: Any, model: str, server_url: str) -> tuple[int, list[str]]:
    """``max_model_len`` of ``model`` in a ``/v1/models`` answer, and every served name (adapters included)."""
    entries = Node(raw, "$", server_url).get("data").items()
    names = [e.get("id").string() or "" for e in entries]
    by_name = dict(zip(names, entries, strict=True))
    entry = by_name.get(model)
    if entry is None:
        return -1, names
    limit = entry.get("max_model_len", required=False).optional_integer()
    parent = entry.get("parent", required=False).optional_string()
    if limit is None and parent in by_name:  # a LoRA adapter: vLLM reports null, the base model's limit applies
        limit = by_name[parent].get("max_model_len").integer()
    if limit is None:
        raise entry.get("max_model_len").fail(f"no max_model_len for {model!r} (nor for its parent {parent!r})")
    return limit, names


def lora_names(raw: Any, server_url: str) -> tuple[str, ...]:
    """Adapters in a ``/v1/models`` answer: entries whose ``parent`` is a base model."""
    entries = Node(raw, "$", server_url).get("data").items()
    return tuple(e.get("id").string() or "" for e in entries if e.get("parent", required=False).value is not None)


def token_list(raw: Any, server_url: str) -> list[int]:
    """The ``tokens`` of a ``/tokenize`` answer."""
    return list(_ids(Node(raw, "$", server_url).get("tokens")))


def requests_in_flight(metrics: str, server_url: str) -> int:
    """Running + waiting requests from vLLM's Prometheus ``/metrics`` (``/load`` stays 0 unless the server runs
    with ``--enable-server-load-tracking``, so it cannot be trusted)."""
    total = 0.0
    seen = set()
    for line in metrics.splitlines():
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            if line.startswith((name + "{", name + " ")):
                try:
                    total += float(line.rsplit(" ", 1)[1])
                except (IndexError, ValueError) as exc:
                    raise ResponseParseError(f"unreadable metric line {line!r} in /metrics", url=server_url) from exc
                seen.add(name)
    if len(seen) != 2:
        raise ResponseParseError("/metrics lacks vllm:num_requests_running / vllm:num_requests_waiting", url=server_url)
    return int(total)


def abort_id(request_id: str, transport: str) -> str:
    """The id vLLM tracks for a caller's ``request_id`` (a raw id is silently ignored by ``/abort_requests``)."""
    return f"generate-tokens-{request_id}" if transport == "generate" else f"cmpl-{request_id}-0"


def flag(raw: Any, key: str, server_url: str) -> bool:
    """A boolean field of an admin answer (``{"is_paused": true}``); anything but a boolean is a parse error."""
    field = Node(raw, "$", server_url).get(key)
    if not isinstance(field.value, bool):
        raise field.fail(f"expected a boolean, got {field.value!r}")
    return field.value


def text(raw: Any, key: str, server_url: str) -> str:
    """A string field of an admin answer (``{"weight_version": "step-3"}``)."""
    return Node(raw, "$", server_url).get(key).string() or ""


def integer(raw: Any, key: str, server_url: str) -> int:
    """An integer field of an admin answer (``{"server_load": 3}``)."""
    return Node(raw, "$", server_url).get(key).integer()


# -- streaming ------------------------------------------------------------------------------------------------


def stream_payload(request: GenerateRequest, model: str | None, *, transport: str) -> tuple[str, dict[str, Any]]:
    """Path and body of a streamed generation on ``transport`` (with the usage chunk)."""
    if transport == "generate":
        path, body = "/inference/v1/generate", generate_payload(request, model)
    else:
        path, body = "/v1/completions", completions_payload(request, model)
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    return path, body


class StreamFold:
    """The chunks of one streamed generation (``n`` 1) read one by one (:meth:`chunk`) and folded back into the
    body the route answers whole (:meth:`result`)."""

    def __init__(self, request: GenerateRequest, server_url: str, *, transport: str) -> None:
        self.request = request
        self.server_url = server_url
        self.transport = transport
        self.chunks = 0
        self.request_id: Any = None
        self.ids: list[int] = []
        #: generate: ``logprobs.content`` entries; completions: the legacy lists by name
        self.entries: list[Any] = []
        self.legacy: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        self.finish: dict[str, Any] | None = None
        self.usage: Any = None
        #: whether :meth:`_plain_token_chunk` may take the chunks it recognises
        self._plain = transport == "generate" and not request.sampling.top_logprobs and not request.images
        #: the engine's prompt (first chunk of a prompt with images)
        self.prompt: dict[str, Any] = {}

    def chunk(self, raw: Any) -> StreamDelta | None:
        """One chunk: its new ids and their logprobs (checked as in a whole answer), or ``None`` when it has
        none (the usage chunk, a finish without a token)."""
        if self._plain:
            delta = self._plain_token_chunk(raw)
            if delta is not None:
                return delta
        body = Node(raw, f"$<chunk {self.chunks}>", self.server_url)
        self.chunks += 1
        rid = body.get("request_id" if self.transport == "generate" else "id").string()
        if self.request.images and isinstance(raw, dict):
            for key in ("prompt_token_ids", "mm_placeholders"):
                if raw.get(key) is not None:
                    self.prompt.setdefault(key, raw[key])
        if self.request_id is None:
            self.request_id = rid
        choices = body.get("choices").items()
        if not choices:
            usage = body.get("usage", required=False)
            if usage.value is not None:
                if self.usage is not None:
                    raise usage.fail("a second usage chunk")
                self.usage = usage.obj()
            return None
        if len(choices) != 1 or choices[0].get("index").integer() != 0:
            raise body.get("choices").fail(f"expected the one choice of index 0, got {len(choices)} choice(s)")
        if self.finish is not None:
            raise body.fail("a chunk with a choice after the one that finished")
        choice = choices[0]
        ids_field = choice.get("token_ids")
        if ids_field.value is None:
            raise ids_field.fail("token_ids is null: the server ignored return_token_ids")
        ids = _ids(ids_field)
        logprobs = self._logprobs(choice, ids)
        finish = choice.get("finish_reason", required=False).value
        if finish is not None:
            self.finish = {
                "finish_reason": finish,
                "stop_reason": choice.get("stop_reason", required=False).value,
                "routed_experts": choice.get("routed_experts", required=False).value,
                "weight_versions": choice.get("weight_versions", required=False).value,
            }
        elif choice.get("routed_experts", required=False).value is not None:
            raise choice.get("routed_experts").fail("routed experts before the chunk that finished")
        self.ids += ids
        return StreamDelta(completion_ids=ids, logprobs=logprobs) if ids else None

    def _plain_token_chunk(self, raw: Any) -> StreamDelta | None:
        """A generate chunk of the usual shape read with plain type checks: one choice of index 0, not finished, no
        routed experts, exact-int ids (at least one) and one ``{"token_id": <that id>, "logprob": <float in
        range>}`` entry per id (no alternatives asked for). Such a chunk is exactly one :meth:`chunk` accepts and
        this reads it to the same delta and state; anything else (also every bad chunk) gives ``None`` before any
        state changed, and :meth:`chunk` reads it field by field, naming the path of the problem."""
        if type(raw) is not dict or self.finish is not None:
            return None
        choices = raw.get("choices")
        rid = raw.get("request_id")
        if type(choices) is not list or len(choices) != 1 or type(rid) is not str:
            return None
        choice = choices[0]
        if type(choice) is not dict or choice.get("finish_reason") is not None:
            return None
        index = choice.get("index")
        if type(index) is not int or index != 0 or choice.get("routed_experts") is not None:
            return None
        ids = choice.get("token_ids")
        block = choice.get("logprobs")
        content = block.get("content") if type(block) is dict else None
        if type(ids) is not list or not ids or type(content) is not list or len(content) != len(ids):
            return None
        values = []
        for token, entry in zip(ids, content, strict=True):  # mostly one: a chunk per engine step
            if type(token) is not int or type(entry) is not dict:
                return None
            claimed = entry.get("token_id")
            value = entry.get("logprob")
            # NaN fails both comparisons, infinities one
            if type(claimed) is not int or claimed != token or type(value) is not float:
                return None
            if not PLACEHOLDER_LOGPROB < value <= 1e-3:
                return None
            values.append(value)
        self.chunks += 1
        if self.request_id is None:
            self.request_id = rid
        self.entries += content
        self.ids += ids
        return StreamDelta(completion_ids=tuple(ids), logprobs=np.array(values, dtype=np.float32))

    def _logprobs(self, choice: Node, ids: tuple[int, ...]) -> Float32s:
        k = self.request.sampling.top_logprobs
        if self.transport == "generate":
            if not ids and choice.get("logprobs", required=False).value is None:
                return np.zeros(0, np.float32)
            logprobs, _ = _logprobs(choice, ids, k)
            self.entries += [entry.value for entry in choice.get("logprobs").get("content").items()]
            return logprobs
        legacy = choice.get("logprobs")
        if legacy.value is None:
            if not ids:
                return np.zeros(0, np.float32)
            raise legacy.fail("no logprobs in the chunk (logprobs was sent)")
        tokens = legacy.get("tokens").items()
        values = legacy.get("token_logprobs").items()
        if not len(tokens) == len(values) == len(ids):
            raise legacy.fail(f"{len(tokens)} tokens and {len(values)} logprobs for {len(ids)} token ids")
        logprobs = np.empty(len(ids), dtype=np.float32)
        for i, token in enumerate(ids):
            claimed = _token_id_string(tokens[i])
            if claimed != token:
                raise tokens[i].fail(f"logprob entry is for token {claimed} but the chunk's id {i} is {token}")
            logprobs[i] = values[i].logprob()
        fields = legacy.obj()
        for name in ("tokens", "token_logprobs", "text_offset"):
            self.legacy[name] += fields.get(name) or []
        if k:
            self.legacy["top_logprobs"] += [row.value for row in legacy.get("top_logprobs").items()]
        return logprobs

    def result(self) -> GenerateResult:
        """The generation as the route's parser reads it answered whole."""
        if self.finish is None:
            raise ResponseParseError(
                f"the stream ended after {self.chunks} chunk(s) without a finish_reason", url=self.server_url
            )
        choice: dict[str, Any] = {"index": 0, "token_ids": self.ids, **self.finish}
        if self.transport == "generate":
            choice["logprobs"] = {"content": self.entries}
            body = {"request_id": self.request_id, "choices": [choice], "usage": self.usage, **self.prompt}
            (result,) = parse_generate(body, self.request, self.server_url)
        else:
            legacy: dict[str, Any] = dict(self.legacy)
            if not self.request.sampling.top_logprobs:
                legacy["top_logprobs"] = None
            choice["logprobs"] = legacy
            body = {"id": self.request_id, "choices": [choice], "usage": self.usage}
            (result,) = parse_completions(body, self.request, self.server_url)
        return result
