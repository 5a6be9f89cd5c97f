"""Fleet fan-out and admin latency under load.

    uv run python bench/bench_fleet.py [--rounds 5] [--servers 64] [--streams 2000]

Servers are emulated by ``bench/instant.py`` in its own process (real sockets, vLLM's admin routes):

1. **Fan-out**: ``admin.pause(mode="wait")`` → ``admin.update_weights(path, version=…)`` → ``admin.resume()``
   (4 HTTP calls per server: pause, collective_rpc reload, update_weight_version, resume), and the whole
   ``admin.weight_sync`` (+ flush and the version check: one GET, 6 calls per server),
   each server answering every admin call after 50 ms: total wall time over 64 servers vs over one server
   (per-round ratio). One server's floor is 200 ms (4 sequential 50 ms calls) for the first and 300 ms for
   weight_sync (6 sequential). The client CPU per admin call divides by the
   admin calls the emulated servers answered during the operation.
2. **Admin latency under load**: ``admin.health()`` and ``admin.state()`` (5 concurrent GETs) latency on one
   server answering admin routes at once, idle vs with 2,000 generation requests in flight on the same client
   and server (the server holds them: 1,024 on connections, the rest queued in the client's data pool).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from typing import Any

import _common as c
import httpx


def make_client(urls: list[str], *, lean: bool = False) -> Any:
    from backends_core import Client, ClientConfig

    config = ClientConfig(backend="vllm", base_url=urls, model=c.MODEL)
    if not lean:
        return Client(config)
    from lean_transport import LeanTransport

    return Client(
        config, transport=LeanTransport(limits=httpx.Limits(max_connections=1024, max_keepalive_connections=1024))
    )


async def fan_out(urls: list[str], rounds: int, *, lean: bool = False) -> dict[str, list[float]]:
    """Wall seconds of each operation, and the client's CPU seconds during it (``cpu_…``); ``construct``: wall
    seconds to build the ``Client`` (one admin pool per server). ``lean``: the client on the hand-written transport
    it used before aiohttp (``lean_transport.py``), for a paired comparison."""
    out: dict[str, list[float]] = {
        "pause_update_resume": [],
        "weight_sync": [],
        "cpu_pause_update_resume": [],
        "cpu_weight_sync": [],
        "calls_pause_update_resume": [],
        "calls_weight_sync": [],
        "construct": [],
    }

    started = time.perf_counter()
    client = make_client(urls, lean=lean)
    out["construct"].append(time.perf_counter() - started)
    async with client:
        await client.admin.health()  # connections up
        for r in range(rounds):
            calls = c.admin_calls(urls[0])
            started, cpu = time.perf_counter(), time.process_time()
            await client.admin.pause(mode="wait")
            await client.admin.update_weights("/ckpt/step", version=f"v{r}")
            await client.admin.resume()
            out["pause_update_resume"].append(time.perf_counter() - started)
            out["cpu_pause_update_resume"].append(time.process_time() - cpu)
            out["calls_pause_update_resume"].append(c.admin_calls(urls[0]) - calls)
            calls = c.admin_calls(urls[0])
            started, cpu = time.perf_counter(), time.process_time()
            await client.admin.weight_sync(path="/ckpt/step", version=f"w{r}", mode="wait")
            out["weight_sync"].append(time.perf_counter() - started)
            out["cpu_weight_sync"].append(time.process_time() - cpu)
            out["calls_weight_sync"].append(c.admin_calls(urls[0]) - calls)
    return out


async def latencies(client: Any, n: int) -> dict[str, float]:
    health, state = [], []
    for _ in range(n):
        t = time.perf_counter()
        await client.admin.health()
        health.append(time.perf_counter() - t)
        t = time.perf_counter()
        await client.admin.state()
        state.append(time.perf_counter() - t)
    return {"health": statistics.median(health), "state": statistics.median(state)}


async def under_load(url: str, streams: int, rounds: int, fx_ids: list[int]) -> dict[str, Any]:
    from backends_core import SamplingParams

    out: dict[str, Any] = {"idle": [], "load": [], "in_flight_on_server": []}
    sampling = SamplingParams(max_tokens=c.COMPLETION_TOKENS)
    # the control client's connection stays open (a new one may wait long while 1,024 generation connections open)
    control_limits = httpx.Limits(keepalive_expiry=3600)
    async with (
        make_client([url]) as client,
        httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=control_limits) as control,
    ):
        await client.admin.health()
        for _ in range(rounds):
            await control.post(url + "/bench/release")
            out["idle"].append(await latencies(client, 20))
            await control.post(url + "/bench/hold")
            tasks = [
                asyncio.ensure_future(client.generate(prompt_ids=fx_ids, sampling=sampling)) for _ in range(streams)
            ]
            held, last = 0, -1
            deadline = time.perf_counter() + 120
            while time.perf_counter() < deadline:  # until the server stops receiving new requests
                await asyncio.sleep(0.5)
                held = (await control.get(url + "/bench/stats")).json()["held"]
                if held == last and held > 0:
                    break
                last = held
            out["in_flight_on_server"].append(held)
            out["load"].append(await latencies(client, 20))
            await control.post(url + "/bench/release")
            results = await asyncio.gather(*tasks)
            assert len(results) == streams
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--servers", type=int, default=64)
    parser.add_argument("--streams", type=int, default=2000)
    parser.add_argument("--delay", type=float, default=0.05)
    args = parser.parse_args()
    c.pin(0)
    tok = c.tokenizer()
    ids = c.render_ids(tok, c.chat_messages(tok))
    data: dict[str, Any] = {"machine": c.machine(), "args": vars(args)}
    with c.ServerProcess("--admin", str(args.servers), "--admin-delay", str(args.delay)) as fleet:
        urls = [fleet.url(f"admin{i}") for i in range(args.servers)]
        one: dict[str, list[float]] = {}
        many: dict[str, list[float]] = {}
        before: dict[str, list[float]] = {}  # 64 servers, the client on the lean transport
        for r in range(args.rounds):  # alternate, so all see the same machine
            for key, value in (await fan_out(urls[:1], 1)).items():
                one.setdefault(key, []).extend(value)
            for key, value in (await fan_out(urls, 1)).items():
                many.setdefault(key, []).extend(value)
            for key, value in (await fan_out(urls, 1, lean=True)).items():
                before.setdefault(key, []).extend(value)
            print(f"fan-out round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    data["fan_out"] = {"one": one, "many": many, "many_lean": before}
    c.save("fleet", data)  # kept even if the load part fails
    with c.ServerProcess("--hold") as server:
        data["load"] = await under_load(server.url("hold"), args.streams, args.rounds, ids)
    c.save("fleet", data)
    m = data["machine"]
    print(f"{m['date']} · {m['cpu']} · {m['cores']} cores · {m['cpu_pressure_at_start']}")
    rows = []
    for key in ("pause_update_resume", "weight_sync"):
        ratio = [many[key][i] / one[key][i] for i in range(args.rounds)]
        ratio_before = [before[key][i] / one[key][i] for i in range(args.rounds)]
        rows.append(
            [
                key,
                c.summary([x * 1e3 for x in one[key]]),
                c.summary([x * 1e3 for x in many[key]]),
                c.ratio_summary(ratio),
                c.summary([x * 1e3 for x in before[key]]),
                c.ratio_summary(ratio_before),
            ]
        )
    n = args.servers
    head = ["operation (50 ms per call)", "1 server ms", f"{n} servers ms", "ratio", "lean transport ms", "ratio"]
    print(c.table(head, rows))
    for key in ("pause_update_resume", "weight_sync"):
        cpu = [x / n * 1e6 for x, n in zip(many["cpu_" + key], many["calls_" + key], strict=True)]
        cpu_before = [x / n * 1e6 for x, n in zip(before["cpu_" + key], before["calls_" + key], strict=True)]
        print(
            f"client CPU per admin call during {key} over {args.servers} servers: {c.summary(cpu)} µs"
            f" (lean transport: {c.summary(cpu_before)} µs)"
        )
    build, build_one = (c.summary([x * 1e3 for x in d["construct"]]) for d in (many, one))
    print(f"Client(...) with {args.servers} servers built in {build} ms (1 server: {build_one} ms)")
    load = data["load"]
    rows = []
    for op in ("health", "state"):
        idle = [x[op] * 1e3 for x in load["idle"]]
        busy = [x[op] * 1e3 for x in load["load"]]
        rows.append(
            [
                f"admin.{op}()",
                c.summary(idle, "{:.2f}"),
                c.summary(busy, "{:.2f}"),
                c.ratio_summary([b / i for b, i in zip(busy, idle, strict=True)]),
            ]
        )
    print(f"\nin flight on the server while loaded: {load['in_flight_on_server']} (of {args.streams} streams)")
    print(c.table(["admin call", "idle ms", f"{args.streams} streams in flight ms", "ratio"], rows))


if __name__ == "__main__":
    asyncio.run(main())
