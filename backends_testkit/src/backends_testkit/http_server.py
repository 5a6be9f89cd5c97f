"""Serve an emulator's async handler on a real TCP port (HTTP/1.1, keep-alive, Content-Length bodies; a
streamed answer, whose body is not an ``httpx.ByteStream``, with chunked transfer as it is produced).

Emulators are written once as ``async def handle(request: httpx.Request) -> httpx.Response``; in-process
tests wrap them in ``httpx.MockTransport``, and this module puts the very same handler on a socket, so the
client's real network path (pools, timeouts, keep-alive) can be exercised and ``--backend-url`` tested.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl as _ssl
from collections.abc import AsyncIterator
from http import HTTPStatus

import httpx

from backends_testkit.fakes import Handler

__all__ = ["serve"]

_MAX_HEADER = 64 * 1024


async def _read_request(reader: asyncio.StreamReader, host: str) -> httpx.Request | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    if len(head) > _MAX_HEADER:
        return None
    lines = head.decode("latin1").split("\r\n")
    method, target, _version = lines[0].split(" ", 2)
    headers = []
    length = 0
    for line in lines[1:]:
        if not line:
            continue
        name, _, value = line.partition(":")
        headers.append((name.strip(), value.strip()))
        if name.strip().lower() == "content-length":
            length = int(value)
    body = await reader.readexactly(length) if length else b""
    return httpx.Request(method, f"http://{host}{target}", headers=headers, content=body)


def _encode_response(response: httpx.Response, body: bytes) -> bytes:
    reason = HTTPStatus(response.status_code).phrase if response.status_code in HTTPStatus._value2member_map_ else ""
    lines = [f"HTTP/1.1 {response.status_code} {reason}"]
    for name, value in response.headers.items():
        if name.lower() not in ("content-length", "transfer-encoding", "connection"):
            lines.append(f"{name}: {value}")
    lines.append(f"content-length: {len(body)}")
    lines.append("connection: keep-alive")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin1") + body


async def _send_chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, response: httpx.Response) -> None:
    """Send ``response`` with chunked transfer, each piece as the handler produces it. A client that left makes a
    write fail; the body is closed either way (an emulator aborts its engine request then)."""
    reason = HTTPStatus(response.status_code).phrase if response.status_code in HTTPStatus._value2member_map_ else ""
    lines = [f"HTTP/1.1 {response.status_code} {reason}"]
    for name, value in response.headers.items():
        if name.lower() not in ("content-length", "transfer-encoding", "connection"):
            lines.append(f"{name}: {value}")
    lines += ["transfer-encoding: chunked", "connection: keep-alive"]
    try:
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin1"))
        await writer.drain()
        async for piece in response.aiter_raw():
            if piece:
                writer.write(b"%x\r\n%b\r\n" % (len(piece), piece))
                await writer.drain()
                if writer.is_closing() or reader.at_eof():
                    raise ConnectionResetError("the client left")
        writer.write(b"0\r\n\r\n")
        await writer.drain()
    finally:
        await response.aclose()


@contextlib.asynccontextmanager
async def serve(
    handler: Handler, *, host: str = "127.0.0.1", port: int = 0, ssl: _ssl.SSLContext | None = None
) -> AsyncIterator[str]:
    """Serve ``handler`` until the block exits; yields the base URL (``port=0`` picks a free port; an ``ssl``
    context serves HTTPS)."""

    open_writers: set[asyncio.StreamWriter] = set()

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        open_writers.add(writer)
        try:
            while True:
                request = await _read_request(reader, f"{host}:{bound_port}")
                if request is None:
                    break
                try:
                    response = await handler(request)
                    if not isinstance(response.stream, httpx.ByteStream):  # produced as it goes: sent so
                        await _send_chunked(reader, writer, response)
                        continue
                    body = await response.aread()
                except (ConnectionError, asyncio.IncompleteReadError):
                    raise
                except Exception as exc:  # an emulator bug becomes a 500, like a real server's
                    response = httpx.Response(500, json={"error": f"{type(exc).__name__}: {exc}"})
                    body = response.content
                writer.write(_encode_response(response, body))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            open_writers.discard(writer)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    server = await asyncio.start_server(on_connection, host, port, ssl=ssl)
    bound_port = server.sockets[0].getsockname()[1]
    try:
        yield f"{'https' if ssl else 'http'}://{host}:{bound_port}"
    finally:
        server.close()
        for writer in list(open_writers):
            writer.close()
        await server.wait_closed()
