"""Talking to SGLang's control plane: the admin key, hints for failures, and the waits SGLang leaves to clients.

* :func:`call` sends a control-route request with the admin key (when configured) and a hint on failure.
* :func:`read` sends a read-only request (``/model_info``, ``/v1/loads``, ``/v1/models``...): those are SGLang
  ``NORMAL`` routes, authorised by the client's own api key, never the admin key.
* :func:`flush_cache` sends ``/flush_cache`` declaring SGLang's refusal while requests are running, queued or
  paused in place (400 ``Flush cache failed.``) a "not now": the request layer sends it again until
  ``flush_cache_timeout`` runs out.
* :func:`drain` polls ``/v1/loads`` until no request is running or waiting, up to ``pause_drain_timeout``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Literal

from backends_core import Refusal, Server, StatusHint
from backends_core.errors import ServerRefusedError
from backends_sglang import wire
from backends_sglang.options import SglangOptions

__all__ = ["call", "drain", "flush_cache", "read", "require_success"]

log = logging.getLogger("backends_sglang")


def _hint(path: str) -> StatusHint:
    def hint(status: int, body: Any) -> str | None:
        if status in (401, 403):
            return (
                "SGLang refused the credentials: control routes need --admin-api-key when the server has one "
                "(set backend_options.admin_api_key_var; the plain api key is not accepted then)"
            )
        if status == 404 and body == {"detail": "Not Found"}:
            return f"this server has no {path}: is it an SGLang >= 0.5.23 HTTP server?"
        return None

    return hint


async def call(
    server: Server,
    options: SglangOptions,
    method: str,
    path: str,
    body: Any = None,
    *,
    expect: Literal["json", "text", "none"] = "json",
    status_hint: StatusHint | None = None,
    refusal: Refusal | None = None,
) -> Any:
    """One control-route request on the admin plane, with the admin key; not retried unless its operation is
    declared idempotent or its server answers ``refusal``."""
    return await server.request(
        method,
        path,
        json_body=body,
        plane="admin",
        retry=False,
        expect=expect,
        headers=options.admin_headers(),
        status_hint=status_hint or _hint(path),
        refusal=refusal,
    )


async def read(server: Server, path: str, *, expect: Literal["json", "text", "none"] = "json") -> Any:
    """One read-only GET on the admin plane with the client's own credentials (retried per the policy)."""
    return await server.request("GET", path, plane="admin", expect=expect, status_hint=_hint(path))


def require_success(server: Server, path: str, raw: Any, *, key: str = "success") -> None:
    """Raise :class:`ServerRefusedError` unless an admin answer reports success.

    :param key: ``"success"`` for ``{"success": bool, "message": ...}`` answers, ``"status"`` for
        ``{"status": "ok", "message": ...}`` ones.
    """
    if not wire.succeeded(raw, server.admin_url, key):
        raise ServerRefusedError(path.lstrip("/"), method="POST", url=server.url(path, plane="admin"), body=raw)


async def flush_cache(server: Server, options: SglangOptions) -> None:
    """``POST /flush_cache``, sent again every ``poll_interval`` while SGLang refuses it, for up to
    ``flush_cache_timeout`` seconds.

    :raises ServerStatusError: still refused at the deadline (its hint says why and for how long it retried).
    """

    def hint(status: int, body: Any) -> str | None:
        if status == 400:
            return (
                "SGLang refuses to flush while requests are running, queued or paused in place; "
                f"retried for up to {options.flush_cache_timeout:g} s (backend_options.flush_cache_timeout)"
            )
        return _hint("/flush_cache")(status, body)

    refused = Refusal(400, within=options.flush_cache_timeout, interval=options.poll_interval)
    await call(server, options, "POST", "/flush_cache", expect="text", status_hint=hint, refusal=refused)


async def in_flight(server: Server) -> int:
    """Requests running or waiting on the server, from ``/v1/loads``."""
    return wire.in_flight(await read(server, "/v1/loads"), server.admin_url)


async def drain(server: Server, options: SglangOptions) -> int:
    """Wait until the server has no request running or waiting, at most ``pause_drain_timeout`` seconds.

    :returns: the requests still in flight at the deadline (0 when drained).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + options.pause_drain_timeout
    while True:
        pending = await in_flight(server)
        remaining = deadline - loop.time()
        if pending == 0 or remaining <= 0:
            if pending:
                log.warning(
                    "%s: %d request(s) still in flight after %g s (pause_drain_timeout); pausing with retract, "
                    "they finish after resume",
                    server.admin_url,
                    pending,
                    options.pause_drain_timeout,
                )
            return pending
        await asyncio.sleep(min(options.poll_interval, remaining))
