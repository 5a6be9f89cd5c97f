"""Paired fleet fan-out of two versions of the code: ``bench_fleet.py``'s fan-out, before and after, alternated.

    git archive <before-commit> | tar -x -C /tmp/before
    uv run python bench/pair_fleet.py --before /tmp/before [--rounds 6] [--servers 64] [--out fleet_pair]

One emulated fleet (``instant.py --admin N``, 50 ms per admin call); each round runs one fresh client process per
side (the order alternates between rounds), each timing pause → update → resume and ``weight_sync`` over one server
and over N servers (``bench_fleet.fan_out``, one round each). The "before" process imports the packages of the
``--before`` tree (``PYTHONPATH`` ahead of the workspace's editable installs); the "after" one this checkout.
Prints, per side, the 64-vs-1 ratio, the client CPU per admin call (divided by the admin calls the servers answered)
and the admin calls per server, then the after ÷ before ratio of the ratios per round; the raw numbers and the CPU
pressure of each round go to ``bench/results/<out>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import _common as c

PACKAGES = ("backends_core", "backends_vllm", "backends_sglang", "backends_dynamo", "backends_testkit")


async def child(urls: list[str]) -> None:
    """One side of one round: the fan-out over one server, then over all of ``urls``, as JSON on stdout."""
    from bench_fleet import fan_out

    import backends_core

    c.pin(0)
    one = await fan_out(urls[:1], 1)
    many = await fan_out(urls, 1)
    print(json.dumps({"one": one, "many": many, "code": backends_core.__file__}))


def side(urls: list[str], before: Path | None) -> dict[str, Any]:
    env = dict(os.environ)
    if before is not None:
        env["PYTHONPATH"] = os.pathsep.join(str(before / p / "src") for p in PACKAGES)
    out = subprocess.run(
        [sys.executable, __file__, "--child", *urls], env=env, capture_output=True, text=True, check=False
    )
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, help="a tree of the code before (git archive of a commit)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--servers", type=int, default=64)
    parser.add_argument("--delay", type=float, default=0.05)
    parser.add_argument("--out", default="fleet_pair")
    parser.add_argument("--child", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        asyncio.run(child(args.child))
        return
    if args.before is None:
        parser.error("--before is required")
    data: dict[str, Any] = {"machine": c.machine(), "args": {**vars(args), "before": str(args.before)}}
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    pressure = []
    with c.ServerProcess("--admin", str(args.servers), "--admin-delay", str(args.delay)) as fleet:
        urls = [fleet.url(f"admin{i}") for i in range(args.servers)]
        for r in range(args.rounds):
            pressure.append(Path("/proc/pressure/cpu").read_text().splitlines()[0])
            order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
            for name in order:
                runs[name].append(side(urls, args.before if name == "before" else None))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    data.update(runs=runs, cpu_pressure_per_round=pressure)
    c.save(args.out, data)
    n = args.servers
    for name, samples in runs.items():
        print(f"{name}: {samples[0]['code']}")
        for key in ("pause_update_resume", "weight_sync"):
            ratio = [s["many"][key][0] / s["one"][key][0] for s in samples]
            cpu = [s["many"]["cpu_" + key][0] / s["many"]["calls_" + key][0] * 1e6 for s in samples]
            calls = sorted({s["many"]["calls_" + key][0] // n for s in samples})
            print(
                f"  {key}: {n} vs 1 server {c.ratio_summary(ratio)}; 1 server "
                f"{c.summary([s['one'][key][0] * 1e3 for s in samples])} ms, {n} servers "
                f"{c.summary([s['many'][key][0] * 1e3 for s in samples])} ms; client CPU per admin call "
                f"{c.summary(cpu)} µs; admin calls per server {calls}"
            )
    for key in ("pause_update_resume", "weight_sync"):
        paired = [
            (a["many"][key][0] / a["one"][key][0]) / (b["many"][key][0] / b["one"][key][0])
            for a, b in zip(runs["after"], runs["before"], strict=True)
        ]
        print(f"after ÷ before, {key} ratio per round: {c.ratio_summary(paired)}")
    print("CPU pressure per round:", pressure)


if __name__ == "__main__":
    main()
