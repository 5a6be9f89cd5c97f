"""Hook implementations of the ``reference`` backend. Each hook is a few lines; wire mapping is in ``wire.py``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from backends_core import Server
from backends_core.config import ClientConfig
from backends_core.converters import structure_response
from backends_core.hookspecs import hookimpl
from backends_core.types import (
    GenerateRequest,
    GenerateResult,
    LoraAdapter,
    PauseMode,
    ServerState,
    StreamDelta,
    TeacherLogprobs,
    TeacherRequest,
)
from backends_testkit.reference import wire


@hookimpl
def sampling_features() -> frozenset[str]:
    """Stop strings and logit bias; the reference engine has no structured output and no unmodelled fields."""
    return frozenset({"stop", "logit_bias"})


@hookimpl
async def post_generate(server: Server, request: GenerateRequest, config: ClientConfig) -> Any:
    return await server.request("POST", "/generate", json_body=wire.generate_payload(request, config.model))


@hookimpl
async def post_generate_stream(
    server: Server, request: GenerateRequest, config: ClientConfig
) -> AsyncIterator[StreamDelta | GenerateResult]:
    state = wire.StreamState()
    async with server.stream("POST", "/generate", json_body=wire.stream_payload(request, config.model)) as stream:
        async for raw in stream.json_events():
            if isinstance(raw, dict) and "error" in raw:
                raise stream.error(raw)
            delta = wire.stream_event(raw, state, server.base_url)
            if delta is not None:
                yield delta
    yield wire.finish_stream(state, request, server.base_url)


@hookimpl
def parse_response(raw: Any, request: GenerateRequest, server_url: str) -> list[GenerateResult]:
    return wire.parse_generate(raw, request, server_url)


@hookimpl
async def teacher_logprobs(server: Server, request: TeacherRequest, config: ClientConfig) -> TeacherLogprobs:
    raw = await server.request("POST", "/score", json_body=wire.score_payload(request, config.model), idempotent=True)
    return wire.parse_score(raw, request, server.base_url)


@hookimpl
async def tokenize_messages(
    server: Server,
    messages: Sequence[Any],
    tools: Sequence[Any] | None,
    chat_template_kwargs: Any,
    add_generation_prompt: bool,
    config: ClientConfig,
) -> list[int]:
    raw = await server.request(
        "POST",
        "/tokenize",
        idempotent=True,
        json_body={
            "model": config.model,
            "messages": [dict(m) for m in messages],
            "tools": list(tools) if tools else None,
            "chat_template_kwargs": dict(chat_template_kwargs),
            "add_generation_prompt": add_generation_prompt,
        },
    )
    return list(structure_response(wire.converter, raw, dict[str, list[int]], url=server.base_url)["tokens"])


async def _admin(server: Server, path: str, body: dict[str, Any] | None = None, *, method: str = "POST") -> Any:
    return await server.request(method, path, json_body=body, plane="admin", retry=method == "GET")


@hookimpl
async def admin_health(server: Server) -> bool:
    await _admin(server, "/health", method="GET")
    return True


@hookimpl
async def admin_ready(server: Server) -> bool:
    raw = await _admin(server, "/ready", method="GET")
    return bool(structure_response(wire.converter, raw, dict[str, bool], url=server.admin_url)["ready"])


@hookimpl
async def admin_pause(server: Server, mode: PauseMode, clear_cache: bool) -> bool:
    await _admin(server, "/pause", {"mode": mode})
    if clear_cache and mode != "keep":
        await _admin(server, "/flush_cache")
    return True


@hookimpl
async def admin_resume(server: Server) -> bool:
    await _admin(server, "/resume")
    return True


@hookimpl
async def admin_flush_cache(server: Server) -> bool:
    await _admin(server, "/flush_cache")
    return True


@hookimpl
async def admin_update_weights(server: Server, path: str, version: str | None) -> bool:
    await _admin(server, "/update_weights", {"path": path, "version": version})
    return True


@hookimpl
async def admin_load_lora(server: Server, adapter: LoraAdapter) -> bool:
    await _admin(server, "/lora/load", {"name": adapter.name, "path": adapter.path, "replace": adapter.replace})
    return True


@hookimpl
async def admin_unload_lora(server: Server, name: str) -> bool:
    await _admin(server, "/lora/unload", {"name": name})
    return True


@hookimpl
async def admin_state(server: Server) -> ServerState:
    raw = await _admin(server, "/state", method="GET")
    state = structure_response(wire.converter, raw, wire.WireState, url=server.admin_url)
    return ServerState(
        paused=state.paused,
        sleeping=state.sleeping,
        weight_version=state.weight_version,
        in_flight=state.in_flight,
        loras=tuple(state.loras),
    )


@hookimpl
async def admin_sleep(server: Server, level: int) -> bool:
    await _admin(server, "/sleep", {"level": level})
    return True


@hookimpl
async def admin_wake(server: Server) -> bool:
    await _admin(server, "/wake")
    return True


@hookimpl
async def admin_abort(server: Server, request_ids: Sequence[str] | None) -> int:
    raw = await _admin(server, "/abort", {"request_ids": None if request_ids is None else list(request_ids)})
    return structure_response(wire.converter, raw, wire.WireAbort, url=server.admin_url).aborted
