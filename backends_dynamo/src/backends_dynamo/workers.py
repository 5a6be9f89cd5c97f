"""Where admin calls go: the frontend (``base_url``) and every worker's system URL, with Dynamo's failures
turned into errors that say what to do.

Admin routes of Dynamo 1.6.1 live on each worker's system port as ``/engine/<route>``, not on the frontend
(where they answer 404). A worker without a route (no ``--enable-rl``, no ``--enable-lora``, the mocker)
answers 404 too, in another shape; the two are told apart:

* frontend-shaped 404: :class:`ConfigError` (the worker URLs are not configured);
* worker-shaped 404: :class:`UnsupportedOperationError` naming the route and the flag that adds it.

All I/O goes through the core :class:`~backends_core._http.Server`; a worker is the same server handle with
its admin URL pointed at the worker (same connection pool, same per-server cache).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable, Mapping
from typing import Any, TypeVar

import attrs

from backends_core._http import Server
from backends_core.errors import ConfigError, ServerStatusError, UnsupportedOperationError
from backends_dynamo import admin_wire
from backends_dynamo.options import DynamoOptions

__all__ = ["at", "engine_call", "frontend", "gather_all", "on_workers", "worker_urls"]

T = TypeVar("T")
BACKEND = "dynamo"


def at(server: Server, url: str) -> Server:
    """``server`` with its admin plane pointed at ``url`` (shares the pools and the cache)."""
    return attrs.evolve(server, admin_url=url.rstrip("/"), cache=server.cache)


def frontend(server: Server) -> Server:
    """The frontend, on the admin pool."""
    return at(server, server.base_url)


def worker_urls(server: Server, options: DynamoOptions) -> tuple[str, ...]:
    """System URLs of the workers behind ``server``."""
    return options.workers(server.base_url, server.admin_url)


async def gather_all(calls: Iterable[Awaitable[T]]) -> list[T]:
    """Run every call to the end; if any failed, raise the first failure (the others are added as notes)."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        first = errors[0]
        for other in errors[1:]:
            first.add_note(f"also failed: {type(other).__name__}: {other}")
        raise first
    return [r for r in results if not isinstance(r, BaseException)]


async def engine_call(
    server: Server,
    url: str,
    route: str,
    body: Mapping[str, Any] | None = None,
    *,
    operation: str,
    retry: bool = False,
) -> Mapping[str, Any]:
    """``POST /engine/<route>`` on the worker at ``url``; the body of a successful answer.

    :param operation: the admin hook this serves (named in errors).
    :param retry: allow the client's retry policy (only for calls that change nothing).
    :raises ConfigError: ``url`` answered like a Dynamo frontend.
    :raises UnsupportedOperationError: the worker has no such route.
    :raises ServerRefusedError: the worker answered ``"status": "error"``.
    """
    worker = at(server, url)
    path = admin_wire.ENGINE_PREFIX + route
    try:
        raw = await worker.request("POST", path, json_body=dict(body or {}), plane="admin", retry=retry)
    except ServerStatusError as exc:
        if exc.status_code != 404:
            raise
        if admin_wire.is_frontend_404(exc.body):
            raise ConfigError(
                [
                    f"{url} answered like a Dynamo frontend: {path} lives on each worker's system port "
                    "(DYN_SYSTEM_PORT); list them in backend_options.worker_urls (or set admin_base_url) "
                    "@ $.backend_options.worker_urls"
                ]
            ) from exc
        raise UnsupportedOperationError(BACKEND, operation, hint=admin_wire.missing_route_hint(route, url)) from exc
    return admin_wire.engine_answer(raw, route, url=worker.url(path, plane="admin"))


async def on_workers(
    server: Server,
    options: DynamoOptions,
    route: str,
    body: Mapping[str, Any] | None = None,
    *,
    operation: str,
    retry: bool = False,
) -> list[Mapping[str, Any]]:
    """:func:`engine_call` on every worker behind ``server``, concurrently; fails if any fails."""
    return await gather_all(
        engine_call(server, url, route, body, operation=operation, retry=retry) for url in worker_urls(server, options)
    )
