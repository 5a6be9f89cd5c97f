"""File-to-file runs of the command line (``backends rollout`` and ``backends teacher``).

A run reads a JSONL input, checks every row before anything is sent, and appends one JSONL result per record
to the output as soon as that record finishes (one write and one flush per record, so an interrupted run leaves
only whole lines). ``resume=True`` keeps the output's finished records and runs the rest; Ctrl-C stops the run,
keeps what finished and prints the summary. Progress goes to stderr: a tqdm bar on a terminal, a plain (or
``--json``) line every ``log_every`` seconds otherwise.

Exit codes: 0 every record ok; 1 some record failed on a server (its line in the output carries ``"error"``);
2 usage, configuration or input (bad rows, whether refused up front or skipped; a repeated id; an output that
exists without ``--resume`` or ``--overwrite``; a sampling feature the backend lacks; a record the client
refused before sending it, e.g. messages it cannot render), which wins over 1; 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import asyncio
import difflib
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Literal, Protocol

import attrs
import numpy as np
from tqdm import tqdm

from backends_core.client import Client
from backends_core.config import ClientConfig
from backends_core.driver import BackendDriver
from backends_core.errors import BackendError, InvalidRequestError, RenderError, UnsupportedOperationError
from backends_core.types import (
    Choice,
    GenerateResult,
    Grammar,
    JsonSchema,
    Regex,
    SamplingParams,
    Structured,
    TeacherRequest,
    TopLogprob,
)

__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "BadRow",
    "Record",
    "RolloutJob",
    "RunOptions",
    "TeacherJob",
    "execute",
    "read_records",
    "result_row",
]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

OnBadRow = Literal["refuse", "skip"]


@attrs.frozen
class BadRow:
    """One input row that cannot run: its line number, the field path in it, and what is wrong."""

    line: int
    path: str
    message: str
    repeat: bool = False  # the row's id is on an earlier line too

    def text(self, source: str) -> str:
        return f"{source}:{self.line}: {self.message} @ {self.path}"


class RowError(Exception):
    """Raised by a row parser: ``path`` is the field path inside the row (``$.sampling.temperature``)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(message)
        self.path, self.message = path, message


@attrs.frozen
class Record:
    """One valid input row: its line number, its 0-based index among the input's rows (blank lines are not
    rows), its key (the row's ``id``, else its line number) and what the job parsed out of it."""

    line: int
    index: int
    key: str
    item: Any
    metadata: Any = None
    has_metadata: bool = False


# -- row checking ----------------------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _int_list(value: Any, path: str, *, non_empty: bool) -> list[int]:
    if not isinstance(value, list):
        raise RowError(path, f"must be a list of token ids (ints >= 0), got {type(value).__name__}")
    if non_empty and not value:
        raise RowError(path, "must not be empty")
    for i, token in enumerate(value):
        if not _is_int(token) or token < 0:
            raise RowError(f"{path}[{i}]", f"must be a token id (an int >= 0), got {token!r}")
    return value


def _unknown(keys: Iterable[str], known: Sequence[str], path: str) -> None:
    for key in keys:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f"; known: {', '.join(sorted(known))}"
            raise RowError(f"{path}.{key}", f"unknown key {key!r}{hint}")


#: How each JSONL ``sampling`` key is checked before :class:`SamplingParams` sees it. ``n`` is left out: a
#: rollout row's group size is its top-level ``"n"``.
_SAMPLING_KINDS: dict[str, str] = {
    "max_tokens": "int",
    "temperature": "number",
    "top_p": "number",
    "top_k": "int",
    "min_p": "number",
    "seed": "int?",
    "stop_token_ids": "ids?",
    "ignore_eos": "bool",
    "min_tokens": "int",
    "top_logprobs": "int",
    "repetition_penalty": "number",
    "presence_penalty": "number",
    "frequency_penalty": "number",
    "stop": "strings",
    "logit_bias": "object",
    "structured": "structured",
    "extra": "object",
}

_STRUCTURED: dict[str, Callable[[Any], Structured]] = {
    JsonSchema.kind: JsonSchema,
    Regex.kind: Regex,
    Choice.kind: Choice,
    Grammar.kind: Grammar,
}


def _sampling_value(key: str, value: Any, path: str) -> Any:
    kind = _SAMPLING_KINDS[key]
    ok = {
        "int": _is_int(value),
        "int?": value is None or _is_int(value),
        "number": _is_number(value) and math.isfinite(value),
        "bool": isinstance(value, bool),
        "ids?": value is None or isinstance(value, list),
        "strings": isinstance(value, str) or (isinstance(value, list) and all(isinstance(s, str) for s in value)),
        "object": isinstance(value, dict),
        "structured": isinstance(value, dict) and len(value) == 1,
    }[kind]
    if not ok:
        wanted = {
            "int": "an int",
            "int?": "an int or null",
            "number": "a finite number",
            "bool": "true or false",
            "ids?": "a list of token ids or null",
            "strings": "a string or a list of strings",
            "object": "an object",
            "structured": 'an object with one key: "json_schema", "regex", "choice" or "grammar"',
        }[kind]
        raise RowError(path, f"must be {wanted}, got {value!r}")
    if kind == "ids?" and value is not None:
        return _int_list(value, path, non_empty=False)
    if key == "logit_bias":  # JSON object keys are strings: "50256": -100
        out: dict[int, Any] = {}
        for token, bias in value.items():
            if not token.isdigit():
                raise RowError(f"{path}.{token}", f"logit_bias keys must be token ids (digits), got {token!r}")
            out[int(token)] = bias
        return out
    if kind == "structured":
        ((name, spec),) = value.items()
        if name not in _STRUCTURED:
            raise RowError(f"{path}.{name}", f"unknown structured kind {name!r}; known: {', '.join(_STRUCTURED)}")
        try:
            return _STRUCTURED[name](spec)
        except (InvalidRequestError, TypeError) as exc:
            raise RowError(f"{path}.{name}", str(exc)) from exc
    return value


def sampling_from_row(value: Any, base: Mapping[str, Any], path: str = "$.sampling") -> SamplingParams:
    """:class:`SamplingParams` from ``base`` (the command line's values) overridden by a row's ``sampling``
    object, every key and type checked with its field path.

    :raises RowError: an unknown key, a wrong type, or a value :class:`SamplingParams` refuses.
    """
    if not isinstance(value, dict):
        raise RowError(path, f"must be an object of sampling fields, got {type(value).__name__}")
    _unknown(value, list(_SAMPLING_KINDS), path)
    fields = dict(base)
    for key, item in value.items():
        fields[key] = _sampling_value(key, item, f"{path}.{key}")
    try:
        return SamplingParams(**fields)
    except (InvalidRequestError, TypeError, ValueError) as exc:
        field = next((k for k in value if str(exc).startswith(k)), None)
        raise RowError(f"{path}.{field}" if field else path, str(exc)) from exc


def _messages(value: Any, path: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise RowError(path, f"must be a non-empty list of messages, got {value!r}")
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise RowError(f"{path}[{i}]", f"a message must be an object, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise RowError(f"{path}[{i}].role", f"must be a non-empty string, got {role!r}")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise RowError(f"{path}[{i}].content", f"must be a string, a list of parts or null, got {content!r}")
    return value


# -- jobs ------------------------------------------------------------------------------------------------


class Job(Protocol):
    """What a run does with each record."""

    name: str
    keys: Sequence[str]

    def parse(self, row: dict[str, Any], index: int) -> Any:
        """The record's work item from its row (``id`` and ``metadata`` already taken out).

        :raises RowError: the row cannot run.
        """

    def samples(self, item: Any) -> int:
        """How many output lines the record writes when it succeeds."""

    def check(self, driver: BackendDriver, record: Record) -> None:
        """Refuse, before anything is sent, a record the backend cannot run.

        :raises UnsupportedOperationError: naming the operation or sampling feature (``sampling.extra``).
        """

    async def run(self, client: Client, record: Record) -> tuple[list[dict[str, Any]], int]:
        """The record's output rows (each with ``"id"``) and the tokens it produced or scored.

        :raises BackendError: the record failed.
        """

    def resumed(self, rows: Sequence[dict[str, Any]], output: Path) -> set[str]:
        """Rows of ``output``'s finished records, kept by a resumed run: load their side data; the keys of those
        whose side data is missing (they run again)."""

    def finish(self, output: Path) -> None:
        """Called once when the run ends, interrupted or not (side files)."""


def _top_logprobs(positions: Sequence[Sequence[TopLogprob]]) -> list[list[dict[str, Any]]]:
    return [[{"token_id": t.token_id, "logprob": t.logprob, "rank": t.rank} for t in pos] for pos in positions]


def result_row(result: GenerateResult, **extra: Any) -> dict[str, Any]:
    """The JSONL row of one sample (``top_logprobs`` and ``image_spans`` only when the result has them)."""
    row = {
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
    if result.top_logprobs is not None:
        row["top_logprobs"] = _top_logprobs(result.top_logprobs)
    if result.image_spans:
        # where each of the row's images lies in prompt_ids, as the engine widened it (the images are the row's own)
        row["image_spans"] = [[s.start, s.end] for s in result.image_spans]
    return row


@attrs.frozen
class _Rollout:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    sampling: SamplingParams
    n: int


@attrs.define
class RolloutJob:
    """``backends rollout``: rows ``{"id"?, "messages", "tools"?, "sampling"?, "n"?, "metadata"?}``.

    The record at index ``i`` (0-based among the input's rows) is seeded ``seed + i`` when ``seed`` is given
    and its row sets no ``sampling.seed``; sample ``j`` of a group gets that seed ``+ j`` (``generate_group``).
    """

    sampling: Mapping[str, Any]
    seed: int | None
    n: int
    routed_experts: bool
    name: str = "rollout"
    keys: Sequence[str] = ("id", "messages", "tools", "sampling", "n", "metadata")
    routed: dict[str, np.ndarray] = attrs.field(factory=dict)

    def parse(self, row: dict[str, Any], index: int) -> _Rollout:
        if "messages" not in row:
            raise RowError("$.messages", "missing: every row needs its conversation")
        messages = _messages(row["messages"], "$.messages")
        tools = row.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise RowError("$.tools", f"must be a list of tool objects, got {tools!r}")
        n = row.get("n", self.n)
        if not _is_int(n) or n < 1:
            raise RowError("$.n", f"group size must be an int >= 1, got {n!r}")
        base = dict(self.sampling, seed=None if self.seed is None else self.seed + index)
        sampling = sampling_from_row(row.get("sampling", {}), base)
        return _Rollout(messages=messages, tools=tools, sampling=sampling, n=n)

    def samples(self, item: _Rollout) -> int:
        return item.n

    def check(self, driver: BackendDriver, record: Record) -> None:
        driver.check_sampling(record.item.sampling)

    async def run(self, client: Client, record: Record) -> tuple[list[dict[str, Any]], int]:
        item: _Rollout = record.item
        results = await client.generate_group(
            messages=item.messages,
            tools=item.tools,
            n=item.n,
            sampling=item.sampling,
            return_routed_experts=self.routed_experts,
            session=record.key,
        )
        rows = []
        for i, result in enumerate(results):
            extra: dict[str, Any] = {"id": record.key} if item.n == 1 else {"id": record.key, "sample": i}
            if record.has_metadata:
                extra["metadata"] = record.metadata
            if result.routed_experts is not None:
                self.routed[record.key if item.n == 1 else f"{record.key}/{i}"] = np.asarray(
                    result.routed_experts.experts
                )
            rows.append(result_row(result, **extra))
        return rows, sum(len(r.completion_ids) for r in results)

    def resumed(self, rows: Sequence[dict[str, Any]], output: Path) -> set[str]:
        """With ``routed_experts``, each finished sample's routing from ``OUTPUT.routed_experts.npz`` (written
        when a run ends: a crashed run left none, so its records run again)."""
        if not self.routed_experts:
            return set()
        path = _npz(output)
        saved: dict[str, np.ndarray] = {}
        if path.exists():
            with np.load(path) as npz:
                saved = {k: npz[k] for k in npz.files}
        lacking = set()
        found: dict[str, str] = {}  # npz name -> record key
        for r in rows:
            name = str(r["id"]) if "sample" not in r else f"{r['id']}/{r['sample']}"
            if name in saved:
                found[name] = str(r["id"])
            else:
                lacking.add(str(r["id"]))
        self.routed.update({name: saved[name] for name, key in found.items() if key not in lacking})
        return lacking

    def finish(self, output: Path) -> None:
        if self.routed:
            save_npz: Any = np.savez
            save_npz(_npz(output), **self.routed)


def _npz(output: Path) -> Path:
    """Where a rollout's routed experts go: ``OUTPUT.routed_experts.npz`` (keys ``id``, or ``id/sample``)."""
    return output.with_suffix(".routed_experts.npz")


@attrs.define
class TeacherJob:
    """``backends teacher``: rows ``{"id"?, "token_ids", "metadata"?}``; output rows ``{"id", "token_ids",
    "logprobs": [null, ...], "top_logprobs"?}`` (``top_logprobs`` when asked: per position, index 0 empty)."""

    top_logprobs: int
    name: str = "teacher"
    keys: Sequence[str] = ("id", "token_ids", "metadata")

    def __attrs_post_init__(self) -> None:
        if not (_is_int(self.top_logprobs) and 0 <= self.top_logprobs <= 20):
            raise InvalidRequestError(f"top_logprobs must be in [0, 20], got {self.top_logprobs!r}")

    def parse(self, row: dict[str, Any], index: int) -> list[int]:
        if "token_ids" not in row:
            raise RowError("$.token_ids", "missing: every row needs the token ids to score")
        token_ids = _int_list(row["token_ids"], "$.token_ids", non_empty=True)
        try:  # the request's own checks (two ids at least), before anything is sent
            TeacherRequest(token_ids=token_ids, top_logprobs=self.top_logprobs)
        except InvalidRequestError as exc:
            raise RowError("$.token_ids", str(exc)) from exc
        return token_ids

    def samples(self, item: Any) -> int:
        return 1

    def check(self, driver: BackendDriver, record: Record) -> None:
        driver.require("teacher_logprobs")

    async def run(self, client: Client, record: Record) -> tuple[list[dict[str, Any]], int]:
        scored = await client.teacher_logprobs(record.item, top_logprobs=self.top_logprobs)
        row: dict[str, Any] = {"id": record.key}
        if record.has_metadata:
            row["metadata"] = record.metadata
        row["token_ids"] = list(scored.token_ids)
        row["logprobs"] = [None, *scored.logprobs[1:].tolist()]
        if self.top_logprobs and scored.top_logprobs is not None:
            row["top_logprobs"] = _top_logprobs(scored.top_logprobs)
        return [row], len(scored.token_ids)

    def resumed(self, rows: Sequence[dict[str, Any]], output: Path) -> set[str]:
        return set()

    def finish(self, output: Path) -> None:
        pass


# -- reading the input -----------------------------------------------------------------------------------


def read_records(path: str, job: Job) -> tuple[list[Record], list[BadRow]]:
    """Every row of ``path`` checked: the valid records and the bad rows (line, field path, message). A key
    repeated on several lines makes each later line a bad row naming the first.

    :raises OSError: the file cannot be read.
    """
    records: list[Record] = []
    bad: list[BadRow] = []
    first_line: dict[str, int] = {}
    index = -1
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, start=1):
            if not text.strip():
                continue
            index += 1
            try:
                row = json.loads(text)
            except json.JSONDecodeError as exc:
                bad.append(BadRow(number, "$", f"not JSON: {exc.msg} (column {exc.colno})"))
                continue
            try:
                record = _record(row, number, index, job)
            except RowError as exc:
                bad.append(BadRow(number, exc.path, exc.message))
                continue
            if record.key in first_line:
                message = f"id {record.key!r} repeats line {first_line[record.key]}"
                bad.append(BadRow(number, "$.id", message, repeat=True))
                continue
            first_line[record.key] = number
            records.append(record)
    return records, bad


def _record(row: Any, number: int, index: int, job: Job) -> Record:
    if not isinstance(row, dict):
        raise RowError("$", f"each line must be a JSON object, got {type(row).__name__}")
    _unknown(row, list(job.keys), "$")
    key = row.get("id", number)
    if not (_is_int(key) or (isinstance(key, str) and key)):
        raise RowError("$.id", f"must be a non-empty string or an int, got {key!r}")
    item = job.parse(row, index)
    return Record(
        line=number, index=index, key=str(key), item=item, metadata=row.get("metadata"), has_metadata="metadata" in row
    )


# -- the output ------------------------------------------------------------------------------------------


class OutputError(Exception):
    """The output file cannot be used as asked (exit 2)."""


@attrs.define
class _Resumed:
    done: set[str]
    kept_rows: int
    notes: list[str]


def prepare_output(output: Path, records: Sequence[Record], job: Job, *, resume: bool, overwrite: bool) -> _Resumed:
    """Make ``output`` ready for appending; with ``resume`` the keys whose every line is there without an error.

    A resumed output keeps exactly those records' lines: a last line cut short by a crash, the lines of records
    that failed and the partial lines of a group are dropped (the file is rewritten) and those records run
    again. Lines whose id is not in the input are kept and counted in a note.

    :raises OutputError: the output exists and neither ``resume`` nor ``overwrite`` is set, or a line before
        the last one is not a JSON object (not a crash's cut: refused rather than rewritten).
    """
    if not output.exists() or output.stat().st_size == 0 or overwrite:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_bytes(b"")
        return _Resumed(done=set(), kept_rows=0, notes=[])
    if not resume:
        raise OutputError(f"{output} exists: --resume to continue it, --overwrite to start over")
    data = output.read_bytes()
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    notes: list[str] = []
    rows: list[tuple[bytes, dict[str, Any]]] = []
    for number, raw in enumerate(lines, start=1):
        try:
            row = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            row = None
        if not isinstance(row, dict) or "id" not in row:
            if number == len(lines) and not tail:
                notes.append(f"{output}:{number}: dropped a cut-off last line")
                continue
            raise OutputError(f"{output}:{number}: not a result line (a JSON object with an id); not resuming")
        rows.append((raw, row))
    if tail:
        notes.append(f"{output}:{len(lines) + 1}: dropped a cut-off last line")
    expected = {r.key: job.samples(r.item) for r in records}
    by_key: dict[str, list[dict[str, Any]]] = {}
    for _raw, row in rows:
        by_key.setdefault(str(row["id"]), []).append(row)
    done = set()
    for key, group in by_key.items():
        if key not in expected or any("error" in r for r in group):
            continue
        n = expected[key]
        samples = sorted(r.get("sample", -1) for r in group)
        if samples == ([-1] if n == 1 else list(range(n))):
            done.add(key)
    lacking = job.resumed([row for key in sorted(done) for row in by_key[key]], output)
    if lacking:
        notes.append(f"{output}: {len(lacking)} finished record(s) lack their routed experts: they run again")
        done -= lacking
    unknown = {k for k in by_key if k not in expected}
    if unknown:
        notes.append(f"{output}: kept {len(unknown)} result(s) whose id is not in the input")
    keep = [(raw, row) for raw, row in rows if str(row["id"]) in done or str(row["id"]) in unknown]
    rerun = {str(row["id"]) for _raw, row in rows} - done - unknown - lacking
    if rerun:
        notes.append(f"{output}: {len(rerun)} record(s) that failed or were cut short run again")
    if len(keep) != len(rows) or notes:
        fd, tmp = tempfile.mkstemp(dir=output.parent, prefix=f".{output.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(b"".join(raw + b"\n" for raw, _row in keep))
        os.replace(tmp, output)
    return _Resumed(done=done, kept_rows=len(keep), notes=notes)


# -- reporting -------------------------------------------------------------------------------------------


@attrs.define
class RunOptions:
    """How a run reads, writes and reports. ``on_bad_row``: ``refuse`` (any bad row: nothing is sent, exit 2)
    or ``skip`` (bad rows reported and skipped, the rest run, exit 2 at the end). ``log_every``: seconds
    between progress lines when stderr is not a terminal (0: after every record)."""

    input: str
    output: str
    concurrency: int = 64
    resume: bool = False
    overwrite: bool = False
    on_bad_row: OnBadRow = "refuse"
    json: bool = False
    log_every: float = 10.0
    stderr: IO[str] | None = None
    stdout: IO[str] | None = None


@attrs.define
class _Tally:
    total: int
    ok: int = 0
    failed: int = 0
    refused: int = 0  # failed records the client refused before sending (input the backend cannot take)
    tokens: int = 0
    started: float = attrs.field(factory=time.monotonic)

    @property
    def finished(self) -> int:
        return self.ok + self.failed

    def elapsed(self) -> float:
        return time.monotonic() - self.started


class _Reporter:
    """Everything a run says: stderr lines (text or JSON), the progress bar or progress lines, the summary."""

    def __init__(self, job: str, options: RunOptions) -> None:
        self.job, self.options = job, options
        self.err = options.stderr or sys.stderr
        self.out = options.stdout or sys.stdout
        self.bar: Any = None
        self.last_log = 0.0

    def emit(self, event: str, text: str, **fields: Any) -> None:
        line = json.dumps({"event": event, "command": self.job, **fields}) if self.options.json else text
        if self.bar is not None:
            self.bar.write(line, file=self.err)
        else:
            print(line, file=self.err, flush=True)

    def bad_row(self, bad: BadRow) -> None:
        self.emit(
            "bad_row",
            f"error: {bad.text(self.options.input)}",
            error="InvalidRequestError",
            file=self.options.input,
            line=bad.line,
            path=bad.path,
            message=bad.message,
        )

    def start(self, tally: _Tally) -> None:
        self.last_log = time.monotonic()
        if self.err.isatty() and not self.options.json:
            self.bar = tqdm(total=tally.total, desc=self.job, unit="rec", file=self.err, dynamic_ncols=True)
            self.bar.set_postfix(errors=0)

    def step(self, tally: _Tally) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(errors=tally.failed, tok_s=f"{tally.tokens / max(tally.elapsed(), 1e-9):.0f}")
            return
        now = time.monotonic()
        if now - self.last_log < self.options.log_every and tally.finished < tally.total:
            return
        self.last_log = now
        elapsed = tally.elapsed()
        rate = tally.finished / elapsed if elapsed > 0 else 0.0
        eta = (tally.total - tally.finished) / rate if rate > 0 else None
        self.emit(
            "progress",
            f"{self.job}: {tally.finished}/{tally.total} records, {tally.failed} failed, {rate:.1f} rec/s, "
            f"{tally.tokens / elapsed if elapsed > 0 else 0.0:.0f} tokens/s, "
            f"ETA {'?' if eta is None else f'{eta:.0f}s'}",
            done=tally.finished,
            total=tally.total,
            failed=tally.failed,
            records_per_s=round(rate, 3),
            eta_s=None if eta is None else round(eta, 1),
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _summary(
    reporter: _Reporter, tally: _Tally, *, skipped: int, resumed: int, interrupted: bool, code: int, output: str
) -> None:
    elapsed = tally.elapsed()
    rate = tally.tokens / elapsed if elapsed > 0 else 0.0
    not_run = tally.total - tally.finished
    summary = {
        "event": "summary",
        "command": reporter.job,
        "output": output,
        "ok": tally.ok,
        "failed": tally.failed,
        "refused": tally.refused,
        "skipped": skipped,
        "resumed": resumed,
        "not_run": not_run,
        "tokens": tally.tokens,
        "elapsed_s": round(elapsed, 3),
        "tokens_per_s": round(rate, 1),
        "interrupted": interrupted,
        "exit_code": code,
    }
    if reporter.options.json:
        print(json.dumps(summary), file=reporter.out, flush=True)
        return
    head = f"{reporter.job} interrupted" if interrupted else reporter.job
    print(
        f"{head}: {tally.ok} ok, {tally.failed} failed"
        + (f" ({tally.refused} refused before sending)" if tally.refused else "")
        + f", {skipped} skipped (bad rows), {resumed} already done"
        + (f", {not_run} not run" if not_run else "")
        + f"; {tally.tokens} tokens in {elapsed:.1f}s ({rate:.1f} tokens/s) -> {output}",
        file=reporter.err,
        flush=True,
    )


# -- the run ---------------------------------------------------------------------------------------------


def execute(
    job: Job,
    options: RunOptions,
    config: Callable[[], ClientConfig],
    make_client: Callable[[ClientConfig], Client] = Client,
) -> int:
    """Run ``job`` over ``options.input`` into ``options.output``; the exit code (see the module doc).

    Nothing is sent before every row is checked, against the backend too (its sampling features and
    operations), and the output is ready; ``make_client`` is called then.

    :raises ConfigError: from ``config()`` (the rows are checked and reported first).
    """
    reporter = _Reporter(job.name, options)
    try:
        return _execute(job, options, config, make_client, reporter)
    except KeyboardInterrupt:  # Ctrl-C before the run started (once it runs, _execute handles it)
        reporter.close()
        reporter.emit("interrupted", f"{job.name} interrupted before anything was sent", interrupted=True)
        return EXIT_INTERRUPTED


def _execute(
    job: Job,
    options: RunOptions,
    config: Callable[[], ClientConfig],
    make_client: Callable[[ClientConfig], Client],
    reporter: _Reporter,
) -> int:
    if options.concurrency < 1:
        reporter.emit(
            "usage_error",
            f"error: --concurrency must be >= 1, got {options.concurrency}",
            error="UsageError",
            message=f"--concurrency must be >= 1, got {options.concurrency}",
        )
        return EXIT_USAGE
    try:
        records, bad = read_records(options.input, job)
    except (OSError, UnicodeDecodeError) as exc:
        reporter.emit("input_error", f"error: {exc}", error=type(exc).__name__, message=str(exc))
        return EXIT_USAGE
    for row in bad:
        reporter.bad_row(row)
    client_config = config()
    driver = BackendDriver(client_config)
    valid: list[Record] = []
    for record in records:
        try:
            job.check(driver, record)
        except UnsupportedOperationError as exc:
            if not exc.operation.startswith("sampling."):  # the backend cannot run this job at all
                reporter.emit("unsupported", f"error: {exc}", error=type(exc).__name__, message=str(exc))
                return EXIT_USAGE
            unsupported = BadRow(record.line, f"$.{exc.operation}", str(exc))
            reporter.bad_row(unsupported)
            bad.append(unsupported)
        else:
            valid.append(record)
    records = valid
    repeated = [row for row in bad if row.repeat]
    if bad and (options.on_bad_row == "refuse" or repeated):
        why = "a repeated id makes the file ambiguous" if repeated else "--on-bad-row refuse"
        reporter.emit(
            "refused",
            f"error: {len(bad)} bad row(s) in {options.input}; nothing was sent ({why})",
            error="InvalidRequestError",
            message=f"{len(bad)} bad row(s); nothing was sent",
            bad_rows=len(bad),
        )
        return EXIT_USAGE
    output = Path(options.output)
    try:
        resumed = prepare_output(output, records, job, resume=options.resume, overwrite=options.overwrite)
    except (OutputError, OSError) as exc:
        reporter.emit("output_error", f"error: {exc}", error=type(exc).__name__, message=str(exc))
        return EXIT_USAGE
    for note in resumed.notes:
        reporter.emit("resume", f"resume: {note}", message=note)
    todo = [r for r in records if r.key not in resumed.done]
    client = make_client(client_config)
    tally = _Tally(total=len(todo))
    interrupted = False
    code = EXIT_USAGE if bad else EXIT_OK
    try:
        with open(output, "a", encoding="utf-8") as sink:
            reporter.start(tally)
            try:
                asyncio.run(_drive(client, job, todo, options.concurrency, sink, reporter, tally))
            except KeyboardInterrupt:
                interrupted = True
    finally:
        reporter.close()
        job.finish(output)
        if interrupted:
            code = EXIT_INTERRUPTED
        elif tally.refused:
            code = EXIT_USAGE
        elif code == EXIT_OK and tally.failed:
            code = EXIT_FAILED
        _summary(
            reporter,
            tally,
            skipped=len(bad),
            resumed=len(resumed.done),
            interrupted=interrupted,
            code=code,
            output=options.output,
        )
    return code


#: A record failing with one of these never reached a server: the row asks for what this client or backend
#: cannot do (messages it cannot render, say). The run exits 2.
_REFUSED_BEFORE_SENDING = (InvalidRequestError, RenderError, UnsupportedOperationError)


async def _drive(
    client: Client,
    job: Job,
    todo: Sequence[Record],
    concurrency: int,
    sink: IO[str],
    reporter: _Reporter,
    tally: _Tally,
) -> None:
    pending: Iterator[Record] = iter(todo)

    async def worker() -> None:
        for record in pending:  # one shared iterator: each record is taken by exactly one worker
            try:
                rows, tokens = await job.run(client, record)
            except BackendError as exc:
                error = f"{type(exc).__name__}: {exc}"
                rows, tokens = [{"id": record.key, "error": error}], 0
                tally.failed += 1
                refused = isinstance(exc, _REFUSED_BEFORE_SENDING)
                tally.refused += refused
                reporter.emit(
                    "record_failed",
                    f"{job.name}: {reporter.options.input}:{record.line} (id {record.key!r}) failed: {error}",
                    error=type(exc).__name__,
                    line=record.line,
                    id=record.key,
                    message=str(exc),
                    sent=not refused,
                )
            else:
                tally.ok += 1
                tally.tokens += tokens
            sink.write("".join(json.dumps(row) + "\n" for row in rows))
            sink.flush()
            reporter.step(tally)

    async with client, asyncio.TaskGroup() as group:
        for _ in range(min(concurrency, len(todo))):
            group.create_task(worker())
