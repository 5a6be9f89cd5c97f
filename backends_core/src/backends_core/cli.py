"""The ``backends`` command line.

Exit codes scripts can trust: 0 success; 1 an operation failed (on any server); 2 bad usage, configuration or
input. ``--json`` prints machine-readable output on stdout; progress goes to stderr.

Configuration comes from ``--config FILE`` (TOML/JSON; ``--section`` picks a table), else ``$BACKENDS_CONFIG``,
and flags (``--backend``, ``--url``, ``--model``, ``--tokenizer``) override it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from backends_core import runs
from backends_core.client import Client
from backends_core.config import ClientConfig
from backends_core.driver import CAPABILITY_HOOKS
from backends_core.errors import AdminError, BackendError, ConfigError, InvalidRequestError
from backends_core.plugins import available_backends, implemented_hooks, make_plugin_manager
from backends_core.types import GenerateResult, LoraAdapter, SamplingParams

__all__ = ["main"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _out(args: argparse.Namespace, value: Any, text: str) -> None:
    print(json.dumps(value, default=_jsonable) if args.json else text)


def _jsonable(value: Any) -> Any:
    if attrs.has(type(value)):
        return attrs.asdict(
            value, value_serializer=lambda _i, _a, v: _jsonable(v) if isinstance(v, np.ndarray | BaseException) else v
        )
    if isinstance(value, np.ndarray):
        return [None if isinstance(x, float) and x != x else x for x in value.tolist()]
    if isinstance(value, BaseException):
        return f"{type(value).__name__}: {value}"
    raise TypeError(f"cannot serialise {type(value).__name__}")


def _config(args: argparse.Namespace) -> ClientConfig:
    path = args.config or os.environ.get("BACKENDS_CONFIG")
    data: dict[str, Any] = ClientConfig.from_file(path, section=args.section).to_mapping() if path else {}
    for flag, key in (("backend", "backend"), ("model", "model"), ("tokenizer", "tokenizer")):
        if getattr(args, flag, None):
            data[key] = getattr(args, flag)
    if getattr(args, "url", None):
        data["base_url"] = args.url
    if "backend" not in data or "base_url" not in data:
        raise ConfigError(["give --backend and --url, or a --config file (or $BACKENDS_CONFIG) that sets them"])
    return ClientConfig.from_mapping(data)


def _run(args: argparse.Namespace, body: Callable[[Client], Awaitable[int]]) -> int:
    async def go() -> int:
        async with Client(_config(args)) as client:
            return await body(client)

    return asyncio.run(go())


def _sampling(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed, top_logprobs=args.top_logprobs
    )


def _result_record(result: GenerateResult, **extra: Any) -> dict[str, Any]:
    return {
        **extra,
        "prompt_ids": list(result.prompt_ids),
        "completion_ids": list(result.completion_ids),
        "logprobs": result.logprobs.tolist(),
        "finish_reason": result.finish_reason,
        "stop_reason": result.stop_reason,
        "weight_version": result.weight_version,
        "server": result.server,
        "request_id": result.request_id,
    }


# -- commands --------------------------------------------------------------------------------------------


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
        return EXIT_OK
    if not rows:
        print('no backends installed; try: pip install "backends[vllm]"')
    for row in rows:
        print(f"{row['name']:<12} {row['distribution']} {row['version']}")
        print(
            f"  error: {row['error']}"
            if row["error"]
            else "  capabilities: " + (", ".join(row["capabilities"]) or "(generate only)")
        )
    return EXIT_OK


def _state(args: argparse.Namespace) -> int:
    async def body(client: Client) -> int:
        reports = await client.admin.fleet_state()
        lines = []
        for r in reports:
            s = r.state
            detail = (
                (
                    f"paused={s.paused} sleeping={s.sleeping} version={s.weight_version} in_flight={s.in_flight} "
                    f"loras={list(s.loras or ())}"
                )
                if s
                else ""
            )
            lines.append(
                f"{r.server}: {'up' if r.reachable else 'DOWN'} ready={r.ready} {detail}"
                + (f" error={r.error}" if r.error else "")
            )
        _out(args, {"servers": reports, "capabilities": sorted(client.capabilities)}, "\n".join(lines))
        return EXIT_OK if all(r.reachable and r.error is None for r in reports) else EXIT_FAILED

    return _run(args, body)


def _admin_op(
    name: str, call: Callable[[Client, argparse.Namespace], Awaitable[Any]]
) -> Callable[[argparse.Namespace], int]:
    def command(args: argparse.Namespace) -> int:
        async def body(client: Client) -> int:
            values = await call(client, args)
            _out(
                args,
                {"operation": name, "servers": client.base_urls, "results": values},
                "\n".join(f"{url}: ok" for url in client.base_urls),
            )
            return EXIT_OK

        return _run(args, body)

    return command


def _update_weights(client: Client, args: argparse.Namespace) -> Awaitable[Any]:
    if args.sync:
        return client.admin.weight_sync(path=args.path, version=args.version, mode=args.mode)
    return client.admin.update_weights(args.path, version=args.version)


def _generate(args: argparse.Namespace) -> int:
    async def body(client: Client) -> int:
        if args.prompt_ids:
            ids = [int(x) for x in args.prompt_ids.split(",")]
            result = await client.generate(prompt_ids=ids, sampling=_sampling(args))
        else:
            result = await client.generate(
                messages=[{"role": "user", "content": args.prompt}], sampling=_sampling(args)
            )
        text = (
            client.tokenizer.decode(list(result.completion_ids))
            if (client.config.tokenizer or client.config.model)
            else ""
        )
        _out(
            args,
            _result_record(result, text=text),
            f"{text}\n[{len(result.completion_ids)} tokens, {result.finish_reason}]",
        )
        return EXIT_OK

    return _run(args, body)


def _run_options(args: argparse.Namespace) -> runs.RunOptions:
    return runs.RunOptions(
        input=args.input,
        output=args.output,
        concurrency=args.concurrency,
        resume=args.resume,
        overwrite=args.overwrite,
        on_bad_row=args.on_bad_row,
        json=args.json,
        log_every=args.log_every,
    )


def _rollout(args: argparse.Namespace) -> int:
    base = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_logprobs=args.top_logprobs)
    job = runs.RolloutJob(
        sampling={"max_tokens": base.max_tokens, "temperature": base.temperature, "top_logprobs": base.top_logprobs},
        seed=args.seed,
        n=args.n,
        routed_experts=args.routed_experts,
    )
    return runs.execute(job, _run_options(args), lambda: _config(args))


def _teacher(args: argparse.Namespace) -> int:
    job = runs.TeacherJob(top_logprobs=args.top_logprobs)
    return runs.execute(job, _run_options(args), lambda: _config(args))


def _check_tokenizer(args: argparse.Namespace) -> int:
    messages = (
        json.loads(Path(args.messages).read_text()) if args.messages else [{"role": "user", "content": args.prompt}]
    )

    async def body(client: Client) -> int:
        check = await client.check_tokenizer(messages)
        if check.match:
            text = f"match: {len(check.local_ids)} tokens agree"
        else:
            text = (
                f"MISMATCH at position {check.first_difference}: "
                f"local {check.local_token!r} vs server {check.server_token!r}"
            )
        _out(args, check, text)
        return EXIT_OK if check.match else EXIT_FAILED

    return _run(args, body)


DEMO_HINT = 'the demo runs on the test kit\'s embedded engine: pip install "backends-core[testing]"'


def _demo(args: argparse.Namespace) -> int:
    try:
        from backends_testkit.demo import run_demo
    except ModuleNotFoundError as exc:
        if exc.name is None or not exc.name.startswith("backends_testkit"):
            raise
        print(f"error: {DEMO_HINT}", file=sys.stderr)
        return EXIT_USAGE

    return run_demo(
        backend=args.backend,
        urls=args.url or (),
        moe_url=args.moe_url,
        model=args.model,
        models_dir=args.models_dir,
        seed=args.seed,
    )


# -- parser ----------------------------------------------------------------------------------------------


def _client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML/JSON client config (default: $BACKENDS_CONFIG)")
    p.add_argument("--section", default=None, help="table of the config file holding the client config")
    p.add_argument("--backend", help="backend name (overrides the config)")
    p.add_argument("--url", action="append", help="server base URL (repeat for a fleet; overrides the config)")
    p.add_argument("--model", help="served model name")
    p.add_argument("--tokenizer", help="local tokenizer directory (to render messages)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--top-logprobs", type=int, default=0)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _run_flags(p: argparse.ArgumentParser) -> None:
    """The flags of file-to-file runs (rollout, teacher): see backends_core.runs."""
    p.add_argument("--concurrency", type=_positive_int, default=64, help="records in flight at once")
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep OUTPUT's finished records and run the rest (failed or cut-off records run again)",
    )
    p.add_argument("--overwrite", action="store_true", help="start OUTPUT over if it exists")
    p.add_argument(
        "--on-bad-row",
        choices=["refuse", "skip"],
        default="refuse",
        help="a bad input row: refuse (default: report every bad row, send nothing, exit 2) or skip (report it, "
        "run the others, exit 2 at the end); a repeated id is always refused",
    )
    p.add_argument(
        "--log-every",
        type=float,
        default=10.0,
        help="seconds between progress lines on stderr when it is not a terminal (0: every record)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="backends", description="One client layer between RL trainers and inference servers."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("list", help="installed backends with version and capabilities")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_list)

    for name, help_ in (("state", "aggregated state of every server"), ("health", "alias of state")):
        p = sub.add_parser(name, help=help_)
        _client_flags(p)
        p.set_defaults(func=_state)

    p = sub.add_parser("pause", help="pause generation on every server")
    _client_flags(p)
    p.add_argument("--mode", choices=["abort", "wait", "keep"], default="wait")
    p.set_defaults(func=_admin_op("pause", lambda c, a: c.admin.pause(a.mode)))

    p = sub.add_parser("resume", help="resume generation on every server")
    _client_flags(p)
    p.set_defaults(func=_admin_op("resume", lambda c, a: c.admin.resume()))

    p = sub.add_parser("update-weights", help="load weights from a directory on every server")
    _client_flags(p)
    p.add_argument("path", help="checkpoint directory as the servers see it")
    p.add_argument("--version", required=True, help="the new weight version")
    p.add_argument("--sync", action="store_true", help="full weight sync: pause, update, flush, resume in finally")
    p.add_argument("--mode", choices=["abort", "wait", "keep"], default="wait", help="pause mode with --sync")
    p.set_defaults(func=_admin_op("update-weights", _update_weights))

    p = sub.add_parser("load-lora", help="load (or with --replace hot-swap) a LoRA adapter on every server")
    _client_flags(p)
    p.add_argument("name")
    p.add_argument("path")
    p.add_argument("--replace", action="store_true")
    p.set_defaults(
        func=_admin_op(
            "load-lora", lambda c, a: c.admin.load_lora(LoraAdapter(name=a.name, path=a.path, replace=a.replace))
        )
    )

    p = sub.add_parser("unload-lora", help="unload a LoRA adapter on every server")
    _client_flags(p)
    p.add_argument("name")
    p.set_defaults(func=_admin_op("unload-lora", lambda c, a: c.admin.unload_lora(a.name)))

    p = sub.add_parser("generate", help="one generation")
    _client_flags(p)
    _sampling_flags(p)
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt", help="a user message (rendered with the chat template)")
    group.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    p.set_defaults(func=_generate)

    p = sub.add_parser(
        "rollout",
        help="JSONL of conversations in, JSONL of results appended as each finishes (+ .npz routed experts)",
    )
    _client_flags(p)
    _sampling_flags(p)
    p.add_argument(
        "input",
        help='JSONL: {"id"?, "messages": [...], "tools"?, "sampling"?: {...}, "n"?, "metadata"?} per line '
        "(id defaults to the line number)",
    )
    p.add_argument(
        "output",
        help="JSONL of results in the order they finish (ids, logprobs, finish reasons, top_logprobs when asked); "
        'a group gives one line per sample with "sample": i; a failed record gives {"id", "error"}',
    )
    p.add_argument(
        "--n",
        type=_positive_int,
        default=1,
        help="group size: samples per conversation (generate_group; sample i seeded with the record's seed + i), "
        'overridden by a line\'s "n"',
    )
    p.add_argument(
        "--routed-experts", action="store_true", help="ask for MoE routing; saved to OUTPUT.routed_experts.npz"
    )
    _run_flags(p)
    p.set_defaults(func=_rollout)

    p = sub.add_parser("teacher", help="score a JSONL of token sequences with teacher logprobs")
    _client_flags(p)
    p.add_argument("input", help='JSONL: {"id"?, "token_ids": [...], "metadata"?} per line')
    p.add_argument(
        "output", help='JSONL appended as each finishes: {"id", "token_ids", "logprobs": [null, ...], "top_logprobs"?}'
    )
    p.add_argument(
        "--top-logprobs", type=int, default=0, help="alternatives per position to write (0: none; index 0 empty)"
    )
    _run_flags(p)
    p.set_defaults(func=_teacher)

    p = sub.add_parser("check-tokenizer", help="compare local chat-template rendering with the server's /tokenize")
    _client_flags(p)
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt", help="a user message")
    group.add_argument("--messages", help="a JSON file with a list of messages")
    p.set_defaults(func=_check_tokenizer)

    p = sub.add_parser("demo", help="the demo on the embedded default engine, or on real servers with --url")
    p.add_argument("--backend", default="vllm", help="backend to demo (default: vllm)")
    p.add_argument("--url", action="append", help="a real server serving the tiny dense model (repeat for a fleet)")
    p.add_argument("--moe-url", default=None, help="a real server serving the tiny MoE model with routed experts")
    p.add_argument("--model", default="tiny-qwen3", help="served model name on --url servers")
    p.add_argument("--models-dir", default=None, help="where to build the tiny models (default: a user cache dir)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ConfigError, InvalidRequestError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except AdminError as exc:
        print(f"error: {exc}", file=sys.stderr)
        for outcome in exc.results:
            verdict = "ok" if outcome.ok else f"FAILED: {type(outcome.error).__name__}: {outcome.error}"
            print(f"  {outcome.server}: {verdict}", file=sys.stderr)
        if exc.state:
            print(f"  state: {exc.state}", file=sys.stderr)
        return EXIT_FAILED
    except BackendError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
