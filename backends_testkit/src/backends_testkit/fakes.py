"""Scriptable fake servers for tests: route ``(method, path)`` to canned answers and record every request."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import httpx

__all__ = ["FakeServer", "Handler", "RecordedRequest", "fault_transport"]

#: An async request handler, the shape every emulator exposes.
Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]


@attrs.frozen
class RecordedRequest:
    method: str
    path: str
    params: dict[str, str]
    json: Any


@attrs.define
class _Route:
    status: int
    body: Any
    raises: BaseException | None
    call: Callable[[httpx.Request], httpx.Response] | None


class FakeServer:
    """Canned HTTP answers by ``(method, path)``; unmatched requests get 404.

    ``add("POST", "/generate", json={...})`` answers with JSON; ``status=`` sets the status; ``content=``
    answers raw bytes; ``raises=httpx.ReadTimeout("...")`` simulates a transport failure; ``call=`` computes
    the answer. ``requests`` records what was sent, in order.
    """

    def __init__(self) -> None:
        self.routes: dict[tuple[str, str], _Route] = {}
        self.requests: list[RecordedRequest] = []

    def add(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        status: int = 200,
        content: bytes | None = None,
        raises: BaseException | None = None,
        call: Callable[[httpx.Request], httpx.Response] | None = None,
    ) -> FakeServer:
        body: Any = content if content is not None else json
        self.routes[(method.upper(), path)] = _Route(status=status, body=body, raises=raises, call=call)
        return self

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.requests.append(
            RecordedRequest(method=request.method, path=request.url.path, params=dict(request.url.params), json=body)
        )
        route = self.routes.get((request.method, request.url.path))
        if route is None:
            return httpx.Response(404, json={"detail": "Not Found"})
        if route.raises is not None:
            raise route.raises
        if route.call is not None:
            return route.call(request)
        if isinstance(route.body, bytes):
            return httpx.Response(route.status, content=route.body)
        return httpx.Response(route.status, json=route.body)

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)


def fault_transport(kind: str) -> httpx.MockTransport:
    """A transport that fails every request the same way, whatever the route.

    :param kind: ``"malformed"`` (200 with a JSON body of the wrong shape), ``"not_json"`` (200 with a
        non-JSON body), ``"status_500"`` (500 with a JSON error body), ``"timeout"`` (read timeout),
        ``"refused"`` (connection refused).
    """

    def handle(request: httpx.Request) -> httpx.Response:
        if kind == "malformed":
            return httpx.Response(200, json={"unexpected": [1, 2, 3]})
        if kind == "not_json":
            return httpx.Response(200, content=b"<html>surprise</html>")
        if kind == "status_500":
            return httpx.Response(500, json={"error": {"message": "engine exploded", "code": 500}})
        if kind == "timeout":
            raise httpx.ReadTimeout("read timed out", request=request)
        if kind == "refused":
            raise httpx.ConnectError("connection refused", request=request)
        raise ValueError(f"unknown fault kind {kind!r}")

    return httpx.MockTransport(handle)
