"""Emulators as ASGI apps.

Every emulator is written once as ``async def handle(request: httpx.Request) -> httpx.Response``.
:func:`asgi_app` wraps such a handler into an ASGI application, so the same emulator runs under any ASGI
server or in-process through ``httpx.ASGITransport`` (``MockTransport`` and
:func:`backends_testkit.http_server.serve` take the handler directly).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import httpx

from backends_testkit.fakes import Handler

__all__ = ["asgi_app"]

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


def asgi_app(handler: Handler) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """An ASGI 3 application that serves ``handler`` (HTTP only; lifespan events are acknowledged)."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            raise ValueError(f"unsupported ASGI scope type {scope['type']!r}")
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        host = dict(scope.get("headers") or []).get(b"host", b"emulator").decode("latin1")
        query = scope.get("query_string", b"").decode("latin1")
        url = f"{scope.get('scheme', 'http')}://{host}{scope['path']}" + (f"?{query}" if query else "")
        request = httpx.Request(scope["method"], url, headers=scope.get("headers") or [], content=body)
        response = await handler(request)
        if not isinstance(response.stream, httpx.ByteStream):  # produced as it goes: sent so
            await _send_streamed(response, receive, send)
            return
        content = await response.aread()
        headers = [
            (k.encode("latin1"), v.encode("latin1"))
            for k, v in response.headers.items()
            if k.lower() not in ("content-length", "transfer-encoding")
        ]
        headers.append((b"content-length", str(len(content)).encode()))
        await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
        await send({"type": "http.response.body", "body": content})

    return app


async def _send_streamed(response: httpx.Response, receive: Receive, send: Send) -> None:
    """Send each piece of ``response`` as it is produced; a client that disconnects stops it (the body is closed:
    an emulator aborts its engine request then)."""
    headers = [
        (k.encode("latin1"), v.encode("latin1"))
        for k, v in response.headers.items()
        if k.lower() not in ("content-length", "transfer-encoding")
    ]

    async def pump() -> None:
        await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
        async for piece in response.aiter_raw():
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    sending = asyncio.ensure_future(pump())
    watching = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({sending, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (sending, watching):
            task.cancel()
        await asyncio.gather(sending, watching, return_exceptions=True)
        await response.aclose()
    if sending.done() and not sending.cancelled() and sending.exception() is not None:
        raise sending.exception()  # type: ignore[misc]
