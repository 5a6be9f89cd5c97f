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
        try:
            async for chunk in self._response.aiter_bytes():
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
        pending = b""
        data: list[bytes] = []
        async for chunk in self.chunks():
            pending += chunk
            while True:
                cut = pending.find(b"\n")
                if cut < 0:
                    break
                line, pending = pending[:cut].rstrip(b"\r"), pending[cut + 1 :]
                if not line:
                    if data:
                        yield b"\n".join(data)
                        data = []
                    continue
                if line.startswith(b"data:"):
                    value = line[5:]
                    data.append(value[1:] if value.startswith(b" ") else value)
        if data or pending.strip():  # a cut connection fails in the transport: this body is not an event stream
            snippet = (b"\n".join(data) or pending)[:200].decode("utf-8", "replace")
            raise ResponseParseError(
                f"the body ended inside an event (not an event stream?): {snippet!r}", url=self.url
            )

    async def json_events(self) -> AsyncIterator[Any]:
        """Each event's data decoded as JSON, up to (not including) a ``[DONE]`` event."""
        async for data in self.events():
            if data.strip() == DONE:
                return
            try:
                yield loads(data)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ResponseParseError(
                    f"stream event is not JSON: {data[:200].decode('utf-8', 'replace')!r}", url=self.url
                ) from exc

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
