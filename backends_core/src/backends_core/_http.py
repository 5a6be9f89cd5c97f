"""HTTP/1.1 for both planes and both schemes: aiohttp's parser and connection pool behind the httpx API.

:class:`AiohttpTransport` is an ``httpx.AsyncBaseTransport``, so the client keeps httpx's request and response
objects (and ``httpx.MockTransport`` stays the testing seam) while the bytes go through one
``aiohttp.ClientSession`` per transport: keep-alive pooling, chunked and ``Connection`` handling, TLS. Proxies
from the environment are httpx's mounts, as for any custom transport.

What :mod:`backends_core.server` needs beyond a status and a body is exactness about failures, so each exchange
is watched on its connection (:class:`_Exchange`, aiohttp's protocol plus two facts): whether the whole request
was handed to the socket, and whether any byte of the answer came back. A failure before the request was out is
an ``httpx.WriteError`` / ``WriteTimeout`` (the server cannot have acted on it); a failure after it carries
``answer_started``, which decides whether the request may be sent again after a reset.

The parts of aiohttp this leans on beyond its documented API are the connector's protocol factory and the
protocol's ``start_timeout`` (called once the request body is written), both stable across aiohttp 3.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import io
import ssl
from collections.abc import AsyncIterator, Iterable
from typing import Any

import aiohttp
import httpx
import yarl
from aiohttp.client_proto import ResponseHandler
from aiohttp.client_reqrep import ClientRequest
from aiohttp.connector import Connection
from aiohttp.tracing import Trace

__all__ = ["STREAMED", "AiohttpTransport"]

#: The exchange of the request being sent in this task (set when its connection is handed out).
_EXCHANGE: contextvars.ContextVar[_Exchange | None] = contextvars.ContextVar("backends_exchange", default=None)
#: Request bodies above this size are handed to aiohttp as a file object (written in chunks, not in one call).
_LARGE_BODY = 1 << 20
#: Answer bodies above this size (or of unknown size) not yet whole when their head arrives are read under the
#: transport's body gate (:attr:`AiohttpTransport.max_large_bodies`); smaller ones are read at once.
_GATED_BODY = 64 << 10
#: Bytes of an answer's body buffered before aiohttp stops reading its connection (it resumes at half of it),
#: until the body is read: what an answer waiting at the body gate holds, the rest staying in the kernel.
_READ_BUFFER = 64 << 10
#: Bytes read from a connection's socket at a time (asyncio's socket transport; its own default, 256 KiB, is used
#: while a large body is read whole: see :meth:`_Exchange.connection_made`).
_RECV_SIZE = 64 << 10
#: Transfer codings an answer may use; any other (gzip, deflate) would reach httpx still encoded.
_TRANSFER_CODINGS = frozenset({"chunked", "identity"})
#: Request extension asking for an answer whose body is handed on as it arrives instead of read whole.
STREAMED = "backends_core.streamed"
#: Write timeout of the request being sent in this task (read when its exchange starts).
_WRITE_TIMEOUT: contextvars.ContextVar[float | None] = contextvars.ContextVar("backends_write_timeout", default=None)


class _WriteTimedOut(aiohttp.ClientConnectionError):
    """The request was not written within its write timeout (the server is not reading)."""


class _Exchange(ResponseHandler):
    """aiohttp's connection protocol, also recording for the current exchange whether the request left whole
    (``sent``) and how many answer bytes arrived (``received``), and enforcing the write timeout: the time the
    request may wait on a full socket buffer (the server not reading) without the buffer draining."""

    sent = False
    received = 0
    #: the error the connection ended with (``None``: a clean close, or still open)
    lost: BaseException | None = None
    _write_limit: float | None = None
    _write_timer: asyncio.TimerHandle | None = None
    #: the transport's own read size (``None``: a transport whose read size is not adjustable)
    _read_size: int | None = None

    def set_response_params(self, **params: Any) -> None:  # a new exchange on this connection
        self.sent, self.received = False, 0
        self._write_limit = _WRITE_TIMEOUT.get()
        super().set_response_params(**params)

    def pause_writing(self) -> None:  # the socket buffer is full
        super().pause_writing()
        if not self.sent and self._write_limit is not None and self._write_timer is None:
            self._write_timer = self._loop.call_later(self._write_limit, self._write_expired)

    def resume_writing(self) -> None:  # the server read some: the wait starts again at the next full buffer
        self._stop_write_timer()
        super().resume_writing()

    def start_timeout(self) -> None:  # aiohttp: the request body is written, the answer's read timeout starts
        self.sent = True
        self._stop_write_timer()
        super().start_timeout()

    def _stop_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # asyncio's socket transport reads up to ``max_size`` bytes at a time into a new buffer of that size, then
        # shrinks it to what arrived: an answer waiting at the body gate would pin such buffers all over the heap
        # (a thousand large answers arriving together fragment it), so reads are small until the body is read
        # (uvloop's and TLS transports have no such attribute and are left as they are)
        size = getattr(transport, "max_size", None)
        if type(size) is int:
            self._read_size = size
            transport.max_size = _RECV_SIZE  # type: ignore[attr-defined]
        super().connection_made(transport)

    def full_reads(self, full: bool) -> None:
        """Read the socket with the transport's own read size (``True``, while a large body is read whole) or
        with :data:`_RECV_SIZE` (``False``)."""
        if self._read_size is not None and self.transport is not None:
            self.transport.max_size = self._read_size if full else _RECV_SIZE  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        self.received += len(data)
        super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost = exc
        self._stop_write_timer()
        super().connection_lost(exc)

    def _write_expired(self) -> None:
        self._write_timer = None
        if not self.sent:
            self.set_exception(_WriteTimedOut("timed out writing the request"))
            if self.transport is not None:
                self.transport.abort()


class _Connector(aiohttp.TCPConnector):
    """aiohttp's pool, with :class:`_Exchange` connections whose current exchange this task can look at, and at
    most ``max_idle`` idle connections (all hosts together; ``None``: no cap): a connection released beyond it
    closes the longest-idle one (the nearest to its keep-alive expiry, and to being closed by the server)."""

    def __init__(self, *, max_idle: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._factory = functools.partial(_Exchange, loop=self._loop)  # type: ignore[assignment]  # a subclass
        self._max_idle = max_idle

    async def connect(
        self,
        req: ClientRequest,
        traces: list[Trace],
        timeout: aiohttp.ClientTimeout,  # noqa: ASYNC109
    ) -> Connection:
        connection = await super().connect(req, traces, timeout)
        protocol = connection.protocol
        _EXCHANGE.set(protocol if isinstance(protocol, _Exchange) else None)
        if protocol is not None and "close" in _tokens(req.headers.getall("connection", ())):
            protocol.force_close()  # the request asks for it; aiohttp would keep the connection otherwise
        return connection

    def _release(self, key: Any, protocol: ResponseHandler, *, should_close: bool = False) -> None:
        super()._release(key, protocol, should_close=should_close)
        if self._max_idle is None or self._closed:
            return
        idle = self._conns
        excess = sum(map(len, idle.values())) - self._max_idle
        while excess > 0:
            oldest = min((k for k in idle if idle[k]), key=lambda k: idle[k][0][1])
            conns = idle[oldest]
            stale, _ = conns.popleft()
            if not conns:
                del idle[oldest]
            transport = stale.transport
            stale.close()
            if oldest.is_ssl and not self._cleanup_closed_disabled:
                self._cleanup_closed_transports.append(transport)
            excess -= 1


class AiohttpTransport(httpx.AsyncBaseTransport):
    """``httpx`` requests sent through one ``aiohttp.ClientSession`` (created on first use, in the running loop).

    :param limits: ``max_connections`` caps the connections in use at once, all hosts together (a request
        beyond it waits for one, up to the ``pool`` timeout); idle connections do not count towards it, so towards
        one host at most ``max_connections`` are ever open, and over several hosts idle connections to one may
        stay open while others are in use. ``max_keepalive_connections`` caps the idle connections kept for reuse
        (all hosts together; the longest idle is closed when one more is released), so at most
        ``max_connections + max_keepalive_connections`` are open at once; ``keepalive_expiry`` is how long an
        idle connection is kept. ``max_keepalive_connections=0`` or ``keepalive_expiry=0`` closes every
        connection after its answer.
    :param verify: TLS verification: an ``ssl.SSLContext``, ``True`` (system CAs) or ``False`` (none).
    :param max_large_bodies: answer bodies above 64 KiB gathered at once (see :meth:`_read`); the others wait,
        their bytes left in the kernel's socket buffers, which bounds the memory of a burst of large answers.
    """

    def __init__(
        self,
        *,
        limits: httpx.Limits | None = None,
        verify: ssl.SSLContext | bool = True,
        max_large_bodies: int = 4,
    ) -> None:
        if max_large_bodies < 1:
            raise ValueError(f"max_large_bodies must be at least 1, got {max_large_bodies}")
        self._limits = limits or httpx.Limits()
        self.max_large_bodies = max_large_bodies
        self._gate: asyncio.Semaphore | None = None
        self._tls: ssl.SSLContext | bool = verify if isinstance(verify, ssl.SSLContext) or not verify else True
        self._session: aiohttp.ClientSession | None = None
        #: one ``aiohttp.ClientTimeout`` per (pool, connect, read) seconds seen
        self._timeouts: dict[tuple[float | None, float | None, float | None], aiohttp.ClientTimeout] = {}

    def _open(self) -> aiohttp.ClientSession:
        limits = self._limits
        keep = bool(limits.keepalive_expiry) and limits.max_keepalive_connections != 0
        connector = _Connector(
            limit=limits.max_connections or 0,
            keepalive_timeout=limits.keepalive_expiry if keep else None,
            force_close=not keep,
            max_idle=limits.max_keepalive_connections,
            ssl=self._tls,
        )
        session = aiohttp.ClientSession(
            connector=connector,
            cookie_jar=aiohttp.DummyCookieJar(),  # httpx keeps the cookies
            auto_decompress=False,  # httpx decodes Content-Encoding
            timeout=aiohttp.ClientTimeout(total=None),
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            read_bufsize=_READ_BUFFER,
        )
        # requests are sent again in one place only (Server.request), which knows what is safe to repeat
        session._retry_connection = False
        return session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        session = self._session
        if session is None or session.closed:
            session = self._session = self._open()
            self._gate = None  # a new session may run in another event loop
        limits = request.extensions.get("timeout", {})
        key = (limits.get("pool"), limits.get("connect"), limits.get("read"))
        timeout = self._timeouts.get(key)
        if timeout is None:
            # aiohttp's ``connect`` bounds the wait for a pooled connection, a new connection's set-up included
            timeout = self._timeouts[key] = aiohttp.ClientTimeout(
                total=None, connect=key[0], sock_connect=key[1], sock_read=key[2]
            )
        charset = request.headers.encoding
        headers = [(name.decode(charset), value.decode(charset)) for name, value in request.headers.raw]
        data: bytes | io.BytesIO | httpx.AsyncByteStream | None
        try:
            content = request.content
            data = (io.BytesIO(content) if len(content) > _LARGE_BODY else content) if content else None
        except httpx.RequestNotRead:
            data = request.stream  # type: ignore[assignment]  # streamed: aiohttp sends it chunked
            headers = [(k, v) for k, v in headers if k.lower() != "transfer-encoding"]
        _EXCHANGE.set(None)
        _WRITE_TIMEOUT.set(limits.get("write"))
        try:
            if request.extensions.get(STREAMED):
                return await self._streamed(session, request, headers, data, timeout)
            async with session.request(
                request.method,
                _url(str(request.url)),
                headers=headers,
                data=data,
                allow_redirects=False,
                timeout=timeout,
                server_hostname=request.extensions.get("sni_hostname"),
            ) as answer:
                _check_codings(answer, request)
                body = await self._read(answer)
        except ValueError as exc:  # aiohttp refuses to build the request (header injection): nothing was sent
            if isinstance(exc, aiohttp.ClientError):
                raise _mapped(exc, request, pool_full=False) from exc
            raise httpx.LocalProtocolError(str(exc), request=request) from exc
        except aiohttp.ClientError as exc:
            connector = session.connector
            full = connector is not None and 0 < connector.limit <= len(connector._acquired)
            raise _mapped(exc, request, pool_full=full) from exc
        finally:
            _EXCHANGE.set(None)
        extensions: dict[str, Any] = {"http_version": b"HTTP/1.1"}
        if answer.reason:
            extensions["reason_phrase"] = answer.reason.encode()
        response = httpx.Response(
            answer.status,
            headers=answer.raw_headers,
            stream=httpx.ByteStream(body),
            request=request,
            extensions=extensions,
        )
        if "content-encoding" not in answer.headers:
            # the body as httpx's ``aread`` would return it (nothing to decode), without iterating the stream
            response._content = body
        return response

    async def _read(self, answer: aiohttp.ClientResponse) -> bytes:
        """The whole body of ``answer``. A large body still arriving is read under the gate: at most
        :attr:`max_large_bodies` of them are gathered at once, the rest wait with their connections paused by
        aiohttp's flow control (what the server sent stays in the kernel's socket buffers), so a burst of large
        answers is not held whole in memory all at once. The caller decodes the body before it next yields, so a
        body is parsed (and released) before the next waiting one is gathered."""
        length = answer.content_length
        if answer.content.is_eof() or (length is not None and length <= _GATED_BODY):
            return await answer.read()
        gate = self._gate
        if gate is None:
            gate = self._gate = asyncio.Semaphore(self.max_large_bodies)
        async with gate:
            exchange = _EXCHANGE.get()
            if exchange is not None:
                exchange.full_reads(True)
            try:
                return await answer.read()
            finally:
                if exchange is not None:
                    exchange.full_reads(False)

    async def _streamed(
        self,
        session: aiohttp.ClientSession,
        request: httpx.Request,
        headers: list[tuple[str, str]],
        data: Any,
        timeout: aiohttp.ClientTimeout,  # noqa: ASYNC109
    ) -> httpx.Response:
        """The answer once its head arrived, its body handed on as it arrives (``Server.stream``)."""
        answer = await session.request(
            request.method,
            _url(str(request.url)),
            headers=headers,
            data=data,
            allow_redirects=False,
            timeout=timeout,
            server_hostname=request.extensions.get("sni_hostname"),
        )
        _check_codings(answer, request)
        extensions: dict[str, Any] = {"http_version": b"HTTP/1.1"}
        if answer.reason:
            extensions["reason_phrase"] = answer.reason.encode()
        return httpx.Response(
            answer.status,
            headers=answer.raw_headers,
            stream=_StreamedBody(answer, request),
            request=request,
            extensions=extensions,
        )

    @property
    def connections(self) -> int:
        """Open connections of the pool, in use or idle."""
        return self.idle_connections + (len(self._pool._acquired) if self._pool is not None else 0)

    @property
    def idle_connections(self) -> int:
        """Connections kept alive for reuse."""
        return sum(len(idle) for idle in self._pool._conns.values()) if self._pool is not None else 0

    @property
    def _pool(self) -> aiohttp.BaseConnector | None:
        session = self._session
        return None if session is None or session.closed else session.connector

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


def _check_codings(answer: aiohttp.ClientResponse, request: httpx.Request) -> None:
    """Refuse an answer in a transfer coding other than chunked (a gzip one would reach httpx still encoded)."""
    codings = answer.headers.getall("transfer-encoding", ())
    if codings and not _tokens(codings) <= _TRANSFER_CODINGS:
        answer.close()
        error = httpx.RemoteProtocolError(f"unsupported Transfer-Encoding: {', '.join(codings)}", request=request)
        setattr(error, "answer_started", True)  # noqa: B010  # read by server.answer_started
        raise error


@functools.lru_cache(maxsize=4096)
def _url(url: str) -> yarl.URL:
    """The URL as aiohttp would parse it from the string, parsed once per URL (aiohttp re-parses a string on every
    request)."""
    return yarl.URL(url)


class _StreamedBody(httpx.AsyncByteStream):
    """An answer's body as aiohttp receives it. Closed after its end, the connection goes back to the pool; closed
    before, the connection is closed (the server sees its client leave)."""

    def __init__(self, answer: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self._answer = answer
        self._request = request
        self._ended = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._answer.content.iter_any():
                yield chunk
        except aiohttp.ClientError as exc:
            # the whole request was written and its answer started: a cut here is a read failure
            raise _mapped(exc, self._request, pool_full=False) from exc
        self._ended = True

    async def aclose(self) -> None:
        if self._ended:
            self._answer.release()
        else:
            self._answer.close()


def _tokens(values: Iterable[str]) -> set[str]:
    """The comma-separated tokens of a header's values, lower-cased."""
    return {token.strip().lower() for value in values for token in value.split(",")}


def _mapped(exc: aiohttp.ClientError, request: httpx.Request, *, pool_full: bool) -> httpx.TransportError:
    """The httpx error for an aiohttp failure, exact about whether the request left and the answer started.

    :param pool_full: every connection of the pool was in use when it failed (a connect timeout was then the wait
        for a free one).
    """
    message = str(exc) or type(exc).__name__
    if isinstance(exc, aiohttp.ClientConnectorError):
        return httpx.ConnectError(message, request=request)
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return (httpx.PoolTimeout if pool_full else httpx.ConnectTimeout)(message, request=request)
    if isinstance(exc, aiohttp.InvalidURL | aiohttp.NonHttpUrlClientError):
        return httpx.UnsupportedProtocol(message, request=request)
    exchange = _EXCHANGE.get()
    sent = exchange is None or exchange.sent
    started = exchange is None or exchange.received > 0
    if isinstance(exc, _WriteTimedOut):
        return httpx.WriteTimeout(message, request=request)
    if isinstance(exc, aiohttp.ServerTimeoutError):
        return httpx.ReadTimeout(message, request=request)
    error: httpx.TransportError
    if not sent and not started:
        error = httpx.WriteError(message, request=request)
    elif isinstance(exc, aiohttp.ClientOSError) or isinstance(getattr(exchange, "lost", None), OSError):
        error = httpx.ReadError(message, request=request)
    else:  # a clean close too early, a cut-off body, a malformed answer
        error = httpx.RemoteProtocolError(message, request=request)
    setattr(error, "answer_started", started)  # noqa: B010  # read by server.answer_started
    return error
