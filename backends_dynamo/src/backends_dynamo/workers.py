"""Where admin calls go: the frontend (``base_url``) and every worker's system URL, with Dynamo's failures
turned into errors that say what to do.

Admin routes of Dynamo 1.6.1 live on each worker's system port as ``/engine/<route>``, not on the frontend
(where they answer 404). A worker without a route (no ``--enable-rl``, no ``--enable-lora``, the mocker)
answers 404 too, in another shape; the two are told apart:

* frontend-shaped 404: :class:`ConfigError` (the worker URLs are not configured);
* worker-shaped 404: :class:`UnsupportedOperationError` naming the route and the flag that adds it.

An operation that changes the workers runs on each of them to the end (:func:`each_worker`) and reports every
worker's outcome when one failed (:func:`raise_for`): with several workers behind one frontend, a failure on one
of them can leave the others changed (new weights, an adapter, a pause), and the caller needs to know which.

All I/O goes through the core :class:`~backends_core.server.Server`; a worker is the same server handle with
its admin URL pointed at the worker (same connection pool, same per-server cache).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import attrs

from backends_core import Server
from backends_core.errors import (
    AdminError,
    ConfigError,
    InvalidRequestError,
    RequestError,
    ServerRefusedError,
    ServerStatusError,
    UnsupportedOperationError,
)
from backends_core.fleet import ServerOutcome
from backends_dynamo import admin_wire
from backends_dynamo.options import DynamoOptions

__all__ = [
    "at",
    "each_worker",
    "engine_call",
    "frontend",
    "gather_all",
    "names",
    "on_workers",
    "raise_for",
    "refused",
    "worker_urls",
]

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


async def _outcome(url: str, call: Awaitable[T]) -> ServerOutcome[T]:
    started = time.perf_counter()
    try:
        value = await call
    except Exception as exc:
        return ServerOutcome(server=url, error=exc, duration_s=time.perf_counter() - started)
    return ServerOutcome(server=url, value=value, duration_s=time.perf_counter() - started)


async def each_worker(urls: Iterable[str], run: Callable[[str], Awaitable[T]]) -> list[ServerOutcome[T]]:
    """``run(url)`` for every worker URL, concurrently, each to its end; every worker's outcome, in order
    (never raises for a worker's failure)."""
    return list(await asyncio.gather(*(_outcome(url, run(url)) for url in urls)))


def raise_for(operation: str, server: Server, outcomes: Sequence[ServerOutcome[Any]], state: str | None) -> None:
    """Raise if a worker failed; return otherwise.

    A single worker's failure that left nothing to report (``state`` is ``None``) is raised as it is; otherwise
    the error is an :class:`AdminError` over every worker's outcome (successes included), named after the
    frontend, whose message ends with ``state``: what the deployment now serves and what to do.
    """
    failed = [o.error for o in outcomes if o.error is not None]
    if not failed:
        return
    if len(outcomes) == 1 and state is None:
        raise failed[0]
    raise AdminError(f"{operation} on the workers behind {server.base_url}", outcomes, state=state)


def refused(error: BaseException | None) -> bool:
    """Whether a worker's error says that the operation did not happen there (a refusal in the body, a 4xx, a
    missing route, a request that never reached the worker), as opposed to a lost answer (timeout, broken
    connection, 5xx) that leaves it unknown."""
    if isinstance(error, ServerStatusError):
        return error.status_code < 500
    if isinstance(error, RequestError) and not error.maybe_processed:
        return True
    return isinstance(error, ServerRefusedError | UnsupportedOperationError | ConfigError | InvalidRequestError)


def names(urls: Iterable[str]) -> str:
    """Worker URLs for a message: ``a``, ``a and b``, ``a, b and c``."""
    listed = list(urls)
    if len(listed) < 2:
        return "".join(listed) or "no worker"
    return ", ".join(listed[:-1]) + " and " + listed[-1]
