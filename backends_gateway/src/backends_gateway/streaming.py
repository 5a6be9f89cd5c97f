"""One way a turn's answer reaches its harness, for every wire: the event stream of a streamed turn (each API
gives only the encoding of its events, :class:`WireStream`) and the body of a whole one, each written by the
gateway itself so that an answer that could not be written is known: its turn is kept out of the training view
(:meth:`~backends_gateway.Gateway.undelivered`) and a retry of the request is answered with it.

Once a stream is prepared (its 200 and headers sent), every failure is an event of that wire's own error form,
then the stream's end: never a second status line inside the body.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Protocol

from aiohttp import web

from backends_gateway.errors import GatewayError
from backends_gateway.gateway import Gateway, Served, Started, TextDelta
from backends_gateway.routing import turn_headers

__all__ = ["WireStream", "deliver", "stream_turn"]

log = logging.getLogger("backends_gateway")

#: what a write to a client that went away raises (aiohttp's ClientConnectionResetError is one)
_GONE = ConnectionError


class WireStream(Protocol):
    """How one API encodes a streamed turn's events."""

    def start(self) -> bytes:
        """What opens the stream, before any text."""

    def text(self, kind: str, text: str) -> bytes:
        """A piece of the reply (``kind``: ``"reasoning"`` or ``"content"``)."""

    def finish(self, served: Served) -> bytes:
        """The rest of the answered (durable) turn, ending the stream."""

    def error(self, exc: GatewayError) -> bytes:
        """A failure after the stream started, ending the stream."""


async def stream_turn(
    request: web.Request,
    gateway: Gateway,
    events: AsyncGenerator[Started | TextDelta | Served, None],
    wire_for: Callable[[Started], WireStream],
) -> web.StreamResponse:
    """Answer a streamed turn: ``events`` (from :meth:`Gateway.stream_turn`) encoded by the wire ``wire_for``
    makes once the session is known. A refusal before the first event is raised (answered as the route's error);
    everything after is an event."""
    first = await anext(events)  # the session is placed (or the request refused) before anything is sent
    assert isinstance(first, Started)
    headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **turn_headers(request, first)}
    response = web.StreamResponse(headers=headers)
    served: Served | None = None
    ended = False
    try:
        await response.prepare(request)
        wire = wire_for(first)
        await response.write(wire.start())
        try:
            async for event in events:
                if isinstance(event, TextDelta):
                    await response.write(wire.text(event.kind, event.text))
                elif isinstance(event, Served):  # durable: the rest ends the stream
                    served = event
                    await response.write(wire.finish(event))
                    ended = True  # every event of the answer is written (a harness may hang up before the end)
        except (_GONE, asyncio.CancelledError):
            raise
        except GatewayError as exc:
            await response.write(wire.error(exc))
        except Exception as exc:  # a bug or a store failure: said as the wire's error event, logged in full
            log.exception("%s %s failed after its stream started", request.method, request.path)
            error = GatewayError(500, f"{type(exc).__name__}: {exc}", kind="server_error", code="internal")
            await response.write(wire.error(error))
        await response.write_eof()
    except _GONE:
        log.info("%s %s: the client went away during the stream", request.method, request.path)
    finally:
        with contextlib.suppress(Exception):
            await events.aclose()
        if served is not None and not ended:
            await asyncio.shield(gateway.undelivered(served))
    return response


async def deliver(request: web.Request, gateway: Gateway, served: Served, response: web.Response) -> web.Response:
    """Write a whole turn's answer now; one that could not be written is kept as never delivered."""
    ended = False
    try:
        await response.prepare(request)
        await response.write_eof()
        ended = True
    except _GONE:
        log.info("%s %s: the client went away before its answer was written", request.method, request.path)
    finally:
        if not ended:
            await asyncio.shield(gateway.undelivered(served))
    return response
