"""The ``backends`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from backends_core.driver import CAPABILITY_HOOKS
from backends_core.errors import BackendError
from backends_core.plugins import available_backends, implemented_hooks, make_plugin_manager

__all__ = ["main"]


def _list(args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    for info in available_backends():
        try:
            pm = make_plugin_manager(info.name)
            caps = sorted(implemented_hooks(pm, pm.get_plugin(info.name)) & CAPABILITY_HOOKS)
            error = None
        except BackendError as exc:
            caps, error = [], str(exc)
        rows.append(
            {
                "name": info.name,
                "distribution": info.distribution,
                "version": info.version,
                "capabilities": caps,
                "error": error,
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print('no backends installed; try: pip install "backends[vllm]"')
        return 0
    for row in rows:
        print(f"{row['name']:<12} {row['distribution']} {row['version']}")
        if row["error"]:
            print(f"  error: {row['error']}")
        else:
            print("  capabilities: " + (", ".join(row["capabilities"]) or "(generate only)"))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from backends_core.demo import run_demo

    return run_demo(
        backend=args.backend,
        urls=args.url or (),
        moe_url=args.moe_url,
        model=args.model,
        models_dir=args.models_dir,
        seed=args.seed,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="backends", description="One client layer between RL trainers and inference servers."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_list = sub.add_parser("list", help="installed backends with version and capabilities")
    p_list.add_argument("--json", action="store_true", help="machine-readable output")
    p_list.set_defaults(func=_list)
    from backends_core.demo import DEFAULT_BACKEND

    p_demo = sub.add_parser("demo", help="run the demo on the embedded default engine, or on real servers with --url")
    p_demo.add_argument("--backend", default=DEFAULT_BACKEND, help=f"backend to demo (default: {DEFAULT_BACKEND})")
    p_demo.add_argument(
        "--url", action="append", help="a real server serving the tiny dense model (repeat for a fleet)"
    )
    p_demo.add_argument("--moe-url", default=None, help="a real server serving the tiny MoE model with routed experts")
    p_demo.add_argument("--model", default="tiny-qwen3", help="served model name on --url servers")
    p_demo.add_argument("--models-dir", default=None, help="where to build the tiny models (default: a user cache dir)")
    p_demo.add_argument("--seed", type=int, default=0)
    p_demo.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except BackendError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
