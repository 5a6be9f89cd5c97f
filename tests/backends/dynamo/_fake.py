"""A scripted Dynamo deployment for client tests: canned answers (captured bodies) by host, method and path,
answered in order when several are queued, with every request recorded."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable
from typing import Any

import attrs
import httpx

FRONTEND = "http://dynamo.test:8000"
WORKERS = ("http://w1.test:8081", "http://w2.test:8081")
_TEXT = "text/plain; charset=utf-8"


@attrs.frozen
class Sent:
    host: str
    method: str
    path: str
    headers: dict[str, str]
    body: Any


@attrs.frozen
class Canned:
    status: int
    content: bytes
    content_type: str

    def __call__(self, request: httpx.Request) -> httpx.Response:
        return httpx.Response(self.status, content=self.content, headers={"content-type": self.content_type})


Answer = Callable[[httpx.Request], httpx.Response]


class Deployment:
    """``add(url, method, path, ...)`` queues answers; the last one of a route repeats. Unscripted routes 404 in
    the frontend's shape on the frontend and in the worker's shape on workers."""

    def __init__(self) -> None:
        self.routes: dict[tuple[str, str, str], deque[Answer]] = {}
        self.sent: list[Sent] = []

    def add(
        self, url: str, method: str, path: str, *, json_body: Any = None, status: int = 200, text: str | None = None
    ) -> Deployment:
        content = text.encode() if text is not None else json.dumps(json_body).encode()
        kind = _TEXT if url in WORKERS or text is not None else "application/json"
        self.routes.setdefault((httpx.URL(url).host, method, path), deque()).append(Canned(status, content, kind))
        return self

    def call(self, url: str, method: str, path: str, answer: Callable[[httpx.Request], httpx.Response]) -> None:
        self.routes.setdefault((httpx.URL(url).host, method, path), deque()).append(answer)

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        host = request.url.host
        self.sent.append(Sent(host, request.method, request.url.path, dict(request.headers), body))
        queue = self.routes.get((host, request.method, request.url.path))
        if not queue:
            if host == httpx.URL(FRONTEND).host:
                message = f"Route not found: {request.method} {request.url.path}"
                return httpx.Response(404, json={"message": message, "type": "Not Found", "code": 404})
            message = f"Route {request.url.path} not found"
            return httpx.Response(404, json={"error": "Route not found", "message": message})
        answer = queue.popleft() if len(queue) > 1 else queue[0]
        return answer(request)

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def to(self, url: str, path: str | None = None) -> list[Sent]:
        """What was sent to ``url`` (and ``path``)."""
        host = httpx.URL(url).host
        return [s for s in self.sent if s.host == host and (path is None or s.path == path)]
