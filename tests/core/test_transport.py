"""The HTTP/1.1 transport (aiohttp behind httpx) against real local servers: keep-alive, pool limits, every
timeout kind, resets, framing (Content-Length, chunked, read-to-close, no-body answers), malformed answers,
hundreds in flight, and what it tells the choke point about a failure (request left, answer started).

Servers are either :func:`backends_testkit.http_server.serve` (asyncio, the emulators' server) or a
blocking-socket server in threads (:class:`RawServer`) that writes exact bytes, so faults land at exact points.
No assertion depends on timing: timeouts are provoked by servers that never answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any, BinaryIO

import httpx
import pytest

from backends_core import Client, ClientConfig, NetworkError, RetryPolicy, Server, ServerStatusError
from backends_core._http import AiohttpTransport
from backends_testkit.http_server import serve

Handler = Callable[[socket.socket, BinaryIO, int], None]


def read_request(f: BinaryIO) -> tuple[str, str, dict[str, str], bytes] | None:
    line = f.readline()
    if not line:
        return None
    method, target, _ = line.decode().split(" ", 2)
    headers: dict[str, str] = {}
    while (h := f.readline()) not in (b"\r\n", b""):
        name, _, value = h.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    n = int(headers.get("content-length", "0"))
    return method, target, headers, f.read(n) if n else b""


def ok(body: bytes = b"{}", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), extra, body)


def reset(sock: socket.socket) -> None:
    """Close with a TCP RST (SO_LINGER 0)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


class RawServer:
    """Blocking sockets in threads; ``handle(sock, rfile, connection_index)`` runs per accepted connection."""

    def __init__(self, handle: Handler) -> None:
        self.handle = handle
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        self.requests = 0
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                s, _ = self.sock.accept()
            except OSError:
                return
            with self._lock:
                if self._closed:  # accepted while the server was closing: nobody would close it
                    s.close()
                    return
                self.conns.append(s)
                index = len(self.conns) - 1
            threading.Thread(target=self._run, args=(s, index), daemon=True).start()

    def _run(self, s: socket.socket, index: int) -> None:
        # the file is closed when the handler returns, so a socket the test closed is really closed then
        with contextlib.suppress(OSError, ValueError), s.makefile("rb") as f:
            self.handle(s, f, index)

    def serve_forever(self, s: socket.socket, f: BinaryIO, respond: Callable[[str, bytes], bytes]) -> None:
        """Answer every request of a connection with ``respond(method, body)``."""
        while (req := read_request(f)) is not None:
            self.requests += 1
            s.sendall(respond(req[0], req[3]))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self.conns)
        self.sock.close()
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)  # a handler blocked reading returns now
            s.close()


@contextlib.contextmanager
def raw_server(handle: Handler):  # type: ignore[no-untyped-def]
    server = RawServer(handle)
    try:
        yield server
    finally:
        server.close()


def lean(**limits: Any) -> tuple[httpx.AsyncClient, AiohttpTransport]:
    """A client on the transport with ``limits`` (httpx's defaults otherwise)."""
    transport = AiohttpTransport(limits=httpx.Limits(**limits))
    timeout = httpx.Timeout(connect=5.0, read=30.0, write=30.0, pool=30.0)
    return httpx.AsyncClient(transport=transport, timeout=timeout), transport


async def eventually(condition: Callable[[], bool]) -> None:
    """Let the event loop run until ``condition`` holds (bounded by the test's own timeout, not asserted)."""
    while not condition():  # noqa: ASYNC110 (a condition on sockets and pool counters, not an event)
        await asyncio.sleep(0.01)


# -- keep-alive and pool --------------------------------------------------------------------------------------


async def test_keep_alive_reuses_one_connection() -> None:
    with raw_server(lambda s, f, i: server.serve_forever(s, f, lambda m, b: ok(b'{"n":%d}' % len(b)))) as server:
        client, _ = lean()
        async with client:
            for n in range(5):
                r = await client.post(server.url + "/x", content=b"a" * n)
                assert r.json() == {"n": n}
        assert len(server.conns) == 1 and server.requests == 5


@pytest.mark.parametrize("limits", [{"keepalive_expiry": 0}, {"max_keepalive_connections": 0}])
async def test_no_keep_alive_when_limits_say_so(limits: dict[str, Any]) -> None:
    with raw_server(lambda s, f, i: server.serve_forever(s, f, lambda m, b: ok())) as server:
        client, transport = lean(**limits)
        async with client:
            for _ in range(3):
                assert (await client.get(server.url)).status_code == 200
                await eventually(lambda: transport.connections <= 1)
        assert len(server.conns) == 3


async def test_pool_limit_caps_connections_and_queues_the_rest() -> None:
    in_flight = 0
    peak = 0
    gate = asyncio.Event()

    async def handle(request: httpx.Request) -> httpx.Response:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        if peak == 3:
            gate.set()
        await gate.wait()
        in_flight -= 1
        return httpx.Response(200, json={"i": int(request.url.params["i"])})

    async with serve(handle) as url:
        client, transport = lean(max_connections=3)
        async with client:
            answers = await asyncio.gather(*(client.get(url, params={"i": i}) for i in range(20)))
            assert [a.json()["i"] for a in answers] == list(range(20))
            assert transport.connections == 3
    assert peak == 3


async def test_pool_timeout_when_every_connection_is_busy() -> None:
    release = threading.Event()

    def handle(s: socket.socket, f: BinaryIO, i: int) -> None:
        while read_request(f) is not None:
            release.wait(30)
            s.sendall(ok())

    with raw_server(handle) as server:
        transport = AiohttpTransport(limits=httpx.Limits(max_connections=1))
        client = httpx.AsyncClient(mounts={"http://": transport}, timeout=httpx.Timeout(30.0, pool=0.2))
        async with client:
            first = asyncio.create_task(client.get(server.url))
            await eventually(lambda: server.conns != [])
            with pytest.raises(httpx.PoolTimeout):
                await client.get(server.url)
            release.set()
            assert (await first).status_code == 200
            assert (await client.get(server.url + "/again")).status_code == 200
        assert len(server.conns) == 1


async def test_released_connection_goes_to_a_waiter_of_the_same_origin() -> None:
    with raw_server(lambda s, f, i: server.serve_forever(s, f, lambda m, b: ok(b))) as server:
        client, _ = lean(max_connections=1)
        async with client:
            answers = await asyncio.gather(*(client.post(server.url, content=b"%d" % i) for i in range(30)))
            assert [a.content for a in answers] == [b"%d" % i for i in range(30)]
        assert len(server.conns) == 1


async def test_two_origins_share_the_connection_limit() -> None:
    respond = lambda m, b: ok(b)  # noqa: E731
    with (
        raw_server(lambda s, f, i: one.serve_forever(s, f, respond)) as one,
        raw_server(lambda s, f, i: two.serve_forever(s, f, respond)) as two,
    ):
        client, transport = lean(max_connections=1)
        async with client:
            for i in range(4):
                url = (one if i % 2 else two).url
                assert (await client.post(url, content=b"%d" % i)).content == b"%d" % i
                assert transport.connections - transport.idle_connections == 0  # none in use between requests
        assert len(one.conns) == 1 and len(two.conns) == 1  # each origin's idle connection is kept and reused


class Tally:
    """Connections a raw server accepted and saw closed by the client, to wait on from the test (with a deadline)."""

    def __init__(self, together: int) -> None:
        self.together = threading.Barrier(together)  # the first requests are answered only once all arrived
        self.closed = 0
        self.changed = threading.Condition()

    def handle(self, server: RawServer, s: socket.socket, f: BinaryIO, index: int) -> None:
        first = True
        while read_request(f) is not None:
            server.requests += 1
            if first:
                first = False
                with contextlib.suppress(threading.BrokenBarrierError):
                    self.together.wait(10)
            s.sendall(ok())
        with self.changed:  # the client closed the connection
            self.closed += 1
            self.changed.notify_all()

    async def closed_reaches(self, n: int) -> bool:
        def wait() -> bool:
            with self.changed:
                return self.changed.wait_for(lambda: self.closed >= n, timeout=10)

        return await asyncio.to_thread(wait)


async def test_max_keepalive_connections_is_the_number_of_idle_connections_kept() -> None:
    tally = Tally(5)
    with raw_server(lambda s, f, i: tally.handle(server, s, f, i)) as server:
        client, transport = lean(max_connections=10, max_keepalive_connections=2)
        async with client:
            answers = await asyncio.gather(*(client.get(server.url) for _ in range(5)))
            assert [a.status_code for a in answers] == [200] * 5
            assert len(server.conns) == 5  # all five were open at once
            assert await tally.closed_reaches(3)
            assert transport.connections == transport.idle_connections == 2
            for _ in range(4):  # the two kept are the ones reused
                assert (await client.get(server.url)).status_code == 200
            answers = await asyncio.gather(*(client.get(server.url) for _ in range(2)))
            assert [a.status_code for a in answers] == [200] * 2
        assert await tally.closed_reaches(5)  # closing the client closed the two kept
        assert len(server.conns) == 5 and server.requests == 11


async def test_the_idle_cap_counts_every_origin_and_max_connections_only_those_in_use() -> None:
    tallies = Tally(2), Tally(2)
    with (
        raw_server(lambda s, f, i: tallies[0].handle(one, s, f, i)) as one,
        raw_server(lambda s, f, i: tallies[1].handle(two, s, f, i)) as two,
    ):
        client, transport = lean(max_connections=2, max_keepalive_connections=3)
        async with client:
            for server in (one, two):  # two at once to each origin; the first two stay idle meanwhile
                answers = await asyncio.gather(*(client.get(server.url) for _ in range(2)))
                assert [a.status_code for a in answers] == [200] * 2
            assert len(one.conns) == 2 and len(two.conns) == 2
            assert await tallies[0].closed_reaches(1)  # the longest idle: one of the first origin's
            assert transport.connections == transport.idle_connections == 3
            assert tallies[1].closed == 0


async def test_hundreds_in_flight() -> None:
    n = 400
    arrived = 0
    everyone = asyncio.Event()

    async def handle(request: httpx.Request) -> httpx.Response:
        nonlocal arrived
        arrived += 1
        if arrived == n:
            everyone.set()
        await everyone.wait()  # every request is in flight at once before any answer
        return httpx.Response(200, content=request.content[::-1])

    async with serve(handle) as url:
        client, transport = lean(max_connections=1000, max_keepalive_connections=1000)
        async with client:
            bodies = [os.urandom(64 + i) for i in range(n)]
            answers = await asyncio.gather(*(client.post(url, content=b) for b in bodies))
            assert [a.content for a in answers] == [b[::-1] for b in bodies]
            assert transport.connections == n and transport.idle_connections == n
            again = await asyncio.gather(*(client.post(url, content=b) for b in bodies[:50]))
            assert all(a.status_code == 200 for a in again) and transport.connections == n


# -- timeouts and connection failures ---------------------------------------------------------------------


async def test_connect_error_on_a_closed_port() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    client, transport = lean()
    async with client:
        with pytest.raises(httpx.ConnectError):
            await client.get(f"http://127.0.0.1:{port}/")
        assert transport.connections == 0


async def test_connect_timeout_when_the_listen_queue_is_full() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(8):  # never accepted: the queue fills and further SYNs are dropped
        f = socket.socket()
        f.setblocking(False)
        f.connect_ex(("127.0.0.1", port))
        fillers.append(f)
    transport = AiohttpTransport()
    client = httpx.AsyncClient(mounts={"http://": transport}, timeout=httpx.Timeout(30.0, connect=0.3))
    try:
        async with client:
            with pytest.raises(httpx.ConnectTimeout):
                await client.get(f"http://127.0.0.1:{port}/")
            assert transport.connections == 0
    finally:
        for f in fillers:
            f.close()
        listener.close()


async def test_read_timeout_before_the_head_and_inside_the_body() -> None:
    def handle(s: socket.socket, f: BinaryIO, i: int) -> None:
        read_request(f)
        if i == 1:
            s.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n12345")
        threading.Event().wait(30)

    with raw_server(handle) as server:
        transport = AiohttpTransport()
        client = httpx.AsyncClient(mounts={"http://": transport}, timeout=httpx.Timeout(30.0, read=0.2))
        async with client:
            with pytest.raises(httpx.ReadTimeout):
                await client.get(server.url)
            with pytest.raises(httpx.ReadTimeout):
                await client.get(server.url)
            assert transport.connections == 0


async def test_write_timeout_when_the_server_never_reads() -> None:
    def handle(s: socket.socket, f: BinaryIO, i: int) -> None:
        threading.Event().wait(30)

    with raw_server(handle) as server:
        transport = AiohttpTransport()
        client = httpx.AsyncClient(mounts={"http://": transport}, timeout=httpx.Timeout(30.0, write=0.3))
        async with client:
            with pytest.raises(httpx.WriteTimeout):
                await client.post(server.url, content=b"x" * (128 << 20))
            assert transport.connections == 0


async def test_reset_mid_body_is_a_read_error_and_a_clean_close_a_protocol_error() -> None:
    def handle(s: socket.socket, f: BinaryIO, i: int) -> None:
        read_request(f)
        s.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 100000\r\n\r\n" + b"x" * 1000)
        if i == 0:
            reset(s)
        else:
            s.shutdown(socket.SHUT_RDWR)

    with raw_server(handle) as server:
        client, transport = lean()
        async with client:
            with pytest.raises(httpx.ReadError):
                await client.get(server.url)
            with pytest.raises(httpx.RemoteProtocolError, match="not completed") as info:
                await client.get(server.url)
            assert info.value.answer_started is True  # type: ignore[attr-defined]
            assert transport.connections == 0


async def test_reset_before_any_answer() -> None:
    def handle(s: socket.socket, f: BinaryIO, i: int) -> None:
        read_request(f)
        if i == 0:
            reset(s)
        else:
            s.shutdown(socket.SHUT_RDWR)

    with raw_server(handle) as server:
        client, _ = lean()
        async with client:
            with pytest.raises(httpx.ReadError) as reset_info:
                await client.get(server.url)
            with pytest.raises(httpx.RemoteProtocolError, match="disconnected") as close_info:
                await client.get(server.url)
        # the request had left, no byte of an answer came back
        for info in (reset_info, close_info):
            assert info.value.answer_started is False  # type: ignore[attr-defined]


# -- keep-alive closes ------------------------------------------------------------------------------------


async def test_connection_close_answer_opens_a_new_connection() -> None:
    def handle(s: socket.socket, f: BinaryIO, i: int) -> None:
        read_request(f)
        s.sendall(ok(b"%d" % i, b"connection: close\r\n"))
        s.shutdown(socket.SHUT_WR)

    with raw_server(handle) as server:
        client, transport = lean()
        async with client:
            assert [(await client.get(server.url)).content for _ in range(3)] == [b"0", b"1", b"2"]
            assert transport.idle_connections == 0


async def test_connection_close_request_is_honoured() -> None:
    with raw_server(lambda s, f, i: server.serve_forever(s, f, lambda m, b: ok())) as server:
        client, transport = lean()
        async with client:
            for _ in range(2):
                await client.get(server.url, headers={"connection": "close"})
                assert transport.connections == 0
        assert len(server.conns) == 2


async def test_a_connection_header_is_read_as_tokens() -> None:
    def handle(s: socket.socket, f: BinaryIO, i: int) -> None:
        server.serve_forever(s, f, lambda m, b: ok(b"%d" % i, b"connection: not-close, x-close\r\n"))

    with raw_server(handle) as server:
        client, transport = lean()
        async with client:
            assert [(await client.get(server.url)).content for _ in range(3)] == [b"0", b"0", b"0"]
            assert transport.idle_connections == 1


async def test_http10_answer_without_keep_alive_closes() -> None:
    def handle(s: socket.socket, f: BinaryIO, i: int) -> None:
        read_request(f)
        s.sendall(b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok")

    with raw_server(handle) as server:
        client, transport = lean()
        async with client:
            assert (await client.get(server.url)).text == "ok"
            assert transport.connections == 0


async def test_server_closing_an_idle_connection_means_reconnect_not_failure() -> None:
    with raw_server(lambda s, f, i: server.serve_forever(s, f, lambda m, b: ok(b"%d" % len(server.conns)))) as server:
        client, transport = lean()
        async with client:
            assert (await client.get(server.url)).content == b"1"
            server.conns[0].shutdown(socket.SHUT_RDWR)  # the server's keep-alive timer fired
            await eventually(lambda: transport.idle_connections == 0)  # the event loop saw the close
            assert (await client.get(server.url)).content == b"2"
            assert transport.connections == 1


async def test_expired_idle_connection_is_not_reused() -> None:
    with raw_server(lambda s, f, i: server.serve_forever(s, f, lambda m, b: ok())) as server:
        client, _ = lean(keepalive_expiry=0.2)
        async with client:
            await client.get(server.url)
            await asyncio.sleep(0.5)  # longer than the expiry
            await client.get(server.url)
        assert len(server.conns) == 2


# -- framing ----------------------------------------------------------------------------------------------


async def test_large_bodies_both_ways() -> None:
    async def echo(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=request.content)

    async with serve(echo) as url:
        client, _ = lean()
        async with client:
            for size in (0, 1, 65_535, 1 << 20, 9 << 20):
                body = os.urandom(size)
                assert (await client.post(url, content=body)).content == body


async def test_large_answers_are_gathered_a_few_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Answers above 64 KiB still arriving (known length or chunked) are read at most ``max_large_bodies`` at
    once; each arrives whole and exact, small ones are never held back."""
    import aiohttp

    reading = most = 0
    read = aiohttp.ClientResponse.read

    async def counted(self: aiohttp.ClientResponse) -> bytes:
        nonlocal reading, most
        length = self.content_length
        big = not self.content.is_eof() and (length is None or length > 64 << 10)
        reading += big
        most = max(most, reading)
        try:
            return await read(self)
        finally:
            reading -= big

    monkeypatch.setattr(aiohttp.ClientResponse, "read", counted)

    async def handle(request: httpx.Request) -> httpx.Response:
        size = int(request.url.params["size"])
        body = bytes([size % 251]) * size
        if request.url.params.get("chunked"):

            async def halves() -> Any:
                yield body[: size // 2]
                yield body[size // 2 :]

            return httpx.Response(200, content=halves())
        return httpx.Response(200, content=body)

    async with serve(handle) as url:
        transport = AiohttpTransport(limits=httpx.Limits(max_connections=100), max_large_bodies=2)
        async with httpx.AsyncClient(transport=transport, timeout=30.0) as client:
            asks = [(size, chunked) for size in (10, 65_536, 65_537, 3 << 20) for chunked in ("", "1")] * 4
            answers = await asyncio.gather(
                *(client.get(url, params={"size": size, "chunked": chunked}) for size, chunked in asks)
            )
    assert [a.content for a in answers] == [bytes([size % 251]) * size for size, _ in asks]
    assert 1 <= most <= 2


async def test_reads_from_the_socket_64_kib_at_a_time() -> None:
    async def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"x" * (1 << 20))

    async with serve(handle) as url:
        client, transport = lean()
        async with client:
            assert (await client.get(url)).content == b"x" * (1 << 20)
            pool = transport._pool
            assert pool is not None
            (idle,) = pool._conns.values()
            assert [getattr(p.transport, "max_size", None) for p, _ in idle] == [64 << 10]


def test_max_large_bodies_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_large_bodies must be at least 1, got 0"):
        AiohttpTransport(max_large_bodies=0)


async def test_chunked_body_with_extensions_trailers_and_odd_splits() -> None:
    payload = [os.urandom(n) for n in (1, 300, 70_000, 5)]

    def handle(s: socket.socket, f: BinaryIO, i: int) -> None:
        while read_request(f) is not None:
            wire = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
            wire += b"".join(b"%X;ext=1\r\n%s\r\n" % (len(p), p) for p in payload) + b"0\r\nx-trailer: 1\r\n\r\n"
            for at in range(0, len(wire), 7001):  # boundaries inside size lines, data and CRLFs
                s.sendall(wire[at : at + 7001])

    with raw_server(handle) as server:
        client, _ = lean()
        async with client:
            for _ in range(2):
                assert (await client.get(server.url)).content == b"".join(payload)
        assert len(server.conns) == 1  # the connection survived the chunked body


async def test_streamed_request_body_is_sent_chunked() -> None:
    received: list[bytes] = []

    def handle(s: socket.socket, f: BinaryIO, i: int) -> None:
        req = read_request(f)
        assert req is not None and req[2].get("transfer-encoding") == "chunked"
        while (size := int(f.readline().strip(), 16)) > 0:
            received.append(f.read(size))
            f.readline()
        f.readline()
        s.sendall(ok(b"got"))

    async def pieces():  # type: ignore[no-untyped-def]
        for piece in (b"one", b"", b"two" * 1000):
            yield piece

    with raw_server(handle) as server:
        client, _ = lean()
        async with client:
            assert (await client.post(server.url, content=pieces())).content == b"got"
    assert received == [b"one", b"two" * 1000]


async def test_chunked_event_stream_arrives_whole() -> None:
    def handle(s: socket.socket, f: BinaryIO, i: int) -> None:
        read_request(f)
        s.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        s.sendall(b"b\r\ndata: one\n\n\r\n")
        s.sendall(b"b\r\ndata: two\n\n\r\n0\r\n\r\n")

    with raw_server(handle) as server:
        client, _ = lean()
        async with client:
            assert (await client.get(server.url)).content == b"data: one\n\ndata: two\n\n"


async def test_read_to_close_body() -> None:
    def handle(s: socket.socket, f: BinaryIO, i: int) -> None:
        read_request(f)
        s.sendall(b"HTTP/1.1 200 OK\r\n\r\npart one, ")
        s.sendall(b"part two")
        s.shutdown(socket.SHUT_RDWR)

    with raw_server(handle) as server:
        client, transport = lean()
        async with client:
            assert (await client.get(server.url)).content == b"part one, part two"
            assert transport.connections == 0


@pytest.mark.parametrize(("method", "status"), [("HEAD", 200), ("GET", 204), ("GET", 304)])
async def test_no_body_answers_keep_the_connection_usable(method: str, status: int) -> None:
    def handle(s: socket.socket, f: BinaryIO, i: int) -> None:
        req = read_request(f)
        assert req is not None
        s.sendall(b"HTTP/1.1 %d X\r\ncontent-length: 100\r\n\r\n" % status)  # a length, but no body follows
        read_request(f)
        s.sendall(ok(b"next"))

    with raw_server(handle) as server:
        client, _ = lean()
        async with client:
            first = await client.request(method, server.url)
            assert first.status_code == status and first.content == b""
            assert (await client.get(server.url)).content == b"next"
        assert len(server.conns) == 1


async def test_interim_100_continue_is_skipped() -> None:
    def handle(s: socket.socket, f: BinaryIO, i: int) -> None:
        read_request(f)
        s.sendall(b"HTTP/1.1 100 Continue\r\n\r\n" + ok(b"done", b"x-a: b\r\n"))

    with raw_server(handle) as server:
        client, _ = lean()
        async with client:
            r = await client.get(server.url)
            assert (r.status_code, r.content, r.headers["x-a"], r.reason_phrase) == (200, b"done", "b", "OK")


@pytest.mark.parametrize(
    ("answer", "match"),
    [
        (b"HTTP/2 200 OK\r\n\r\n", "status line"),
        (b"HTTP/1.1 2x0 OK\r\n\r\n", "status line"),
        (b"garbage\r\n\r\n", "status line"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "header token"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n", "Content-Length"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\nab", "Content-Length"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n", "Transfer-Encoding"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n", "chunk size"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0x1\r\na\r\n", "chunk size"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n", "Transfer-Encoding"),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 2\r\n\r\n2\r\nok\r\n0\r\n\r\n",
            "Content-Length",
        ),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nabc\r\n", "LF after chunk"),
        (b"HTTP/1.1 200 OK\r\nx: " + b"y" * 200_000, "more than"),
    ],
)
async def test_malformed_answers_are_protocol_errors(answer: bytes, match: str) -> None:
    def handle(s: socket.socket, f: BinaryIO, i: int) -> None:
        read_request(f)
        s.sendall(answer)
        threading.Event().wait(30)

    with raw_server(handle) as server:
        client, transport = lean()
        async with client:
            with pytest.raises(httpx.RemoteProtocolError, match=match):
                await client.get(server.url)
            assert transport.connections == 0


async def test_header_injection_is_refused_before_sending() -> None:
    with raw_server(lambda s, f, i: server.serve_forever(s, f, lambda m, b: ok())) as server:
        client, _ = lean()
        async with client:
            request = client.build_request("GET", server.url)
            request.headers["x-evil"] = "a\r\nx-injected: 1"
            with pytest.raises(httpx.LocalProtocolError):
                await client.send(request)
        assert server.requests == 0


async def test_https_goes_through_it_and_a_failed_handshake_is_a_connect_error() -> None:
    """A server that answers a TLS hello with plain HTTP: the handshake fails before the request was sent."""

    async def plain(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(plain, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        client, transport = lean()
        async with client:
            with pytest.raises(httpx.ConnectError):
                await client.get(f"https://127.0.0.1:{port}/")
            assert transport.connections == 0
    finally:
        server.close()
        await server.wait_closed()


async def test_cancelled_request_frees_its_slot() -> None:
    def handle(s: socket.socket, f: BinaryIO, i: int) -> None:
        if i == 0:
            read_request(f)
            threading.Event().wait(30)
        else:
            server.serve_forever(s, f, lambda m, b: ok())

    with raw_server(handle) as server:
        client, transport = lean(max_connections=1)
        async with client:
            task = asyncio.create_task(client.get(server.url))
            await eventually(lambda: server.conns != [])
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert transport.connections == 0
            assert (await client.get(server.url)).status_code == 200


# -- through the client -----------------------------------------------------------------------------------


async def test_client_uses_it_for_both_schemes_unless_a_proxy_is_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    config = ClientConfig(backend="vllm", base_url="http://127.0.0.1:1", model="m")
    async with Client(config) as client:
        for url in ("http://127.0.0.1:1/x", "https://127.0.0.1:1/x"):
            assert isinstance(client._data._transport_for_url(httpx.URL(url)), AiohttpTransport)
            assert isinstance(client._admin_clients[0]._transport_for_url(httpx.URL(url)), AiohttpTransport)
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.invalid:3128")
    async with Client(config) as client:  # the proxied scheme goes through httpx's transport, which reads it
        assert not isinstance(client._data._transport_for_url(httpx.URL("http://127.0.0.1:1/x")), AiohttpTransport)
        assert isinstance(client._data._transport_for_url(httpx.URL("https://127.0.0.1:1/x")), AiohttpTransport)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    async with Client(config) as client:
        assert not isinstance(client._data._transport_for_url(httpx.URL("https://127.0.0.1:1/x")), AiohttpTransport)


async def test_5xx_then_reset_is_retried_once_on_a_fresh_connection() -> None:
    """The choke point's rule for servers that answer 5xx and then reset that keep-alive connection."""

    def handle(s: socket.socket, f: BinaryIO, i: int) -> None:
        if i == 0:
            read_request(f)
            s.sendall(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 4\r\n\r\nboom")
            read_request(f)  # the next request arrives on the same connection: reset it
            reset(s)
        else:
            server.serve_forever(s, f, lambda m, b: ok(b'{"fine":true}'))

    with raw_server(handle) as server:
        client, _ = lean()
        async with client:
            srv = Server(
                base_url=server.url,
                admin_url=server.url,
                data_client=client,
                admin_client=client,
                retry=RetryPolicy(attempts=1),
            )
            with pytest.raises(ServerStatusError):
                await srv.request("POST", "/g", json_body={})
            assert await srv.request("POST", "/g", json_body={}) == {"fine": True}

    # without a 5xx before it, a reset is a NetworkError (the server may have acted)
    def reset_all(s: socket.socket, f: BinaryIO, i: int) -> None:
        read_request(f)
        reset(s)

    with raw_server(reset_all) as server:
        client, _ = lean()
        async with client:
            srv = Server(base_url=server.url, admin_url=server.url, data_client=client, admin_client=client)
            with pytest.raises(NetworkError, match="ReadError") as info:
                await srv.request("POST", "/g", json_body={})
            assert info.value.maybe_processed


@pytest.mark.parametrize("close", [reset, socket.socket.close], ids=["reset", "clean close"])
async def test_after_a_5xx_an_answer_cut_off_midway_is_never_resent(close: Callable[[socket.socket], None]) -> None:
    """The status line and part of the body arrived: the engine ran the request, so it is not sent again."""
    generations: list[int] = []

    def handle(s: socket.socket, f: BinaryIO, i: int) -> None:
        if i == 0:
            read_request(f)
            s.sendall(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 4\r\n\r\nboom")
        read_request(f)
        generations.append(i)
        s.sendall(b'HTTP/1.1 200 OK\r\ncontent-length: 400\r\n\r\n{"completion_ids": [1, 2')
        close(s)

    with raw_server(handle) as server:
        client, _ = lean()
        async with client:
            srv = Server(base_url=server.url, admin_url=server.url, data_client=client, admin_client=client)
            with pytest.raises(ServerStatusError):
                await srv.request("POST", "/g", json_body={})
            with pytest.raises(NetworkError) as info:
                await srv.request("POST", "/g", json_body={})
    assert info.value.maybe_processed
    assert generations == [0]


def test_runs_on_uvloop_too() -> None:
    """The same requests on uvloop's event loop."""
    uvloop = pytest.importorskip("uvloop")

    async def echo(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=request.content)

    async def main() -> None:
        async with serve(echo) as url:
            client, transport = lean(max_connections=20)
            async with client:
                for size in (0, 10, 3 << 20):
                    body = os.urandom(size)
                    assert (await client.post(url, content=body)).content == body
                bodies = [os.urandom(i) for i in range(100)]
                answers = await asyncio.gather(*(client.post(url, content=b) for b in bodies))
                assert [a.content for a in answers] == bodies and transport.connections == 20
                assert (await client.post(url, content=b"x")).content == b"x"

    uvloop.run(main())
