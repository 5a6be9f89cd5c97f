"""The ``backends`` command line.

Exit codes scripts can trust: 0 success; 1 an operation failed (on any server); 2 bad usage, configuration or
input. ``--json`` prints machine-readable output on stdout; progress goes to stderr.

Configuration comes in layers (:meth:`ClientConfig.load`): ``--config FILE`` (TOML/JSON; ``--section`` picks a
table), else ``$BACKENDS_CONFIG``; over it ``$BACKENDS_URL``, ``$BACKENDS_BACKEND``, ``$BACKENDS_MODEL``,
``$BACKENDS_TOKENIZER``; over those the flags ``--url``, ``--backend``, ``--model``, ``--tokenizer``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from backends_core.client import Client
from backends_core.config import ClientConfig
from backends_core.driver import CAPABILITY_HOOKS
from backends_core.errors import AdminError, BackendError, ConfigError, InvalidRequestError
from backends_core.plugins import available_backends, implemented_hooks, make_plugin_manager
from backends_core.types import GenerateResult, LoraAdapter, SamplingParams

__all__ = ["main"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class Progress:
    """A one-line progress counter on stderr (only when stderr is a terminal)."""

    def __init__(self, label: str, total: int | None = None) -> None:
        self.label, self.total, self.done = label, total, 0
        self.enabled = sys.stderr.isatty()

    def step(self, n: int = 1) -> None:
        self.done += n
        if self.enabled:
            of = f"/{self.total}" if self.total is not None else ""
            print(f"\r{self.label}: {self.done}{of}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled:
            print(file=sys.stderr)


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
    """The config file, then ``$BACKENDS_*``, then the flags (:meth:`ClientConfig.load`)."""
    flags = {"backend": args.backend, "base_url": args.url, "model": args.model, "tokenizer": args.tokenizer}
    return ClientConfig.load(args.config, section=args.section, flags=flags)


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


def _jsonl(path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"{path}:{n}: not JSON: {exc.msg}") from exc
            if not isinstance(record, dict):
                raise InvalidRequestError(f"{path}:{n}: each line must be a JSON object")
            yield n, record


def _write_jsonl(path: str, rows: Sequence[dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


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


def _rollout(args: argparse.Namespace) -> int:
    records = list(_jsonl(args.input))

    async def body(client: Client) -> int:
        limit = asyncio.Semaphore(args.concurrency)
        progress = Progress("rollout", len(records))
        routed: dict[str, np.ndarray] = {}

        async def one(n: int, record: dict[str, Any]) -> list[dict[str, Any]]:
            key = str(record.get("id", n))
            size = record.get("n", args.n)
            sampling = SamplingParams(
                **{
                    "max_tokens": args.max_tokens,
                    "temperature": args.temperature,
                    "seed": args.seed,
                    "top_logprobs": args.top_logprobs,
                    **record.get("sampling", {}),
                }
            )
            async with limit:
                try:
                    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                        raise InvalidRequestError(f"line {n}: n must be an int >= 1, got {size!r}")
                    results = await client.generate_group(
                        messages=record["messages"],
                        tools=record.get("tools"),
                        n=size,
                        sampling=sampling,
                        return_routed_experts=args.routed_experts,
                        session=key,
                    )
                except (BackendError, KeyError) as exc:
                    return [{"id": key, "error": f"{type(exc).__name__}: {exc}"}]
                finally:
                    progress.step()
            rows = []
            for i, result in enumerate(results):
                extra: dict[str, Any] = {"id": key} if size == 1 else {"id": key, "sample": i}
                if result.routed_experts is not None:
                    routed[key if size == 1 else f"{key}/{i}"] = np.asarray(result.routed_experts.experts)
                rows.append(_result_record(result, **extra))
            return rows

        groups = await asyncio.gather(*(one(n, r) for n, r in records))
        rows = [row for group in groups for row in group]
        progress.close()
        _write_jsonl(args.output, rows)
        if routed:
            save_npz: Any = np.savez
            save_npz(Path(args.output).with_suffix(".routed_experts.npz"), **routed)
        failed = sum("error" in row for row in rows)
        print(f"{len(rows) - failed} ok, {failed} failed -> {args.output}", file=sys.stderr)
        return EXIT_FAILED if failed else EXIT_OK

    return _run(args, body)


def _teacher(args: argparse.Namespace) -> int:
    records = list(_jsonl(args.input))

    async def body(client: Client) -> int:
        limit = asyncio.Semaphore(args.concurrency)
        progress = Progress("teacher", len(records))

        async def one(n: int, record: dict[str, Any]) -> dict[str, Any]:
            key = str(record.get("id", n))
            async with limit:
                try:
                    scored = await client.teacher_logprobs(record["token_ids"], top_logprobs=args.top_logprobs)
                except (BackendError, KeyError) as exc:
                    return {"id": key, "error": f"{type(exc).__name__}: {exc}"}
                finally:
                    progress.step()
            return {"id": key, "token_ids": list(scored.token_ids), "logprobs": [None, *scored.logprobs[1:].tolist()]}

        rows = await asyncio.gather(*(one(n, r) for n, r in records))
        progress.close()
        _write_jsonl(args.output, rows)
        return EXIT_FAILED if any("error" in row for row in rows) else EXIT_OK

    return _run(args, body)


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

    p = sub.add_parser("rollout", help="JSONL of conversations in, JSONL of results out (+ .npz routed experts)")
    _client_flags(p)
    _sampling_flags(p)
    p.add_argument("input", help='JSONL: {"id"?, "messages": [...], "tools"?, "sampling"?: {...}, "n"?} per line')
    p.add_argument(
        "output",
        help='JSONL of results (ids, logprobs, finish reasons); a group gives one line per sample with "sample": i',
    )
    p.add_argument(
        "--n",
        type=int,
        default=1,
        help="group size: samples per conversation (generate_group; sample i seeded with --seed + i), "
        'overridden by a line\'s "n"',
    )
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument(
        "--routed-experts", action="store_true", help="ask for MoE routing; saved to OUTPUT.routed_experts.npz"
    )
    p.set_defaults(func=_rollout)

    p = sub.add_parser("teacher", help="score a JSONL of token sequences with teacher logprobs")
    _client_flags(p)
    p.add_argument("input", help='JSONL: {"id"?, "token_ids": [...]} per line')
    p.add_argument("output", help='JSONL: {"id", "token_ids", "logprobs": [null, ...]}')
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--top-logprobs", type=int, default=0)
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
