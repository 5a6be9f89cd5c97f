"""A streamed answer (:class:`ResponseStream`) and the Server-Sent Events read from it.

:meth:`backends_core.server.Server.stream` opens one: the status was already checked (a non-2xx answer raised the
same typed error as :meth:`~backends_core.server.Server.request` before any byte of the body was handed out), and
from then on the body arrives as the server sends it. A connection that fails mid-stream raises
:class:`~backends_core.errors.NetworkError` or :class:`~backends_core.errors.RequestTimeout`
(``maybe_processed=True``: the engine had the request). Closing the stream before its end closes the connection,
which is how a server learns its client left (vLLM, SGLang and Dynamo abort the request then).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from backends_core.errors import NetworkError, RequestTimeout, ResponseParseError, ServerStatusError
from backends_core.jsonio import loads

__all__ = ["DONE", "ResponseStream"]

#: The payload OpenAI-style servers send as their last event.
DONE = b"[DONE]"


class ResponseStream:
    """A 2xx answer whose body is read as it arrives.

    :ivar method: the request's method.
    :ivar url: the request's URL.
    """

    def __init__(
        self,
        response: httpx.Response,
        *,
        method: str,
        url: str,
        map_transport: Callable[[httpx.TransportError, str, str], RequestTimeout | NetworkError],
        redact: Callable[[Any], Any],
    ) -> None:
        self._response = response
        self.method = method
        self.url = url
        self._map_transport = map_transport
        self._redact = redact
        self.closed = False

    @property
    def headers(self) -> httpx.Headers:
        return self._response.headers

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes in the pieces they arrived in."""
        response = self._response
        # without a content coding the transport's pieces are the body's: read them without httpx's decoding
        # and re-chunking layers (one async generator per layer and piece)
        if "content-encoding" in response.headers or not isinstance(response.stream, httpx.AsyncByteStream):
            pieces = response.aiter_bytes()
        else:
            pieces = response.stream.__aiter__()
        try:
            async for chunk in pieces:
                yield chunk
        except httpx.TransportError as exc:
            raise self._map_transport(exc, self.method, self.url) from exc
        except httpx.StreamError as exc:
            raise NetworkError(
                f"{type(exc).__name__}: {exc}", method=self.method, url=self.url, maybe_processed=True
            ) from exc

    async def events(self) -> AsyncIterator[bytes]:
        """The ``data`` of each Server-Sent Event, in order (multi-line data joined with ``\\n``; comments,
        ``event:``, ``id:`` and ``retry:`` lines skipped). A body that ends cleanly inside an event is not an event
        stream: :class:`ResponseParseError`."""
        reader = _EventReader(self.url)
        async for chunk in self.chunks():
            for data in reader.feed(chunk):
                yield data
        reader.end()

    async def json_events(self) -> AsyncIterator[Any]:
        """Each event's data decoded as JSON, up to (not including) a ``[DONE]`` event."""
        reader = _EventReader(self.url)
        async for chunk in self.chunks():
            for data in reader.feed(chunk):
                if data.strip() == DONE:
                    return
                try:
                    value = loads(data)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    raise ResponseParseError(
                        f"stream event is not JSON: {data[:200].decode('utf-8', 'replace')!r}", url=self.url
                    ) from exc
                yield value
        reader.end()

    def error(self, body: Any, *, status_code: int = 500, hint: str | None = None) -> ServerStatusError:
        """The error for a failure the server reported inside a started stream (its status line said 200):
        ``status_code`` is the status the server gave the failure in its event, if any."""
        return ServerStatusError(
            method=self.method, url=self.url, status_code=status_code, body=self._redact(body), hint=hint
        )

    async def aclose(self) -> None:
        """Stop reading; before the end of the body this closes the connection."""
        if not self.closed:
            self.closed = True
            await self._response.aclose()


class _EventReader:
    """The Server-Sent Events of a body fed piece by piece: :meth:`feed` returns the ``data`` of each event the
    piece completed.

    Two ways through a piece, with the same events: the usual stream (``\\n`` line ends, one ``data: …`` line
    per event) is split at the blank lines with bytes methods, one pass per piece; anything else (``\\r\\n``
    line ends, several data lines, comments, other fields, a ``data`` line started in an earlier piece) goes line
    by line.
    """

    __slots__ = ("data", "pending", "url")

    def __init__(self, url: str) -> None:
        self.url = url
        #: bytes received after the last complete event (by lines: after the last line end)
        self.pending = b""
        #: by lines: the data lines of the event under way
        self.data: list[bytes] = []

    def feed(self, chunk: bytes) -> list[bytes]:
        pending = self.pending + chunk if self.pending else chunk
        events: list[bytes] = []
        if self.data or b"\r" in pending:
            self.pending = self._lines(pending, events)
            return events
        blocks = pending.split(b"\n\n")
        self.pending = blocks.pop()
        for block in blocks:
            if block.startswith(b"data: ") and b"\n" not in block:
                events.append(block[6:])
            elif block:
                self._lines(block + b"\n\n", events)
        return events

    def _lines(self, pending: bytes, events: list[bytes]) -> bytes:
        """Read ``pending``'s complete lines into ``self.data`` and ``events``; the incomplete last line back."""
        lines = pending.split(b"\n")
        rest = lines.pop()
        data = self.data
        for raw in lines:
            line = raw.rstrip(b"\r")
            if not line:
                if data:
                    events.append(b"\n".join(data))
                    data.clear()
                continue
            if line.startswith(b"data:"):
                value = line[5:]
                data.append(value[1:] if value.startswith(b" ") else value)
        return rest

    def end(self) -> None:
        """The body ended: refuse it when it ended inside an event (a cut connection fails in the transport, so
        this body is not an event stream)."""
        events: list[bytes] = []
        pending = self._lines(self.pending, events) if not self.data else self.pending
        self.pending = b""
        data = self.data
        if data or pending.strip():
            snippet = (b"\n".join(data) or pending)[:200].decode("utf-8", "replace")
            raise ResponseParseError(
                f"the body ended inside an event (not an event stream?): {snippet!r}", url=self.url
            )
