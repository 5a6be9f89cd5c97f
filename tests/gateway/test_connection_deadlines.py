"""A connection holds a file descriptor of the gateway only while it is useful: one that trickles its headers,
never sends a request, or sits idle after one is closed after ``idle_timeout_s``; a body that stops arriving is
answered 408 in the API's shape after ``body_timeout_s``; the gateway goes on serving meanwhile. Raw sockets, as
a careless or hostile client would hold them."""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

import httpx
import orjson

from backends_gateway import GatewayLimits

LIMITS = GatewayLimits(idle_timeout_s=1, body_timeout_s=1)
DEADLINE_S = 60.0
"""How long a closing may take on a loaded machine (it takes about a second)."""
TURN = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


async def connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    where = urlsplit(url)
    assert where.hostname is not None and where.port is not None
    return await asyncio.open_connection(where.hostname, where.port)


async def closed_by_the_gateway(reader: asyncio.StreamReader) -> bytes:
    """Everything the gateway sent until it closed the connection (fails past :data:`DEADLINE_S`)."""
    async with asyncio.timeout(DEADLINE_S):
        return await reader.read()


async def test_a_connection_that_never_sends_a_request_is_closed(scripted_gateway) -> None:
    async with scripted_gateway([], limits=LIMITS) as served:
        reader, writer = await connect(served.url)
        opened = time.monotonic()
        assert await closed_by_the_gateway(reader) == b""
        assert time.monotonic() - opened >= 0.9
        writer.close()


async def test_headers_trickled_byte_by_byte_are_cut_off_while_others_are_served(scripted_gateway) -> None:
    async with scripted_gateway(["served<|im_end|>"], limits=LIMITS) as served:
        reader, writer = await connect(served.url)
        closed = asyncio.create_task(closed_by_the_gateway(reader))
        trickle = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 200
        async with httpx.AsyncClient(base_url=served.url, trust_env=False, timeout=60) as http:
            for byte in trickle:
                if closed.done():
                    break
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.wait({closed}, timeout=0.05)  # a byte every 50 ms: a slow loris
            assert await closed == b""
            answered = await http.post("/v1/chat/completions", json=TURN)
            assert answered.status_code == 200, answered.text
        writer.close()


async def test_a_body_that_stops_arriving_is_answered_408_in_the_apis_shape(scripted_gateway) -> None:
    async with scripted_gateway([], limits=LIMITS) as served:
        for path, shape in (("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic")):
            reader, writer = await connect(served.url)
            head = (
                f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                "Content-Length: 1000\r\n\r\n"
            )
            writer.write(head.encode() + orjson.dumps(TURN)[:10])
            await writer.drain()
            async with asyncio.timeout(DEADLINE_S):
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().partition(b"content-length: ")[2].partition(b"\r\n")[0])
                body = orjson.loads(await reader.readexactly(length))
            assert head.startswith(b"HTTP/1.1 408"), head
            error = body["error"]
            assert error["code"] == "body_timeout" and error["param"] == "body"
            assert (body.get("type") == "error") == (shape == "anthropic")
            writer.close()
        assert served.script.requests == []


async def test_an_idle_kept_alive_connection_is_closed_after_its_request(scripted_gateway) -> None:
    async with scripted_gateway([], limits=LIMITS) as served:
        reader, writer = await connect(served.url)
        writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        await writer.drain()
        answer = await closed_by_the_gateway(reader)
        assert answer.startswith(b"HTTP/1.1 200") and b'"status":"ok"' in answer
        writer.close()
