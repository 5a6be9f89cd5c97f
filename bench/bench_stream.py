"""What streaming and the synchronous client cost over a plain generate call, against the instant server.

    uv run python bench/bench_stream.py [--rounds 5] [--n1 200] [--nc 640] [--clients ...] [--out stream]

The same sample every time (1,024 prompt ids, 256 completion tokens with logprobs, vLLM backend, default
transport ``/inference/v1/generate``), measured as client CPU per call (``time.process_time``, all threads, so
the :class:`SyncClient`'s loop thread is counted) and calls/s:

* ``ours_ids``: ``await Client.generate(prompt_ids=…)`` (the plain answer, one JSON body);
* ``ours_stream``: ``async with Client.stream(prompt_ids=…) as s: async for delta in s`` with every delta consumed
  (its ids and logprobs read), then ``s.result``; the server sends the same sample as vLLM 0.32 streams it (one
  Server-Sent Event per token, the usage chunk, ``[DONE]``; each event one HTTP chunk written on its own, see
  ``instant.py``);
* ``ours_sync``: ``SyncClient.generate(prompt_ids=…)`` from a plain thread (no event loop in it), concurrency 1
  only (a blocking caller makes one call at a time);
* ``floor_ids`` / ``floor_stream``: the floors beside them, a bare ``aiohttp.ClientSession`` posting pre-built
  request bytes, then ``orjson.loads`` of the body / of each event's data (the body's pieces split at blank lines,
  up to ``[DONE]``): what any Python client on aiohttp at least pays for the same answer.

Concurrency 1 and 64 (``--conc``) for the async clients. Each batch gets its own client (pool) and an unmeasured
warm-up of 2×concurrency calls; batches run in a shuffled order each round, each async batch on a fresh event
loop. Ratios are taken per round (same round and concurrency): ``stream ÷ ids`` (CPU), ``sync − ids`` (µs of
CPU per call) and each of ours ÷ its floor, then median [min-max]. ``--stream-step-ms`` is passed to the instant
server (a delay between streamed events; 0: each event in its own server loop iteration). The client is pinned to
core 0 and the server to core 1 on a 2-core machine.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import _common as c
import orjson

ASYNC_CLIENTS = ("ours_ids", "ours_stream", "floor_ids", "floor_stream")
CLIENTS = (*ASYNC_CLIENTS, "ours_sync")


class Fixture:
    def __init__(self) -> None:
        self.tok = c.tokenizer()
        self.prompt_ids = c.render_ids(self.tok, c.chat_messages(self.tok))
        self.completion = c.completion_ids(self.tok)
        self.stop = c.stop_token_ids(self.tok)
        self.request_body = orjson.dumps(
            {
                "model": c.MODEL,
                "token_ids": self.prompt_ids,
                "sampling_params": {
                    "max_tokens": c.COMPLETION_TOKENS,
                    "temperature": 1.0,
                    "stop_token_ids": self.stop,
                    "logprobs": 0,
                    "skip_special_tokens": False,
                },
            }
        )

    def sampling(self) -> Any:
        from backends_core import SamplingParams

        return SamplingParams(max_tokens=c.COMPLETION_TOKENS, temperature=1.0, stop_token_ids=self.stop)

    def config(self, url: str) -> Any:
        from backends_core import ClientConfig

        return ClientConfig(backend="vllm", base_url=url, model=c.MODEL)

    def check(self, result: Any) -> None:
        assert list(result.completion_ids) == self.completion and list(result.prompt_ids) == self.prompt_ids
        assert len(result.logprobs) == len(self.completion)


async def floor_client(name: str, url: str, fx: Fixture) -> tuple[Callable[[], Awaitable[Any]], Any]:
    import aiohttp

    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1000, keepalive_timeout=3600))
    target = url + "/inference/v1/generate"
    headers = {"content-type": "application/json"}
    plain, streamed = fx.request_body, fx.request_body[:-1] + b',"stream":true}'

    if name == "floor_ids":

        async def call() -> Any:
            async with session.post(target, data=plain, headers=headers) as r:
                return orjson.loads(await r.read())

    else:

        async def call() -> Any:
            events = []
            pending = b""
            async with session.post(target, data=streamed, headers=headers) as r:
                async for piece in r.content.iter_any():
                    *done, pending = (pending + piece).split(b"\n\n")
                    for event in done:
                        if event == b"data: [DONE]":
                            return events
                        events.append(orjson.loads(event[6:]))
            return events

    await call()
    return call, session


async def async_client(name: str, url: str, fx: Fixture) -> tuple[Callable[[], Awaitable[Any]], Any]:
    if name.startswith("floor"):
        return await floor_client(name, url, fx)
    from backends_core import Client

    client = Client(fx.config(url), tokenizer=fx.tok)
    sampling = fx.sampling()

    if name == "ours_ids":

        async def call() -> Any:
            return await client.generate(prompt_ids=fx.prompt_ids, sampling=sampling)

    elif name == "ours_stream":

        async def call() -> Any:
            n = 0
            async with client.stream(prompt_ids=fx.prompt_ids, sampling=sampling) as s:
                async for delta in s:  # every delta consumed: its ids and logprobs read
                    n += len(delta.completion_ids)
                    delta.logprobs.sum()
            assert n == len(fx.completion)
            return s.result

    else:
        raise ValueError(name)
    fx.check(await call())
    return call, client


async def measure_async(name: str, url: str, fx: Fixture, n: int, conc: int) -> tuple[float, float]:
    call, client = await async_client(name, url, fx)

    async def batch(calls: int) -> None:
        remaining = iter(range(calls))

        async def worker() -> None:
            for _ in remaining:
                await call()

        await asyncio.gather(*(worker() for _ in range(conc)))

    try:
        await batch(2 * conc)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        await batch(n)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    finally:
        await (client.close() if name.startswith("floor") else client.aclose())
    return cpu / n * 1e6, n / wall


def measure_sync(url: str, fx: Fixture, n: int) -> tuple[float, float]:
    from backends_core import SyncClient

    sampling = fx.sampling()
    with SyncClient(fx.config(url), tokenizer=fx.tok) as client:
        fx.check(client.generate(prompt_ids=fx.prompt_ids, sampling=sampling))
        for _ in range(2):
            client.generate(prompt_ids=fx.prompt_ids, sampling=sampling)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for _ in range(n):
            client.generate(prompt_ids=fx.prompt_ids, sampling=sampling)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return cpu / n * 1e6, n / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--n1", type=int, default=200, help="calls per batch at concurrency 1")
    parser.add_argument("--nc", type=int, default=640, help="calls per batch at concurrency 64")
    parser.add_argument("--clients", default=",".join(CLIENTS))
    parser.add_argument("--conc", default="1,64")
    parser.add_argument("--stream-step-ms", type=float, default=0.0)
    parser.add_argument("--out", default="stream")
    args = parser.parse_args()
    c.pin(0)
    fx = Fixture()
    clients = args.clients.split(",")
    concs = [int(x) for x in args.conc.split(",")]
    data: dict[str, Any] = {"machine": c.machine(), "args": vars(args), "rounds": []}
    with c.ServerProcess("--stream-step-ms", str(args.stream_step_ms)) as server:
        url = server.url("plain")
        batches = [(cl, k) for cl in clients for k in concs if cl in ASYNC_CLIENTS or k == 1]
        for r in range(args.rounds):
            results: dict[str, list[float]] = {}
            for cl, k in c.shuffled(batches, r):
                n = args.n1 if k == 1 else args.nc
                if cl == "ours_sync":
                    cpu, rate = measure_sync(url, fx, n)
                else:
                    cpu, rate = asyncio.run(measure_async(cl, url, fx, n, k))
                results[f"{cl}|{k}"] = [cpu, rate]
            data["rounds"].append(results)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    data["machine"]["cpu_pressure_at_end"] = c.machine()["cpu_pressure_at_start"]
    c.save(args.out, data)
    print(report(data))


def report(data: dict[str, Any]) -> str:
    rounds = data["rounds"]
    keys = list(rounds[0])
    order = {cl: i for i, cl in enumerate(CLIENTS)}
    keys.sort(key=lambda key: (int(key.split("|")[1]), order.get(key.split("|")[0], 99)))
    headers = ["conc", "client", "CPU µs/call", "calls/s", "CPU ÷ ours_ids", "CPU − ours_ids (µs)", "CPU ÷ its floor"]
    floors = {"ours_ids": "floor_ids", "ours_stream": "floor_stream", "ours_sync": "floor_ids"}
    rows = []
    for key in keys:
        cl, k = key.split("|")
        base = f"ours_ids|{k}"
        cpu = [rd[key][0] for rd in rounds]
        rate = [rd[key][1] for rd in rounds]
        ratio = diff = "-"
        if base in rounds[0]:
            ratio = c.ratio_summary([rd[key][0] / rd[base][0] for rd in rounds])
            diff = c.summary([rd[key][0] - rd[base][0] for rd in rounds])
        floor = f"{floors.get(cl)}|{k}"
        to_floor = "-"
        if floor in rounds[0]:
            to_floor = c.ratio_summary([rd[key][0] / rd[floor][0] for rd in rounds])
        rows.append([k, cl, c.summary(cpu), c.summary(rate), ratio, diff, to_floor])
    m = data["machine"]
    return (
        f"{m['date']} · {m['cpu']} · {m['cores']} cores · pressure at start {m['cpu_pressure_at_start']}"
        f" · at end {m.get('cpu_pressure_at_end')}\n" + c.table(headers, rows)
    )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--report":
        import json

        with open(sys.argv[2]) as f:
            print(report(json.load(f)))
    else:
        main()
