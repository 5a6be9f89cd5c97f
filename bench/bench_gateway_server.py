"""Server overhead of the gateway's candidate HTTP libraries, serving the same OpenAI-style handler.

    uv run python bench/bench_gateway_server.py [--rounds 4] [--n 8000] [--n-stream 1500] [--out gateway_server]

Every server runs in its own process pinned to core 1 and answers ``POST /v1/chat/completions`` with the same
handler logic: read the whole body (~2 KB, a chat of 3 messages), ``orjson.loads`` it, then

* ``"stream"`` absent: answer a ~1.5 KB ``chat.completion`` (id, object, created, model, ``choices[0].message``
  {role, content}, finish_reason, usage) built as a dict and written with ``orjson.dumps``;
* ``"stream": true``: answer ``text/event-stream``, 64 ``data: {chat.completion.chunk}\\n\\n`` events (one token
  of content delta each, each chunk ``orjson.dumps``-ed when sent) then ``data: [DONE]\\n\\n``, one write per event
  and one event per loop iteration (the generator awaits ``asyncio.sleep(0)`` after each, as events arriving one
  by one from an engine would be), chunked transfer encoding.

Servers (``--servers``):

* ``raw``: the floor, ``asyncio.start_server`` on uvloop reading the head up to the blank line and the body to its
  ``Content-Length``, writing pre-built answer bytes (no JSON work; the stream's 65 pre-built HTTP chunks one per
  loop iteration), HTTP/1.1 keep-alive; ``raw_asyncio`` (not in the default set): the same on asyncio's own loop;
* ``aiohttp``: ``aiohttp.web`` (``AppRunner`` + ``TCPSite``, ``access_log=None``) on asyncio's default loop;
  ``aiohttp_uvloop``: the same on uvloop;
* ``uvicorn``: ``starlette`` (``Route`` + ``Response`` / ``StreamingResponse``) served by ``uvicorn``
  (``loop="uvloop"``, ``http="httptools"`` when httptools is installed, else h11, ``log_level="warning"``,
  ``access_log=False``, ``lifespan="off"``, keep-alive timeout 75 s as aiohttp's).

The load generator (this process, pinned to core 0, on uvloop) is a bare ``aiohttp.ClientSession`` (keep-alive, no
connection limit) posting pre-built request bytes and reading each answer whole, ``--conc`` workers at once (1, 64,
256). A batch: a fresh session, an unmeasured warm-up of 2×concurrency requests, then ``--n`` requests
(``--n-stream`` streamed ones): the server process's CPU time (all its threads) before and after, ÷ requests =
server CPU µs per request, read two ways: the process's CPU clock (``clock_gettime`` on the clock id of
``clock_getcpuclockid(pid)``, exact to the ns; the figure reported) and ``psutil.Process(pid).cpu_times()`` user +
system (``/proc/PID/stat``, 10 ms ticks: ±10 ms per batch; the ``(psutil)`` column, a cross-check); wall time →
requests/s; each request's latency (post to the last byte read) → p50 / p99; the load generator's own CPU per
request beside it (if it nears the wall time per request, the client is the bottleneck of that batch's latency).
Each round starts every server afresh, then walks the cells (stream or not × concurrency) in a shuffled order and,
in each cell, the servers in an order rotated per round, so a library and the floor are measured seconds apart;
ratios to ``raw`` are taken per round and cell, then median [min-max].
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import _common as c
import orjson

SERVERS = ("raw", "raw_asyncio", "aiohttp", "aiohttp_uvloop", "uvicorn")
DEFAULT_SERVERS = ("raw", "aiohttp", "aiohttp_uvloop", "uvicorn")
MODES = ("plain", "stream")
ROUTE = "/v1/chat/completions"
STREAM_EVENTS = 64
BACKLOG = 4096
MODEL = "qwen3-8b"
_text = c._text  # seeded words


# -- the workload: request, answer and stream chunks (identical for every server) ------------------------------


def request_body(stream: bool) -> bytes:
    """~2 KB: a chat of 3 messages (system, an assistant greeting, the user's question) and sampling fields."""
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are a careful assistant. " + _text(60, 1)},
            {"role": "assistant", "content": "Hello! How can I help? " + _text(60, 2)},
            {"role": "user", "content": _text(200, 3)},
        ],
        "max_tokens": 256,
        "temperature": 1.0,
        "top_p": 1.0,
        "logprobs": False,
    }
    if stream:
        body["stream"] = True
    return orjson.dumps(body)


def completion(req: dict[str, Any]) -> dict[str, Any]:
    """The non-streamed answer (~1.5 KB once dumped), built per request as a gateway would from an engine result."""
    return {
        "id": "chatcmpl-6f1b2c3d4e5f60718293a4b5c6d7e8f9",
        "object": "chat.completion",
        "created": 1795304516,
        "model": req["model"],
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": _CONTENT},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 412, "completion_tokens": 256, "total_tokens": 668},
    }


_CONTENT = _text(215, 4)


def chunks(req: dict[str, Any]) -> list[dict[str, Any]]:
    """The 64 ``chat.completion.chunk`` objects of a streamed answer: one token of content each (the first also
    carries the role, the last the finish reason)."""
    out = []
    for i, word in enumerate(_CONTENT.split()[:STREAM_EVENTS]):
        delta: dict[str, Any] = {"role": "assistant", "content": word} if i == 0 else {"content": " " + word}
        last = i == STREAM_EVENTS - 1
        out.append(
            {
                "id": "chatcmpl-6f1b2c3d4e5f60718293a4b5c6d7e8f9",
                "object": "chat.completion.chunk",
                "created": 1795304516,
                "model": req["model"],
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": "stop" if last else None}],
            }
        )
    return out


_CHUNKS = chunks({"model": MODEL})
DONE = b"data: [DONE]\n\n"


def answer(body: bytes) -> tuple[dict[str, Any], bytes | None]:
    """The shared handler: parse the request; the JSON answer, or ``None`` when the request asks for a stream."""
    req = orjson.loads(body)
    if req.get("stream"):
        return req, None
    return req, orjson.dumps(completion(req))


async def events(req: dict[str, Any]) -> AsyncIterator[bytes]:
    """The shared stream: one ``data:`` event per loop iteration, then ``[DONE]``."""
    for chunk in _CHUNKS:
        yield b"data: " + orjson.dumps(chunk) + b"\n\n"
        await asyncio.sleep(0)
    yield DONE


# -- the servers (each in its own process: ``--serve NAME``) ---------------------------------------------------


def listening_socket() -> socket.socket:
    # proto IPPROTO_TCP, not 0: asyncio's own loop sets TCP_NODELAY only on accepted sockets whose proto says TCP
    # (a socket made with proto 0 keeps Nagle on and stalls a stream of small writes on delayed ACKs, ~40 ms)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(BACKLOG)
    return sock


def announce(port: int) -> None:
    print(json.dumps({"port": port, "pid": os.getpid()}), flush=True)


async def serve_raw() -> None:
    plain = orjson.dumps(completion({"model": MODEL}))
    plain_answer = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(plain),
        plain,
    )
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n"
    stream = [b"data: " + orjson.dumps(chunk) + b"\n\n" for chunk in _CHUNKS] + [DONE]
    pieces = [b"%x\r\n%s\r\n" % (len(e), e) for e in stream]
    pieces[-1] += b"0\r\n\r\n"

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head_bytes = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head_bytes.split(b"\r\n"):
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                body = await reader.readexactly(length)
                if b'"stream":true' in body:
                    writer.write(head)
                    for piece in pieces:
                        writer.write(piece)
                        await asyncio.sleep(0)
                else:
                    writer.write(plain_answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, sock=listening_socket(), backlog=BACKLOG)
    announce(server.sockets[0].getsockname()[1])
    await server.serve_forever()


async def serve_aiohttp() -> None:
    from aiohttp import web

    async def chat(request: web.Request) -> web.StreamResponse:
        req, body = answer(await request.read())
        if body is not None:
            return web.Response(body=body, content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        async for event in events(req):
            await response.write(event)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post(ROUTE, chat)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=BACKLOG)
    await site.start()
    announce(runner.addresses[0][1])
    await asyncio.Event().wait()


def uvicorn_http() -> str:
    try:
        import httptools  # noqa: F401
    except ImportError:
        return "h11"
    return "httptools"


def serve_uvicorn() -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    async def chat(request: Request) -> Response:
        req, body = answer(await request.body())
        if body is not None:
            return Response(body, media_type="application/json")
        return StreamingResponse(events(req), media_type="text/event-stream")

    app = Starlette(routes=[Route(ROUTE, chat, methods=["POST"])])
    config = uvicorn.Config(
        app,
        loop="uvloop",
        http=uvicorn_http(),
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_keep_alive=75,
        backlog=BACKLOG,
    )
    sock = listening_socket()
    announce(sock.getsockname()[1])
    uvicorn.Server(config).run(sockets=[sock])


def serve(name: str) -> None:
    c.pin(1)
    if name == "uvicorn":
        serve_uvicorn()
        return
    coro = {"raw": serve_raw, "raw_asyncio": serve_raw, "aiohttp": serve_aiohttp, "aiohttp_uvloop": serve_aiohttp}
    if name in ("raw", "aiohttp_uvloop"):
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(coro[name]())
    else:
        asyncio.run(coro[name]())


class Server:
    def __init__(self, name: str) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--serve", name], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"server {name} did not start")
        info = json.loads(line)
        self.url = f"http://127.0.0.1:{info['port']}{ROUTE}"
        import psutil

        self.ps = psutil.Process(self.proc.pid)

    def cpu(self) -> tuple[float, float]:
        """(the process's CPU clock, psutil's user + system): the same time, the clock exact to the ns (Linux's
        ``clock_getcpuclockid(pid)``, read from outside), psutil's in 10 ms ticks (``/proc/PID/stat``)."""
        t = self.ps.cpu_times()
        ticks = t.user + t.system
        try:
            return time.clock_gettime(((~self.proc.pid) << 3) | 2), ticks  # CPUCLOCK_SCHED of the process
        except OSError:
            return ticks, ticks

    def close(self) -> None:
        if self.proc.poll() is not None:
            print(f"server {self.name} had exited with {self.proc.returncode}", file=sys.stderr)
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# -- the load generator ----------------------------------------------------------------------------------------


def check(mode: str, body: bytes) -> None:
    if mode == "plain":
        obj = orjson.loads(body)
        assert obj["object"] == "chat.completion" and obj["choices"][0]["message"]["content"] == _CONTENT, obj
        return
    parts = body.split(b"\n\n")
    assert parts[-2:] == [b"data: [DONE]", b""], parts[-3:]
    data = [orjson.loads(p[6:]) for p in parts[:-2]]
    assert len(data) == STREAM_EVENTS and all(d["object"] == "chat.completion.chunk" for d in data)
    assert "".join(d["choices"][0]["delta"]["content"] for d in data) == " ".join(_CONTENT.split()[:STREAM_EVENTS])


async def batch(server: Server, mode: str, conc: int, n: int) -> dict[str, Any]:
    import aiohttp

    data = request_body(mode == "stream")
    headers = {"content-type": "application/json"}
    latencies: list[float] = []
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=3600))

    async def one() -> bytes:
        async with session.post(server.url, data=data, headers=headers) as r:
            assert r.status == 200, r.status
            return await r.read()

    async def run(calls: int, record: bool) -> None:
        remaining = iter(range(calls))

        async def worker() -> None:
            for _ in remaining:
                t0 = time.perf_counter()
                await one()
                if record:
                    latencies.append(time.perf_counter() - t0)

        await asyncio.gather(*(worker() for _ in range(conc)))

    try:
        check(mode, await one())
        await run(2 * conc, False)
        (clock0, ticks0), client0, wall0 = server.cpu(), time.process_time(), time.perf_counter()
        await run(n, True)
        wall = time.perf_counter() - wall0
        (clock1, ticks1), client1 = server.cpu(), time.process_time()
    finally:
        await session.close()
    latencies.sort()
    return {
        "server_cpu_us": (clock1 - clock0) / n * 1e6,
        "server_cpu_psutil_us": (ticks1 - ticks0) / n * 1e6,
        "client_cpu_us": (client1 - client0) / n * 1e6,
        "rps": n / wall,
        "p50_ms": statistics.median(latencies) * 1e3,
        "p99_ms": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1e3,
        "n": n,
        "server_cpu_s": clock1 - clock0,
    }


def run_batch(server: Server, mode: str, conc: int, n: int) -> dict[str, Any]:
    try:
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(batch(server, mode, conc, n))


def versions() -> dict[str, str]:
    out = {}
    for dist in ("aiohttp", "starlette", "uvicorn", "httptools", "uvloop", "h11", "orjson", "psutil"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def pressure() -> str | None:
    try:
        return Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except OSError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--n", type=int, default=8000, help="non-streamed requests per batch")
    parser.add_argument("--n-stream", type=int, default=1500, help="streamed requests per batch")
    parser.add_argument("--conc", default="1,64,256")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--servers", default=",".join(DEFAULT_SERVERS), help=f"of {','.join(SERVERS)}")
    parser.add_argument("--out", default="gateway_server")
    args = parser.parse_args()
    servers = args.servers.split(",")
    assert all(s in SERVERS for s in servers), servers
    concs = [int(x) for x in args.conc.split(",")]
    modes = args.modes.split(",")
    c.pin(0)
    data: dict[str, Any] = {
        "machine": c.machine(),
        "versions": versions(),
        "uvicorn_http": uvicorn_http(),
        "args": vars(args),
        "request_bytes": {m: len(request_body(m == "stream")) for m in MODES},
        "answer_bytes": len(orjson.dumps(completion({"model": MODEL}))),
        "rounds": [],
    }
    print(
        f"request {data['request_bytes']} B, answer {data['answer_bytes']} B, uvicorn http={data['uvicorn_http']}",
        file=sys.stderr,
    )
    started = time.perf_counter()
    cells = [(m, k) for m in modes for k in concs]
    for r in range(args.rounds):
        running = {name: Server(name) for name in servers}
        results: dict[str, dict[str, Any]] = {"_pressure": {"start": pressure()}}
        try:
            order = servers[r % len(servers) :] + servers[: r % len(servers)]
            for mode, k in c.shuffled(cells, r):
                n = args.n if mode == "plain" else args.n_stream
                for name in order:
                    results[f"{name}|{mode}|{k}"] = run_batch(running[name], mode, k, n)
        finally:
            for srv in running.values():
                srv.close()
        results["_pressure"]["end"] = pressure()
        data["rounds"].append(results)
        print(f"round {r + 1}/{args.rounds} done ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    data["machine"]["cpu_pressure_at_end"] = pressure()
    data["elapsed_s"] = time.perf_counter() - started
    path = c.save(args.out, data)
    print(report(data))
    print(f"raw numbers: {path}", file=sys.stderr)


def report(data: dict[str, Any]) -> str:
    rounds = data["rounds"]
    keys = [key for key in rounds[0] if not key.startswith("_")]
    order = {s: i for i, s in enumerate(SERVERS)}
    keys.sort(key=lambda key: (MODES.index(key.split("|")[1]), int(key.split("|")[2]), order[key.split("|")[0]]))
    headers = [
        "mode",
        "conc",
        "server",
        "server CPU µs/req",
        "(psutil)",
        "÷ raw",
        "req/s",
        "p50 ms",
        "p99 ms",
        "p50 ÷ raw",
        "client CPU µs/req",
    ]
    rows = []
    for key in keys:
        name, mode, k = key.split("|")
        base = f"raw|{mode}|{k}"

        def values(field: str, key: str = key) -> list[float]:
            return [rd[key][field] for rd in rounds]

        def to_raw(field: str, key: str = key, base: str = base) -> str:
            if base not in rounds[0]:
                return "-"
            return c.ratio_summary([rd[key][field] / max(rd[base][field], 1e-9) for rd in rounds])

        rows.append(
            [
                mode,
                k,
                name,
                c.summary(values("server_cpu_us")),
                f"{statistics.median(values('server_cpu_psutil_us')):.0f}",
                to_raw("server_cpu_us"),
                c.summary(values("rps")),
                c.summary(values("p50_ms"), "{:.2f}"),
                c.summary(values("p99_ms"), "{:.2f}"),
                to_raw("p50_ms"),
                c.summary(values("client_cpu_us")),
            ]
        )
    m = data["machine"]
    press = [(rd["_pressure"]["start"], rd["_pressure"]["end"]) for rd in rounds]
    return (
        f"{m['date']} · {m['cpu']} · {m['cores']} cores · Python {m['python']} · {data['versions']}"
        f" · uvicorn http={data['uvicorn_http']} · {data.get('elapsed_s', 0):.0f} s\n"
        f"CPU pressure per round (start, end): {press}\n" + c.table(headers, rows)
    )


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        serve(sys.argv[2])
    elif len(sys.argv) > 2 and sys.argv[1] == "--report":
        with open(sys.argv[2]) as f:
            print(report(json.load(f)))
    else:
        main()
