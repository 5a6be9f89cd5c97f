"""SGLang's wire format (0.5.23 HTTP server) and its mapping to the core types.

Generation and teacher scoring both use ``POST /generate`` with token ids:

* request: ``{"input_ids", "sampling_params": {...}, "return_logprob": true, "logprob_start_len",
  "top_logprobs_num", "rid", "lora_path", "return_routed_experts", "routed_experts_start_len", ...}``.
  ``sampling_params`` rejects unknown keys with a 400, so every field is mapped by name here, and every one
  is sent (SGLang merges omitted fields from ``--preferred-sampling-params``).
* answer: one object, or a list of ``n`` objects when ``n > 1``: ``output_ids`` and ``meta_info`` with
  ``output_token_logprobs = [[logprob, token_id, text|null], ...]`` (each id checked against ``output_ids``),
  ``finish_reason = {"type": "length"|"stop"|"abort", "matched"?, "message"?}``, ``weight_version``,
  ``weight_versions`` spans, ``cached_tokens`` and, when asked, ``routed_experts`` (see
  :mod:`backends_sglang.experts`).
* teacher: ``max_new_tokens: 0`` with ``logprob_start_len: 0``; ``input_token_logprobs`` then has one entry per
  token and entry 0 is ``[null, id, text]``. (With ``logprob_start_len = k`` the list starts at position ``k``
  and entry ``k`` is null too, although that token has a logprob: never score from ``k > 0``.)

Streaming (``"stream": true``): Server-Sent Events whose data is the same object, ``[DONE]`` last. By default each
event is cumulative (``output_ids`` and the logprob lists hold everything so far); with the server flag
``--incremental-streaming-output`` each holds only what is new. ``meta_info.completion_tokens`` counts everything
so far in both forms, which tells them apart (:class:`StreamFold`). ``finish_reason`` is null until the last event,
which also carries ``weight_versions`` and routed experts.

Output logprobs are ``log_softmax(logits / temperature)`` on SGLang (not renormalised for top-k/top-p; raw at
temperature 0); prompt logprobs are always raw. They are the engine's own numbers and are passed through.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from typing import Any

import attrs
import numpy as np

from backends_core.errors import ConfigError, InvalidRequestError, ResponseParseError
from backends_core.images import Image, ImageSpan, check_expansion, collapse
from backends_core.jsonnode import Node
from backends_core.types import (
    Choice,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    JsonSchema,
    Regex,
    SamplingParams,
    StreamDelta,
    TeacherLogprobs,
    TeacherRequest,
    TopLogprob,
    Usage,
    WeightVersionSpan,
)
from backends_sglang import experts

__all__ = [
    "EXTRA_KEYS",
    "MODELLED",
    "SAMPLING_KEYS",
    "generate_payload",
    "in_flight",
    "lora_names",
    "max_req_input_len",
    "parse_generate",
    "parse_teacher",
    "routed_start",
    "sampling_params",
    "structured_fields",
    "succeeded",
    "teacher_payload",
    "token_list",
    "weight_version",
]

#: The keys SGLang 0.5.23's ``sampling_params`` accepts; any other key is a 400.
SAMPLING_KEYS = (
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
    "custom_params",
    "beam_width",
    "watermark",
    "choice",
)
_FINISH: dict[str, FinishReason] = {"length": "length", "stop": "stop", "abort": "abort"}
#: Wire names the modelled fields of :class:`SamplingParams` use: ``extra`` may not set them.
MODELLED = frozenset(
    {
        "max_new_tokens",
        "min_new_tokens",
        "n",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop_token_ids",
        "ignore_eos",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "sampling_seed",
        "stop",
        "logit_bias",
        "json_schema",
        "regex",
        "ebnf",
    }
)
#: ``sampling_params`` keys ``extra`` may set: SGLang's own, minus the modelled ones and those that change the
#: answer's shape (``beam_width``) or whose meaning SGLang 0.5.23 does not define (``choice``).
EXTRA_KEYS = frozenset(SAMPLING_KEYS) - MODELLED - {"beam_width", "choice"}
_REGEX_SPECIAL = frozenset("\\.^$|?*+()[]{}/")


def _regex_literal(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_SPECIAL else c for c in text)


def structured_fields(s: SamplingParams) -> dict[str, Any]:
    """SGLang's structured-output field for ``s.structured``: ``json_schema`` (a JSON string), ``regex``,
    ``ebnf``; a choice is the regex alternation of its literal strings (SGLang's ``sampling_params`` has no
    choice field of its own)."""
    c = s.structured
    if c is None:
        return {}
    if isinstance(c, JsonSchema):
        return {"json_schema": json.dumps(dict(c.schema), separators=(",", ":"))}
    if isinstance(c, Regex):
        return {"regex": c.pattern}
    if isinstance(c, Choice):
        return {"regex": "(" + "|".join(_regex_literal(x) for x in c.choices) + ")"}
    return {"ebnf": c.grammar}


# -- requests -------------------------------------------------------------------------------------------


def sampling_params(s: SamplingParams, *, max_new_tokens: int | None = None) -> dict[str, Any]:
    """Our :class:`SamplingParams` under SGLang's names, every field explicit (``sampling_seed`` only when set)."""
    params: dict[str, Any] = {
        "max_new_tokens": s.max_tokens if max_new_tokens is None else max_new_tokens,
        "min_new_tokens": s.min_tokens,
        "n": s.n,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "min_p": s.min_p,
        "stop_token_ids": list(s.stop_token_ids or ()),
        "ignore_eos": s.ignore_eos,
        "repetition_penalty": s.repetition_penalty,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
    }
    if s.seed is not None:
        params["sampling_seed"] = s.seed
    if s.stop:
        params["stop"] = list(s.stop)
    if s.logit_bias:
        params["logit_bias"] = {str(token): bias for token, bias in s.logit_bias.items()}
    params.update(structured_fields(s))
    for key, value in s.extra.items():
        if key in MODELLED:
            raise InvalidRequestError(f"extra key {key!r} collides with a field SamplingParams models: set it there")
        if key not in EXTRA_KEYS:
            raise InvalidRequestError(
                f"extra key {key!r} is not a sampling_params field SGLang 0.5.23 takes; known: {sorted(EXTRA_KEYS)}"
            )
        params[key] = value
    return params


_I64 = 2**63


def single_samples(request: GenerateRequest) -> list[GenerateRequest]:
    """``request`` (``n`` samples, seeded) as ``n`` requests of one sample, sample ``i`` with seed ``seed + i``
    and, when the caller named the request, the id ``<request_id>_<i>`` (SGLang's own name for sample ``i``; it
    refuses two requests with one id).

    :raises InvalidRequestError: ``seed + n - 1`` does not fit SGLang's signed 64-bit ``sampling_seed``.
    """
    s = request.sampling
    assert s.seed is not None
    if not (s.seed >= -_I64 and s.seed + s.n - 1 < _I64):
        raise InvalidRequestError(f"seed {s.seed} (+ n - 1 = {s.n - 1}) does not fit SGLang's 64-bit sampling_seed")
    return [
        attrs.evolve(
            request,
            sampling=attrs.evolve(s, n=1, seed=s.seed + i),
            request_id=None if request.request_id is None else f"{request.request_id}_{i}",
        )
        for i in range(s.n)
    ]


def routed_start(request: GenerateRequest) -> int:
    """The ``routed_experts_start_len`` to send: the wanted start, at most the last prompt position (the
    rows of completion positions are then trimmed client-side, whatever the server does past the prompt)."""
    return min(request.routed_experts_start, len(request.prompt_ids) - 1)


def generate_payload(request: GenerateRequest) -> dict[str, Any]:
    """Body of ``POST /generate`` for a generation. ``model`` has no place on ``/generate`` (SGLang serves one
    model; adapters are chosen by ``lora_path``)."""
    body: dict[str, Any] = {
        "input_ids": list(request.prompt_ids),
        "sampling_params": sampling_params(request.sampling),
        "return_logprob": True,
        "logprob_start_len": -1,
        "top_logprobs_num": request.sampling.top_logprobs,
        "return_text_in_logprobs": False,
    }
    if request.request_id is not None:
        body["rid"] = request.request_id
    if request.lora is not None:
        body["lora_path"] = request.lora
    if request.cache_salt is not None:
        body["cache_salt"] = request.cache_salt
    if request.priority is not None:
        body["priority"] = request.priority
    if request.return_routed_experts:
        body["return_routed_experts"] = True
        body["routed_experts_start_len"] = routed_start(request)
    if request.images:
        _with_images(body, request.prompt_ids, request.images, request.image_spans, request.cache_salt)
    return body


def image_key(image: Image, salt: str | None) -> str:
    """The ``mm_hashes`` entry of ``image``: SGLang keys its vision-embedding cache by it and never clears that cache
    (not on ``/flush_cache``, not on a weight update), so the key is salted with the weight version: 64 hex."""
    return image.sha256 if not salt else hashlib.sha256(image.identity(salt).encode()).hexdigest()


def _with_images(
    body: dict[str, Any],
    ids: tuple[int, ...],
    images: tuple[Image, ...],
    spans: tuple[ImageSpan, ...],
    salt: str | None,
) -> None:
    """``body`` carrying ``images``: ids collapsed to one placeholder per image (SGLang widens each; with any other
    count its tokenizer manager never answers), the images, their salted keys, and the ids it ran asked back."""
    body["input_ids"] = list(collapse(ids, spans))
    body["image_data"] = [image.data_url() for image in images]
    body["mm_hashes"] = [image_key(image, salt) for image in images]
    body["return_prompt_token_ids"] = True


def teacher_payload(request: TeacherRequest) -> dict[str, Any]:
    """Body of ``POST /generate`` scoring ``request.token_ids``: no new token, prompt logprobs from position 0."""
    body: dict[str, Any] = {
        "input_ids": list(request.token_ids),
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": request.top_logprobs,
        "return_text_in_logprobs": False,
    }
    if request.request_id is not None:
        body["rid"] = request.request_id
    if request.lora is not None:
        body["lora_path"] = request.lora
    if request.images:
        _with_images(body, request.token_ids, request.images, request.image_spans, request.cache_salt)
    return body


def engine_prompt(
    holder: Node, images: int, image_token: int | None, meta: Node
) -> tuple[tuple[int, ...], tuple[ImageSpan, ...]]:
    """The prompt ids SGLang ran (``prompt_token_ids``, asked with ``return_prompt_token_ids``) and each image's
    span: SGLang names no offsets, so the spans are the runs of the image placeholder (the client sent exactly one
    per image, each between the template's vision markers); ``meta_info.image_tokens`` must be their total."""
    field = holder.get("prompt_token_ids")
    ids = tuple(t.integer() for t in field.items())
    if image_token is None:
        raise field.fail("the model's image placeholder id is unknown (no image_token_id in its config.json)")
    spans: list[ImageSpan] = []
    for i, token in enumerate(ids):
        if token != image_token:
            continue
        if spans and spans[-1].end == i:
            spans[-1] = ImageSpan(spans[-1].start, i + 1)
        else:
            spans.append(ImageSpan(i, i + 1))
    if len(spans) != images:
        raise field.fail(f"{len(spans)} runs of the image placeholder {image_token} for {images} images")
    reported = meta.get("image_tokens", required=False)
    if reported.value is not None and reported.integer() != sum(s.length for s in spans):
        raise reported.fail(
            f"image_tokens is {reported.value} but the placeholder runs hold {sum(s.length for s in spans)}"
        )
    return ids, tuple(spans)


# -- generation answers ---------------------------------------------------------------------------------


def _triple(entry: Node) -> tuple[Node, int]:
    """``[logprob, token_id, text|null]`` -> (logprob body, token id)."""
    parts = entry.items()
    if len(parts) not in (2, 3):
        raise entry.fail(f"expected [logprob, token_id, text], got {len(parts)} element(s)")
    return parts[0], parts[1].integer()


def _alternatives(row: Node, k: int) -> tuple[TopLogprob, ...]:
    """The first ``k`` ``[logprob, id, text]`` of a top-logprobs row, checked to be in descending order."""
    entries = row.items()
    if len(entries) < k:
        raise row.fail(f"expected {k} alternatives, got {len(entries)}")
    top = []
    for rank, entry in enumerate(entries[:k], start=1):
        lp, token = _triple(entry)
        top.append(TopLogprob(token_id=token, logprob=lp.logprob(), rank=rank))
    if any(a.logprob < b.logprob - 1e-6 for a, b in itertools.pairwise(top)):
        raise row.fail("alternatives are not in descending logprob order")
    return tuple(top)


def _finish(meta: Node) -> tuple[FinishReason, int | str | None]:
    field = meta.get("finish_reason")
    kind = field.get("type").string()
    if kind not in _FINISH:
        raise field.get("type").fail(f"finish type {kind!r} is not one of {list(_FINISH)}")
    if kind != "stop":
        return _FINISH[kind], None
    matched = field.get("matched", required=False).value
    if matched is not None and (isinstance(matched, bool) or not isinstance(matched, int | str)):
        raise field.get("matched").fail(f"expected a token id, a string or null, got {matched!r}")
    return "stop", matched


def _spans(meta: Node) -> tuple[WeightVersionSpan, ...]:
    field = meta.get("weight_versions", required=False)
    if field.value is None:
        return ()
    return tuple(
        WeightVersionSpan(version=s.get("version").string(), start=s.get("start").integer(), end=s.get("end").integer())
        for s in field.items()
    )


def _samples(raw: Any, n: int, url: str) -> list[Node]:
    body = Node(raw, "$", url)
    samples = body.items() if isinstance(raw, list) else [body]
    if len(samples) != n:
        raise body.fail(f"expected {n} sample(s) (n={n}), got {len(samples)}")
    return samples


def _completion_logprobs(meta: Node, completion: tuple[int, ...]) -> np.ndarray[Any, np.dtype[np.float32]]:
    field = meta.get("output_token_logprobs", required=False)
    if field.value is None:
        raise field.fail("no output logprobs in the answer although return_logprob was sent")
    entries = field.items()
    if len(entries) != len(completion):
        raise field.fail(f"{len(entries)} logprob entries for {len(completion)} output ids")
    logprobs = np.empty(len(completion), dtype=np.float32)
    for i, (token, entry) in enumerate(zip(completion, entries, strict=True)):
        lp, claimed = _triple(entry)
        if claimed != token:
            raise entry.fail(f"logprob entry is for token {claimed} but output id {i} is {token}")
        logprobs[i] = lp.logprob()
    return logprobs


def _top_rows(meta: Node, k: int, count: int) -> tuple[tuple[TopLogprob, ...], ...] | None:
    if not k:
        return None
    field = meta.get("output_top_logprobs", required=False)
    if field.value is None:
        raise field.fail(f"no top logprobs in the answer although top_logprobs_num={k} was sent")
    rows = field.items()
    if len(rows) != count:
        raise field.fail(f"{len(rows)} top-logprob rows for {count} output ids")
    return tuple(_alternatives(row, k) for row in rows)


def _usage(meta: Node, prompt: int, completion: int) -> Usage:
    reported = meta.get("prompt_tokens").integer()
    if reported != prompt:
        raise meta.get("prompt_tokens").fail(f"prompt_tokens is {reported} but {prompt} prompt ids were sent")
    generated = meta.get("completion_tokens").integer()
    if generated != completion:
        raise meta.get("completion_tokens").fail(f"completion_tokens is {generated} for {completion} output ids")
    cached = meta.get("cached_tokens", required=False)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_tokens=cached.integer() if cached.value is not None else None,
    )


def parse_generate(
    raw: Any,
    request: GenerateRequest,
    server_url: str,
    geometry: experts.RoutingGeometry | None,
    *,
    front: str | None = None,
    image_token: int | None = None,
) -> list[GenerateResult]:
    """One :class:`GenerateResult` per sample of a ``/generate`` answer.

    :param geometry: routing layers and top-k, needed only when routed experts were asked for.
    :param image_token: the model's image placeholder id (needed only for a prompt with images).
    :param front: the kind of router the answer came through (``FrontConfig.kind``), if any.
    :raises ResponseParseError: naming the offending JSON path.
    """
    results = []
    for sample in _samples(raw, request.sampling.n, server_url):
        meta = sample.get("meta_info")
        completion = tuple(t.integer() for t in sample.get("output_ids").items())
        prompt: tuple[int, ...] = request.prompt_ids
        image_spans: tuple[ImageSpan, ...] = ()
        if request.images:
            prompt, image_spans = engine_prompt(sample, len(request.images), image_token, meta)
        finish, stop_reason = _finish(meta)
        spans = _spans(meta)
        version = meta.get("weight_version", required=False)
        routed = None
        if request.return_routed_experts:
            field = meta.get("routed_experts", required=False)
            if field.value is None:
                if front is not None:
                    raise field.fail(
                        f"routed experts were asked for but the answer that came through the {front} front at "
                        f"{server_url} has none: the router drops meta_info.routed_experts (sglang-router 0.3.2 "
                        "does, whatever the replicas return); send requests that need them to a replica directly "
                        "(a client without front, base_url = the replicas)"
                    )
                raise field.fail(
                    "routed experts were asked for but the answer has none: start SGLang with "
                    "--enable-return-routed-experts (MoE models only)"
                )
            routed = experts.decode(
                field.value,
                geometry,
                total_tokens=len(prompt) + len(completion),
                server_start=routed_start(request),
                wanted_start=request.routed_experts_start,
                field=field.path,
                url=server_url,
            )
        results.append(
            GenerateResult(
                prompt_ids=prompt,
                images=request.images,
                image_spans=image_spans,
                completion_ids=completion,
                logprobs=_completion_logprobs(meta, completion),
                finish_reason=finish,
                stop_reason=stop_reason,
                top_logprobs=_top_rows(meta, request.sampling.top_logprobs, len(completion)),
                routed_experts=routed,
                weight_version=version.string()
                if version.value is not None
                else (spans[-1].version if spans else None),
                weight_versions=spans,
                usage=_usage(meta, len(prompt), len(completion)),
                request_id=meta.get("id").string(),
                server=server_url,
            )
        )
    return results


def parse_teacher(
    raw: Any, request: TeacherRequest, server_url: str, *, image_token: int | None = None
) -> TeacherLogprobs:
    """Teacher logprobs from ``meta_info.input_token_logprobs`` of a ``max_new_tokens: 0`` answer."""
    (sample,) = _samples(raw, 1, server_url)
    meta = sample.get("meta_info")
    ids = request.token_ids
    if request.images:
        answered, spans = engine_prompt(sample, len(request.images), image_token, meta)
        check_expansion(
            ids,
            request.image_spans,
            answered,
            spans,
            images=len(request.images),
            where="teacher",
            server_url=server_url,
        )
    field = meta.get("input_token_logprobs", required=False)
    if field.value is None:
        raise field.fail("no prompt logprobs in the answer although return_logprob and logprob_start_len 0 were sent")
    entries = field.items()
    if len(entries) != len(ids):
        raise field.fail(f"{len(entries)} entries for {len(ids)} token ids (logprob_start_len 0 was sent)")
    logprobs = np.full(len(ids), np.nan, dtype=np.float32)
    # SGLang runs an image's placeholders as per-image pad values (its cache keys), and scores those: the entries
    # there name another token, and their logprobs are no logprob of the placeholder; they stay NaN
    in_image = np.zeros(len(ids), dtype=bool)
    for span in request.image_spans:
        in_image[span.start : span.end] = True
    for i, (token, entry) in enumerate(zip(ids, entries, strict=True)):
        if in_image[i]:
            continue
        lp, claimed = _triple(entry)
        if claimed != token:
            raise entry.fail(f"entry is for token {claimed} but token {i} is {token}")
        if i == 0:
            if lp.value is not None:
                raise lp.fail("the first entry must have a null logprob (the first token has no prefix)")
            continue
        logprobs[i] = lp.logprob()
    top = None
    if request.top_logprobs:
        rows_field = meta.get("input_top_logprobs", required=False)
        if rows_field.value is None:
            raise rows_field.fail(f"no top logprobs although top_logprobs_num={request.top_logprobs} was sent")
        rows = rows_field.items()
        if len(rows) != len(ids):
            raise rows_field.fail(f"{len(rows)} top-logprob rows for {len(ids)} token ids")
        top = ((), *(_alternatives(row, request.top_logprobs) for row in rows[1:]))
    version = meta.get("weight_version", required=False)
    return TeacherLogprobs(
        token_ids=ids,
        logprobs=logprobs,
        top_logprobs=top,
        weight_version=version.string() if version.value is not None else None,
    )


# -- admin answers --------------------------------------------------------------------------------------


def max_req_input_len(raw: Any, server_url: str) -> int:
    """The longest prompt the scheduler accepts (``max_req_input_len`` of ``/server_info``; the scheduler's
    ``max_req_len`` is 5 more, and ``prompt + max_new_tokens`` is clipped to ``max_req_len - 1``)."""
    body = Node(raw, "$", server_url)
    if isinstance(raw, dict) and raw.get("router_manager") is True:
        raise ConfigError(
            [
                f"{server_url} is an sglang-router (SGLang Model Gateway), not an SGLang server: its "
                "/get_server_info is the router's own; configure it as a front ([front] kind = 'sglang-router') "
                "so that admin operations reach every replica @ $.front"
            ]
        )
    if body.has("max_req_input_len"):
        value = body.get("max_req_input_len").integer()
    else:
        states = body.get("internal_states", required=False)
        if states.value is None or not states.items() or not states.items()[0].has("max_req_input_len"):
            raise body.fail("no max_req_input_len in /server_info (top level or internal_states[0])")
        value = states.items()[0].get("max_req_input_len").integer()
    if value < 1:
        raise body.get("max_req_input_len").fail(f"max_req_input_len must be >= 1, got {value}")
    return value


def weight_version(raw: Any, server_url: str) -> str:
    """``weight_version`` of a ``/model_info`` answer."""
    return Node(raw, "$", server_url).get("weight_version").string()


def in_flight(raw: Any, server_url: str) -> int:
    """Running plus waiting requests over every data-parallel rank of a ``/v1/loads`` answer."""
    loads = Node(raw, "$", server_url).get("loads").items()
    return sum(load.get("num_running_reqs").integer() + load.get("num_waiting_reqs").integer() for load in loads)


def lora_names(raw: Any, server_url: str) -> tuple[str, ...]:
    """Loaded adapters in a ``/v1/models`` answer: the entries with a ``parent`` model."""
    entries = Node(raw, "$", server_url).get("data").items()
    return tuple(e.get("id").string() for e in entries if e.get("parent", required=False).value is not None)


def succeeded(raw: Any, server_url: str, key: str = "success") -> bool:
    """Whether an admin answer reports success: ``{"success": true}`` or ``{"status": "ok"}`` (``key="status"``)."""
    body = Node(raw, "$", server_url)
    if key == "status":
        return body.get("status").string() == "ok"
    return body.get(key).boolean()


def token_list(raw: Any, server_url: str) -> list[int]:
    """The u32 ``tokens`` of a ``/v1/tokenize`` answer."""
    return list(Node(raw, "$", server_url).get("tokens").token_ids())


# -- streaming ------------------------------------------------------------------------------------------------


def stream_payload(request: GenerateRequest) -> dict[str, Any]:
    """The body of a streamed ``POST /generate``."""
    return {**generate_payload(request), "stream": True}


#: ``meta_info`` lists that grow with the output (cumulative events) or hold the new part (incremental ones).
_GROWING = ("output_token_logprobs", "output_top_logprobs")


class StreamFold:
    """The events of one streamed generation read one by one (:meth:`event`), cumulative or incremental, and
    folded back into the answer ``/generate`` gives whole (:meth:`result`)."""

    def __init__(
        self,
        request: GenerateRequest,
        server_url: str,
        geometry: experts.RoutingGeometry | None,
        *,
        image_token: int | None = None,
    ) -> None:
        self.request = request
        self.server_url = server_url
        self.geometry = geometry
        self.image_token = image_token
        #: the ids SGLang ran (every event of a prompt with images carries them)
        self.prompt: Any = None
        self.events = 0
        self.ids: list[int] = []
        self.lists: dict[str, list[Any]] = {name: [] for name in _GROWING}
        self.meta: dict[str, Any] | None = None
        self.finished = False

    def event(self, raw: Any) -> StreamDelta | None:
        """One event: its new ids and their logprobs (checked as in a whole answer), or ``None`` without any."""
        body = Node(raw, f"$<event {self.events}>", self.server_url)
        self.events += 1
        if self.finished:
            raise body.fail("an event after the one that finished")
        meta = body.get("meta_info")
        ids = [t.integer() for t in body.get("output_ids").items()]
        total = meta.get("completion_tokens").integer()
        seen = len(self.ids)
        if len(ids) == total and ids[:seen] == self.ids:  # cumulative (or the first event: both read the same)
            start = seen
        elif seen + len(ids) == total:  # incremental
            start = 0
        else:
            raise body.get("output_ids").fail(
                f"{len(ids)} output ids with completion_tokens {total} after {seen} ids: neither everything so far "
                "nor what is new"
            )
        new = tuple(ids[start:])
        fields = meta.obj()
        cut = {}
        for name in _GROWING:
            values = fields.get(name)
            if values is None:
                continue
            items = meta.get(name).items()
            if len(items) != len(ids):
                raise meta.get(name).fail(f"{len(items)} entries for {len(ids)} output ids")
            cut[name] = [item.value for item in items[start:]]
        logprobs = np.zeros(0, np.float32)
        if new:
            logprobs = _completion_logprobs(
                Node({"output_token_logprobs": cut.get("output_token_logprobs")}, meta.path, self.server_url), new
            )
        for name, values in cut.items():
            self.lists[name] += values
        self.ids += new
        self.meta = dict(fields)
        if self.request.images and isinstance(raw, dict) and raw.get("prompt_token_ids") is not None:
            self.prompt = raw["prompt_token_ids"]
        self.finished = fields.get("finish_reason") is not None
        return StreamDelta(completion_ids=new, logprobs=logprobs) if new else None

    def result(self) -> GenerateResult:
        """The generation as :func:`parse_generate` reads it answered whole."""
        if not self.finished or self.meta is None:
            raise ResponseParseError(
                f"the stream ended after {self.events} event(s) without a finish_reason", url=self.server_url
            )
        meta = dict(self.meta)
        for name in _GROWING:
            if name in meta and meta[name] is not None:
                meta[name] = self.lists[name]
        body: dict[str, Any] = {"output_ids": self.ids, "meta_info": meta}
        if self.prompt is not None:
            body["prompt_token_ids"] = self.prompt
        (result,) = parse_generate(body, self.request, self.server_url, self.geometry, image_token=self.image_token)
        return result
