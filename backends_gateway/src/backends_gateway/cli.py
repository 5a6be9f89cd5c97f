"""``backends gateway``: serve the gateway over a client config; ``backends gateway export``: a store's
trajectories as a dataset (one row per branch).

Registered as a verb of the ``backends`` command (entry point group ``backends_core.cli``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import resource
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import IO, Any

import attrs
import orjson

from backends_core import Client
from backends_core.cli_common import (
    EXIT_OK,
    UsageError,
    add_client_flags,
    add_json_flag,
    client_config,
    emit,
    nonnegative_int,
    positive_int,
)
from backends_gateway.app import serve
from backends_gateway.gateway import Gateway, GatewayLimits
from backends_gateway.keys import Keys, KeysError
from backends_gateway.store import SQLiteStore
from backends_gateway.stores import open_store
from backends_gateway.trajectory import Trajectories

__all__ = ["export_rows", "register"]

DEFAULT_STORE = "backends-gateway.db"
_LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})
_LIMIT_FLAGS = {f.name: f.default for f in attrs.fields(GatewayLimits)}
#: what a limit without a number defaults to
_FROM_MODEL = {
    "context_length": "max_position_embeddings of the model's config.json",
    "max_completion_tokens": "the context length",
}


def register(sub: Any) -> None:
    """Add ``gateway`` (and its ``export``) to the ``backends`` command's subparsers."""
    p = sub.add_parser(
        "gateway",
        help="a capture gateway over a client config: harnesses in, exact token trajectories out",
        description="Serve OpenAI's chat completions and Responses API and Anthropic's Messages API over the "
        "configured backend; every turn is kept in --store. "
        "'backends gateway export' writes a store's trajectories as JSONL or Parquet.",
    )
    add_client_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=nonnegative_int, default=8080, help="port (default: 8080; 0: a free one)")
    p.add_argument(
        "--store",
        default=DEFAULT_STORE,
        help=f"the SQLite store file (default: ./{DEFAULT_STORE}), or a postgresql://user@host/db URL (replicas)",
    )
    p.add_argument(
        "--keys",
        default=None,
        metavar="FILE",
        help="a TOML file of bearer keys ([trainer] and [harness] tables, name = key): harness keys see only their "
        "own sessions, the trainer key everything (default: no keys; anyone who reaches the port may call it)",
    )
    p.add_argument(
        "--allowed-hosts",
        default="",
        metavar="NAMES",
        help="comma-separated Host names the gateway answers to besides localhost, 127.0.0.1 and ::1 (listening on "
        "loopback, any other Host is refused as a DNS rebinding; listening elsewhere, any Host is answered unless "
        "names are given)",
    )
    for name, default in _LIMIT_FLAGS.items():
        shown = default if default is not None else _FROM_MODEL.get(name, "none")
        p.add_argument(
            f"--{name.replace('_', '-')}", type=positive_int, default=default, help=f"limit (default: {shown})"
        )
    p.set_defaults(func=_serve)
    actions = p.add_subparsers(dest="gateway_command", metavar="{export}")
    e = actions.add_parser("export", help="write a store's trajectories, one row per branch (JSONL or Parquet)")
    e.add_argument(
        "--store", dest="export_store", default=DEFAULT_STORE, help="the store file (or postgresql:// URL) to read"
    )
    e.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl", help="output format (default: jsonl)")
    e.add_argument("--output", "-o", required=True, help="the file to write ('-': stdout, JSONL only)")
    e.add_argument("--group", default=None, help="only sessions of this group")
    e.add_argument(
        "--status", choices=["closed", "open", "all"], default="closed", help="which sessions (default: closed)"
    )
    add_json_flag(e)
    e.set_defaults(func=_export)


def _raise_file_limit() -> None:
    """Every connection holds a file descriptor: take the hard limit the system allows, not the soft default
    (1,024 on many systems, 256 on some), so a rollout batch's connections are not what stops the gateway."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft < wanted:
        with contextlib.suppress(ValueError, OSError):  # a system that refuses keeps its limit
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def _limits(args: argparse.Namespace) -> GatewayLimits:
    return GatewayLimits(**{name: getattr(args, name) for name in _LIMIT_FLAGS})


def _serve(args: argparse.Namespace) -> int:
    if args.port > 65535:
        raise UsageError(f"argument --port: must be in [0, 65535], got {args.port}")
    loaded = client_config(args)
    # the gateway keeps each session's turns itself (the client's stateless cache would remember them twice)
    config = attrs.evolve(loaded, stateless=attrs.evolve(loaded.stateless, enabled=False))
    limits = _limits(args)
    try:
        store = open_store(args.store)
    except ValueError as exc:
        raise UsageError(f"argument --store: {exc}") from None

    where = store.where
    try:
        keys = None if args.keys is None else Keys.from_file(args.keys)
    except KeysError as exc:
        raise UsageError(f"argument --keys: {exc}") from None
    hosts = [name.strip() for name in args.allowed_hosts.split(",") if name.strip()]
    if keys is None and args.host not in _LOOPBACK:
        print(
            f"warning: listening on {args.host} without --keys: anyone who reaches the port can send turns and read "
            "every session",
            file=sys.stderr,
        )

    _raise_file_limit()

    async def run() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        try:
            async with (
                Client(config) as client,
                Gateway(client, store, limits=limits) as gateway,
                serve(gateway, host=args.host, port=args.port, keys=keys, allowed_hosts=hosts) as url,
            ):
                # what is loaded now (tokenizer, templates, parsers) lives as long as the process: kept out of the
                # collector's full passes, which would otherwise walk it and stall every turn in flight
                gc.collect()
                gc.freeze()
                ready = {"url": url, "store": where, "model": config.model}
                emit(args, ready, f"gateway at {url} (OpenAI base_url {url}/v1), store {where} (Ctrl-C stops it)")
                sys.stdout.flush()
                await stop.wait()
        finally:
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(signum)
        return EXIT_OK

    return _run(run)


def _run(main: Callable[[], Coroutine[Any, Any, int]]) -> int:
    """``main()`` on asyncio's own event loop: uvloop costs less CPU per turn but, measured, served a burst of
    connections unevenly (some harnesses waiting until the burst ended; bench/README.md)."""
    return asyncio.run(main())


def export_rows(reader: Trajectories, *, group: str | None, status: str | None) -> Any:
    """One dict per branch of every chosen session: the training view and the session's summary (a branch's
    images as ``data:`` URLs, a remote one as its URL, each widened at its ``[start, end]`` of ``image_spans``)."""
    for trajectory in reader.sessions(group=group, status=status):
        for sample in trajectory.samples:
            yield {
                "session": trajectory.session,
                "group": trajectory.group,
                "status": trajectory.status,
                "reward": trajectory.reward,
                "branch": sample.branch,
                "parent_branch": sample.parent_branch,
                "parent_turn": sample.parent_turn,
                "reason": sample.reason,
                "turns": list(sample.turns),
                "weight_versions": list(sample.weight_versions),
                "finish_reason": sample.finish_reason,
                "input_ids": sample.input_ids.tolist(),
                "loss_mask": sample.loss_mask.tolist(),
                "logprobs": sample.logprobs.tolist(),
                "image_spans": [[span.start, span.end] for span in sample.image_spans],
                "images": [image.data_url() for image in sample.images],
            }


def _export(args: argparse.Namespace) -> int:
    try:
        store = open_store(args.export_store)
    except ValueError as exc:
        raise UsageError(f"argument --store: {exc}") from None
    if isinstance(store, SQLiteStore) and not store.path.is_file():
        raise UsageError(f"argument --store: no gateway store at {store.path}")
    reader = Trajectories(args.export_store)
    rows = export_rows(reader, group=args.group, status=None if args.status == "all" else args.status)
    count = 0
    if args.format == "jsonl":
        out: IO[bytes]
        with sys.stdout.buffer if args.output == "-" else open(args.output, "wb") as out:
            for row in rows:
                out.write(orjson.dumps(row) + b"\n")
                count += 1
    else:
        if args.output == "-":
            raise UsageError("argument --output: parquet is written to a file, not stdout")
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.Table.from_pylist(list(rows), schema=_parquet_schema(pa))
        pq.write_table(table, args.output)
        count = table.num_rows
    if args.output != "-":
        emit(args, {"rows": count, "output": args.output}, f"{count} branches written to {args.output}")
    return EXIT_OK


def _parquet_schema(pa: Any) -> Any:
    return pa.schema(
        [
            ("session", pa.string()),
            ("group", pa.string()),
            ("status", pa.string()),
            ("reward", pa.float64()),
            ("branch", pa.int32()),
            ("parent_branch", pa.int32()),
            ("parent_turn", pa.int32()),
            ("reason", pa.string()),
            ("turns", pa.list_(pa.int32())),
            ("weight_versions", pa.list_(pa.string())),
            ("finish_reason", pa.string()),
            ("input_ids", pa.list_(pa.int32())),
            ("loss_mask", pa.list_(pa.uint8())),
            ("logprobs", pa.list_(pa.float32())),
            ("image_spans", pa.list_(pa.list_(pa.int32()))),
            ("images", pa.list_(pa.string())),
        ]
    )
