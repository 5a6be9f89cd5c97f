"""Scale: requests/s and peak RSS with 1,000 and 10,000 requests in flight against the instant server.

    uv run python bench/bench_scale.py [--reps 2] [--sizes 1000,10000] [--clients ours_ids,floor_httpx,renderers_ids]

Every sample is a fresh process (``--worker``): imports, one client, 8 warm-up calls, then baseline = VmRSS;
``asyncio.gather`` of N generate calls started at once, results kept (as an RL batch would), then peak = VmHWM.
requests/s = N / wall time of the burst. Memory per in-flight request = (peak − baseline) / N. Clients as in
bench_client.py (library-default pools for ours: 1,024 connections; 1,000 for the others). Bodies: ``plain`` at
both sizes, ``re`` (routed experts, 1,279 × 48 × 8) at 1,000 only: our client keeps the decoded uint8 array
(491 KB), the floor a 655 KB base64 ``str``, renderers a memoryview of the 681 KB body.

Timeouts are generous so that a slow sample finishes instead of failing: ours runs with the library defaults
(600 s read and pool), the floor and renderers here with 900 s (bench_client.py's 60 s made renderers' queued
requests fail at 10,000 in flight: they wait for one of its 1,000 connections). Every sample is bounded by
``--sample-timeout`` (default 900 s); a sample that fails or runs out of time is recorded as such.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import subprocess
import sys
import time
from typing import Any

import _common as c

from backends_core import SamplingParams


def status_kb(field: str) -> int:
    return c.proc_status_kb(field)


#: Request timeout of the floor and renderers here (seconds): long enough for 10,000 queued requests.
PEER_TIMEOUT = 900.0


def peer_factory(client: str, url: str, body: str, fx: Any) -> Any:
    """bench_client.py's floor and renderers clients with :data:`PEER_TIMEOUT` instead of 60 s (same pools)."""
    if client == "floor_httpx":

        async def floor() -> Any:
            import httpx

            limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100, keepalive_expiry=3600)
            http = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(PEER_TIMEOUT))
            target, headers = url + "/inference/v1/generate", {"content-type": "application/json"}

            async def call() -> Any:
                return json.loads((await http.post(target, content=fx.request_body, headers=headers)).content)

            return call, http.aclose

        return floor
    if client == "renderers_ids":

        async def renderers() -> Any:
            import httpx2
            import openai
            from renderers import Qwen3Renderer
            from renderers.client import generate

            http = openai.DefaultAsyncHttpxClient(
                limits=httpx2.Limits(max_connections=1000, max_keepalive_connections=100, keepalive_expiry=3600),
                timeout=httpx2.Timeout(PEER_TIMEOUT),
            )
            oc = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, http_client=http)
            renderer = Qwen3Renderer(fx.tok)
            sampling = {"max_tokens": c.COMPLETION_TOKENS, "temperature": 1.0}

            async def call() -> Any:
                return await generate(
                    client=oc,
                    renderer=renderer,
                    messages=fx.messages,
                    model=c.MODEL,
                    prompt_ids=fx.prompt_ids,
                    sampling_params=sampling,
                    sampling=SamplingParams(max_tokens=16),
                )

            return call, oc.close

        return renderers
    return None


async def worker(client: str, n: int, body: str, url: str) -> dict[str, Any]:
    from bench_client import Fixture, make_factory

    fx = Fixture()
    factory = peer_factory(client, url, body, fx) or make_factory(client, url, body, fx)
    call, close = await factory()
    for _ in range(8):
        await call()
    gc.collect()
    baseline = status_kb("VmRSS")
    started = time.perf_counter()
    results = await asyncio.gather(*(call() for _ in range(n)))
    wall = time.perf_counter() - started
    peak = status_kb("VmHWM")
    assert len(results) == n
    await close()
    return {"rps": n / wall, "wall_s": wall, "baseline_mb": baseline / 1024, "peak_mb": peak / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--sizes", default="1000,10000")
    parser.add_argument("--clients", default="ours_ids,floor_httpx,renderers_ids")
    parser.add_argument("--sample-timeout", type=float, default=900.0, help="seconds one sample may take")
    parser.add_argument("--re", action=argparse.BooleanOptionalAction, default=True, help="routed-experts body too")
    parser.add_argument("--worker", nargs=4, metavar=("CLIENT", "N", "BODY", "URL"))
    args = parser.parse_args()
    if args.worker:
        c.pin(0)
        client, n, body, url = args.worker
        print(json.dumps(asyncio.run(worker(client, int(n), body, url))))
        return
    sizes = [int(x) for x in args.sizes.split(",")]
    clients = args.clients.split(",")
    cases = [(cl, n, "plain") for n in sizes for cl in clients]
    if args.re:
        cases += [(cl, min(sizes), "re") for cl in clients]
    samples: dict[str, list[dict[str, Any]]] = {f"{cl}|{n}|{b}": [] for cl, n, b in cases}
    failures: dict[str, list[str]] = {}
    machine = c.machine()
    with c.ServerProcess() as server:
        for rep in range(args.reps):
            for cl, n, b in c.shuffled(cases, rep):
                key = f"{cl}|{n}|{b}"
                port = "re_obj" if b == "re" and cl.startswith("renderers") else b
                cmd = [sys.executable, __file__, "--worker", cl, str(n), b, server.url(port)]
                try:
                    out = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=args.sample_timeout)
                except subprocess.TimeoutExpired:
                    failures.setdefault(key, []).append(f"did not finish in {args.sample_timeout:.0f} s")
                    print(f"{key} did not finish in {args.sample_timeout:.0f} s", file=sys.stderr, flush=True)
                    continue
                if out.returncode != 0:
                    failures.setdefault(key, []).append(out.stderr.strip().splitlines()[-1] if out.stderr else "?")
                    print(f"{key} failed: {out.stderr[-2000:]}", file=sys.stderr, flush=True)
                    continue
                samples[key].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(f"{key}: {samples[key][-1]}", file=sys.stderr, flush=True)
            print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)
    data = {"machine": machine, "args": vars(args), "samples": samples, "failures": failures}
    c.save("scale", data)
    m = data["machine"]
    print(f"{m['date']} · {m['cpu']} · {m['cores']} cores · {m['cpu_pressure_at_start']}")
    rows = []
    for cl, n, b in cases:
        s = samples[f"{cl}|{n}|{b}"]
        if not s:
            rows.append([b, n, cl, "failed: " + "; ".join(failures.get(f"{cl}|{n}|{b}", [])), "", "", ""])
            continue
        rows.append(
            [
                b,
                n,
                cl,
                c.summary([x["rps"] for x in s]),
                c.summary([x["baseline_mb"] for x in s]),
                c.summary([x["peak_mb"] for x in s]),
                c.summary([(x["peak_mb"] - x["baseline_mb"]) * 1024 / n for x in s], "{:.1f}"),
            ]
        )
    print(c.table(["body", "in flight", "client", "requests/s", "baseline MB", "peak RSS MB", "KB per request"], rows))


if __name__ == "__main__":
    main()
