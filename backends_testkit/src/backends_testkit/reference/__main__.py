"""Serve the reference engine on a real port: ``python -m backends_testkit.reference --model DIR [--port N]``.

Prints ``listening on http://host:port`` once ready (``--port 0`` picks a free port), then serves until
interrupted. Used by live tests and by anyone who wants a real server speaking the reference dialect.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib

from backends_testkit.engine import ReferenceEngine
from backends_testkit.reference.emulator import ReferenceEmulator


async def _serve(model: str, host: str, port: int, seed: int, name: str | None) -> None:
    engine = ReferenceEngine(model, seed=seed)
    emulator = ReferenceEmulator(engine, model_name=name)
    async with emulator.serve(host=host, port=port) as url:
        print(f"listening on {url}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await emulator.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m backends_testkit.reference")
    parser.add_argument("--model", required=True, help="tiny model directory (see backends_testkit.tinymodel)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--served-model-name", default=None)
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args.model, args.host, args.port, args.seed, args.served_model_name))


if __name__ == "__main__":
    main()
