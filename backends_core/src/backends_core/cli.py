"""The ``backends`` command line.

Exit codes scripts can trust: 0 success; 1 an operation failed (on any server); 2 bad usage, configuration or
input (130: interrupted). ``--json`` prints one JSON object per line on stdout and errors as one JSON object on
stderr; progress goes to stderr. The shared machinery (exit codes, JSON output, error reporting, checked argument
types) lives in :mod:`backends_core.cli_common`.

Configuration comes in layers (:meth:`ClientConfig.load`): ``--config FILE`` (TOML/JSON; ``--section`` picks a
table), else ``$BACKENDS_CONFIG``; over it ``$BACKENDS_URL``, ``$BACKENDS_BACKEND``, ``$BACKENDS_MODEL``,
``$BACKENDS_TOKENIZER``; over those the flags ``--url``, ``--backend``, ``--model``, ``--tokenizer``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata as md
import json
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from backends_core import runs
from backends_core.cli_common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    JsonArgumentParser,
    UsageError,
    add_client_flags,
    add_json_flag,
    add_log_level_flag,
    client_config,
    emit,
    int_list,
    nonnegative_int,
    positive_int,
    run_main,
)
from backends_core.client import Client
from backends_core.driver import CAPABILITY_HOOKS
from backends_core.errors import (
    FIRST_PARTY_EXTRAS,
    BackendError,
    BackendNotFoundError,
    ConfigError,
    InvalidRequestError,
)
from backends_core.multiturn.rendering import load_tokenizer
from backends_core.parsing import AUTO, chosen_parser, merge_parsers
from backends_core.plugins import available_backends, implemented_hooks, make_plugin_manager
from backends_core.types import LoraAdapter, SamplingParams

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "build_parser", "main"]


def _run(args: argparse.Namespace, body: Callable[[Client], Awaitable[int]]) -> int:
    async def go() -> int:
        async with Client(client_config(args)) as client:
            return await body(client)

    return asyncio.run(go())


def _sampling(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed, top_logprobs=args.top_logprobs
    )


# -- commands --------------------------------------------------------------------------------------------


def _list(args: argparse.Namespace) -> int:
    template = None
    if args.tokenizer is not None:  # a bad directory is a ConfigError naming it, before anything is listed
        template = getattr(load_tokenizer(args.tokenizer), "chat_template", None) or ""
    rows: list[dict[str, Any]] = []
    for info in available_backends():
        parsers: dict[str, Any] = {}
        try:
            pm = make_plugin_manager(info.name)
            caps = sorted(implemented_hooks(pm, pm.get_plugin(info.name)) & CAPABILITY_HOOKS)
            for kind, found in (("tool", pm.hook.tool_parsers()), ("reasoning", pm.hook.reasoning_parsers())):
                installed = merge_parsers(kind, found)
                parsers[kind] = sorted(installed)
                if template is not None:
                    parsers[f"auto_{kind}"] = chosen_parser(kind, AUTO, installed, template)
            error = None
        except (BackendError, ConfigError) as exc:
            caps, error = [], str(exc)
        rows.append(
            {
                "name": info.name,
                "distribution": info.distribution,
                "version": info.version,
                "capabilities": caps,
                "parsers": parsers,
                "error": error,
            }
        )
    if args.json:
        for row in rows:
            emit(True, row)
        return EXIT_OK
    if not rows:
        print('no backends installed; try: pip install "backends[vllm]"')
    for row in rows:
        print(f"{row['name']:<12} {row['distribution']} {row['version']}")
        if row["error"]:
            print(f"  error: {row['error']}")
            continue
        print("  capabilities: " + (", ".join(row["capabilities"]) or "(generate only)"))
        parsers = row["parsers"]
        line = (
            f"  parsers: tool {', '.join(parsers['tool']) or '-'}; reasoning {', '.join(parsers['reasoning']) or '-'}"
        )
        if template is not None:
            line += f" (auto for {args.tokenizer}: tool {parsers['auto_tool']}, reasoning {parsers['auto_reasoning']})"
        print(line)
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
        if reports.disagreement:
            lines.append("DISAGREEMENT: " + "; ".join(reports.disagreement))
        state = {
            "servers": list(reports),
            "disagreement": reports.disagreement,
            "capabilities": sorted(client.capabilities),
        }
        emit(args, state, "\n".join(lines))
        return EXIT_OK if all(r.reachable and r.error is None for r in reports) else EXIT_FAILED

    return _run(args, body)


def _admin_op(
    name: str, call: Callable[[Client, argparse.Namespace], Awaitable[Any]]
) -> Callable[[argparse.Namespace], int]:
    def command(args: argparse.Namespace) -> int:
        async def body(client: Client) -> int:
            values = await call(client, args)
            emit(
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
    sampling = _sampling(args)  # checked before anything is sent

    async def body(client: Client) -> int:
        # the completion is decoded with the tokenizer a --prompt is rendered with, or with --tokenizer; it is loaded
        # (and a bad one reported) before anything is sent
        tokenizer = client.tokenizer if args.prompt is not None or client.config.tokenizer else None
        if args.prompt_ids:
            result = await client.generate(prompt_ids=args.prompt_ids, sampling=sampling)
        else:
            result = await client.generate(messages=[{"role": "user", "content": args.prompt}], sampling=sampling)
        text = tokenizer.decode(list(result.completion_ids)) if tokenizer is not None else ""
        emit(
            args,
            runs.result_row(result, text=text),
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
    return runs.execute(job, _run_options(args), lambda: client_config(args))


def _teacher(args: argparse.Namespace) -> int:
    job = runs.TeacherJob(top_logprobs=args.top_logprobs)
    return runs.execute(job, _run_options(args), lambda: client_config(args))


def _messages_file(path: str) -> list[dict[str, Any]]:
    """The ``--messages`` file: a JSON list of message objects, each with a string ``role``."""
    try:
        messages = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise InvalidRequestError(f"--messages {path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"--messages {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"--messages {path}:{exc.lineno}: not JSON: {exc.msg}") from None
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError(f"--messages {path}: must hold a non-empty JSON list of messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequestError(f"--messages {path}: $[{i}] must be an object, got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise InvalidRequestError(f"--messages {path}: $[{i}].role must be a string")
    return messages


def _check_tokenizer(args: argparse.Namespace) -> int:
    messages = _messages_file(args.messages) if args.messages else [{"role": "user", "content": args.prompt}]

    async def body(client: Client) -> int:
        check = await client.check_tokenizer(messages)
        if check.match:
            text = f"match: {len(check.local_ids)} tokens agree"
        else:
            text = (
                f"MISMATCH at position {check.first_difference}: "
                f"local {check.local_token!r} vs server {check.server_token!r}"
            )
        emit(args, check, text)
        return EXIT_OK if check.match else EXIT_FAILED

    return _run(args, body)


DEMO_HINT = 'the demo runs on the test kit\'s embedded engine: pip install "backends-core[testing]"'


def _check_backend_installed(name: str) -> None:
    """Refuse a backend name nothing installed registers (exit 2), before anything is built or started."""
    installed = [info.name for info in available_backends()]
    if name not in installed:
        raise BackendNotFoundError(name, installed)


def _demo(args: argparse.Namespace) -> int:
    try:
        from backends_testkit.demo import run_demo
    except ModuleNotFoundError as exc:
        if exc.name is None or not exc.name.startswith("backends_testkit"):
            raise
        raise MissingInstallError(DEMO_HINT) from None
    _check_backend_installed(args.backend)
    return run_demo(
        backend=args.backend,
        urls=args.url or (),
        moe_url=args.moe_url,
        model=args.model,
        models_dir=args.models_dir,
        seed=args.seed,
        json_lines=bool(getattr(args, "json", False)),
    )


class MissingInstallError(ConfigError):
    """An optional part of the installation a verb needs is missing (the message says what to install): exit 2."""

    def __init__(self, message: str) -> None:
        super().__init__([message])

    def __str__(self) -> str:
        return self.messages[0]


def _serve_hint(backend: str) -> str:
    """What to install to serve ``backend``'s emulator."""
    if backend == "reference":
        return 'the reference emulator is part of the test kit: pip install "backends-core[testing]"'
    drivers = {info.name: info.distribution for info in available_backends()}
    return (
        f"no emulator of backend {backend!r} is installed: it comes with the backend's testing extra, "
        f'pip install "{drivers.get(backend, f"backends-{backend}")}[testing]"'
    )


#: The entry-point group emulators register in (``backends_testkit.emulators.EMULATOR_GROUP``, read here from
#: package metadata so the test kit is imported only when it is there).
EMULATOR_GROUP = "backends_testkit.emulators"


def _installed_emulators() -> set[str]:
    """Backends whose emulator an installed distribution registers (from package metadata; nothing is imported)."""
    return {ep.name for ep in md.entry_points(group=EMULATOR_GROUP)}


def _serve(args: argparse.Namespace) -> int:
    """Serve the embedded emulator of ``--backend`` on a port until Ctrl-C or SIGTERM (then exit 0)."""
    installed = [info.name for info in available_backends()]
    servable = args.backend in installed or args.backend in (*FIRST_PARTY_EXTRAS, "reference")
    if not servable:  # a mistyped or unknown name: named with the installed ones and close matches
        raise BackendNotFoundError(args.backend, installed)
    try:
        from backends_testkit.emulators import NoEmulatorError, make_emulator
        from backends_testkit.engine import ReferenceEngine
        from backends_testkit.tinymodel import build_tiny_models, default_models_dir
    except ModuleNotFoundError as exc:
        if exc.name is None or not exc.name.startswith("backends_testkit"):
            raise
        raise MissingInstallError(_serve_hint(args.backend)) from None
    if args.backend not in installed or args.backend not in _installed_emulators():
        raise MissingInstallError(_serve_hint(args.backend))
    if args.port > 65535:
        raise UsageError(f"argument --port: must be in [0, 65535], got {args.port}")

    async def serve() -> int:
        root = Path(args.models_dir) if args.models_dir else default_models_dir(seed=args.seed)
        models = build_tiny_models(root, seed=args.seed)
        model_dir = models.moe if args.moe else models.dense
        engine = ReferenceEngine(model_dir, seed=args.seed)
        try:
            try:
                emulator = make_emulator(args.backend, engine, routed_experts=args.moe)
            except NoEmulatorError as exc:  # several distributions claim the name
                raise MissingInstallError(str(exc)) from None
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(signum, stop.set)
            try:
                async with emulator.serve(host=args.host, port=args.port) as url:
                    await _answers(url)
                    ready = {
                        "url": url,
                        "backend": args.backend,
                        "model": engine.model_name,
                        "tokenizer": str(model_dir),
                        "moe": args.moe,
                    }
                    emit(
                        args,
                        ready,
                        f"serving the {args.backend} emulator of {engine.model_name} at {url} (Ctrl-C stops it)\n"
                        f"try: backends generate --backend {args.backend} --url {url} --model {engine.model_name} "
                        f'--tokenizer {model_dir} --prompt "hello"',
                    )
                    await stop.wait()
            finally:
                for signum in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(signum)
        finally:
            await engine.aclose()
        return EXIT_OK

    return asyncio.run(serve())


async def _answers(url: str) -> None:
    """One request to the server just started, so the URL is printed only once it answers HTTP (any status)."""
    import httpx

    async with httpx.AsyncClient(timeout=30.0) as http:
        await http.get(f"{url}/")


def _versions() -> dict[str, Any]:
    """The installed distributions of backends, from package metadata (nothing is imported): backends-core,
    the umbrella, the test kit, every backend's driver and every emulator's distribution."""
    dists: dict[str, dict[str, Any]] = {}

    def entry(name: str, version: str) -> dict[str, Any]:
        return dists.setdefault(name, {"distribution": name, "version": version, "backends": [], "emulators": []})

    for name in ("backends-core", "backends", "backends-testkit"):
        with contextlib.suppress(md.PackageNotFoundError):
            entry(name, md.version(name))
    for info in available_backends():
        entry(info.distribution, info.version)["backends"].append(info.name)
    for ep in md.entry_points(group=EMULATOR_GROUP):
        if ep.dist is not None:
            entry(ep.dist.name, ep.dist.version)["emulators"].append(ep.name)
    core = dists.get("backends-core", {}).get("version")
    return {"backends_core": core, "distributions": list(dists.values())}


def _print_versions(as_json: bool) -> int:
    versions = _versions()
    lines = []
    for d in versions["distributions"]:
        roles = [f"{kind}: {', '.join(sorted(d[kind]))}" for kind in ("backends", "emulators") if d[kind]]
        lines.append(f"{d['distribution']} {d['version']}" + (f" ({'; '.join(roles)})" if roles else ""))
    emit(as_json, versions, "\n".join(lines))
    return EXIT_OK


# -- parser ----------------------------------------------------------------------------------------------


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=positive_int, default=64, help="completion tokens at most (default: 64)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default: 1.0; 0: greedy)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: none, the server's choice)")
    p.add_argument(
        "--top-logprobs", type=nonnegative_int, default=0, help="top logprobs per completion token (default: 0)"
    )


def _run_flags(p: argparse.ArgumentParser) -> None:
    """The flags of file-to-file runs (rollout, teacher): see backends_core.runs."""
    p.add_argument("--concurrency", type=positive_int, default=64, help="records in flight at once")
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
    parser = JsonArgumentParser(
        prog="backends",
        description="One client layer between RL trainers and inference servers.",
        epilog="exit codes: 0 ok, 1 an operation failed on some server, 2 bad usage, configuration or input",
    )
    parser.add_argument(
        "--version",
        dest="show_version",
        action="store_true",
        help="print the installed versions of backends-core and every backend distribution, then exit",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output (also accepted after the command)")
    add_log_level_flag(parser, verb=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("list", help="installed backends with version, capabilities and parsers")
    p.add_argument(
        "--tokenizer", help="a local tokenizer directory: also show the parsers 'auto' chooses for its chat template"
    )
    add_json_flag(p)
    p.set_defaults(func=_list)

    for name, help_ in (("state", "aggregated state of every server"), ("health", "alias of state")):
        p = sub.add_parser(name, help=help_)
        add_client_flags(p)
        p.set_defaults(func=_state)

    p = sub.add_parser("pause", help="pause generation on every server")
    add_client_flags(p)
    p.add_argument(
        "--mode",
        choices=["abort", "wait", "keep"],
        default="wait",
        help="abort requests in flight, wait for them, or keep them frozen until resume (default: wait)",
    )
    p.set_defaults(func=_admin_op("pause", lambda c, a: c.admin.pause(a.mode)))

    p = sub.add_parser("resume", help="resume generation on every server")
    add_client_flags(p)
    p.set_defaults(func=_admin_op("resume", lambda c, a: c.admin.resume()))

    p = sub.add_parser("update-weights", help="load weights from a directory on every server")
    add_client_flags(p)
    p.add_argument("path", help="checkpoint directory as the servers see it")
    p.add_argument("--version", required=True, help="the new weight version")
    p.add_argument("--sync", action="store_true", help="full weight sync: pause, update, flush, resume in finally")
    p.add_argument("--mode", choices=["abort", "wait", "keep"], default="wait", help="pause mode with --sync")
    p.set_defaults(func=_admin_op("update-weights", _update_weights))

    p = sub.add_parser("load-lora", help="load (or with --replace hot-swap) a LoRA adapter on every server")
    add_client_flags(p)
    p.add_argument("name", help="the adapter's name (what requests ask for)")
    p.add_argument("path", help="the adapter's directory as the servers see it")
    p.add_argument("--replace", action="store_true", help="replace a loaded adapter of that name in place")
    p.set_defaults(
        func=_admin_op(
            "load-lora", lambda c, a: c.admin.load_lora(LoraAdapter(name=a.name, path=a.path, replace=a.replace))
        )
    )

    p = sub.add_parser("unload-lora", help="unload a LoRA adapter on every server")
    add_client_flags(p)
    p.add_argument("name", help="the adapter's name")
    p.set_defaults(func=_admin_op("unload-lora", lambda c, a: c.admin.unload_lora(a.name)))

    p = sub.add_parser("generate", help="one generation")
    add_client_flags(p)
    _sampling_flags(p)
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt", help="a user message (rendered with the chat template)")
    group.add_argument("--prompt-ids", type=int_list, help="comma-separated prompt token ids, e.g. 1,2,3")
    p.set_defaults(func=_generate)

    p = sub.add_parser(
        "rollout",
        help="JSONL of conversations in, JSONL of results appended as each finishes (+ .npz routed experts)",
    )
    add_client_flags(p)
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
        type=positive_int,
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
    add_client_flags(p)
    p.add_argument("input", help='JSONL: {"id"?, "token_ids": [...], "metadata"?} per line')
    p.add_argument(
        "output", help='JSONL appended as each finishes: {"id", "token_ids", "logprobs": [null, ...], "top_logprobs"?}'
    )
    p.add_argument(
        "--top-logprobs",
        type=nonnegative_int,
        default=0,
        help="alternatives per position to write (0: none; index 0 empty)",
    )
    _run_flags(p)
    p.set_defaults(func=_teacher)

    p = sub.add_parser("check-tokenizer", help="compare local chat-template rendering with the server's /tokenize")
    add_client_flags(p)
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
    p.add_argument("--seed", type=int, default=0, help="seed of the tiny models, engines and sampling (default: 0)")
    add_json_flag(p)
    p.set_defaults(func=_demo)

    p = sub.add_parser(
        "serve",
        help="serve a backend's embedded emulator (numpy engine, tiny model) on a port, to try the CLI without a GPU",
    )
    p.add_argument(
        "--backend", required=True, help="whose server to emulate: vllm, sglang, dynamo, reference or any installed"
    )
    p.add_argument("--moe", action="store_true", help="serve the tiny MoE model (answers routed experts)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument(
        "--port", type=nonnegative_int, default=8000, help="port to listen on (default: 8000; 0: a free one)"
    )
    p.add_argument("--models-dir", default=None, help="where to build the tiny models (default: a user cache dir)")
    p.add_argument("--seed", type=int, default=0, help="seed of the tiny models and the engine (default: 0)")
    add_json_flag(p)
    p.set_defaults(func=_serve)
    _add_verbs(sub)
    return parser


#: The entry-point group of verbs other distributions add: each entry point is ``register(subparsers)``, which adds
#: its parser (``backends_gateway.cli:register`` adds ``gateway``).
VERB_GROUP = "backends_core.cli"
#: First-party verbs that come with an extra, and what to install when it is missing.
OPTIONAL_VERBS = {"gateway": ("the OpenAI-compatible capture gateway over a client config", "gateway")}


def _add_verbs(sub: Any) -> None:
    """The installed distributions' verbs; a first-party verb not installed still parses and says what to install."""
    added = set()
    for ep in md.entry_points(group=VERB_GROUP):
        ep.load()(sub)
        added.add(ep.name)
    for name, (help_, extra) in OPTIONAL_VERBS.items():
        if name in added:
            continue
        # every argument taken as it is (no prefix character is ever typed): the answer is what to install
        p = sub.add_parser(name, help=f"{help_} (not installed)", add_help=False, prefix_chars="\0")
        p.add_argument("rest", nargs="*")

        def missing(args: argparse.Namespace, name: str = name, extra: str = extra) -> int:
            raise MissingInstallError(f'backends {name} is not installed: pip install "backends[{extra}]"')

        p.set_defaults(func=missing)


def _dispatch(args: argparse.Namespace) -> int:
    if getattr(args, "show_version", False):
        return _print_versions(bool(getattr(args, "json", False)))
    func = getattr(args, "func", None)
    if func is None:
        raise UsageError("a command is required (see backends --help)", usage=build_parser().format_usage())
    return int(func(args))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (see :mod:`backends_core.cli_common`)."""
    return run_main(lambda: build_parser().parse_args(argv), argv, _dispatch)


if __name__ == "__main__":
    sys.exit(main())
