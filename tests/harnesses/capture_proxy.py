"""The recording reverse proxy every harness test puts in front of the gateway (its own thread and event loop): the
harness gets the proxy's URL, so nothing in the harness or the gateway is patched to see the wire.

* :class:`CaptureProxy` forwards every request to the gateway, streams passing through chunk by chunk, and keeps
  each request and the gateway's answer (a stream as its raw SSE text) as an :class:`Exchange`, optionally appended
  to a JSON-lines log as it ends.
* :class:`Exchange` reads an answer on whichever wire (Anthropic Messages, OpenAI Responses, chat completions),
  whole or streamed: its text, its tool-call ids, the error it carried, whether the harness got it whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import attrs
from aiohttp import web

__all__ = ["GENERATION_PATHS", "CaptureProxy", "Exchange"]

GENERATION_PATHS = ("/v1/messages", "/v1/chat/completions", "/v1/responses")
"""The routes that answer a turn (``count_tokens`` and model lists are not turns)."""

_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "accept-encoding", "upgrade"}
"""Request headers not forwarded."""
_HOP_BACK = {"content-length", "transfer-encoding", "connection", "keep-alive", "upgrade"}
"""Response headers not passed back (the body is passed on as it came, so its ``content-encoding`` stays)."""


@attrs.define
class Exchange:
    """One request through :class:`CaptureProxy` and the gateway's answer. Header names are lower case."""

    method: str
    path: str
    headers: dict[str, str]
    raw: bytes
    """The request body as the harness sent it."""
    started: float
    status: int = 0
    response_headers: dict[str, str] = attrs.field(factory=dict)
    response: str = ""
    """The answer's text (a stream's raw SSE), as far as the gateway sent it."""
    finished: float | None = None
    #: the harness hung up before the answer's end was written to it (Codex does once it has read the last event)
    client_closed: bool = False
    #: ... while part of the answer was still to be written to it (it did not get the answer whole)
    cut_short: bool = False
    #: the proxy's own failure to get the gateway's answer
    error: str | None = None

    @property
    def body(self) -> Any:
        """The request body: its JSON, else its text (``None`` when empty)."""
        if not self.raw:
            return None
        try:
            return json.loads(self.raw)
        except ValueError:
            return self.raw.decode("utf-8", "replace")

    @property
    def generation(self) -> bool:
        """A request for a model turn."""
        return self.method == "POST" and self.path.split("?")[0].endswith(GENERATION_PATHS)

    @property
    def streamed(self) -> bool:
        return "text/event-stream" in self.response_headers.get("content-type", "")

    @property
    def session(self) -> str | None:
        return self.response_headers.get("x-session-id")

    @property
    def turn(self) -> int | None:
        value = self.response_headers.get("x-turn")
        return int(value) if value is not None and value.isdigit() else None

    def sse_events(self) -> list[tuple[str | None, Any]]:
        """A stream's events as ``(event name, parsed data)``."""
        out: list[tuple[str | None, Any]] = []
        for block in self.response.replace("\r\n", "\n").split("\n\n"):
            name: str | None = None
            data: list[str] = []
            for line in block.split("\n"):
                if line.startswith("event:"):
                    name = line[6:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].lstrip())
            if not data:
                continue
            raw = "\n".join(data)
            try:
                out.append((name, json.loads(raw)))
            except ValueError:
                out.append((name, raw))
        return out

    def events(self) -> Iterator[tuple[str | None, dict[str, Any]]]:
        """The JSON objects of an answer: a stream's events, else the whole body."""
        if self.streamed:
            for name, data in self.sse_events():
                if isinstance(data, dict):
                    yield name, data
            return
        with contextlib.suppress(ValueError):
            body = json.loads(self.response)
            if isinstance(body, dict):
                yield None, body

    def answer_error(self) -> str | None:
        """The error an answer carried in its body (a stream's ``error`` or ``response.failed`` event), or ``None``."""
        for name, event in self.events():
            if name in ("error", "response.failed") or event.get("type") in ("error", "response.failed"):
                return f"event {name or event.get('type')}: {json.dumps(event)[:600]}"
            if event.get("error"):
                return f"error: {json.dumps(event)[:600]}"
        return None

    def failure(self) -> str | None:
        """Why the harness did not get a whole answer (the proxy's error, an error status, an error in the answer, a
        connection dropped mid-answer), or ``None``."""
        if self.error:
            return f"upstream: {self.error}"
        if self.status != 200:
            return f"HTTP {self.status}: {self.response[:600]}"
        error = self.answer_error()
        if error is not None:
            return error
        if self.cut_short:
            return "the harness closed the connection before the end of the answer"
        return None

    def received(self) -> bool:
        """The harness got this answer whole (an HTTP 200 without an error in it)."""
        return self.failure() is None

    def answer_text(self) -> str:
        """The text an answer gave the harness (Anthropic ``text`` blocks or their deltas, Responses ``output_text``
        parts of its whole body or of ``response.completed``, chat ``content`` or its deltas)."""
        text: list[str] = []
        for _name, event in self.events():
            if event.get("type") == "content_block_delta":  # anthropic stream
                delta = event.get("delta") or {}
                if delta.get("type") == "text_delta":
                    text.append(str(delta.get("text") or ""))
            if event.get("type") == "message":  # anthropic whole message
                text += [str(b.get("text") or "") for b in event.get("content") or [] if b.get("type") == "text"]
            response = event.get("response") if event.get("type") == "response.completed" else event
            if isinstance(response, dict) and response.get("object") == "response":  # responses, whole or completed
                for item in response.get("output") or []:
                    if isinstance(item, dict) and item.get("type") == "message":
                        parts = item.get("content") or []
                        text += [str(p.get("text") or "") for p in parts if p.get("type") == "output_text"]
            for choice in event.get("choices") or []:  # chat, streamed (delta) or not (message)
                part = choice.get("delta") or choice.get("message") or {}
                text.append(str(part.get("content") or ""))
        return "".join(text)

    def call_ids(self) -> list[str]:
        """The ids of the tool calls an answer gave the harness (Anthropic ``tool_use`` blocks, Responses
        ``function_call`` items, chat ``tool_calls``), streamed or not, each once."""
        ids: list[str] = []

        def add(value: Any) -> None:
            if isinstance(value, str) and value and value not in ids:
                ids.append(value)

        for _name, event in self.events():
            block = event.get("content_block")  # anthropic stream
            if isinstance(block, dict) and block.get("type") == "tool_use":
                add(block.get("id"))
            for block in event.get("content") or []:  # anthropic whole message
                if isinstance(block, dict) and block.get("type") == "tool_use":
                    add(block.get("id"))
            item = event.get("item")  # responses stream
            if isinstance(item, dict) and item.get("type") == "function_call":
                add(item.get("call_id"))
            for item in event.get("output") or (event.get("response") or {}).get("output") or []:
                if isinstance(item, dict) and item.get("type") == "function_call":
                    add(item.get("call_id"))
            for choice in event.get("choices") or []:  # chat, streamed (delta) or not (message)
                part = choice.get("delta") or choice.get("message") or {}
                for call in part.get("tool_calls") or []:
                    add(call.get("id"))
        return ids

    def answer(self) -> tuple[str, list[str]]:
        """The reply this exchange carried to the harness: its text and its tool-call ids."""
        return self.answer_text(), self.call_ids()

    def short(self) -> str:
        answer = self.response if self.status >= 400 or self.error else ""
        closed = " (the harness hung up before the end)" if self.client_closed else ""
        return f"{self.method} {self.path} -> {self.status}{closed} {self.error or ''}{answer[:600]}"

    def as_json(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "path": self.path,
            "headers": self.headers,
            "body": self.body,
            "status": self.status,
            "response_headers": self.response_headers,
            "response": self.response,
            "seconds": None if self.finished is None else round(self.finished - self.started, 3),
            "client_closed": self.client_closed,
            "error": self.error,
            "failure": self.failure(),
        }


_CLOSED = (ConnectionError, aiohttp.ClientConnectionResetError)


class CaptureProxy:
    """``with CaptureProxy(gw.url, log=path) as proxy``: a reverse proxy at :attr:`url` forwarding everything to
    ``upstream`` (the gateway's base URL) and keeping each :class:`Exchange` in :attr:`exchanges` (in the order the
    requests arrived); each is appended to ``log`` as a JSON line as it ends.

    ``rewrite(path, body)``, for probing only (never in a test): the JSON body forwarded instead of the one received
    (which is what the exchange records), to see past a refusal what a harness sends later."""

    def __init__(
        self,
        upstream: str,
        *,
        log: Path | None = None,
        rewrite: Callable[[str, dict[str, Any]], Any] | None = None,
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self.log = log
        self.rewrite = rewrite
        self.exchanges: list[Exchange] = []
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._failed: list[BaseException] = []
        self._session: aiohttp.ClientSession | None = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        exchange = Exchange(
            method=request.method,
            path=request.path_qs,
            headers={k.lower(): v for k, v in request.headers.items()},
            raw=raw,
            started=time.time(),
        )
        self.exchanges.append(exchange)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        body = exchange.body
        if self.rewrite is not None and isinstance(body, dict):
            raw = json.dumps(self.rewrite(request.path, body)).encode()
        assert self._session is not None
        chunks: list[bytes] = []
        reply: web.StreamResponse | None = None
        try:
            async with self._session.request(
                request.method, self.upstream + request.path_qs, headers=headers, data=raw
            ) as upstream:
                exchange.status = upstream.status
                exchange.response_headers = {k.lower(): v for k, v in upstream.headers.items()}
                reply = web.StreamResponse(
                    status=upstream.status,
                    headers={k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_BACK},
                )
                await reply.prepare(request)
                async for chunk in upstream.content.iter_any():
                    chunks.append(chunk)
                    try:
                        await reply.write(chunk)
                    except _CLOSED:
                        # the harness hung up, so do we: the gateway sees what it would have seen without the proxy
                        exchange.client_closed = exchange.cut_short = True
                        break
                if not exchange.client_closed:
                    try:
                        await reply.write_eof()
                    except _CLOSED:
                        exchange.client_closed = True
                return reply
        except asyncio.CancelledError:
            exchange.client_closed = exchange.cut_short = True
            raise
        except Exception as exc:
            exchange.error = f"{type(exc).__name__}: {exc}"
            if reply is None and isinstance(exc, aiohttp.ClientError):
                return web.Response(status=502, text=exchange.error)
            raise
        finally:
            exchange.response = b"".join(chunks).decode("utf-8", "replace")
            exchange.finished = time.time()
            if self.log is not None:
                with self.log.open("a", encoding="utf-8") as out:
                    out.write(json.dumps(exchange.as_json(), default=str) + "\n")

    async def _main(self, ready: threading.Event) -> None:
        self._stop = asyncio.Event()
        timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
        async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False) as session:
            self._session = session
            app = web.Application(client_max_size=256 * 1024 * 1024)
            app.router.add_route("*", "/{tail:.*}", self._handle)
            runner = web.AppRunner(app, access_log=None, handle_signals=False)
            await runner.setup()
            try:
                site = web.TCPSite(runner, "127.0.0.1", 0)
                await site.start()
                server = site._server
                assert server is not None
                port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
                self.url = f"http://127.0.0.1:{port}"
                ready.set()
                await self._stop.wait()
            finally:
                await runner.cleanup()

    def __enter__(self) -> CaptureProxy:
        ready = threading.Event()

        def run() -> None:
            try:
                self._loop.run_until_complete(self._main(ready))
            except BaseException as exc:
                self._failed.append(exc)
            finally:
                ready.set()

        self._thread = threading.Thread(target=run, name="capture-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(60) or not self.url:
            raise RuntimeError(f"the capture proxy did not start: {self._failed}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(60)
        self._loop.close()

    def turns(self) -> list[Exchange]:
        """The exchanges that asked for a model turn."""
        return [e for e in self.exchanges if e.generation]

    def sessions(self) -> list[str]:
        """The sessions the gateway named in its answers, in order of first appearance."""
        out: list[str] = []
        for e in self.exchanges:
            if e.session and e.session not in out:
                out.append(e.session)
        return out

    def summary(self) -> str:
        """One line an exchange."""
        return "\n".join(e.short() for e in self.exchanges)

    def failures(self) -> list[str]:
        """Each exchange the harness did not get whole, and why."""
        return [f"#{i} {e.method} {e.path}: {e.failure()}" for i, e in enumerate(self.exchanges) if e.failure()]
