"""The hand-written HTTP/1.1 transport the client used before aiohttp, kept for paired benchmarks only
(``bench_client.py`` ``floor_lean`` / ``ours_ids_lean``, ``bench_fleet.py``); not part of the library.

A lean HTTP/1.1 transport for ``httpx.AsyncClient`` on plain asyncio (``http://`` origins only).

httpx's default transport runs every request through httpcore's pool, h11's state machine and anyio's socket
streams: ~60 % of the client's CPU per generate call (bench/README.md). This transport does the same job with a
few C-level operations per request: one ``write`` of head + body, the response collected by an
:class:`asyncio.Protocol` into a list of received chunks, the head found with ``bytes.find`` and split once, the
body taken with one slice or one join.

Pool (one per transport, shared by all origins, like httpcore's): at most ``max_connections`` open or opening
connections; idle ones are kept per origin, newest reused first, at most ``max_keepalive_connections`` of them and
each for ``keepalive_expiry`` seconds; a request that finds the pool full waits (first come, first served) for a
released connection or slot, up to the ``pool`` timeout. An idle connection the server closed is noticed by the
event loop and dropped, so the next request opens a new one; one idle for over a second is also checked with a
zero-timeout ``select`` before reuse (the window where the server's close is still in flight).

Timeouts (``request.extensions["timeout"]``, set by ``httpx.AsyncClient``) and failures raise the exceptions
httpx's own transport raises: ``ConnectTimeout``/``ConnectError`` (no connection), ``PoolTimeout`` (no free
connection in time), ``WriteTimeout``/``WriteError`` (request not fully handed to the kernel), ``ReadTimeout``
(no data for ``read`` seconds), ``ReadError`` (connection reset while waiting for or reading the answer) and
``RemoteProtocolError`` (the server closed early or sent something that is not HTTP/1.1). Response framing:
``Content-Length``, ``chunked`` (extensions and trailers skipped) or read-to-close; no body for ``HEAD``, 1xx,
204 and 304; interim 1xx answers are skipped; ``Connection: close`` (either side) and HTTP/1.0 without
keep-alive close the connection after the body. Chunked and read-to-close bodies stream as they arrive (SSE).

TLS is not handled here: :class:`backends_core.client.Client` mounts this transport for ``http://`` only and
leaves ``https://`` to httpx's default transport (with the configured ``verify``), and uses httpx's default for
everything when the environment configures an HTTP proxy.
"""

from __future__ import annotations

import asyncio
import collections
import re
import select
from collections.abc import AsyncIterator
from typing import Any, cast

import httpx

__all__ = ["LeanTransport"]

#: Largest response head (status line + headers) accepted, as h11's default.
MAX_HEAD = 100 * 1024
#: Idle connections older than this are checked with a zero-timeout ``select`` before reuse.
PEEK_AFTER = 1.0
#: Request bodies up to this size are joined to the head and sent with one ``send``.
_JOIN_BODY = 1 << 20
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")
_DEFAULT_LIMITS = httpx.Limits()
_LENGTH, _CHUNKED, _CLOSE, _NONE = 0, 1, 2, 3


def _eof_error(conn: _Conn, what: str, request: httpx.Request) -> httpx.TransportError:
    if isinstance(conn.lost_exc, OSError):
        return httpx.ReadError(f"{what}: {conn.lost_exc}", request=request)
    return httpx.RemoteProtocolError(what, request=request)


class _Conn(asyncio.Protocol):
    """One keep-alive connection: buffers what arrives and wakes the request's coroutine when it has enough."""

    def __init__(self, pool: LeanTransport, origin: tuple[str, int], loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.origin = origin
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.chunks: list[bytes] = []
        self.size = 0
        self.need = 0
        self.waiter: asyncio.Future[bool] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.timeout = 0.0
        self.last_data = 0.0
        self.eof = False
        self.closed = False
        self.lost_exc: BaseException | None = None
        self.paused = False
        self.drain_waiter: asyncio.Future[None] | None = None
        self.idle = False
        self.idle_since = 0.0
        #: The connection holds one of the pool's slots until it is dropped.
        self.slot = True

    # -- asyncio.Protocol -----------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio.Transport subclasses
        # pause as soon as anything is left unsent: "written" then means handed to the kernel, as in httpcore
        self.transport.set_write_buffer_limits(high=0, low=0)

    def data_received(self, data: bytes) -> None:
        self.chunks.append(data)
        self.size += len(data)
        waiter = self.waiter
        if waiter is not None:
            self.last_data = self.loop.time()
            if self.size >= self.need and not waiter.done():
                waiter.set_result(False)

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = self.closed = True
        self.lost_exc = exc
        self._wake()
        drain = self.drain_waiter
        if drain is not None and not drain.done():
            drain.set_exception(httpx.WriteError(f"connection lost while sending: {exc or 'closed by the server'}"))
        self.pool._lost(self)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        drain = self.drain_waiter
        if drain is not None and not drain.done():
            drain.set_result(None)

    # -- used by the request's coroutine --------------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(False)

    def _on_timer(self) -> None:
        waiter = self.waiter
        if waiter is None or waiter.done():
            return
        left = self.timeout - (self.loop.time() - self.last_data)
        if left > 0:
            self.timer = self.loop.call_later(left, self._on_timer)
        else:
            waiter.set_result(True)

    async def fill(self, need: int, read_s: float | None, request: httpx.Request) -> bool:
        """Wait until ``need`` bytes are buffered (True) or the peer closed first (False).

        :raises httpx.ReadTimeout: no data arrived for ``read_s`` seconds.
        """
        timeout = read_s
        while self.size < need:
            if self.eof:
                return False
            waiter: asyncio.Future[bool] = self.loop.create_future()
            self.waiter, self.need = waiter, need
            if timeout is not None:
                self.timeout, self.last_data = timeout, self.loop.time()
                self.timer = self.loop.call_later(timeout, self._on_timer)
            try:
                timed_out = await waiter
            finally:
                self.waiter = None
                if self.timer is not None:
                    self.timer.cancel()
                    self.timer = None
            if timed_out:
                raise httpx.ReadTimeout(f"no data from the server for {timeout} s", request=request)
        return True

    def joined(self) -> bytes:
        """Everything buffered, as one ``bytes`` (kept as the single buffered chunk)."""
        chunks = self.chunks
        if len(chunks) == 1:
            return chunks[0]
        data = b"".join(chunks)
        self.chunks = [data] if data else []
        return data

    def consume(self, data: bytes, n: int) -> None:
        """Drop the first ``n`` bytes of ``data`` (the current :meth:`joined` buffer)."""
        if n >= len(data):
            self.chunks, self.size = [], 0
        else:
            rest = data[n:]
            self.chunks, self.size = [rest], len(rest)

    async def send(self, data: bytes, write_s: float | None, request: httpx.Request) -> None:
        """Hand ``data`` to the kernel.

        :raises httpx.WriteError: the connection is gone.
        :raises httpx.WriteTimeout: the kernel did not take it all within ``write_s`` seconds.
        """
        timeout = write_s
        transport = self.transport
        if self.closed or transport is None or transport.is_closing():
            raise httpx.WriteError(f"connection closed before sending: {self.lost_exc or 'closed'}", request=request)
        transport.write(data)
        if transport.is_closing():  # send() failed
            raise httpx.WriteError(f"connection lost while sending: {self.lost_exc or 'closed'}", request=request)
        if self.paused:
            drain: asyncio.Future[None] = self.loop.create_future()
            self.drain_waiter = drain
            try:
                await asyncio.wait_for(drain, timeout)
            except TimeoutError:
                raise httpx.WriteTimeout(f"request not sent within {timeout} s", request=request) from None
            except httpx.WriteError as exc:
                exc.request = request
                raise
            finally:
                self.drain_waiter = None

    def alive(self) -> bool:
        """Zero-timeout check that an idle connection has nothing to read (EOF or stray bytes: unusable)."""
        transport = self.transport
        if self.closed or transport is None or transport.is_closing():
            return False
        sock = transport.get_extra_info("socket")
        if sock is None:
            return True
        try:
            readable, _, _ = select.select([sock.fileno()], [], [], 0)
        except (OSError, ValueError):
            return False
        return not readable

    def close(self) -> None:
        transport = self.transport
        if transport is not None:
            transport.abort()  # drops anything unsent (a request given up on), so the socket closes now
        self.closed = True


class _Body(httpx.AsyncByteStream):
    """The response body: already read (``ready``), or read from the connection as it is iterated."""

    def __init__(
        self,
        owner: LeanTransport,
        conn: _Conn | None,
        request: httpx.Request,
        *,
        ready: bytes | None = None,
        mode: int = _NONE,
        length: int = 0,
        timeout: float | None = None,
        keep: bool = False,
    ) -> None:
        self._owner = owner
        self._conn = conn
        self._request = request
        self._ready = ready
        self._mode = mode
        self._length = length
        self._timeout = timeout
        self._keep = keep

    def _finish(self, keep: bool) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            if keep:
                self._owner._release(conn)
            else:
                self._owner._drop(conn)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        ready, self._ready = self._ready, None
        if ready is not None:
            if ready:
                yield ready
            return
        conn = self._conn
        if conn is None:
            return
        try:
            if self._mode == _LENGTH:
                if not await conn.fill(self._length, self._timeout, self._request):
                    raise _eof_error(
                        conn,
                        f"peer closed connection without sending complete message body "
                        f"(received {conn.size} bytes, expected {self._length})",
                        self._request,
                    )
                data = conn.joined()
                extra = len(data) > self._length
                body = data[: self._length] if extra else data
                conn.chunks, conn.size = [], 0
                self._finish(self._keep and not extra)
                yield body
            elif self._mode == _CHUNKED:
                async for piece in self._chunked(conn):
                    yield piece
            else:  # read to close
                while True:
                    if conn.size:
                        data = conn.joined()
                        conn.chunks, conn.size = [], 0
                        yield data
                    elif conn.eof:
                        if isinstance(conn.lost_exc, OSError):
                            raise _eof_error(conn, "connection lost while reading the body", self._request)
                        self._finish(False)
                        return
                    else:
                        await conn.fill(1, self._timeout, self._request)
        except BaseException:
            self._finish(False)
            raise

    async def _chunked(self, conn: _Conn) -> AsyncIterator[bytes]:
        request = self._request
        while True:
            data = conn.joined()
            pieces: list[bytes] = []
            pos = 0
            need = 0
            done = False
            while True:
                eol = data.find(b"\r\n", pos)
                if eol < 0:
                    if len(data) - pos > 4096:
                        raise httpx.RemoteProtocolError("chunk size line too long", request=request)
                    need = len(data) + 1
                    break
                line = data[pos:eol].split(b";", 1)[0].strip(b" \t")
                if _CHUNK_SIZE.fullmatch(line) is None:
                    raise httpx.RemoteProtocolError(f"invalid chunk size line {data[pos:eol][:40]!r}", request=request)
                size = int(line, 16)
                if size == 0:
                    end = data.find(b"\r\n\r\n", eol)
                    if end < 0:
                        if len(data) - eol > MAX_HEAD:
                            raise httpx.RemoteProtocolError("chunked trailers too large", request=request)
                        need = len(data) + 1
                        break
                    pos, done = end + 4, True
                    break
                end = eol + 2 + size
                if len(data) < end + 2:
                    need = end + 2
                    break
                if data[end : end + 2] != b"\r\n":
                    raise httpx.RemoteProtocolError("chunk not followed by CRLF", request=request)
                pieces.append(data[eol + 2 : end])
                pos = end + 2
            if done:
                extra = len(data) > pos
                conn.chunks, conn.size = [], 0
                self._finish(self._keep and not extra)
                if pieces:
                    yield b"".join(pieces)
                return
            conn.consume(data, pos)
            if pieces:
                yield pieces[0] if len(pieces) == 1 else b"".join(pieces)
            if not await conn.fill(need - pos, self._timeout, request):
                raise _eof_error(conn, "peer closed connection in the middle of a chunked body", request)

    async def aclose(self) -> None:
        self._ready = None
        self._finish(False)  # a body not read to its end leaves the connection in an unknown state


class LeanTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 over asyncio for ``http://`` URLs, with a keep-alive pool honouring ``limits``.

    :param limits: pool sizes and keep-alive expiry (``None`` values mean no limit).
    """

    def __init__(self, *, limits: httpx.Limits = _DEFAULT_LIMITS) -> None:
        self._max = limits.max_connections if limits.max_connections is not None else 1 << 62
        self._max_idle = limits.max_keepalive_connections if limits.max_keepalive_connections is not None else 1 << 62
        self._expiry = limits.keepalive_expiry if limits.keepalive_expiry is not None else float("inf")
        self._idle: dict[tuple[str, int], collections.deque[_Conn]] = {}
        self._n_idle = 0
        #: Slots taken: connections open or being opened.
        self._n = 0
        self._waiters: collections.deque[tuple[tuple[str, int], asyncio.Future[_Conn | None]]] = collections.deque()
        self._conns: set[_Conn] = set()
        self._closed = False

    @property
    def connections(self) -> int:
        """Connections open or being opened (for tests and metrics)."""
        return self._n

    @property
    def idle_connections(self) -> int:
        return self._n_idle

    # -- pool -----------------------------------------------------------------------------------------------

    def _free_slot(self) -> None:
        """A slot became free: hand it to the first live waiter (it opens a connection), else count it free."""
        waiters = self._waiters
        while waiters:
            _origin, fut = waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self._n -= 1

    def _drop(self, conn: _Conn) -> None:
        conn.close()
        if conn.idle:
            conn.idle = False
            idle = self._idle.get(conn.origin)
            if idle is not None and conn in idle:
                idle.remove(conn)
                self._n_idle -= 1
        self._conns.discard(conn)
        if conn.slot:
            conn.slot = False
            self._free_slot()

    def _lost(self, conn: _Conn) -> None:
        """The connection closed; if it was idle, take it out of the pool now (in use: its request drops it)."""
        if conn.idle:
            self._drop(conn)

    def _release(self, conn: _Conn) -> None:
        """The response was read to its end and the connection may be reused."""
        if self._closed or conn.closed or conn.chunks:
            self._drop(conn)
            return
        waiters = self._waiters
        while waiters:
            origin, fut = waiters[0]
            if fut.done():
                waiters.popleft()
                continue
            if origin == conn.origin:
                waiters.popleft()
                fut.set_result(conn)
                return
            break
        if waiters or self._n_idle >= self._max_idle:
            self._drop(conn)  # its slot goes to the first waiter (another origin), or is freed
            return
        now = conn.loop.time()
        idle = self._idle.get(conn.origin)
        if idle is None:
            idle = self._idle[conn.origin] = collections.deque()
        while idle and now - idle[0].idle_since > self._expiry:
            self._drop(idle[0])
        conn.idle, conn.idle_since = True, now
        idle.append(conn)
        self._n_idle += 1

    async def _acquire(self, origin: tuple[str, int], request: httpx.Request, timeouts: dict[str, Any]) -> _Conn:
        """A connection to ``origin``: an idle one, a new one, or one handed over by a finishing request."""
        loop = asyncio.get_running_loop()
        idle = self._idle.get(origin)
        if idle:
            now = loop.time()
            while idle:
                conn = idle.pop()
                conn.idle = False
                self._n_idle -= 1
                age = now - conn.idle_since
                if conn.closed or conn.size or age > self._expiry or (age > PEEK_AFTER and not conn.alive()):
                    self._drop(conn)
                    continue
                return conn
        if self._n >= self._max and self._n_idle:
            # the pool is full but some other origin has idle connections: close its oldest one
            oldest = min((q[0] for q in self._idle.values() if q), key=lambda c: c.idle_since)
            self._drop(oldest)
        if self._n < self._max:
            self._n += 1
            return await self._connect(origin, request, timeouts, loop)
        fut: asyncio.Future[_Conn | None] = loop.create_future()
        self._waiters.append((origin, fut))
        pool_timeout = timeouts.get("pool")
        timer = None
        if pool_timeout is not None:
            timer = loop.call_later(pool_timeout, _expire, fut, pool_timeout, request)
        try:
            got = await fut
        except BaseException:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                handed = fut.result()  # handed over just as we were cancelled: give it back
                if handed is None:
                    self._free_slot()
                else:
                    self._release(handed)
            raise
        finally:
            if timer is not None:
                timer.cancel()
        if got is None:
            return await self._connect(origin, request, timeouts, loop)
        return got

    async def _connect(
        self,
        origin: tuple[str, int],
        request: httpx.Request,
        timeouts: dict[str, Any],
        loop: asyncio.AbstractEventLoop,
    ) -> _Conn:
        """Open a connection in a slot already taken (freed again on failure)."""
        timeout = timeouts.get("connect")
        try:
            async with asyncio.timeout(timeout):
                _, conn = await loop.create_connection(lambda: _Conn(self, origin, loop), origin[0], origin[1])
        except TimeoutError:
            self._free_slot()
            message = f"no connection to {origin[0]}:{origin[1]} within {timeout} s"
            raise httpx.ConnectTimeout(message, request=request) from None
        except OSError as exc:
            self._free_slot()
            raise httpx.ConnectError(str(exc) or type(exc).__name__, request=request) from exc
        except BaseException:
            self._free_slot()
            raise
        if self._closed:
            self._drop(conn)
            raise httpx.ConnectError("transport closed", request=request)
        self._conns.add(conn)
        return conn

    # -- requests -------------------------------------------------------------------------------------------

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            raise httpx.UnsupportedProtocol(f"LeanTransport speaks http:// only, not {url.scheme}://", request=request)
        if self._closed:
            raise httpx.ConnectError("transport closed", request=request)
        head = _request_head(request)
        try:
            body = request.content
        except httpx.RequestNotRead:
            body = None
        timeouts: dict[str, Any] = request.extensions.get("timeout", {})
        conn = await self._acquire((url.host, url.port or 80), request, timeouts)
        try:
            write = timeouts.get("write")
            if body is None:
                await conn.send(head, write, request)
                chunked = b"chunked" in request.headers.get("transfer-encoding", "").encode().lower()
                async for piece in request.stream:  # type: ignore[union-attr]
                    if piece:
                        await conn.send(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece, write, request)
                if chunked:
                    await conn.send(b"0\r\n\r\n", write, request)
            elif len(body) <= _JOIN_BODY:
                await conn.send(head + body, write, request)
            else:
                await conn.send(head, write, request)
                await conn.send(body, write, request)
            return await self._response(conn, request, timeouts.get("read"))
        except BaseException:
            self._drop(conn)
            raise

    async def _response(self, conn: _Conn, request: httpx.Request, read: float | None) -> httpx.Response:
        scanned = 0
        interim = False
        while True:  # skips interim 1xx answers
            data = conn.joined()
            end = data.find(b"\r\n\r\n", max(0, scanned - 3))
            while end < 0:
                if len(data) > MAX_HEAD:
                    raise httpx.RemoteProtocolError("response head too large", request=request)
                scanned = len(data)
                if not await conn.fill(scanned + 1, read, request):
                    started = bool(scanned) or interim
                    what = (
                        "peer closed connection in the middle of the response head"
                        if started
                        else "Server disconnected without sending a response."
                    )
                    error = _eof_error(conn, what, request)
                    error.answer_started = started  # type: ignore[attr-defined]  # read by the retry rule in server.py
                    raise error
                data = conn.joined()
                end = data.find(b"\r\n\r\n", max(0, scanned - 3))
            status, reason, version, headers, length, chunked, close = _parse_head(data[:end], request)
            start = end + 4
            if 100 <= status < 200:
                if status == 101:
                    raise httpx.RemoteProtocolError("unexpected 101 Switching Protocols", request=request)
                conn.consume(data, start)
                scanned = 0
                interim = True
                continue
            break
        keep = not close and b"close" not in request.headers.get("connection", "").encode().lower()
        if version == b"HTTP/1.0":
            keep = keep and close is False
        extensions = {"http_version": version, "reason_phrase": reason}
        if request.method == "HEAD" or status in (204, 304):
            mode = _NONE
        elif chunked:
            mode = _CHUNKED
        elif length is not None:
            mode = _LENGTH
        else:
            mode, keep = _CLOSE, False
        if mode == _NONE or (mode == _LENGTH and len(data) - start >= length):  # type: ignore[operator]
            if mode == _LENGTH:
                stop = start + length  # type: ignore[operator]
                body = data[start:stop]
                keep = keep and len(data) == stop
            else:
                body = b""
                keep = keep and len(data) == start
            conn.chunks, conn.size = [], 0
            if keep:
                self._release(conn)
            else:
                self._drop(conn)
            stream = _Body(self, None, request, ready=body)
        else:
            conn.consume(data, start)
            stream = _Body(self, conn, request, mode=mode, length=length or 0, timeout=read, keep=keep)
        return httpx.Response(status, headers=headers, stream=stream, extensions=extensions)

    async def aclose(self) -> None:
        self._closed = True
        for conn in list(self._conns):
            self._drop(conn)
        while self._waiters:
            _origin, fut = self._waiters.popleft()
            if not fut.done():
                fut.set_exception(httpx.ConnectError("transport closed"))
        await asyncio.sleep(0)  # let the closed sockets' connection_lost callbacks run before the loop may end


def _expire(fut: asyncio.Future[_Conn | None], timeout: float, request: httpx.Request) -> None:
    if not fut.done():
        fut.set_exception(httpx.PoolTimeout(f"no free connection within {timeout} s", request=request))


def _request_head(request: httpx.Request) -> bytes:
    """``METHOD target HTTP/1.1`` and the headers, CRLF-terminated.

    :raises httpx.LocalProtocolError: a header or the target contains CR or LF (header injection).
    """
    raw = request.headers.raw
    head = b"%s %s HTTP/1.1\r\n%s\r\n" % (
        request.method.encode(),
        request.url.raw_path,
        b"".join([b"%s: %s\r\n" % pair for pair in raw]),
    )
    lines = len(raw) + 2
    if head.count(b"\n") != lines or head.count(b"\r") != lines:
        raise httpx.LocalProtocolError("CR or LF inside a request header or the target", request=request)
    return head


def _parse_head(
    head: bytes, request: httpx.Request
) -> tuple[int, bytes, bytes, list[tuple[bytes, bytes]], int | None, bool, bool | None]:
    """Status line and headers: ``(status, reason, version, headers, content_length, chunked, close)``;
    ``close`` is True for ``Connection: close``, False for ``Connection: keep-alive``, None when absent.

    :raises httpx.RemoteProtocolError: not an HTTP/1.x response head.
    """
    lines = head.split(b"\r\n")
    status_line = lines[0]
    parts = status_line.split(b" ", 2)
    version = parts[0]
    if len(parts) < 2 or version not in (b"HTTP/1.1", b"HTTP/1.0") or len(parts[1]) != 3 or not parts[1].isdigit():
        raise httpx.RemoteProtocolError(f"invalid HTTP status line {status_line[:80]!r}", request=request)
    status = int(parts[1])
    reason = parts[2] if len(parts) == 3 else b""
    headers: list[tuple[bytes, bytes]] = []
    length: int | None = None
    chunked = False
    close: bool | None = None
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name[-1:] in (b" ", b"\t") or name[:1] in (b" ", b"\t"):
            raise httpx.RemoteProtocolError(f"invalid response header line {line[:80]!r}", request=request)
        value = value.strip(b" \t")
        headers.append((name, value))
        lower = name.lower()
        if lower == b"content-length":
            values = {v.strip(b" \t") for v in value.split(b",")}
            if len(values) != 1 or not (v := values.pop()).isdigit() or len(v) > 18:
                raise httpx.RemoteProtocolError(f"invalid Content-Length {value[:40]!r}", request=request)
            if length is not None and length != int(v):
                raise httpx.RemoteProtocolError("conflicting Content-Length headers", request=request)
            length = int(v)
        elif lower == b"transfer-encoding":
            codings = [c.strip(b" \t").lower() for c in value.split(b",")]
            if codings[-1] != b"chunked":
                raise httpx.RemoteProtocolError(f"unsupported Transfer-Encoding {value[:40]!r}", request=request)
            chunked = True
        elif lower == b"connection":
            tokens = value.lower()
            if b"close" in tokens:
                close = True
            elif b"keep-alive" in tokens and close is None:
                close = False
    if chunked:
        length = None  # Transfer-Encoding overrides Content-Length (RFC 9112 6.3)
    return status, reason, version, headers, length, chunked, close
