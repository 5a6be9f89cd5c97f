"""Fault injection between a client and a (real or emulated) server.

:class:`FaultyTransport` wraps an emulator's handler (or any async handler) and, per request, applies the
:class:`Fault` a plan picks: transport failures before or after the request reaches the server, slow or
truncated bodies, error statuses, or a mutation of the server's real JSON answer (wrong ids, dropped
logprobs, corrupted routed experts...). It records which requests reached the server, so tests can prove
nothing that may have reached the engine was sent twice.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any, Literal

import attrs
import httpx

from backends_testkit.fakes import Handler

__all__ = ["Fault", "FaultyTransport", "FaultKind"]

FaultKind = Literal[
    "refuse",  # connection refused: never reached the server
    "reset_before_send",  # connection dropped while writing the request: never reached the server
    "reset_after_send",  # the server got the request, the connection died before the answer
    "read_timeout",  # the server got the request and never answered in time
    "slow_drip",  # the answer trickles in slower than the read timeout allows
    "status",  # an error status with an optional body (5xx, 4xx in the engine's error shape)
    "truncated_json",  # the server's real answer, cut in half
    "mutate",  # the server's real JSON answer, changed by ``mutate``
]


@attrs.frozen(kw_only=True)
class Fault:
    kind: FaultKind
    status: int = 500
    body: Any = None
    mutate: Callable[[Any], Any] | None = None


class FaultyTransport(httpx.AsyncBaseTransport):
    """An httpx transport that serves ``handler`` but injects the faults ``plan`` chooses.

    :param handler: the real or emulated server.
    :param plan: called with each request and its sequence number; returns a :class:`Fault` or ``None``.
    """

    def __init__(self, handler: Handler, plan: Callable[[httpx.Request, int], Fault | None]) -> None:
        self.handler = handler
        self.plan = plan
        self.count = 0
        #: Requests that reached the server (the handler saw them), in order.
        self.reached: list[httpx.Request] = []

    async def _serve(self, request: httpx.Request) -> httpx.Response:
        self.reached.append(request)
        return await self.handler(request)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.count += 1
        await request.aread()
        fault = self.plan(request, self.count)
        if fault is None:
            return await self._serve(request)
        if fault.kind == "refuse":
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        if fault.kind == "reset_before_send":
            raise httpx.WriteError("[Errno 104] Connection reset by peer", request=request)
        if fault.kind == "status":
            self.reached.append(request)
            if fault.body is None:
                return httpx.Response(fault.status, content=b"", request=request)
            return httpx.Response(fault.status, json=fault.body, request=request)
        response = await self._serve(request)
        if fault.kind == "reset_after_send":
            raise httpx.ReadError("[Errno 104] Connection reset by peer", request=request)
        if fault.kind in ("read_timeout", "slow_drip"):
            await asyncio.sleep(0)
            raise httpx.ReadTimeout("timed out reading the response", request=request)
        content = await response.aread()
        if fault.kind == "truncated_json":
            return httpx.Response(
                response.status_code,
                content=content[: len(content) // 2],
                request=request,
                headers={"content-type": "application/json"},
            )
        assert fault.kind == "mutate" and fault.mutate is not None
        mutated = fault.mutate(json.loads(content))
        return httpx.Response(
            response.status_code,
            content=json.dumps(mutated).encode(),
            request=request,
            headers={"content-type": "application/json"},
        )
