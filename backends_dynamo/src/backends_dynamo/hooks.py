"""Hook implementations of the ``dynamo`` backend (the entry point): generation, teacher scoring, tokenization
and options here. The admin hooks, the admin wire shapes and the client-side state live in
:mod:`backends_dynamo.admin` (registered from here); the generation wire mapping, streaming included, in
:mod:`backends_dynamo.wire`; the options in :mod:`backends_dynamo.options`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import attrs

from backends_core import Server, hookimpl
from backends_core.config import ClientConfig
from backends_core.errors import InvalidRequestError
from backends_core.fronts import Front
from backends_core.types import (
    SAMPLING_FEATURES,
    GenerateRequest,
    GenerateResult,
    StreamDelta,
    TeacherLogprobs,
    TeacherRequest,
)
from backends_dynamo import wire

# The admin hooks: importing them here registers them with this entry point module.
from backends_dynamo.admin import (
    REQUEST_ID_HEADER,
    Tracker,
    admin_abort,
    admin_destroy_weight_transfer,
    admin_flush_cache,
    admin_health,
    admin_init_weight_transfer,
    admin_load_lora,
    admin_pause,
    admin_ready,
    admin_resume,
    admin_sleep,
    admin_state,
    admin_unload_lora,
    admin_update_weights,
    admin_update_weights_distributed,
    admin_wake,
    dynamo_request_id,
    tracker,
    weight_transfer_plan,
)
from backends_dynamo.front import DynamoFront
from backends_dynamo.options import DynamoOptions, parse_options

__all__ = [
    "admin_abort",
    "admin_destroy_weight_transfer",
    "admin_flush_cache",
    "admin_health",
    "admin_init_weight_transfer",
    "admin_load_lora",
    "admin_pause",
    "admin_ready",
    "admin_resume",
    "admin_sleep",
    "admin_state",
    "admin_unload_lora",
    "admin_update_weights",
    "admin_update_weights_distributed",
    "admin_wake",
    "parse_response",
    "post_generate",
    "teacher_logprobs",
    "tokenize_messages",
    "validate_backend_options",
    "weight_transfer_plan",
]


@hookimpl
def validate_backend_options(options: Mapping[str, Any], config: ClientConfig) -> DynamoOptions:
    return parse_options(options, config)


def _hint(status: int, body: Any) -> str | None:
    message = str(body.get("message", "")) if isinstance(body, Mapping) else str(body)
    if status == 400 and ("unknown field" in message or "Unsupported parameter" in message):
        return (
            "the frontend refuses a field (nvext and top level are deny-unknown); this backend speaks ai-dynamo 1.6.1"
        )
    if status == 404 and message == "Model not found":
        return "the model (or LoRA adapter) is not served by this frontend: GET /v1/models lists what is"
    if status == 404:
        return "no such route: is this a Dynamo frontend?"
    if status == 503:
        return "no worker serves the model right now (starting up, asleep, or gone)"
    return None


# -- generation -------------------------------------------------------------------------------------------


def _one_sample(request: GenerateRequest, index: int) -> GenerateRequest:
    s = request.sampling
    seed = None if s.seed is None else s.seed + index
    return attrs.evolve(request, sampling=attrs.evolve(s, n=1, seed=seed))


def _note_request_id(track: Tracker, raw: Any, sent: str) -> None:
    answered = raw.get("id") if isinstance(raw, Mapping) else None
    if isinstance(answered, str) and not answered.endswith(sent):
        track.ignores_request_ids = True


async def _send(
    server: Server, request: GenerateRequest, index: int, model: str, options: DynamoOptions
) -> wire.Sample:
    track = tracker(server)
    rid = dynamo_request_id(request.request_id, index)
    path, body = wire.generation_payload(
        _one_sample(request, index),
        model,
        transport=options.transport,
        metadata=options.extra_fields,
        stream=options.stream,
    )
    flight = track.begin(rid, request.request_id)
    try:
        raw = await server.request(
            "POST",
            path,
            json_body=body,
            headers={REQUEST_ID_HEADER: rid},
            expect="text" if options.stream else "json",
            status_hint=_hint,
            # the routed experts' base64 (megabytes) stays in the raw body as a memoryview: never JSON-scanned
            large_strings=("routed_experts", "data") if request.return_routed_experts and not options.stream else (),
        )
    finally:
        aborted, version = track.end(flight)
    if options.stream:
        raw = wire.fold(wire.parse_sse(raw, server.base_url), server.base_url)
    _note_request_id(track, raw, rid)
    return wire.Sample(raw, aborted=aborted, weight_version=version)


_WINDOWS = "dynamo.context_windows"  # Server.cache: {model: context_window} from the frontend's /v1/models


async def _context_window(server: Server, model: str) -> int:
    """``model``'s ``context_window`` on ``server`` (0: unknown), from ``GET /v1/models``: read once per frontend and
    read again when ``model`` is not listed (an adapter loaded since).

    :raises InvalidRequestError: the frontend does not serve ``model``.
    """
    windows: dict[str, int] | None = server.cache.get(_WINDOWS)
    if windows is None or model not in windows:
        raw = await server.request("GET", "/v1/models", status_hint=_hint)
        windows = server.cache[_WINDOWS] = wire.context_windows(raw, server.base_url)
    if model not in windows:
        raise InvalidRequestError(f"model {model!r} is not served by {server.base_url} (it serves {sorted(windows)})")
    return windows[model]


async def _check_length(server: Server, request: GenerateRequest, model: str) -> None:
    """What the frontend refuses with its ``context_length`` 400: prompt + ``max_tokens`` above the window."""
    window = await _context_window(server, model)
    needed = len(request.prompt_ids) + request.sampling.max_tokens
    if window and needed > window:
        raise InvalidRequestError(
            f"prompt of {len(request.prompt_ids)} tokens + max_tokens {request.sampling.max_tokens} = {needed} exceeds "
            f"the context_window {window} of {model!r} on {server.base_url}"
        )


@hookimpl
def sampling_features(options: DynamoOptions) -> frozenset[str]:
    """Stop strings (matched by the frontend's detokenizer; not together with ``ignore_eos``, which makes 1.6.1
    ignore them: ``wire.check_generation`` refuses the pair) and the ``extra`` keys of ``wire.EXTRA_KEYS``;
    structured output (``guided_*``) only with ``backend_options.structured_output``. Never ``logit_bias``:
    1.6.1 accepts it on its OpenAI routes but does not forward it to the engine (its ``SamplingOptions`` have no
    such field)."""
    features = {"stop", "extra"}
    if options.structured_output:
        features.update(f for f in SAMPLING_FEATURES if f.startswith("structured."))
    return frozenset(features)


@hookimpl
def image_refusal() -> str:
    # Dynamo 1.6.1's frontend forwards chat image parts to workers started with --enable-multimodal only, its
    # /v1/completions has no field for an image, and its /inference/v1/generate takes vLLM-rendered features only
    # (it refuses raw content_parts): no route here both takes the client's ids and reports the widened prompt.
    return (
        "Dynamo 1.6.1 has no token-in route that takes raw images and reports the prompt ids its worker ran "
        "(its /v1/completions takes no images; /inference/v1/generate refuses content_parts)"
    )


@hookimpl
async def post_generate(
    server: Server, request: GenerateRequest, config: ClientConfig, options: DynamoOptions
) -> wire.Exchange:
    model = wire.served_name(request.lora, request.model, config.model)
    wire.check_generation(request, fan_out=options.fan_out_n)
    if options.check_prompt_length:
        await _check_length(server, request, model)
    tasks = [asyncio.ensure_future(_send(server, request, i, model, options)) for i in range(request.sampling.n)]
    try:
        samples = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return wire.Exchange(tuple(samples))


@hookimpl
async def post_generate_stream(
    server: Server, request: GenerateRequest, config: ClientConfig, options: DynamoOptions
) -> AsyncIterator[StreamDelta | GenerateResult]:
    model = wire.served_name(request.lora, request.model, config.model)
    wire.check_generation(request, fan_out=options.fan_out_n)
    track = tracker(server)
    rid = dynamo_request_id(request.request_id, 0)
    path, body = wire.generation_payload(
        request, model, transport=options.transport, metadata=options.extra_fields, stream=True
    )
    fold = wire.StreamFold(request, server.base_url)
    flight = track.begin(rid, request.request_id)
    try:
        async with server.stream(
            "POST", path, json_body=body, headers={REQUEST_ID_HEADER: rid}, status_hint=_hint
        ) as stream:
            async for raw in stream.json_events():
                if isinstance(raw, dict) and "error" in raw:
                    error = raw["error"]
                    code = error.get("code") if isinstance(error, dict) else None
                    raise stream.error(error, status_code=code if isinstance(code, int) else 500)
                delta = fold.chunk(raw)
                if delta is not None:
                    yield delta
    finally:
        aborted, version = track.end(flight)
    if fold.chunks:
        _note_request_id(track, fold.chunks[0], rid)
    yield fold.result(aborted=aborted, weight_version=version)


@hookimpl
def parse_response(raw: Any, request: GenerateRequest, server_url: str) -> list[GenerateResult]:
    return wire.parse_generation(raw, request, server_url)


@hookimpl
async def teacher_logprobs(
    server: Server, request: TeacherRequest, config: ClientConfig, options: DynamoOptions
) -> TeacherLogprobs:
    model = wire.served_name(request.lora, request.model, config.model)
    wire.check_teacher(request)
    path, body = wire.teacher_payload(request, model, transport=options.transport)
    track = tracker(server)
    rid = dynamo_request_id(request.request_id)
    flight = track.begin(rid, request.request_id)
    try:
        raw = await server.request(
            "POST", path, json_body=body, headers={REQUEST_ID_HEADER: rid}, idempotent=True, status_hint=_hint
        )
    finally:
        _, version = track.end(flight)
    return wire.parse_teacher(raw, request, server.base_url, weight_version=version)


@hookimpl
async def tokenize_messages(
    server: Server,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    chat_template_kwargs: Mapping[str, Any],
    add_generation_prompt: bool,
    config: ClientConfig,
) -> list[int]:
    """The frontend's own rendering of ``messages``, read from the engine record of a one-token chat request."""
    if not add_generation_prompt:
        raise InvalidRequestError(
            "Dynamo's chat route always renders the generation prompt: add_generation_prompt=False cannot be checked"
        )
    path, body = wire.tokenize_payload(messages, tools, chat_template_kwargs, wire.served_name(config.model))
    raw = await server.request("POST", path, json_body=body, idempotent=True, status_hint=_hint)
    return wire.parse_prompt_ids(raw, server.base_url)


@hookimpl
def fronts() -> Mapping[str, type[Front]]:
    """``[front] kind = "dynamo"``: Dynamo's frontend, workers discovered at ``/v1/rl/workers``."""
    return {DynamoFront.kind: DynamoFront}
