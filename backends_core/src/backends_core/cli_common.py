"""What every ``backends`` verb shares: exit codes, ``--json`` output, errors on stderr, and checked argument
types.

Exit codes (the CLI's contract with scripts):

- ``0`` (:data:`EXIT_OK`): the command did what it was asked.
- ``1`` (:data:`EXIT_FAILED`): an operation failed on some server (an admin call, a request, a check).
- ``2`` (:data:`EXIT_USAGE`): bad usage, configuration or input, reported before anything is sent; also a
  missing optional installation (``backends demo`` / ``backends serve`` without the test kit).
- ``130`` (:data:`EXIT_INTERRUPTED`): interrupted (Ctrl-C) where the verb does not say otherwise.

With ``--json`` every verb writes one JSON object per line on stdout, and an error as one JSON object on stderr::

    {"error": {"type": "ConfigError", "message": "invalid configuration: ...", "exit": 2}}

``type`` is the exception's class name (``UsageError`` for a command-line mistake argparse caught), ``message``
the same text the plain form prints after ``error:``, and ``exit`` the process's exit status. An
:class:`~backends_core.errors.AdminError` adds ``"operation"``, ``"servers"`` (``[{"server", "ok", "error"}]``,
every server's outcome) and ``"state"`` (what the failure left behind, or ``null``).

A verb is ``func(args) -> int`` and raises for every failure; :func:`run_main` turns the exception into the exit
status and the message (plain or JSON), the one place where that happens.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import IO, Any, NoReturn

import attrs
import numpy as np

from backends_core.config import ClientConfig
from backends_core.errors import (
    AdminError,
    BackendConflictError,
    BackendError,
    BackendLoadError,
    BackendNotFoundError,
    BackendValidationError,
    ConfigError,
    InvalidRequestError,
    RenderError,
    UnsupportedOperationError,
)

__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "JsonArgumentParser",
    "UsageError",
    "add_client_flags",
    "add_json_flag",
    "emit",
    "error_object",
    "exit_code",
    "int_list",
    "jsonable",
    "json_line",
    "nonnegative_int",
    "positive_int",
    "report_error",
    "client_config",
    "run_main",
    "wants_json",
]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

#: Errors about what the user asked for (usage, configuration, input, installation): exit 2. Everything else
#: a :class:`BackendError` reports is an operation that failed on a server: exit 1.
USAGE_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError,
    InvalidRequestError,
    RenderError,
    BackendNotFoundError,
    BackendConflictError,
    BackendLoadError,
    BackendValidationError,
    UnsupportedOperationError,
    OSError,  # a file named on the command line cannot be read or written
)


class UsageError(InvalidRequestError):
    """The command line itself is wrong (unknown option, missing argument, bad value): exit 2.

    :ivar usage: the usage line of the (sub)command, printed before the message in the plain form.
    """

    def __init__(self, message: str, *, usage: str = "") -> None:
        self.usage = usage
        super().__init__(message)


class JsonArgumentParser(argparse.ArgumentParser):
    """An argparse parser whose errors are raised as :class:`UsageError` (so they are reported like every other
    error, as JSON with ``--json``) instead of printed and exited on; unknown arguments are reported with the usage
    of the subcommand they were given to."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message, usage=self.format_usage())

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            parser: argparse.ArgumentParser = self
            chosen: argparse.ArgumentParser | None = self
            while chosen is not None:  # down to the innermost subcommand given (``gateway export``)
                parser, chosen = chosen, None
                for action in parser._actions:
                    if isinstance(action, argparse._SubParsersAction):
                        chosen = action.choices.get(getattr(parsed, action.dest or "", None) or "")
            raise UsageError(f"unrecognized arguments: {' '.join(extras)}", usage=parser.format_usage())
        return parsed


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    """``--json`` on a verb; also accepted before the verb (``backends --json state``), so the verb's default
    must not overwrite the top-level one."""
    parser.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS,
        help="machine-readable output: one JSON object per line on stdout, errors as JSON on stderr",
    )
    add_log_level_flag(parser)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def add_client_flags(parser: argparse.ArgumentParser) -> None:
    """The flags naming a client config (read by :func:`client_config`), and ``--json``."""
    parser.add_argument("--config", help="TOML/JSON client config (default: $BACKENDS_CONFIG)")
    parser.add_argument("--section", default=None, help="table of the config file holding the client config")
    parser.add_argument("--backend", help="backend name (overrides the config)")
    parser.add_argument("--url", action="append", help="server base URL (repeat for a fleet; overrides the config)")
    parser.add_argument("--model", help="served model name")
    parser.add_argument("--tokenizer", help="local tokenizer directory (to render messages)")
    add_json_flag(parser)


def client_config(args: argparse.Namespace) -> ClientConfig:
    """The config file, then ``$BACKENDS_*``, then the flags of :func:`add_client_flags`
    (:meth:`ClientConfig.load`)."""
    flags = {"backend": args.backend, "base_url": args.url, "model": args.model, "tokenizer": args.tokenizer}
    return ClientConfig.load(args.config, section=args.section, flags=flags)


def add_log_level_flag(parser: argparse.ArgumentParser, *, verb: bool = True) -> None:
    """``--log-level``: show the library's log lines (retries, failover, cooldown, admin phases, membership) on
    stderr; as JSON objects with ``--json``. Accepted before the verb too."""
    parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        type=str.upper,
        default=argparse.SUPPRESS if verb else None,
        help="show the library's log lines at this level and above on stderr (retries, failover, cooldown, admin "
        "phases, membership; JSON objects with --json); default: none",
    )


class _JsonLogFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(
            {"event": "log", "logger": record.name, "level": record.levelname, "message": record.getMessage()}
        )


class _OwnLoggers(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.name.startswith("backends")


_log_handler: logging.Handler | None = None


def configure_logging(args: argparse.Namespace) -> None:
    """Send the ``backends*`` loggers to stderr at ``args.log_level`` (nothing when it is not given)."""
    global _log_handler
    root = logging.getLogger()
    if _log_handler is not None:  # main() called again in one process: this call's choice only
        root.removeHandler(_log_handler)
        _log_handler = None
    level = getattr(args, "log_level", None)
    if level is None:
        return
    handler = _log_handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_OwnLoggers())
    handler.setFormatter(
        _JsonLogFormatter()
        if getattr(args, "json", False)
        else logging.Formatter("%(levelname)s %(name)s: %(message)s")
    )
    root.addHandler(handler)
    for name in ("backends_core", "backends_vllm", "backends_sglang", "backends_dynamo"):
        logging.getLogger(name).setLevel(level)
    if root.level > logging.getLevelName(level):
        root.setLevel(level)


def wants_json(args: argparse.Namespace | None, argv: Sequence[str] | None = None) -> bool:
    """Whether output is JSON: ``args.json``, or (when parsing failed) ``--json`` among the raw arguments."""
    if args is not None:
        return bool(getattr(args, "json", False))
    return "--json" in (sys.argv[1:] if argv is None else argv)


def jsonable(value: Any) -> Any:
    """``json.dumps`` ``default=`` for the library's values: attrs classes, numpy arrays (NaN as ``null``), numpy
    scalars, exceptions (``"Type: message"``), sets and tuples."""
    if attrs.has(type(value)):
        return attrs.asdict(
            value,
            value_serializer=lambda _i, _a, v: (
                jsonable(v) if isinstance(v, np.ndarray | np.generic | BaseException) else v
            ),
        )
    if isinstance(value, np.ndarray):
        return [None if isinstance(x, float) and x != x else x for x in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, BaseException):
        return f"{type(value).__name__}: {value}"
    if isinstance(value, set | frozenset):
        return sorted(value, key=str)
    raise TypeError(f"cannot serialise {type(value).__name__}")


def json_line(value: Any) -> str:
    """``value`` as one line of JSON (no newline inside; NaN written as ``null`` only inside arrays)."""
    return json.dumps(value, default=jsonable, separators=(", ", ": "))


def emit(args: argparse.Namespace | bool, value: Any, text: str | None = None, *, file: IO[str] | None = None) -> None:
    """Print ``value`` as one JSON line when JSON output is on (``args.json`` or a bool), else ``text`` (nothing
    when ``text`` is ``None``). Flushed, so a reader of a pipe sees each line as it is written."""
    on = args if isinstance(args, bool) else wants_json(args)
    out = file or sys.stdout
    if on:
        print(json_line(value), file=out, flush=True)
    elif text is not None:
        print(text, file=out, flush=True)


def exit_code(exc: BaseException) -> int:
    """The exit status ``exc`` ends the command with (see the module's table)."""
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(exc, USAGE_ERRORS):
        return EXIT_USAGE
    return EXIT_FAILED


def error_object(exc: BaseException) -> dict[str, Any]:
    """The JSON form of an error: ``{"error": {"type", "message", "exit", ...}}`` (see the module docstring)."""
    body: dict[str, Any] = {"type": type(exc).__name__, "message": _message(exc), "exit": exit_code(exc)}
    if isinstance(exc, AdminError):
        body["operation"] = exc.operation
        body["servers"] = [
            {"server": r.server, "ok": r.ok, "error": None if r.ok else f"{type(r.error).__name__}: {r.error}"}
            for r in exc.results
        ]
        body["state"] = exc.state
    return {"error": body}


def _message(exc: BaseException) -> str:
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return f"{exc.strerror}: {exc.filename}"
    return str(exc) or type(exc).__name__


def report_error(exc: BaseException, *, as_json: bool, file: IO[str] | None = None) -> int:
    """Write ``exc`` to stderr (plain, or one JSON object) and return its exit status."""
    err = file or sys.stderr
    if as_json:
        print(json_line(error_object(exc)), file=err, flush=True)
        return exit_code(exc)
    if isinstance(exc, UsageError) and exc.usage:
        print(exc.usage, end="", file=err)
    print(f"error: {_message(exc)}", file=err)
    if isinstance(exc, AdminError):
        for outcome in exc.results:
            verdict = "ok" if outcome.ok else f"FAILED: {type(outcome.error).__name__}: {outcome.error}"
            print(f"  {outcome.server}: {verdict}", file=err)
        if exc.state:
            print(f"  state: {exc.state}", file=err)
    err.flush()
    return exit_code(exc)


def run_main(
    parse: Callable[[], argparse.Namespace], argv: Sequence[str] | None, command: Callable[[argparse.Namespace], int]
) -> int:
    """Parse, run ``command`` and map every failure to its message and exit status: the CLI's one ``except``.

    Errors of the library (:class:`BackendError`), of files (:class:`OSError`) and of the command line
    (:class:`UsageError`) are reported in one line (or one JSON object); an unexpected exception is a bug, reported
    the same way with its traceback after it (in the plain form), exit 1.
    """
    args: argparse.Namespace | None = None
    try:
        args = parse()
        configure_logging(args)
        return int(command(args))
    except (BackendError, OSError, KeyboardInterrupt) as exc:
        return report_error(exc, as_json=wants_json(args, argv))
    except Exception as exc:
        as_json = wants_json(args, argv)
        code = report_error(exc, as_json=as_json)
        if not as_json:
            traceback.print_exc()
        return code


def _int(text: str, what: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what}: {text!r} is not an integer") from None


def positive_int(text: str) -> int:
    """argparse ``type=``: an integer >= 1."""
    value = _int(text, "value")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def nonnegative_int(text: str) -> int:
    """argparse ``type=``: an integer >= 0."""
    value = _int(text, "value")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


def int_list(text: str) -> list[int]:
    """argparse ``type=``: comma-separated integers (``1,2,3``); an item that is not one is named by position."""
    items = text.split(",")
    values = []
    for n, item in enumerate(items, start=1):
        if not item.strip():
            raise argparse.ArgumentTypeError(f"item {n} of {len(items)} is empty")
        values.append(_int(item, f"item {n} of {len(items)}"))
    return values
