"""The one base every emulator is written on: an inference server's HTTP dialect over the reference engine.

An emulator is ``async def handle(request: httpx.Request) -> httpx.Response``; :class:`EmulatorBase` supplies that
function, and a subclass supplies what is particular to its server:

* :meth:`EmulatorBase.routes`: ``path -> Route`` (the methods it accepts, its auth level, its handler);
* the answers for what has no route: :meth:`~EmulatorBase.not_found`, :meth:`~EmulatorBase.method_not_allowed`,
  :meth:`~EmulatorBase.unauthorized` (FastAPI's and a bearer-key middleware's forms by default);
* :meth:`~EmulatorBase.error_response`: the answer for an exception a handler raised that is not an
  :class:`HttpError` (a validation failure in the server's own form, an engine refusal);
* :meth:`~EmulatorBase.find_route` when routing depends on more than the path (a host, a path parameter).

The base keeps the request log (:attr:`EmulatorBase.requests`), checks bearer keys per route level, and serves
the handler in-process (:meth:`~EmulatorBase.transport`), under an ASGI server (:meth:`~EmulatorBase.asgi`) or on a
real port (:meth:`~EmulatorBase.serve`). :meth:`~EmulatorBase.aclose` stops the engine.

A minimal emulator::

    class AcmeEmulator(EmulatorBase):
        def routes(self) -> dict[str, Route]:
            return {"/health": Route(self._health, methods=GET, level="open")}

        async def _health(self, request: httpx.Request) -> httpx.Response:
            return json_reply(200, {"ok": True})
"""

from __future__ import annotations

import contextlib
import functools
import json
import ssl as _ssl
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Literal

import attrs
import httpx

from backends_testkit.asgi import asgi_app
from backends_testkit.engine import ReferenceEngine
from backends_testkit.http_server import serve as serve_on_port

__all__ = [
    "ANY_METHOD",
    "GET",
    "GET_POST",
    "POST",
    "EmulatorBase",
    "Handler",
    "HttpError",
    "Level",
    "Route",
    "StreamedBody",
    "empty",
    "json_reply",
    "sse_reply",
    "text_reply",
]

Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]
#: Who may call a route: anyone (``open``), holders of the API key (``normal``), holders of the admin key when
#: one is set, else of the API key (``admin``).
Level = Literal["open", "normal", "admin"]

GET = frozenset({"GET"})
POST = frozenset({"POST"})
GET_POST = frozenset({"GET", "POST"})
ANY_METHOD = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


@attrs.frozen
class Route:
    """One path of the emulated server.

    :ivar handler: answers a request that passed the method and auth checks.
    :ivar methods: the HTTP methods the path accepts (others get :meth:`EmulatorBase.method_not_allowed`).
    :ivar level: the auth level (see :data:`Level`).
    """

    handler: Handler
    methods: frozenset[str] = POST
    level: Level = "normal"


class HttpError(Exception):
    """Raised inside a handler: :attr:`response` is the answer."""

    def __init__(self, response: httpx.Response, reason: str | None = None) -> None:
        super().__init__(reason or f"HTTP {response.status_code}")
        self.response = response


def json_reply(status: int, body: Any, *, content_type: str = "application/json") -> httpx.Response:
    """A JSON answer (``null`` included), serialised as Python's ``json`` does."""
    return httpx.Response(status, content=json.dumps(body).encode(), headers={"content-type": content_type})


def text_reply(status: int, text: str, *, content_type: str | None = None) -> httpx.Response:
    """A text answer; without ``content_type`` it carries none (as a bare ``Response(content=...)``)."""
    headers = {"content-type": content_type} if content_type else None
    return httpx.Response(status, content=text.encode(), headers=headers)


class StreamedBody(httpx.AsyncByteStream):
    """A body sent as it is produced (served with chunked transfer on a port). Closing it before its end (the client
    left) closes the generators producing it, whose ``finally`` aborts the engine request.

    :param chunks: the body's pieces.
    :param sources: generators ``chunks`` reads from, closed with it.
    """

    def __init__(self, chunks: AsyncGenerator[bytes, None], *sources: AsyncGenerator[Any, None]) -> None:
        self._chunks = chunks
        self._sources = sources

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._chunks:
            yield chunk

    async def aclose(self) -> None:
        await self._chunks.aclose()
        for source in self._sources:
            await source.aclose()


def sse_reply(
    events: AsyncGenerator[Any, None],
    *,
    done: bool = True,
    content_type: str = "text/event-stream; charset=utf-8",
    dumps: Callable[[Any], str] = json.dumps,
) -> httpx.Response:
    """A 200 answer streaming ``events`` as Server-Sent Events (``data: <json>``; a ``str`` event is sent as
    is), then ``data: [DONE]`` when ``done``."""

    async def body() -> AsyncGenerator[bytes, None]:
        async for event in events:
            data = event if isinstance(event, str) else dumps(event)
            yield f"data: {data}\n\n".encode()
        if done:
            yield b"data: [DONE]\n\n"

    return httpx.Response(200, headers={"content-type": content_type}, stream=StreamedBody(body(), events))


def empty(status: int = 200) -> httpx.Response:
    """An answer without a body."""
    return httpx.Response(status)


class EmulatorBase:
    """An inference server's HTTP dialect over one engine.

    :param engine: the engine to serve.
    :param api_key: the server's API key (bearer); ``None``: no key needed.
    :param admin_api_key: the key of ``admin`` routes, when the server has a separate one (the API key is then
        refused there).
    :param log_size: how many requests :attr:`requests` keeps (the oldest are dropped).
    """

    def __init__(
        self,
        engine: ReferenceEngine,
        *,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        log_size: int = 1000,
    ) -> None:
        self.engine = engine
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        #: ``(method, path)`` of every request received (see :meth:`log_entry`), newest last.
        self.requests: deque[tuple[str, str]] = deque(maxlen=log_size)

    # -- what a subclass provides -----------------------------------------------------------------------

    def routes(self) -> Mapping[str, Route]:
        """``path -> Route``; called once, at the first request (after the subclass's ``__init__``)."""
        raise NotImplementedError(f"{type(self).__name__} must define routes()")

    def find_route(self, request: httpx.Request) -> Route | None:
        """The route of ``request`` (by path; override for host- or parameter-dependent routing)."""
        return self.route_table.get(request.url.path)

    def log_entry(self, request: httpx.Request) -> tuple[str, str]:
        """What :attr:`requests` records of a request."""
        return request.method, request.url.path

    def not_found(self, request: httpx.Request) -> httpx.Response:
        return json_reply(404, {"detail": "Not Found"})

    def method_not_allowed(self, request: httpx.Request) -> httpx.Response:
        return json_reply(405, {"detail": "Method Not Allowed"})

    def unauthorized(self, request: httpx.Request) -> httpx.Response:
        return json_reply(401, {"error": "Unauthorized"})

    def error_response(self, exc: Exception) -> httpx.Response | None:
        """The answer for an exception a handler raised (``None``: let it propagate)."""
        return None

    # -- serving ----------------------------------------------------------------------------------------

    @functools.cached_property
    def route_table(self) -> Mapping[str, Route]:
        return self.routes()

    def authorized(self, request: httpx.Request, level: Level) -> bool:
        """Whether the request's bearer key opens a route of ``level``."""
        if level == "open":
            return True
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        token = token if scheme.lower() == "bearer" else ""
        if level == "admin" and self.admin_api_key is not None:
            return token == self.admin_api_key
        return self.api_key is None or token == self.api_key

    async def handle(self, request: httpx.Request) -> httpx.Response:
        """Answer one request as the emulated server would."""
        self.requests.append(self.log_entry(request))
        route = self.find_route(request)
        if not self.authorized(request, route.level if route is not None else "normal"):
            return self.unauthorized(request)
        if route is None:
            return self.not_found(request)
        if request.method not in route.methods:
            return self.method_not_allowed(request)
        try:
            return await route.handler(request)
        except HttpError as exc:
            return exc.response
        except Exception as exc:
            response = self.error_response(exc)
            if response is None:
                raise
            return response

    def transport(self) -> httpx.MockTransport:
        """An httpx transport that answers in-process."""
        return httpx.MockTransport(self.handle)

    def asgi(self) -> Callable[..., Awaitable[None]]:
        """This emulator as an ASGI 3 application."""
        return asgi_app(self.handle)

    @contextlib.asynccontextmanager
    async def serve(
        self, *, host: str = "127.0.0.1", port: int = 0, ssl: _ssl.SSLContext | None = None
    ) -> AsyncIterator[str]:
        """Serve on a real port until the block exits; yields the base URL (``port=0`` picks a free one)."""
        async with serve_on_port(self.handle, host=host, port=port, ssl=ssl) as url:
            yield url

    async def aclose(self) -> None:
        """Stop the engine (a subclass releases its own resources, then calls this)."""
        await self.engine.aclose()
