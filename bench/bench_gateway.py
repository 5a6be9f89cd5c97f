"""The gateway (``backends_gateway``) over the instant server: CPU per turn beside the direct client call and two
floors, added latency, memory per open session, 10,000 open sessions, and the store's throughput.

    uv run python bench/bench_gateway.py [--parts cpu,latency,profile,breakdown,memory,scale,store,anthropic]
        [--rounds 5]
        [--turns 4] [--sessions 1:50,64:192,256:512] [--memory-sessions 2000] [--scale-sessions 10000
        --scale-in-flight 1000 --scale-timeout 300] [--keep-profile FILE] [--memory-trace]

Processes and cores (2-core machine): the **worker** (``--worker``: the gateway and its client in one process, or
one of the comparisons below) is pinned to core 0 alone; the instant server (``instant.py``, its ``multiturn``
port: canned vLLM 0.32 answers whose usage follows the prompt sent) and the **harness** (this process, the load
generator: bare ``aiohttp.ClientSession`` on uvloop, orjson) share core 1. The worker's CPU is its
``time.process_time()`` (user + system of all its threads, the store's writer thread included), read through its
control app (another port) before and after each batch, so the harness's and the engine's CPU never count.
Workers (``--worker`` modes):

* ``direct``: ``Client.generate(messages=…, previous=<the session's last result>, session=…)`` then
  ``client.parse_completion`` (the reply message, which the next turn's messages must hold), driven in the worker
  itself: what a trainer pays calling the client directly, no HTTP in front (its bridge computes the message spans
  too: a ``previous=`` result of this client carries them, so both sides pay for them);
* ``hop``: a trivial ``aiohttp.web`` handler reading the OpenAI body (``orjson.loads``) and answering a canned
  ``chat.completion`` (the gateway's own answer for this completion), no engine call: an HTTP hop alone;
* ``proxy``: the same handler calling the engine as ``direct`` does (the previous result kept in a dict per session)
  and answering the parsed reply with the gateway's ``chat_completion`` builder: the thinnest gateway possible, an
  HTTP hop in front of the engine call, no checks, no sessions, no store. The honest floor: any OpenAI gateway over
  the client pays at least this;
* ``gateway``: ``Gateway(Client, SQLiteStore(file), limits)`` behind ``backends_gateway.serve`` (aiohttp), the
  store on this machine's disk (ext4, ``synchronous=FULL``).

Every worker runs as ``backends gateway`` does: on uvloop (where installed), its client with the library defaults
but the stateless turn cache off (``StatelessPolicy(enabled=False)``: the gateway keeps the turns; ``direct`` and
``proxy`` use the same client config, ``session=`` and ``previous=`` as the gateway's calls).

Workload: multi-turn sessions. Turn 1 of session i is ``_common.chat_variants``' chat i mod 64 (six messages
rendering to 1,024 ids with the tiny test tokenizer); turn k+1's messages are turn k's, the assistant message the
worker answered, and a new user message of 40 words (~90 ids with the template). Every answer is the canned 256
completion ids (reasoning + answer). So turn 1 renders whole and turns 2… bridge on the previous turn's exact ids
(the gateway's counts are checked: every later turn ``bridged``); with ``--turns 4`` prompts grow 1,024 → ~2,070
ids. The harness posts ``{"model", "messages", "max_tokens": 256, "temperature": 1.0}`` to
``/s/<session>/v1/chat/completions``. A batch runs ``S`` sessions with ``c`` of them in flight at once (each
session's turns one after another), after an unmeasured warm-up of ``max(c, 2)`` sessions; workers run in a shuffled
order per round, one fresh worker per mode and round; ratios are paired per round, then median [min-max].

Parts:

* ``cpu``: worker CPU per turn at c = 1 and 64, all four workers (target: gateway ≤ 1.5× direct);
* ``latency``: turn latency p50/p99 at c = 1 and 256, ``gateway`` (round trip at the harness) and ``direct`` (the
  call in the worker); added latency = gateway − direct, per percentile and round;
* ``profile``: cProfile (own CPU time of the loop thread, ``time.thread_time``) of the gateway worker over one
  batch at c = 64, own time grouped by package as ``profile_client.py`` does, plus the CPU of each thread; then
  (no profiler) the CPU of the message spans of a prompt rendered whole, for conversations of 1 to 40 turns;
* ``breakdown``: no profiler, the gateway and the direct worker at c = 1 with the pieces of :data:`TIMED` wrapped
  in CPU timers (the loop thread's ``time.thread_time``), the garbage collector's time by generation
  (``gc.callbacks``), and each thread's CPU: where the gateway's extra goes;
* ``memory``: a fresh gateway worker, ``--memory-sessions`` sessions of ``--memory-turns`` turns left open; RSS
  growth (after ``gc.collect()``) ÷ open sessions (``--memory-trace``: a second run under ``tracemalloc``, growth
  by line);
* ``scale``: a fresh gateway worker, ``--scale-sessions`` sessions of ``--scale-turns`` turns with
  ``--scale-in-flight`` in flight, all left open, bounded by ``--scale-timeout`` seconds (no new turn starts after
  it); errors by kind, turns/s, the gateway's peak RSS (``VmHWM``), the most turns it held in flight at once, and
  turns slower than 10 s; once per ``--scale-loops`` (default: uvloop, as the CLI, then asyncio's loop).
  ``GatewayLimits``' ``max_in_flight`` and ``max_sessions`` are raised to twice the sizes asked when the defaults
  (4,096 and 100,000) are below that; the JSON says whether they were;
* ``anthropic``: the gateway worker's CPU per turn on Anthropic's Messages route (``/s/<session>/v1/messages``)
  beside the chat-completions route, at the ``--cpu-conc`` concurrencies: the same sessions and prompts (the chat's
  system message as ``system``, each answer's content blocks, thinking and text, sent back as the assistant
  message), one fresh gateway worker per route and round, ratios paired per round;
* ``store``: ``SQLiteStore.record_turn`` alone in a process of its own (core 0), 1 and 256 sessions recording at
  once (turns/s, CPU per turn), a fresh file per batch; the record is a real turn 3 of the workload (10 messages,
  1,687 prompt ids, 256 completion ids, their logprobs and 15 message spans: ~15 KB a row).

Raw numbers go to ``bench/results/gateway.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import _common as c
import orjson

MODES = ("direct", "hop", "proxy", "gateway")
MAX_TOKENS = c.COMPLETION_TOKENS
USER_WORDS = 40

Message = dict[str, Any]
TurnFn = Callable[[str, list[Message], bool], Awaitable[Message]]


# -- the workload -------------------------------------------------------------------------------------------


def build_fixture(path: Path, turns: int) -> None:
    """The chats (turn 1 of each session) and the user messages of later turns, for the harness and workers."""
    tok = c.tokenizer()
    variants = c.chat_variants(tok)
    users = [{"role": "user", "content": c._text(USER_WORDS, 500 + k)} for k in range(max(turns, 16))]
    path.write_bytes(orjson.dumps({"variants": variants, "users": users, "tokenizer": str(c.tokenizer_dir())}))


def load_fixture(path: str) -> dict[str, Any]:
    return orjson.loads(Path(path).read_bytes())


def percentiles(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3

    return {"p50_ms": at(0.50), "p90_ms": at(0.90), "p99_ms": at(0.99), "max_ms": ordered[-1] * 1e3}


async def run_sessions(
    turn: TurnFn,
    fx: dict[str, Any],
    *,
    sessions: int,
    turns: int,
    conc: int,
    tag: str,
    deadline: float | None = None,
) -> dict[str, Any]:
    """``sessions`` sessions of ``turns`` turns, ``conc`` sessions in flight; ``turn(session, messages, last)``
    answers the assistant message. Stops starting turns after ``deadline`` (``time.monotonic``)."""
    variants, users = fx["variants"], fx["users"]
    queue = iter(range(sessions))
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    slow = 0
    done = {"turns": 0, "sessions": 0, "in_flight": 0, "max_in_flight": 0}

    async def worker() -> None:
        nonlocal slow
        for i in queue:
            session = f"{tag}-{i}"
            messages: list[Message] = list(variants[i % len(variants)])
            for k in range(turns):
                if deadline is not None and time.monotonic() > deadline:
                    return
                done["in_flight"] += 1
                done["max_in_flight"] = max(done["max_in_flight"], done["in_flight"])
                started = time.perf_counter()
                try:
                    reply = await turn(session, messages, k == turns - 1)
                except Exception as exc:  # counted: a failed session stops, the others go on
                    errors[_kind(exc)] += 1
                    break
                finally:
                    done["in_flight"] -= 1
                latencies.append(time.perf_counter() - started)
                slow += latencies[-1] > 10
                done["turns"] += 1
                messages = [*messages, reply, users[k]]
            done["sessions"] += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    wall = time.perf_counter() - started
    return {
        "turns": done["turns"],
        "sessions": done["sessions"],
        "wall_s": wall,
        "turns_per_s": done["turns"] / wall if wall else 0.0,
        "errors": dict(errors),
        "max_in_flight": done["max_in_flight"],
        "latency": percentiles(latencies),
        "slow_10s": slow,
    }


def _kind(exc: BaseException) -> str:
    if isinstance(exc, HttpStatusError):
        return f"HTTP {exc.status} {exc.code}"
    if isinstance(exc, OSError):
        cause = exc.__cause__ or exc.__context__
        detail = f"{exc.strerror or exc}" if exc.errno else str(cause or exc)
        return f"{type(exc).__name__}: {detail[:120]}"
    return f"{type(exc).__name__}: {str(exc)[:120]}"


class HttpStatusError(Exception):
    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        try:
            self.code = orjson.loads(body)["error"]["code"]
        except Exception:
            self.code = body[:80].decode(errors="replace")
        super().__init__(f"HTTP {status}: {body[:300]!r}")


# -- the worker (core 0) ------------------------------------------------------------------------------------


def thread_cpu() -> dict[str, float]:
    """CPU seconds of each thread of this process by thread name (the default executor's threads summed)."""
    import threading

    import psutil

    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for t in psutil.Process().threads():
        name = names.get(t.id, "(native)")
        if name.startswith(("asyncio_", "uvloop_", "ThreadPoolExecutor")):
            name = "(thread pool)"
        out[name] = out.get(name, 0.0) + t.user_time + t.system_time
    return out


#: What the ``breakdown`` part times (the loop thread's CPU, ``time.thread_time``): (module, owner, attribute, label).
#: Coroutines are timed across their awaits, so only at concurrency 1 (no other turn runs meanwhile).
TIMED = (
    ("backends_gateway.app", None, "chat_completions", "app.chat_completions (the handler)"),
    ("backends_gateway.app", None, "parse_chat_request", "  parse_chat_request"),
    ("backends_gateway.gateway", "Gateway", "turn", "  Gateway.turn"),
    ("backends_gateway.gateway", "Gateway", "_session_for", "    Gateway._session_for (a new session: read, insert)"),
    ("backends_gateway.gateway", None, "chain_digests", "    chain_digests (both calls)"),
    ("backends_core.client", "Client", "generate", "    Client.generate"),
    ("backends_core.multiturn.turn_cache", None, "extend_with_spans", "      extend_with_spans (the bridge)"),
    ("backends_core.client", None, "rendered_spans", "    rendered_spans (spans of a turn rendered whole)"),
    ("backends_core.client", "Client", "parse_completion", "    Client.parse_completion (all calls)"),
    ("backends_gateway.sessions", "TurnRecord", "result", "    TurnRecord.result (previous=)"),
    ("backends_gateway.store", "SQLiteStore", "record_turn", "    SQLiteStore.record_turn (loop side)"),
)


def install_timers(times: dict[str, float]) -> None:
    """Wrap :data:`TIMED` so that ``times[label]`` accumulates the loop thread's CPU in each (nested ones too)."""
    import functools
    import importlib
    import inspect

    for module_name, owner_name, attribute, label in TIMED:
        module = importlib.import_module(module_name)
        owner = getattr(module, owner_name) if owner_name else module
        fn = inspect.getattr_static(owner, attribute)
        if isinstance(fn, classmethod | staticmethod):
            raise TypeError(f"{attribute}: time plain functions and methods only")
        if inspect.iscoroutinefunction(fn):

            async def timed_async(*a: Any, _fn: Any = fn, _label: str = label, **k: Any) -> Any:
                t0 = time.thread_time()
                try:
                    return await _fn(*a, **k)
                finally:
                    times[_label] = times.get(_label, 0.0) + time.thread_time() - t0

            setattr(owner, attribute, functools.wraps(fn)(timed_async))
        else:

            def timed(*a: Any, _fn: Any = fn, _label: str = label, **k: Any) -> Any:
                t0 = time.thread_time()
                try:
                    return _fn(*a, **k)
                finally:
                    times[_label] = times.get(_label, 0.0) + time.thread_time() - t0

            setattr(owner, attribute, functools.wraps(fn)(timed))


async def worker_main(config: dict[str, Any]) -> None:
    """Serve one mode until SIGTERM; print ``{"url", "control"}`` once ready. The control app (another port, same
    loop) runs ``direct`` batches, reads RSS and thread CPU, and starts/stops the profiler."""
    import cProfile

    import numpy as np
    from aiohttp import web

    from backends_core import Client, ClientConfig, GenerateResult, SamplingParams, StatelessPolicy
    from backends_gateway import Gateway, GatewayLimits, SQLiteStore, serve
    from backends_gateway.openai_chat import chat_completion

    mode = config["mode"]
    times: dict[str, float] = {}
    if config.get("timers"):
        install_timers(times)  # before the app is built: its routes take the handler then
        gc_started = [0.0]

        def on_gc(phase: str, info: dict[str, int]) -> None:  # the collector's own time, by generation
            if phase == "start":
                gc_started[0] = time.thread_time()
            else:
                label = f"gc, generation {info['generation']}"
                times[label] = times.get(label, 0.0) + time.thread_time() - gc_started[0]

        gc.callbacks.append(on_gc)
    fx = load_fixture(config["fixture"])
    client_config = ClientConfig(
        backend="vllm",
        base_url=config["engine"],
        model=c.MODEL,
        tokenizer=fx["tokenizer"],
        stateless=StatelessPolicy(enabled=False),  # as the CLI builds it (the gateway keeps the turns itself)
    )
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    gateway: Gateway | None = None
    profiler: list[cProfile.Profile] = []
    in_flight_seen = [0]
    traces: list[Any] = []
    if config.get("trace"):
        import tracemalloc

        tracemalloc.start()

    async with contextlib.AsyncExitStack() as stack:
        client = await stack.enter_async_context(Client(client_config))
        url = None
        if mode == "gateway":
            limits = GatewayLimits(**config.get("limits", {}))
            gateway = await stack.enter_async_context(Gateway(client, SQLiteStore(config["store"]), limits=limits))
            url = await stack.enter_async_context(serve(gateway))

            async def watch() -> None:  # the most turns the gateway held at once (sampled)
                while True:
                    in_flight_seen[0] = max(in_flight_seen[0], gateway._in_flight)
                    await asyncio.sleep(0.02)

            watcher = loop.create_task(watch())
            stack.callback(watcher.cancel)
        elif mode in ("hop", "proxy"):
            canned_result = GenerateResult(
                prompt_ids=(0,) * c.PROMPT_TOKENS,
                completion_ids=tuple(c.completion_ids(client.tokenizer)),
                logprobs=np.zeros(c.COMPLETION_TOKENS, np.float32),
                finish_reason="stop",
            )
            canned = orjson.dumps(
                chat_completion(
                    id="chatcmpl-hop",
                    model=c.MODEL,
                    message=client.parse_completion(canned_result),
                    finish="stop",
                    prompt_tokens=c.PROMPT_TOKENS,
                    completion_tokens=c.COMPLETION_TOKENS,
                    logprobs=None,
                    fingerprint=None,
                )
            )
            previous: dict[str, GenerateResult] = {}

            async def hop(request: web.Request) -> web.Response:
                orjson.loads(await request.read())
                return web.Response(body=canned, content_type="application/json")

            async def proxy(request: web.Request) -> web.Response:
                body = orjson.loads(await request.read())
                session = request.match_info["session"]
                result = await client.generate(
                    messages=body["messages"],
                    sampling=SamplingParams(max_tokens=body["max_tokens"], temperature=body["temperature"]),
                    session=session,
                    previous=previous.pop(session, None),
                )
                if "X-Bench-Last" not in request.headers:
                    previous[session] = result
                answer = chat_completion(
                    id=f"chatcmpl-{session}",
                    model=body["model"],
                    message=client.parse_completion(result),
                    finish=result.finish_reason,
                    prompt_tokens=len(result.prompt_ids),
                    completion_tokens=len(result.completion_ids),
                    logprobs=None,
                    fingerprint=result.weight_version,
                )
                return web.Response(body=orjson.dumps(answer), content_type="application/json")

            app = web.Application(client_max_size=16 << 20)
            app.router.add_post("/s/{session}/v1/chat/completions", hop if mode == "hop" else proxy)
            url = await stack.enter_async_context(_serve_app(app))

        direct_previous: dict[str, GenerateResult] = {}

        async def direct_turn(session: str, messages: list[Message], last: bool) -> Message:
            result = await client.generate(
                messages=messages, sampling=sampling, session=session, previous=direct_previous.pop(session, None)
            )
            if not last:
                direct_previous[session] = result
            return client.parse_completion(result)

        async def run(request: web.Request) -> web.Response:
            args = await request.json()
            return web.json_response(await run_sessions(direct_turn, fx, **args))

        async def stats(request: web.Request) -> web.Response:
            if request.query.get("gc"):
                gc.collect()
            status = {k: c.proc_status_kb(k) for k in ("VmRSS", "VmHWM")}
            out: dict[str, Any] = {"rss_kb": status["VmRSS"], "hwm_kb": status["VmHWM"], "threads": thread_cpu()}
            out["times"] = dict(times)
            out["cpu"] = time.process_time()
            if request.query.get("trace"):  # tracemalloc's growth since the last snapshot, by line
                import tracemalloc

                snapshot = tracemalloc.take_snapshot()
                if traces:
                    diff = snapshot.compare_to(traces[-1], "lineno")
                    out["trace"] = [[str(d.traceback), d.size_diff, d.count_diff] for d in diff[:25]]
                traces[:] = [snapshot]
            if gateway is not None:
                out["open_sessions"] = len(gateway._sessions)
                out["joined"] = len(gateway._joined)
                out["in_flight_seen"] = in_flight_seen[0]
                in_flight_seen[0] = 0
            return web.json_response(out)

        async def cpu(request: web.Request) -> web.Response:
            return web.json_response(time.process_time())  # every thread of the process, ns resolution

        async def profile_start(request: web.Request) -> web.Response:
            profile = cProfile.Profile(time.thread_time)  # the loop thread's own CPU (shared machine)
            profiler.append(profile)
            profile.enable()
            return web.json_response({})

        async def profile_stop(request: web.Request) -> web.Response:
            profile = profiler.pop()
            profile.disable()
            profile.dump_stats((await request.json())["path"])
            return web.json_response({})

        async def session(request: web.Request) -> web.Response:
            assert gateway is not None
            return web.json_response(await gateway.summary(request.match_info["id"]))

        control = web.Application()
        control.router.add_post("/run", run)
        control.router.add_get("/stats", stats)
        control.router.add_get("/cpu", cpu)
        control.router.add_post("/profile/start", profile_start)
        control.router.add_post("/profile/stop", profile_stop)
        control.router.add_get("/session/{id}", session)
        control_url = await stack.enter_async_context(_serve_app(control))
        print(json.dumps({"url": url, "control": control_url, "pid": os.getpid()}), flush=True)
        await stop.wait()


@contextlib.asynccontextmanager
async def _serve_app(app: Any) -> Any:
    from aiohttp import web

    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


class Worker:
    """A worker process (``--worker``) pinned to core 0."""

    def __init__(self, mode: str, engine: str, fixture: Path, tmp: Path, **extra: Any) -> None:
        self.mode = mode
        self.store = tmp / f"gateway-{mode}-{time.monotonic_ns()}.db"
        config = {"mode": mode, "engine": engine, "fixture": str(fixture), "store": str(self.store), **extra}
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", json.dumps(config)], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{mode} worker did not start")
        ready = json.loads(line)
        self.url: str | None = ready["url"]
        self.control: str = ready["control"]

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(OSError):
                os.unlink(f"{self.store}{suffix}")


# -- the harness (core 1) -----------------------------------------------------------------------------------


class Harness:
    """Drives a worker: over HTTP for ``hop``/``proxy``/``gateway``, through its control app for ``direct``."""

    def __init__(self, fx: dict[str, Any], timeout: float = 900.0) -> None:
        import aiohttp

        self.fx = fx
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=3600)
        self.http = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout))

    async def aclose(self) -> None:
        await self.http.close()

    def http_turn(self, url: str, api: str = "openai") -> TurnFn:
        headers = {"content-type": "application/json"}
        last_headers = {**headers, "X-Bench-Last": "1"}
        if api == "anthropic":
            return self.messages_turn(url, headers, last_headers)

        async def turn(session: str, messages: list[Message], last: bool) -> Message:
            body = orjson.dumps({"model": c.MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 1.0})
            target = f"{url}/s/{session}/v1/chat/completions"
            async with self.http.post(target, data=body, headers=last_headers if last else headers) as response:
                raw = await response.read()
                if response.status != 200:
                    raise HttpStatusError(response.status, raw)
            return orjson.loads(raw)["choices"][0]["message"]

        return turn

    def messages_turn(self, url: str, headers: dict[str, str], last_headers: dict[str, str]) -> TurnFn:
        """A turn on the Messages route: the chat's system message as ``system``, the answer's blocks as the reply."""

        async def turn(session: str, messages: list[Message], last: bool) -> Message:
            fields: dict[str, Any] = {"model": c.MODEL, "max_tokens": MAX_TOKENS, "temperature": 1.0}
            if messages[0]["role"] == "system":
                fields["system"], messages = messages[0]["content"], messages[1:]
            body = orjson.dumps({**fields, "messages": messages})
            target = f"{url}/s/{session}/v1/messages"
            async with self.http.post(target, data=body, headers=last_headers if last else headers) as response:
                raw = await response.read()
                if response.status != 200:
                    raise HttpStatusError(response.status, raw)
            return {"role": "assistant", "content": orjson.loads(raw)["content"]}

        return turn

    async def batch(
        self, worker: Worker, *, sessions: int, turns: int, conc: int, tag: str, api: str = "openai"
    ) -> dict[str, Any]:
        """One measured batch after a warm-up of ``conc`` sessions: worker CPU per turn, turns/s, latencies."""
        args = {"turns": turns, "conc": conc, "api": api}
        await self.drive(worker, sessions=max(conc, 2), tag=f"{tag}w", **args)
        cpu0 = await self.cpu(worker)
        out = await self.drive(worker, sessions=sessions, tag=tag, **args)
        out["cpu_us_per_turn"] = (await self.cpu(worker) - cpu0) / max(out["turns"], 1) * 1e6
        return out

    async def drive(
        self, worker: Worker, *, sessions: int, turns: int, conc: int, tag: str, api: str = "openai", **kw: Any
    ) -> Any:
        if worker.mode == "direct":
            args = {"sessions": sessions, "turns": turns, "conc": conc, "tag": tag}
            async with self.http.post(worker.control + "/run", json=args) as r:
                return await r.json()
        assert worker.url is not None
        return await run_sessions(
            self.http_turn(worker.url, api), self.fx, sessions=sessions, turns=turns, conc=conc, tag=tag, **kw
        )

    async def cpu(self, worker: Worker) -> float:
        """The worker's CPU seconds so far (``time.process_time`` in it: user + system of all its threads)."""
        async with self.http.get(worker.control + "/cpu") as r:
            return float(await r.json())

    async def stats(self, worker: Worker, *, collect: bool = False, trace: bool = False) -> dict[str, Any]:
        params = {"gc": "1"} if collect else {}
        if trace:
            params["trace"] = "1"
        async with self.http.get(worker.control + "/stats", params=params) as r:
            return await r.json()

    async def summary(self, worker: Worker, session: str) -> dict[str, Any]:
        async with self.http.get(f"{worker.control}/session/{session}") as r:
            return await r.json()


# -- parts --------------------------------------------------------------------------------------------------


def parse_sizes(text: str) -> dict[int, int]:
    """``"1:30,64:192"`` → {concurrency: sessions per batch}."""
    return {int(k): int(v) for k, v in (item.split(":") for item in text.split(","))}


async def part_turns(args: argparse.Namespace, engine: str, fixture: Path, tmp: Path, data: dict[str, Any]) -> None:
    """cpu (c=1, 64: every mode) and latency (c=1, 256: direct and gateway), one fresh worker per mode and round."""
    fx = load_fixture(str(fixture))
    sizes = parse_sizes(args.sessions)
    plan: dict[str, set[int]] = {m: set() for m in MODES}
    if "cpu" in args.parts:
        for m in MODES:
            plan[m] |= set(args.cpu_conc)
    if "latency" in args.parts:
        for m in ("direct", "gateway"):
            plan[m] |= set(args.latency_conc)
    modes = [m for m in MODES if plan[m]]
    harness = Harness(fx)
    rounds: list[dict[str, Any]] = data.setdefault("turns", [])
    try:
        for r in range(args.rounds):
            results: dict[str, Any] = {}
            for mode in c.shuffled(modes, r):
                worker = Worker(mode, engine, fixture, tmp)
                try:
                    for conc in c.shuffled(sorted(plan[mode]), r + 7):
                        tag = f"r{r}-{mode}-c{conc}"
                        out = await harness.batch(worker, sessions=sizes[conc], turns=args.turns, conc=conc, tag=tag)
                        if mode == "gateway":  # every turn after the first bridged on the previous turn's ids
                            summary = await harness.summary(worker, f"{tag}-0")
                            out["session_0"] = summary
                            assert summary["bridged"] == args.turns - 1 and summary["branched"] == 0, summary
                        if out["errors"]:
                            print(f"  {tag}: errors {out['errors']}", file=sys.stderr, flush=True)
                        results[f"{mode}|{conc}"] = out
                        print(
                            f"  {tag}: {out['cpu_us_per_turn']:.0f} µs/turn, {out['turns_per_s']:.0f} turns/s, "
                            f"p50 {out['latency']['p50_ms']:.1f} ms",
                            file=sys.stderr,
                            flush=True,
                        )
                    results[f"{mode}|threads"] = (await harness.stats(worker))["threads"]
                finally:
                    worker.close()
            results["pressure"] = c.cpu_pressure()
            rounds.append(results)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    finally:
        await harness.aclose()


async def part_anthropic(args: argparse.Namespace, engine: str, fixture: Path, tmp: Path, data: dict[str, Any]) -> None:
    """The gateway worker's CPU per turn over each API, one fresh worker per API and round."""
    fx = load_fixture(str(fixture))
    sizes = parse_sizes(args.sessions)
    harness = Harness(fx)
    rounds: list[dict[str, Any]] = data.setdefault("anthropic", [])
    try:
        for r in range(args.rounds):
            results: dict[str, Any] = {}
            for api in c.shuffled(["openai", "anthropic"], r):
                worker = Worker("gateway", engine, fixture, tmp)
                try:
                    for conc in c.shuffled(sorted(args.cpu_conc), r + 7):
                        tag = f"r{r}-{api}-c{conc}"
                        out = await harness.batch(
                            worker, sessions=sizes[conc], turns=args.turns, conc=conc, tag=tag, api=api
                        )
                        summary = await harness.summary(worker, f"{tag}-0")
                        assert summary["bridged"] == args.turns - 1 and summary["branched"] == 0, summary
                        assert not out["errors"], (tag, out["errors"])
                        results[f"{api}|{conc}"] = out
                        print(f"  {tag}: {out['cpu_us_per_turn']:.0f} µs/turn", file=sys.stderr, flush=True)
                finally:
                    worker.close()
            results["pressure"] = c.cpu_pressure()
            rounds.append(results)
            print(f"anthropic round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    finally:
        await harness.aclose()


async def part_profile(args: argparse.Namespace, engine: str, fixture: Path, tmp: Path, data: dict[str, Any]) -> None:
    import pstats

    from profile_client import by_package

    fx = load_fixture(str(fixture))
    conc = args.profile_conc
    sessions = parse_sizes(args.sessions).get(conc, 3 * conc)
    harness = Harness(fx)
    worker = Worker("gateway", engine, fixture, tmp)
    path = tmp / "gateway.prof"
    try:
        await harness.drive(worker, sessions=max(conc, 2), turns=args.turns, conc=conc, tag="pw")
        threads0 = (await harness.stats(worker))["threads"]
        cpu0 = await harness.cpu(worker)
        async with harness.http.post(worker.control + "/profile/start"):
            pass
        out = await harness.drive(worker, sessions=sessions, turns=args.turns, conc=conc, tag="p")
        async with harness.http.post(worker.control + "/profile/stop", json={"path": str(path)}):
            pass
        cpu = await harness.cpu(worker) - cpu0
        threads1 = (await harness.stats(worker))["threads"]
    finally:
        worker.close()
        await harness.aclose()
    turns = out["turns"]
    if args.keep_profile:
        shutil.copyfile(path, args.keep_profile)
    stats = pstats.Stats(str(path))
    total = sum(v[2] for v in stats.stats.values())  # type: ignore[attr-defined]
    top = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[: args.top]  # type: ignore[attr-defined]
    cumulative = sorted(stats.stats.items(), key=lambda kv: -kv[1][3])[: args.top]  # type: ignore[attr-defined]

    def entry(key: Any, value: Any) -> dict[str, Any]:
        filename, line, name = key
        return {
            "function": f"{_short(filename)}:{line}({name})",
            "calls": value[1],
            "own_us_per_turn": value[2] / turns * 1e6,
            "cum_us_per_turn": value[3] / turns * 1e6,
        }

    data["profile"] = {
        "conc": conc,
        "turns": turns,
        "process_cpu_us_per_turn_profiled": cpu / turns * 1e6,
        "loop_thread_profiled_us_per_turn": total / turns * 1e6,
        "threads_us_per_turn": {k: (threads1.get(k, 0) - threads0.get(k, 0)) / turns * 1e6 for k in threads1},
        "by_package": [(p, share) for p, share in by_package(stats, total)],
        "top_own": [entry(k, v) for k, v in top],
        "top_cumulative": [entry(k, v) for k, v in cumulative],
        "spans_cost": spans_cost(fx),
    }


def spans_cost(fx: dict[str, Any], turns: Sequence[int] = (1, 5, 10, 20, 40)) -> list[dict[str, Any]]:
    """CPU ms of the message spans of a prompt rendered whole (``rendered_spans``, what the gateway reads for
    every turn it does not bridge: a session's first, a new branch) beside one render of the same messages and
    ``chain_digests``, for conversations of 1, 5, 10... turns (no profiler)."""
    from backends_core.multiturn.extension import end_of_turn_ids
    from backends_core.multiturn.rendering import render_text
    from backends_core.multiturn.spans import rendered_spans
    from backends_gateway.sessions import chain_digests

    tok = c.tokenizer()
    eot = end_of_turn_ids(tok, None)[0]
    reply = {"role": "assistant", "content": c._text(60, 9), "reasoning_content": c._text(60, 10)}
    out = []
    for n in turns:
        messages = list(fx["variants"][0])
        for k in range(n - 1):
            messages += [reply, fx["users"][k % len(fx["users"])]]
        ids = c.render_ids(tok, messages)
        row: dict[str, Any] = {"turn": n, "messages": len(messages), "prompt_ids": len(ids)}
        pieces = {
            "rendered_spans_ms": lambda m=messages, i=ids: rendered_spans(
                tok, m, i, tools=None, chat_template_kwargs=None, end_of_turn=eot
            ),
            "render_text_ms": lambda m=messages: render_text(tok, m),
            "chain_digests_ms": lambda m=messages: chain_digests(m, None, None),
        }
        for name, fn in pieces.items():
            fn()
            calls, started = 0, time.process_time()
            while calls < 3 or time.process_time() - started < 0.3:
                fn()
                calls += 1
            row[name] = (time.process_time() - started) / calls * 1e3
        out.append(row)
    return out


def _short(filename: str) -> str:
    for marker in ("site-packages/", "/src/", "/lib/python3"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename


async def part_breakdown(args: argparse.Namespace, engine: str, fixture: Path, tmp: Path, data: dict[str, Any]) -> None:
    """Where the gateway's extra CPU goes at c=1: :data:`TIMED` pieces, each thread, beside the direct call's."""
    fx = load_fixture(str(fixture))
    harness = Harness(fx)
    sessions = parse_sizes(args.sessions).get(1, 50) * 2
    out: dict[str, Any] = {}
    try:
        for r in range(args.breakdown_rounds):
            for mode in c.shuffled(["direct", "gateway"], r):
                worker = Worker(mode, engine, fixture, tmp, timers=True)
                try:
                    await harness.drive(worker, sessions=4, turns=args.turns, conc=1, tag="bw")
                    before = await harness.stats(worker)
                    run = await harness.drive(worker, sessions=sessions, turns=args.turns, conc=1, tag="b")
                    after = await harness.stats(worker)
                finally:
                    worker.close()
                turns = run["turns"]
                pieces = {k: (v - before["times"].get(k, 0.0)) / turns * 1e6 for k, v in after["times"].items()}
                threads = {k: (v - before["threads"].get(k, 0.0)) / turns * 1e6 for k, v in after["threads"].items()}
                out.setdefault(mode, []).append(
                    {
                        "process_us_per_turn": (after["cpu"] - before["cpu"]) / turns * 1e6,
                        "threads_us_per_turn": {k: v for k, v in threads.items() if v > 0.5},
                        "pieces_us_per_turn": pieces,
                    }
                )
                print(f"  breakdown {mode}: {out[mode][-1]}", file=sys.stderr, flush=True)
    finally:
        await harness.aclose()
    data["breakdown"] = out


async def part_memory(args: argparse.Namespace, engine: str, fixture: Path, tmp: Path, data: dict[str, Any]) -> None:
    fx = load_fixture(str(fixture))
    harness = Harness(fx)
    out: dict[str, Any] = {}
    try:
        variants = [("gateway", False)]
        if args.memory_trace:
            variants.append(("gateway under tracemalloc", True))
        for label, trace in variants:
            worker = Worker("gateway", engine, fixture, tmp, trace=trace)
            try:
                await harness.drive(worker, sessions=16, turns=args.memory_turns, conc=16, tag="mw")
                before = await harness.stats(worker, collect=True, trace=trace)
                run = await harness.drive(
                    worker, sessions=args.memory_sessions, turns=args.memory_turns, conc=64, tag="m"
                )
                after = await harness.stats(worker, collect=True, trace=trace)
            finally:
                worker.close()
            grown = after["open_sessions"] - before["open_sessions"]
            out[label] = {
                "sessions": grown,
                "turns": run["turns"],
                "errors": run["errors"],
                "rss_before_mb": before["rss_kb"] / 1024,
                "rss_after_mb": after["rss_kb"] / 1024,
                "kb_per_session": (after["rss_kb"] - before["rss_kb"]) / max(grown, 1),
            }
            if trace:
                out[label]["trace_kb_per_session"] = [
                    [where, size / 1024 / max(grown, 1), count] for where, size, count in after.get("trace", [])
                ]
            print(f"  memory, {label}: {out[label]}", file=sys.stderr, flush=True)
    finally:
        await harness.aclose()
    data["memory"] = out


async def part_scale(args: argparse.Namespace, engine: str, fixture: Path, tmp: Path, data: dict[str, Any]) -> None:
    from backends_gateway import GatewayLimits

    fx = load_fixture(str(fixture))
    default = GatewayLimits()
    limits = {
        "max_in_flight": max(default.max_in_flight, 2 * args.scale_in_flight),
        "max_sessions": max(default.max_sessions, 2 * args.scale_sessions),
    }
    raised = {k: v for k, v in limits.items() if v != getattr(default, k)}
    data["scale"] = {}
    for loop in args.scale_loops:
        data["scale"][loop] = await _scale(args, engine, fixture, tmp, fx, limits, loop)
        data["scale"][loop]["raised"] = raised


async def _scale(
    args: argparse.Namespace, engine: str, fixture: Path, tmp: Path, fx: Any, limits: dict[str, int], loop: str
) -> dict[str, Any]:
    harness = Harness(fx, timeout=args.scale_timeout + 120)
    worker = Worker("gateway", engine, fixture, tmp, limits=limits, loop=loop)
    try:
        await harness.drive(worker, sessions=8, turns=args.scale_turns, conc=8, tag="sw")
        before = await harness.stats(worker, collect=True)
        deadline = time.monotonic() + args.scale_timeout
        run = await asyncio.wait_for(
            harness.drive(
                worker,
                sessions=args.scale_sessions,
                turns=args.scale_turns,
                conc=args.scale_in_flight,
                tag="s",
                deadline=deadline,
            ),
            args.scale_timeout + 180,
        )
        after = await harness.stats(worker)
    finally:
        worker.close()
        await harness.aclose()
    out = {
        "loop": loop,
        "limits": limits,
        "sessions_asked": args.scale_sessions,
        "in_flight_asked": args.scale_in_flight,
        "turns_per_session": args.scale_turns,
        "timeout_s": args.scale_timeout,
        "open_sessions": after["open_sessions"] - before["open_sessions"],
        "gateway_in_flight_max_sampled": after["in_flight_seen"],
        "rss_baseline_mb": before["rss_kb"] / 1024,
        "rss_end_mb": after["rss_kb"] / 1024,
        "peak_rss_mb": after["hwm_kb"] / 1024,
        **run,
    }
    print(f"  scale ({loop}): {out}", file=sys.stderr, flush=True)
    return out


# -- the store (its own process, core 0) --------------------------------------------------------------------


async def store_main(config: dict[str, Any]) -> dict[str, Any]:
    """``record_turn`` alone on each store kind (``sqlite``: a fresh file per batch; ``postgres``: a fresh database
    per batch on a PostgreSQL server this worker starts, default ``fsync``/``synchronous_commit``): ``rounds`` ×
    concurrency 1 and ``conc``. The CPU is this process's (the PostgreSQL server's own processes are not in it)."""

    from backends_core import Client, ClientConfig, SamplingParams
    from backends_gateway import TurnRecord, TurnRequest
    from backends_testkit.postgres import PostgresServer

    fx = load_fixture(config["fixture"])
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0)
    cfg = ClientConfig(backend="vllm", base_url=config["engine"], model=c.MODEL, tokenizer=fx["tokenizer"])
    async with Client(cfg) as client:  # a real turn 3 of the workload
        messages: list[Message] = list(fx["variants"][0])
        result = None
        for k in range(3):
            if k:
                messages = [*messages, client.parse_completion(result), fx["users"][k - 1]]  # type: ignore[arg-type]
            result = await client.generate(messages=messages, sampling=sampling, previous=result)
        assert result is not None
        reply = client.parse_completion(result)
    request = TurnRequest(messages=messages, sampling=sampling)
    base = TurnRecord.of(
        result, session="s", turn=0, branch=0, parent=None, request=request, reply=reply, model=c.MODEL
    )
    from backends_gateway.store import _turn_row

    row_bytes = sum(len(v) if isinstance(v, bytes | str) else 8 for v in _turn_row(base) if v is not None)
    tmp = Path(config["tmp"])
    out: dict[str, Any] = {
        "record": {
            "messages": len(messages),
            "prompt_ids": len(result.prompt_ids),
            "completion_ids": len(result.completion_ids),
            "message_spans": len(result.message_spans),
            "row_bytes": row_bytes,
        },
        "rounds": [],
    }
    kinds = config.get("kinds", ["sqlite"])
    server = PostgresServer().start() if "postgres" in kinds else None
    try:
        await _store_rounds(config, kinds, server, base, tmp, out)
    finally:
        if server is not None:
            server.stop()
    return out


async def _store_rounds(
    config: dict[str, Any],
    kinds: list[str],
    server: Any,
    base: Any,
    tmp: Path,
    out: dict[str, Any],
) -> None:
    import attrs

    from backends_gateway import Branch, SessionRecord, open_store

    for r in range(config["rounds"]):
        results = {}
        for kind, conc in c.shuffled([(k, n) for k in kinds for n in config["conc"]], r):
            n = config["n"][str(conc)]
            path = tmp / f"store-{r}-{conc}.db"
            spec = path if kind == "sqlite" else server.create_database(f"bench_{r}_{conc}")
            store = open_store(spec)
            await store.open()
            sessions = [SessionRecord(id=f"s{i}") for i in range(conc)]
            await asyncio.gather(*(store.create_session(s) for s in sessions))
            per = -(-n // conc)
            records = [
                [attrs.evolve(base, session=s.id, turn=k, parent=k - 1 if k else None) for k in range(per)]
                for s in sessions
            ]
            branches = [
                Branch(session=s.id, branch=0, parent_branch=None, parent_turn=None, reason="first", created=0.0)
                for s in sessions
            ]

            cpu0, wall0 = time.process_time(), time.perf_counter()
            await asyncio.gather(*(_record_all(store, *x) for x in zip(sessions, records, branches, strict=True)))
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
            await store.aclose()
            size = path.stat().st_size if kind == "sqlite" else 0
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(OSError):
                    os.unlink(f"{path}{suffix}")
            turns = per * conc
            results[f"{kind}:{conc}"] = {
                "turns": turns,
                "turns_per_s": turns / wall,
                "cpu_us_per_turn": cpu / turns * 1e6,
                "wall_s": wall,
                "file_mb": size / 1e6,
            }
            print(f"  store {kind} c={conc}: {results[f'{kind}:{conc}']}", file=sys.stderr, flush=True)
        out["rounds"].append(results)


async def _record_all(store: Any, session: Any, turns: list[Any], branch: Any) -> None:
    """One session's turns, one after another (its ``counts`` updated as the gateway does)."""
    for k, turn in enumerate(turns):
        session.counts = {**session.counts, "turns": k + 1}
        await store.record_turn(turn, session, branch if k == 0 else None)


def part_store(args: argparse.Namespace, engine: str, fixture: Path, tmp: Path, data: dict[str, Any]) -> None:
    config = {
        "engine": engine,
        "fixture": str(fixture),
        "tmp": str(tmp),
        "rounds": args.store_rounds,
        "conc": [1, args.store_conc],
        "n": {"1": args.store_n1, str(args.store_conc): args.store_nc},
        "kinds": args.store_kinds.split(","),
    }
    out = subprocess.run(
        [sys.executable, __file__, "--store-worker", json.dumps(config)], stdout=subprocess.PIPE, text=True, check=True
    )
    data["store"] = json.loads(out.stdout.strip().splitlines()[-1])


# -- report -------------------------------------------------------------------------------------------------


def report(data: dict[str, Any]) -> str:
    m = data["machine"]
    lines = [f"{m['date']} · {m['cpu']} · {m['cores']} cores · {m['cpu_pressure_at_start']}"]
    rounds = data.get("turns") or []
    if rounds:
        keys = [k for k in rounds[0] if "|" in k and not k.endswith("|threads")]
        concs = sorted({int(k.split("|")[1]) for k in keys})
        rows = []
        for conc in concs:
            for mode in MODES:
                key = f"{mode}|{conc}"
                if key not in rounds[0]:
                    continue
                cpu = [rd[key]["cpu_us_per_turn"] for rd in rounds]
                ratios = []
                for ref in ("direct", "proxy"):
                    if f"{ref}|{conc}" in rounds[0]:
                        values = [rd[key]["cpu_us_per_turn"] / rd[f"{ref}|{conc}"]["cpu_us_per_turn"] for rd in rounds]
                        ratios.append(c.ratio_summary(values))
                    else:
                        ratios.append("-")
                lat = [rd[key]["latency"] for rd in rounds]
                rows.append(
                    [
                        conc,
                        mode,
                        c.summary(cpu),
                        *ratios,
                        c.summary([rd[key]["turns_per_s"] for rd in rounds]),
                        c.summary([x["p50_ms"] for x in lat], "{:.2f}"),
                        c.summary([x["p99_ms"] for x in lat], "{:.2f}"),
                        sum(sum(rd[key]["errors"].values()) for rd in rounds),
                    ]
                )
        headers = ["conc", "worker", "CPU µs/turn", "÷ direct", "÷ proxy", "turns/s", "p50 ms", "p99 ms", "errors"]
        lines += ["", "CPU per turn and latency:", c.table(headers, rows)]
        rows = []
        for conc in concs:
            if f"gateway|{conc}" in rounds[0] and f"direct|{conc}" in rounds[0]:
                cells = [conc]
                for q in ("p50_ms", "p99_ms"):
                    added = [rd[f"gateway|{conc}"]["latency"][q] - rd[f"direct|{conc}"]["latency"][q] for rd in rounds]
                    cells.append(c.summary(added, "{:.2f}"))
                rows.append(cells)
        lines += ["", "added latency (gateway − direct), ms:", c.table(["conc", "p50", "p99"], rows)]
    if data.get("anthropic"):
        rounds = data["anthropic"]
        rows = []
        for conc in sorted({int(k.split("|")[1]) for k in rounds[0] if "|" in k}):
            openai, messages = [
                [rd[f"{api}|{conc}"]["cpu_us_per_turn"] for rd in rounds] for api in ("openai", "anthropic")
            ]
            ratios = [m / o for m, o in zip(messages, openai, strict=True)]
            rows.append([conc, c.summary(openai), c.summary(messages), c.ratio_summary(ratios)])
        headers = ["conc", "chat completions µs/turn", "messages µs/turn", "messages ÷ chat completions"]
        lines += ["", "gateway CPU per turn by API:", c.table(headers, rows)]
    if "profile" in data:
        p = data["profile"]
        lines += [
            "",
            f"profile (gateway, c={p['conc']}, {p['turns']} turns): process {p['process_cpu_us_per_turn_profiled']:.0f}"
            f" µs/turn under the profiler, loop thread profiled {p['loop_thread_profiled_us_per_turn']:.0f} µs/turn",
            "threads µs/turn: " + ", ".join(f"{k} {v:.0f}" for k, v in p["threads_us_per_turn"].items() if v > 0.5),
            "own time by package:",
        ]
        lines += [f"  {name:<28} {share * 100:5.1f} %" for name, share in p["by_package"]]
        lines += ["top own time (µs/turn, calls):"]
        lines += [f"  {e['own_us_per_turn']:7.1f} {e['calls']:>8} {e['function']}" for e in p["top_own"]]
        lines += ["top cumulative (µs/turn):"]
        lines += [f"  {e['cum_us_per_turn']:7.1f} {e['calls']:>8} {e['function']}" for e in p["top_cumulative"]]
        rows = [
            [
                x["turn"],
                x["messages"],
                x["prompt_ids"],
                f"{x['rendered_spans_ms']:.2f}",
                f"{x['render_text_ms']:.3f}",
                f"{x['chain_digests_ms']:.3f}",
            ]
            for x in p["spans_cost"]
        ]
        headers = ["turn", "messages", "prompt ids", "rendered_spans ms", "one render ms", "chain_digests ms"]
        lines += ["message spans of a prompt rendered whole (no profiler):", c.table(headers, rows)]
    if "breakdown" in data:
        b = data["breakdown"]
        labels = [label for *_, label in TIMED]
        rows = []
        for mode in ("direct", "gateway"):
            runs = b.get(mode, [])
            if not runs:
                continue
            rows.append([mode, "process CPU", c.summary([x["process_us_per_turn"] for x in runs])])
            for name in sorted({k for x in runs for k in x["threads_us_per_turn"]}):
                rows.append([mode, f"thread {name}", c.summary([x["threads_us_per_turn"].get(name, 0) for x in runs])])
            for label in [*labels, *(f"gc, generation {g}" for g in range(3))]:
                if any(label in x["pieces_us_per_turn"] for x in runs):
                    values = [x["pieces_us_per_turn"].get(label, 0.0) for x in runs]
                    rows.append([mode, label.replace("  ", "· "), c.summary(values)])
        lines += ["", "breakdown at c=1 (µs per turn, loop thread CPU unless a thread is named):"]
        lines += [c.table(["worker", "piece", "µs/turn"], rows)]
    if "memory" in data:
        rows = [
            [
                label,
                v["sessions"],
                v["turns"],
                f"{v['rss_before_mb']:.0f}",
                f"{v['rss_after_mb']:.0f}",
                f"{v['kb_per_session']:.1f}",
            ]
            for label, v in data["memory"].items()
        ]
        lines += [
            "",
            "memory per open session:",
            c.table(["gateway", "sessions", "turns", "RSS before MB", "after MB", "KB per session"], rows),
        ]
    for loop, s in data.get("scale", {}).items():
        lines += [
            "",
            f"scale, gateway on {loop}: {s['sessions']} sessions ({s['open_sessions']} open), {s['turns']} turns, "
            f"{s['max_in_flight']} in flight (gateway {s['gateway_in_flight_max_sampled']}), errors {s['errors']}, "
            f"{s['turns_per_s']:.0f} turns/s over {s['wall_s']:.0f} s, peak RSS {s['peak_rss_mb']:.0f} MB "
            f"(baseline {s['rss_baseline_mb']:.0f}), p50 {s['latency'].get('p50_ms', 0):.0f} ms, "
            f"p99 {s['latency'].get('p99_ms', 0):.0f} ms, max {s['latency'].get('max_ms', 0):.0f} ms, "
            f"{s['slow_10s']} turns over 10 s; limits raised: {s['raised'] or 'none'}",
        ]
    if "store" in data:
        st = data["store"]
        rows = []
        for conc in st["rounds"][0]:
            rows.append(
                [
                    conc,
                    c.summary([rd[conc]["turns_per_s"] for rd in st["rounds"]]),
                    c.summary([rd[conc]["cpu_us_per_turn"] for rd in st["rounds"]]),
                ]
            )
        lines += ["", f"store (record {st['record']}):", c.table(["store:sessions", "turns/s", "CPU µs/turn"], rows)]
    return "\n".join(lines)


def versions() -> dict[str, str]:
    import sqlite3
    from importlib.metadata import PackageNotFoundError, version

    out = {"sqlite": sqlite3.sqlite_version}
    for name in (
        "backends-core",
        "backends-vllm",
        "backends-gateway",
        "aiohttp",
        "orjson",
        "numpy",
        "uvloop",
        "psutil",
    ):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "-"
    return out


async def main(args: argparse.Namespace) -> None:
    c.pin(1)  # the harness beside the instant server; workers take core 0
    data: dict[str, Any] = {"machine": c.machine(), "versions": versions(), "args": vars(args)}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-gateway-", dir=args.tmp) as tmp_name:
        tmp = Path(tmp_name)
        fixture = tmp / "fixture.json"
        build_fixture(fixture, max(args.turns, args.memory_turns, args.scale_turns))
        with c.ServerProcess() as server:
            engine = server.url("multiturn")
            if "cpu" in args.parts or "latency" in args.parts:
                await part_turns(args, engine, fixture, tmp, data)
            if "profile" in args.parts:
                await part_profile(args, engine, fixture, tmp, data)
            if "breakdown" in args.parts:
                await part_breakdown(args, engine, fixture, tmp, data)
            if "memory" in args.parts:
                await part_memory(args, engine, fixture, tmp, data)
            if "scale" in args.parts:
                await part_scale(args, engine, fixture, tmp, data)
            if "store" in args.parts:
                part_store(args, engine, fixture, tmp, data)
            if "anthropic" in args.parts:
                await part_anthropic(args, engine, fixture, tmp, data)
    data["wall_s"] = time.monotonic() - started
    data["cpu_pressure_at_end"] = c.cpu_pressure()
    c.save(args.out, data)
    print(report(data))


def run_like_cli(main: Any, loop: str | None = None) -> Any:
    """``main`` on uvloop where it is installed, else asyncio's loop, as ``backends gateway`` runs
    (``loop="asyncio"``: asyncio's loop anyway)."""
    if loop == "asyncio":
        return asyncio.run(main)
    try:
        import uvloop
    except ModuleNotFoundError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="cpu,latency,profile,breakdown,memory,scale,store")
    parser.add_argument("--breakdown-rounds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--turns", type=int, default=4, help="turns per session (cpu, latency, profile)")
    parser.add_argument("--sessions", default="1:50,64:192,256:512", help="sessions per measured batch, by concurrency")
    parser.add_argument("--cpu-conc", default="1,64")
    parser.add_argument("--latency-conc", default="1,256")
    parser.add_argument("--profile-conc", type=int, default=64)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--keep-profile", default=None, help="copy the gateway's cProfile stats to this file")
    parser.add_argument("--memory-sessions", type=int, default=2000)
    parser.add_argument("--memory-turns", type=int, default=3)
    parser.add_argument("--memory-trace", action="store_true", help="memory: also a run under tracemalloc (by line)")
    parser.add_argument("--scale-sessions", type=int, default=10_000)
    parser.add_argument("--scale-in-flight", type=int, default=1000)
    parser.add_argument("--scale-turns", type=int, default=2)
    parser.add_argument("--scale-timeout", type=float, default=300.0, help="no new scale turn starts after it (s)")
    parser.add_argument("--scale-loops", default="uvloop,asyncio", help="the gateway's event loop(s) for scale")
    parser.add_argument("--store-rounds", type=int, default=3)
    parser.add_argument("--store-conc", type=int, default=256)
    parser.add_argument("--store-kinds", default="sqlite,postgres", help="the stores to measure (sqlite,postgres)")
    parser.add_argument("--store-n1", type=int, default=300, help="turns recorded at concurrency 1")
    parser.add_argument("--store-nc", type=int, default=5120, help="turns recorded at --store-conc")
    parser.add_argument("--tmp", default=None, help="where the store files go (default: the system's temp dir)")
    parser.add_argument("--out", default="gateway")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--store-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.parts = args.parts.split(",")
    args.cpu_conc = [int(x) for x in args.cpu_conc.split(",")]
    args.scale_loops = args.scale_loops.split(",")
    args.latency_conc = [int(x) for x in args.latency_conc.split(",")]
    unknown = set(args.parts) - {"cpu", "latency", "profile", "breakdown", "memory", "scale", "store", "anthropic"}
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}")
    return args


if __name__ == "__main__":
    if "--worker" in sys.argv:
        c.pin(0)
        worker_config = json.loads(sys.argv[sys.argv.index("--worker") + 1])
        run_like_cli(worker_main(worker_config), worker_config.get("loop"))
    elif "--store-worker" in sys.argv:
        c.pin(0)
        result = run_like_cli(store_main(json.loads(sys.argv[sys.argv.index("--store-worker") + 1])))
        print(json.dumps(result))
    else:
        run_like_cli(main(parse_args()))
