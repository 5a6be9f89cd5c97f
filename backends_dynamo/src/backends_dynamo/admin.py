"""Admin hooks of the ``dynamo`` backend: the frontend for health, readiness and state, every worker's
``/engine/<route>`` for the rest (see :mod:`backends_dynamo.workers`), and what Dynamo 1.6.1 does not report
kept client-side (:mod:`backends_dynamo.tracking`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

from backends_core import Server, hookimpl
from backends_core.config import ClientConfig
from backends_core.errors import InvalidRequestError, ResponseParseError, ServerRefusedError, ServerStatusError
from backends_core.errors import UnsupportedOperationError as Unsupported
from backends_core.types import DistributedGroup, LoraAdapter, PauseMode, ServerState, TensorSpec
from backends_dynamo import admin_wire
from backends_dynamo.options import DynamoOptions
from backends_dynamo.tracking import REQUEST_ID_HEADER, tracker
from backends_dynamo.workers import BACKEND, at, engine_call, frontend, gather_all, on_workers, worker_urls

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
]

#: How long ``admin_wake`` waits for the frontend to route to the model again.
WAKE_READY_TIMEOUT_S = 30.0


# -- health -----------------------------------------------------------------------------------------------


async def _status(server: Server, path: str, read: Any) -> bool:
    """GET ``path`` on ``server``'s admin URL: ``read(body)`` on 200, ``False`` on 503 (not ready)."""
    try:
        raw = await server.request("GET", path, plane="admin")
    except ServerStatusError as exc:
        if exc.status_code == 503:
            return False
        raise
    return bool(read(raw, server.admin_url))


@hookimpl
async def admin_health(server: Server, options: DynamoOptions) -> bool:
    """The frontend's ``/health`` and, for every worker configured apart from it, the worker's system ``/health``."""
    checks = [_status(frontend(server), "/health", admin_wire.frontend_healthy)]
    checks.extend(
        _status(at(server, url), "/health", admin_wire.worker_ready)
        for url in worker_urls(server, options)
        if url != server.base_url
    )
    return all(await gather_all(checks))


async def _model_ready(server: Server, model: str | None) -> bool:
    front = frontend(server)
    if model is None:
        return bool(admin_wire.model_ids(await front.request("GET", "/v1/models", plane="admin"), front.admin_url))
    try:
        return await _status(front, f"/v1/models/{quote(model, safe='')}/ready", admin_wire.model_ready)
    except ServerStatusError as exc:
        if exc.status_code == 404:  # not registered (a sleeping worker leaves discovery)
            return False
        raise


@hookimpl
async def admin_ready(server: Server, config: ClientConfig) -> bool:
    """The frontend routes to the model (``/v1/models/{id}/ready``) and this client has not paused or put the
    workers to sleep."""
    track = tracker(server)
    if track.paused or track.sleeping:
        return False
    return await _model_ready(server, config.model)


# -- pause, cache, weights ----------------------------------------------------------------------------------


@hookimpl
async def admin_pause(server: Server, mode: PauseMode, clear_cache: bool, options: DynamoOptions) -> bool:
    track = tracker(server)
    if mode == "abort":
        track.abort_everything()  # before sending: aborted answers may arrive before the pause is confirmed
    body = {"mode": mode, "clear_cache": clear_cache and mode != "keep"}
    await on_workers(server, options, "pause_generation", body, operation="admin_pause")
    track.paused = True
    return True


@hookimpl
async def admin_resume(server: Server, options: DynamoOptions) -> bool:
    await on_workers(server, options, "resume_generation", operation="admin_resume")
    tracker(server).paused = False
    return True


@hookimpl
async def admin_flush_cache(server: Server, options: DynamoOptions) -> bool:
    await on_workers(server, options, "flush_cache", operation="admin_flush_cache")
    return True


def _wants_pause(result: object) -> bool:
    return isinstance(result, ServerRefusedError) and admin_wire.needs_pause(result)


async def _paused_update(
    server: Server, options: DynamoOptions, route: str, body: Mapping[str, Any], operation: str
) -> list[Mapping[str, Any]]:
    """A weight update on every worker. Dynamo refuses one unless the worker is paused: workers that refuse for
    that reason are paused (mode ``wait``), updated and resumed, so the call succeeds either way and never
    resumes a worker that was paused before."""
    urls = worker_urls(server, options)
    first = await asyncio.gather(
        *(engine_call(server, u, route, body, operation=operation) for u in urls), return_exceptions=True
    )
    unpaused = [u for u, r in zip(urls, first, strict=True) if _wants_pause(r)]
    failed = [r for r in first if isinstance(r, BaseException) and not _wants_pause(r)]
    if failed:
        raise failed[0]
    answers = [r for r in first if not isinstance(r, BaseException)]
    if unpaused:
        pause = {"mode": "wait", "clear_cache": False}
        await gather_all(engine_call(server, u, "pause_generation", pause, operation=operation) for u in unpaused)
        try:
            answers += await gather_all(engine_call(server, u, route, body, operation=operation) for u in unpaused)
        finally:
            await gather_all(engine_call(server, u, "resume_generation", operation=operation) for u in unpaused)
    return answers


def _record_version(server: Server, answers: Sequence[Mapping[str, Any]], asked: str | None) -> None:
    versions = {admin_wire.weight_version(a) for a in answers}
    tracker(server).set_weight_version(versions.pop() if len(versions) == 1 else asked)


@hookimpl
async def admin_update_weights(server: Server, path: str, version: str | None, options: DynamoOptions) -> bool:
    body: dict[str, Any] = {"model_path": path}
    if version is not None:
        body["weight_version"] = version
    answers = await _paused_update(server, options, "update_weights_from_disk", body, "admin_update_weights")
    _record_version(server, answers, version)
    return True


@hookimpl
async def admin_init_weight_transfer(server: Server, group: DistributedGroup, options: DynamoOptions) -> bool:
    urls = worker_urls(server, options)
    if len(urls) > 1:
        raise InvalidRequestError(
            f"{server.base_url} has {len(urls)} workers but a DistributedGroup gives one rank_offset per server: "
            "configure each worker as its own server to join them to a group"
        )
    body = {
        "master_address": group.master_address,
        "master_port": group.master_port,
        "rank_offset": group.rank_offset,
        "world_size": group.world_size,
        "group_name": group.group_name,
        "backend": group.backend,
    }
    await on_workers(server, options, "init_weights_update_group", body, operation="admin_init_weight_transfer")
    return True


@hookimpl
async def admin_destroy_weight_transfer(server: Server, group_name: str, options: DynamoOptions) -> bool:
    """``/engine/destroy_weights_update_group`` on every worker: Dynamo forwards the body as the keyword
    arguments of the worker's ``destroy_broadcaster`` RPC (stock vLLM workers lack it: ``"status": "error"``,
    a :class:`ServerRefusedError`)."""
    await on_workers(
        server,
        options,
        "destroy_weights_update_group",
        {"group_name": group_name},
        operation="admin_destroy_weight_transfer",
    )
    return True


@hookimpl
async def admin_update_weights_distributed(
    server: Server, group_name: str, tensors: Sequence[TensorSpec], version: str | None, options: DynamoOptions
) -> bool:
    body: dict[str, Any] = {
        "names": [t.name for t in tensors],
        "dtypes": [t.dtype for t in tensors],
        "shapes": [list(t.shape) for t in tensors],
        "group_name": group_name,
    }
    if version is not None:
        body["weight_version"] = version
    answers = await _paused_update(
        server, options, "update_weights_from_distributed", body, "admin_update_weights_distributed"
    )
    _record_version(server, answers, version)
    return True


# -- LoRA -------------------------------------------------------------------------------------------------


async def _load_lora(server: Server, url: str, adapter: LoraAdapter) -> None:
    body = {"lora_name": adapter.name, "source": {"uri": admin_wire.lora_uri(adapter.path)}}
    answer = await engine_call(server, url, "load_lora", body, operation="admin_load_lora")
    if not admin_wire.already_loaded(answer):
        return
    where = f"{url}{admin_wire.ENGINE_PREFIX}load_lora"
    if not adapter.replace:
        raise ServerRefusedError(
            f"load_lora of {adapter.name!r} (the name is loaded already and Dynamo kept the loaded adapter; "
            "pass replace=True to reload it)",
            method="POST",
            url=where,
            body=answer,
        )
    # no hot swap without DYN_LORA_HOTSWAP_ENABLED on the worker: unload, then load (not atomic)
    await engine_call(server, url, "unload_lora", {"lora_name": adapter.name}, operation="admin_load_lora")
    answer = await engine_call(server, url, "load_lora", body, operation="admin_load_lora")
    if admin_wire.already_loaded(answer):
        what = f"load_lora of {adapter.name!r} after unloading it"
        raise ServerRefusedError(what, method="POST", url=where, body=answer)


@hookimpl
async def admin_load_lora(server: Server, adapter: LoraAdapter, options: DynamoOptions) -> bool:
    await gather_all(_load_lora(server, url, adapter) for url in worker_urls(server, options))
    return True


@hookimpl
async def admin_unload_lora(server: Server, name: str, options: DynamoOptions) -> bool:
    await on_workers(server, options, "unload_lora", {"lora_name": name}, operation="admin_unload_lora")
    return True


# -- state, sleep, abort ------------------------------------------------------------------------------------


async def _versions(server: Server, options: DynamoOptions) -> list[str | None] | None:
    try:
        answers = await on_workers(server, options, "get_weight_version", operation="admin_state", retry=True)
    except Unsupported:  # a worker without RL routes (the mocker): the version is unknown
        return None
    return [admin_wire.weight_version(a) for a in answers]


@hookimpl
async def admin_state(server: Server, config: ClientConfig, options: DynamoOptions) -> ServerState:
    """Pause and sleep state as this client set them (Dynamo 1.6.1 reports neither), the workers' declared weight
    version, the frontend's in-flight gauge, and the served names other than ``ClientConfig.model``."""
    front = frontend(server)
    metrics, models, versions = await asyncio.gather(
        front.request("GET", "/metrics", plane="admin", expect="text"),
        front.request("GET", "/v1/models", plane="admin"),
        _versions(server, options),
    )
    track = tracker(server)
    version = None
    if versions is not None:
        if len(set(versions)) > 1:
            detail = f"the workers behind {server.base_url} report different weight versions {versions}"
            raise ResponseParseError(detail, url=server.admin_url)
        version = versions[0] if versions else None
        if version != track.weight_version:
            track.set_weight_version(version)
    in_flight = admin_wire.gauge(metrics, "dynamo_request_plane_inflight_requests", front.admin_url)
    names = admin_wire.model_ids(models, front.admin_url)
    return ServerState(
        paused=track.paused,
        sleeping=track.sleeping,
        weight_version=version,
        in_flight=None if in_flight is None else int(in_flight),
        loras=tuple(n for n in names if n != config.model),
    )


@hookimpl
async def admin_sleep(server: Server, level: int, options: DynamoOptions) -> bool:
    await on_workers(server, options, "control/sleep", {"level": level}, operation="admin_sleep")
    tracker(server).sleeping = True
    return True


@hookimpl
async def admin_wake(server: Server, config: ClientConfig, options: DynamoOptions) -> bool:
    """Wake every worker, then wait until the frontend routes to the model again (a sleeping worker leaves
    discovery, and requests get 503 until it is back)."""
    await on_workers(server, options, "control/wake_up", operation="admin_wake")
    tracker(server).sleeping = False
    deadline = time.monotonic() + WAKE_READY_TIMEOUT_S
    while not await _model_ready(server, config.model):
        if time.monotonic() > deadline:
            raise ServerRefusedError(
                f"wake_up (the workers woke but the frontend did not route to {config.model!r} "
                f"within {WAKE_READY_TIMEOUT_S:.0f} s)",
                method="GET",
                url=server.url("/v1/models", plane="data"),
                body=None,
            )
        await asyncio.sleep(0.05)
    return True


@hookimpl
async def admin_abort(server: Server, request_ids: Sequence[str] | None, options: DynamoOptions) -> int:
    """Abort by caller id (sent as the bare request UUID, on every worker) or every request this client has in
    flight (Dynamo 1.6.1 has no abort-all). Returns -1: Dynamo says ``ok`` whether or not the id was known."""
    track = tracker(server)
    if request_ids is not None and track.ignores_request_ids:
        raise Unsupported(
            BACKEND,
            "admin_abort",
            hint=f"{server.base_url} does not take request ids from {REQUEST_ID_HEADER}, so no id can be aborted",
        )
    uuids = track.abort_everything() if request_ids is None else track.abort_ids(list(request_ids))
    if not uuids:
        return 0
    await gather_all(
        engine_call(server, url, "abort_request", {"request_id": u}, operation="admin_abort")
        for url in worker_urls(server, options)
        for u in uuids
    )
    return -1
