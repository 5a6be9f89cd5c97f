"""Scale: requests/s and peak RSS with 1,000 and 10,000 requests in flight against the instant server.

    uv run python bench/bench_scale.py [--reps 2] [--sizes 1000,10000] [--clients ours_ids,floor_httpx,renderers_ids]

Every sample is a fresh process (``--worker``): imports, one client, 8 warm-up calls, then baseline = VmRSS;
``asyncio.gather`` of N generate calls started at once, results kept (as an RL batch would), then peak = VmHWM.
requests/s = N / wall time of the burst. Memory per in-flight request = (peak − baseline) / N. Clients as in
bench_client.py (library-default pools for ours: 1,024 connections; 1,000 for the others). Bodies: ``plain`` at
both sizes, ``re`` (routed experts, 1,279 × 48 × 8) at 1,000 only: our client keeps the decoded uint8 array
(491 KB), the floor a 655 KB base64 ``str``, renderers a memoryview of the 681 KB body.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _common as c


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return -1


async def worker(client: str, n: int, body: str, url: str) -> dict[str, Any]:
    from bench_client import Fixture, make_factory

    fx = Fixture()
    call, close = await make_factory(client, url, body, fx)()
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
    parser.add_argument("--worker", nargs=4, metavar=("CLIENT", "N", "BODY", "URL"))
    args = parser.parse_args()
    if args.worker:
        c.pin(0)
        client, n, body, url = args.worker
        print(json.dumps(asyncio.run(worker(client, int(n), body, url))))
        return
    sizes = [int(x) for x in args.sizes.split(",")]
    clients = args.clients.split(",")
    cases = [(cl, n, "plain") for n in sizes for cl in clients] + [(cl, min(sizes), "re") for cl in clients]
    samples: dict[str, list[dict[str, Any]]] = {f"{cl}|{n}|{b}": [] for cl, n, b in cases}
    with c.ServerProcess() as server:
        for rep in range(args.reps):
            for cl, n, b in c.shuffled(cases, rep):
                port = "re_obj" if b == "re" and cl.startswith("renderers") else b
                cmd = [sys.executable, __file__, "--worker", cl, str(n), b, server.url(port)]
                out = subprocess.run(cmd, capture_output=True, text=True, check=False)
                if out.returncode != 0:
                    print(f"{cl} {n} {b} failed: {out.stderr[-2000:]}", file=sys.stderr)
                    continue
                samples[f"{cl}|{n}|{b}"].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)
    data = {"machine": c.machine(), "samples": samples}
    c.save("scale", data)
    m = data["machine"]
    print(f"{m['date']} · {m['cpu']} · {m['cores']} cores · {m['cpu_pressure_at_start']}")
    rows = []
    for cl, n, b in cases:
        s = samples[f"{cl}|{n}|{b}"]
        if not s:
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
