"""Real Python agent harnesses from PyPI, each in its own cached venv, run as a new user would against the gateway,
and what they send captured on the way.

* :data:`AGENTS_SDK`, :data:`MINI_SWE_AGENT`, :data:`LANGGRAPH`, :data:`SMOLAGENTS`: the recipes. Each pins the
  harness and installs under ``constraints/<name>-<version>.txt`` (a ``pip freeze`` of a working install, copied to a
  content-addressed path beside the venvs so every checkout shares one venv); :func:`ensure_harness_venv` builds it
  with :func:`backends_testkit.live.ensure_venv` (``~/.cache/backends/server-venvs/harness-...``; rebuilt when the
  recipe or the constraints change). None pulls torch.
* :func:`captured`: a :class:`~capture_proxy.CaptureProxy` in front of the gateway, keeping what the harness sent
  and what it got.
* :class:`HarnessProcess`: one harness script (``harness_scripts/``) in its venv as a subprocess in its own process
  group: fresh ``HOME`` and working directory under the test's ``tmp_path``, telemetry off, only a base URL, an API key
  and the model name ``tiny``; killed (the whole group) at its timeout. The script's last line is
  ``HARNESS_RESULT {json}``.
* :func:`check_tool_loop` and friends: what every harness test asserts about one run.
* :func:`probe_summary`: the compact account of what a harness sent (fields, headers, roles, content kinds) and what
  failed, written beside the test's files and to ``$BACKENDS_HARNESS_PROBE_DIR`` when that is set.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
from capture_proxy import CaptureProxy, Exchange

from backends_testkit.live import ensure_venv, stable_copy

HERE = Path(__file__).resolve().parent
SCRIPTS = HERE / "harness_scripts"
CONSTRAINTS = HERE / "constraints"
MODEL = "tiny"
API_KEY = "sk-harness-probe"
RUN_TIMEOUT_S = 120.0
"""Seconds one harness run may take (seen: 3-15 s; the first run of a fresh venv also compiles bytecode)."""
RESULT_PREFIX = "HARNESS_RESULT "
PROBE = "backends-probe"
ANSWER = "Done: the command printed its output twice."
""":class:`~agent_engine.ShellLoop`'s final answer, without its end token."""

#: Telemetry and network side channels off, for every harness.
QUIET_ENV: dict[str, str] = {
    "OPENAI_AGENTS_DISABLE_TRACING": "1",
    "LANGSMITH_TRACING": "false",
    "LANGCHAIN_TRACING_V2": "false",
    "LANGSMITH_API_KEY": "",
    "LITELLM_TELEMETRY": "False",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "DO_NOT_TRACK": "1",
    "ANONYMIZED_TELEMETRY": "False",
    "MSWEA_SILENT_STARTUP": "1",
}


def venv_python() -> str:
    """The interpreter that creates the venvs: ``$BACKENDS_HARNESS_PYTHON`` or this Python's base interpreter (the
    project's venv is not inherited)."""
    override = os.environ.get("BACKENDS_HARNESS_PYTHON")
    if override:
        return override
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    return str(base) if base.exists() else sys.executable


@attrs.frozen
class Harness:
    """One harness's recipe.

    :param name: the distribution pinned (also the constraints file's and the venv's name).
    :param version: its version.
    :param extra: other requirements of the install (each pinned by the constraints too).
    :param check: Python run in the venv after the install (imports what the scripts use).
    """

    name: str
    version: str
    check: str
    extra: tuple[str, ...] = ()

    @property
    def venv_name(self) -> str:
        return f"harness-{self.name}-{self.version}"

    @property
    def constraints(self) -> Path:
        return CONSTRAINTS / f"{self.name}-{self.version}.txt"

    def requirements(self) -> list[str]:
        return [f"{self.name}=={self.version}", *self.extra]


AGENTS_SDK = Harness("openai-agents", "0.24.0", check="import agents, openai; print('openai', openai.__version__)")
MINI_SWE_AGENT = Harness(
    "mini-swe-agent",
    "2.4.6",
    check="import os; os.environ['MSWEA_SILENT_STARTUP'] = '1'; import minisweagent.run.mini, litellm; print('ok')",
)
LANGGRAPH = Harness(
    "langgraph",
    "1.2.24",
    extra=("langchain-openai==1.7.4",),
    check="import langgraph.prebuilt, langchain_openai; print('ok')",
)
SMOLAGENTS = Harness(
    "smolagents", "1.26.0", extra=("openai",), check="import smolagents, openai; print(smolagents.__version__)"
)


def stable_constraints(harness: Harness) -> Path:
    """A copy of the harness's constraints at a content-addressed path beside the venvs."""
    return stable_copy(harness.constraints.read_text(encoding="utf-8"), f"{harness.venv_name}-constraints")


def install_commands(harness: Harness) -> list[list[str]]:
    return [
        ["pip", "install", *harness.requirements(), "-c", str(stable_constraints(harness))],
        ["python", "-c", harness.check],
    ]


def ensure_harness_venv(harness: Harness) -> Path:
    """Build (once per machine and recipe) and return the harness's venv."""
    return ensure_venv(
        harness.venv_name,
        python=venv_python(),
        install=install_commands(harness),
        marker_extra=harness.constraints.read_text(encoding="utf-8"),
    )


# -- the harness process -------------------------------------------------------------------------------------------


@attrs.define
class HarnessRun:
    """What one harness run left: its exit code, its result line (``None`` if it printed none), its output."""

    argv: list[str]
    returncode: int | None
    timed_out: bool
    seconds: float
    result: dict[str, Any] | None
    stdout: str
    stderr: str

    def tail(self, lines: int = 40) -> str:
        out = "\n".join(self.stdout.splitlines()[-lines:])
        err = "\n".join(self.stderr.splitlines()[-lines:])
        return f"--- stdout tail\n{out}\n--- stderr tail\n{err}"


class HarnessProcess:
    """One harness script started in its venv (:meth:`start`), then waited for (:meth:`finish`)."""

    def __init__(
        self,
        venv: Path,
        script: str,
        args: Sequence[str],
        *,
        base_url: str,
        workdir: Path,
        env: Mapping[str, str] | None = None,
        timeout: float = RUN_TIMEOUT_S,
    ) -> None:
        self.workdir = workdir
        self.home = workdir / "home"
        self.cwd = workdir / "work"
        for path in (self.home, self.cwd):
            path.mkdir(parents=True, exist_ok=True)
        self.argv = [str(venv / "bin" / "python"), str(SCRIPTS / script), *args]
        self.timeout = timeout
        self.env = {
            "PATH": f"{venv / 'bin'}{os.pathsep}/usr/local/bin:/usr/bin:/bin",
            "HOME": str(self.home),
            "XDG_CONFIG_HOME": str(self.home / ".config"),
            "XDG_CACHE_HOME": str(self.home / ".cache"),
            "TMPDIR": str(workdir),
            "LANG": "C.UTF-8",
            "TERM": "dumb",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": str(SCRIPTS),
            "VIRTUAL_ENV": str(venv),
            **QUIET_ENV,
            "OPENAI_BASE_URL": base_url,
            "OPENAI_API_KEY": API_KEY,
            "HARNESS_MODEL": MODEL,
            **(env or {}),
        }
        self._proc: subprocess.Popen[bytes] | None = None
        self._started = 0.0

    def start(self) -> HarnessProcess:
        self._out = (self.workdir / "stdout.txt").open("wb")
        self._err = (self.workdir / "stderr.txt").open("wb")
        self._started = time.monotonic()
        self._proc = subprocess.Popen(
            self.argv,
            cwd=self.cwd,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=self._out,
            stderr=self._err,
            start_new_session=True,
        )
        return self

    def finish(self) -> HarnessRun:
        assert self._proc is not None, "start() first"
        timed_out = False
        left = max(1.0, self.timeout - (time.monotonic() - self._started))
        try:
            self._proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            timed_out = True
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError, PermissionError):  # a tool's leftover children
            os.killpg(self._proc.pid, signal.SIGKILL)
        seconds = time.monotonic() - self._started
        self._out.close()
        self._err.close()
        stdout = (self.workdir / "stdout.txt").read_text(errors="replace")
        stderr = (self.workdir / "stderr.txt").read_text(errors="replace")
        result = None
        for line in reversed(stdout.splitlines()):
            if line.startswith(RESULT_PREFIX):
                result = json.loads(line[len(RESULT_PREFIX) :])
                break
        return HarnessRun(self.argv, self._proc.returncode, timed_out, seconds, result, stdout, stderr)

    def run(self) -> HarnessRun:
        """Run the script to its end (or its timeout)."""
        return self.start().finish()


# -- what a test asserts -------------------------------------------------------------------------------------------

_TOOL_RESPONSE = re.compile(r"<tool_response>\n?(.*?)\n?</tool_response>", re.S)


def tool_responses(prompt: str) -> list[str]:
    """The tool responses the template rendered into ``prompt``."""
    return _TOOL_RESPONSE.findall(prompt)


def ordered_turns(trajectory: Mapping[str, Any]) -> list[dict[str, Any]]:
    return sorted(trajectory["turns"], key=lambda t: t["turn"])


def prefix_breaks(trajectory: Mapping[str, Any]) -> list[str]:
    """Where a turn's ``prompt_ids`` does not start with the previous turn's ``prompt_ids + completion_ids``."""
    out = []
    turns = ordered_turns(trajectory)
    for before, turn in itertools.pairwise(turns):
        want = list(before["prompt_ids"]) + list(before["completion_ids"])
        have = list(turn["prompt_ids"])
        if have[: len(want)] != want:
            same = next(
                (i for i, (a, b) in enumerate(zip(want, have, strict=False)) if a != b), min(len(want), len(have))
            )
            out.append(
                f"turn {turn['turn']} (branch {turn['branch']}, parent {turn['parent']}) does not extend turn "
                f"{before['turn']}: they part at id {same} of {len(want)}"
            )
    return out


def reply_tool_ids(trajectory: Mapping[str, Any]) -> list[str]:
    return [call["id"] for turn in ordered_turns(trajectory) for call in (turn["reply"].get("tool_calls") or [])]


def check_session(trajectory: Mapping[str, Any], proxy: CaptureProxy, *, min_tool_calls: int = 2) -> list[str]:
    """The trajectory checks of one run's session: one branch, each turn extending the previous one's ids, distinct
    tool-call ids, no turn in the training view that the harness did not receive. The problems found (``[]``: none)."""
    problems: list[str] = []
    branches = trajectory["branches"]
    if len(branches) != 1:
        problems.append(
            f"{len(branches)} branches: "
            + "; ".join(f"branch {b['branch']} ({b.get('reason')}) turns {b.get('turns')}" for b in branches)
        )
    problems.extend(prefix_breaks(trajectory))
    ids = reply_tool_ids(trajectory)
    if len(ids) < min_tool_calls:
        problems.append(f"{len(ids)} tool calls in the session's replies, want at least {min_tool_calls}")
    repeated = [i for i, n in Counter(ids).items() if n > 1]
    if repeated:
        problems.append(f"tool-call ids repeat: {repeated} (all: {ids})")
    received = [e for e in proxy.turns() if e.received()]
    numbered = {(e.session, e.turn) for e in received}
    answers = [e.answer() for e in received]
    got_ids = {i for _text, ids in answers for i in ids}
    got_texts = {text.strip() for text, _ids in answers}
    by_turn = {t["turn"]: t for t in trajectory["turns"]}

    def was_received(number: int) -> bool:
        if (trajectory["session"], number) in numbered:
            return True
        reply = by_turn[number]["reply"]
        ids = [c["id"] for c in reply.get("tool_calls") or []]
        if ids:
            return all(i in got_ids for i in ids)
        return str(reply.get("content") or "").strip() in got_texts

    for branch in branches:
        unseen = [t for t in branch.get("turns") or [] if not was_received(t)]
        if unseen:
            problems.append(
                f"branch {branch['branch']}'s training view holds turns {unseen} the harness never received"
            )
    return problems


def check_tool_loop(
    gw: Any,
    proxy: CaptureProxy,
    run: HarnessRun,
    *,
    final: str = ANSWER,
    system: str | None = None,
    responses: Any = tool_responses,
) -> list[str]:
    """Everything a single run of a harness must show; the problems found (``[]``: none).

    :param final: text the harness's final answer must contain.
    :param system: the harness's own system prompt / instructions (default: the script's ``system`` field); its
        first line must be in a prompt the engine rendered.
    :param responses: how to find the tool responses in a rendered prompt (default: the template's
        ``<tool_response>`` blocks).
    """
    problems: list[str] = []
    result = run.result or {}
    if run.timed_out:
        problems.append(f"the harness timed out after {run.seconds:.0f}s")
    if run.returncode != 0 or run.result is None:
        problems.append(f"the harness exited with {run.returncode} and result {run.result is not None}")
    if final not in str(result.get("final", "")):
        problems.append(f"final answer {str(result.get('final'))[:300]!r} lacks {final!r}")
    prompts = list(gw.engine.prompts)
    seen = max((sum(PROBE in r for r in responses(p)) for p in prompts), default=0)
    if seen < 2:
        problems.append(f"the engine saw {seen} tool responses holding {PROBE!r} in one prompt, want 2")
    system_text = system if system is not None else str(result.get("system", ""))
    first = next((line.strip() for line in system_text.splitlines() if line.strip()), "")
    if not first or not any(first in p for p in prompts):
        problems.append(f"the harness's system prompt {first[:120]!r} is in no rendered prompt")
    sessions = proxy.sessions()
    if len(sessions) != 1:
        problems.append(f"the run's answers name {len(sessions)} sessions: {sessions}")
    for session in sessions[:3]:
        problems.extend(f"session {session}: {p}" for p in check_session(gw.trajectory(session), proxy))
    if problems:
        problems.append("gateway failures seen by the harness: " + (json.dumps(proxy.failures(), indent=1) or "none"))
        problems.append(run.tail())
    return problems


def check_concurrent_runs(
    gw: Any, proxies: Sequence[CaptureProxy], runs: Sequence[HarnessRun], *, name: str, directory: Path
) -> list[str]:
    """Identical runs at the same time, each through its own proxy, no session in the URL (their probes saved as
    ``<name>-<i>``): each must finish its loop with :data:`ANSWER` in a session of its own (:func:`check_session`),
    none shared, and the gateway hold exactly one session a run. The problems found (``[]``: none)."""
    problems: list[str] = []
    for i, (proxy, run) in enumerate(zip(proxies, runs, strict=True)):
        save_probe(f"{name}-{i}", proxy, run, directory)
        if run.returncode != 0 or ANSWER not in str((run.result or {}).get("final")):
            problems.append(f"run {i} did not finish its loop: {run.returncode} {run.result}\n{run.tail(15)}")
        if len(proxy.sessions()) != 1:
            problems.append(f"run {i}'s answers name sessions {proxy.sessions()}")
        for session in proxy.sessions()[:2]:
            problems.extend(f"run {i}, session {session}: {p}" for p in check_session(gw.trajectory(session), proxy))
    for first, second in itertools.combinations(proxies, 2):
        if set(first.sessions()) & set(second.sessions()):
            problems.append(f"the runs share sessions: {set(first.sessions()) & set(second.sessions())}")
    held = [s["session"] for s in gw.sessions()]
    if len(held) != len(runs):
        problems.append(f"the gateway holds {len(held)} sessions, want {len(runs)}: {held}")
    return problems


def assert_clean(problems: Iterable[str]) -> None:
    found = list(problems)
    assert not found, "\n".join(found)


# -- the probe report ----------------------------------------------------------------------------------------------


def _example(value: Any, width: int = 60) -> Any:
    if isinstance(value, str):
        return value if len(value) <= width else value[:width] + "..."
    if isinstance(value, bool | int | float) or value is None:
        return value
    text = json.dumps(value, default=str)
    return text if len(text) <= width else text[:width] + "..."


def _content_kinds(content: Any) -> list[str]:
    if content is None:
        return ["null"]
    if isinstance(content, str):
        return ["str"]
    if isinstance(content, list):
        return sorted(
            {str(part.get("type", "?")) if isinstance(part, dict) else type(part).__name__ for part in content}
        )
    return [type(content).__name__]


def describe_request(exchange: Exchange) -> dict[str, Any]:
    """One request, compactly: its top-level fields (example values), its messages' or input items' roles and
    content kinds, its tools."""
    body = exchange.body
    out: dict[str, Any] = {"path": exchange.path, "status": exchange.status, "streamed": exchange.streamed}
    if not isinstance(body, dict):
        return out
    fields = {k: _example(v) for k, v in body.items() if k not in ("messages", "input", "tools", "instructions")}
    out["fields"] = fields
    if "instructions" in body:
        out["instructions"] = _example(body["instructions"], 80)
    items = body.get("messages") if "messages" in body else body.get("input")
    if isinstance(items, str):
        out["items"] = ["input:str"]
    elif isinstance(items, list):
        described = []
        for item in items:
            if not isinstance(item, dict):
                described.append(type(item).__name__)
                continue
            label = item.get("role") or item.get("type") or "?"
            if item.get("type") and item.get("role"):
                label = f"{item['type']}/{item['role']}"
            extra = sorted(k for k in item if k not in ("role", "content", "type"))
            described.append(
                f"{label}[{','.join(_content_kinds(item.get('content')))}]"
                + (f"{{{','.join(extra)}}}" if extra else "")
            )
        out["items"] = described
    tools = body.get("tools")
    if isinstance(tools, list):
        out["tools"] = [
            f"{t.get('type')}:{(t.get('function') or t).get('name')}" if isinstance(t, dict) else str(t) for t in tools
        ]
        out["tool_keys"] = sorted({k for t in tools if isinstance(t, dict) for k in (t.get("function") or t)})
    return out


def probe_summary(proxy: CaptureProxy) -> dict[str, Any]:
    """What the harness sent over the run (headers with example values, fields, roles and content kinds per
    request, in order) and each failure the gateway gave."""
    headers: dict[str, Any] = {}
    for e in proxy.exchanges:
        for k, v in e.headers.items():
            if k == "authorization":
                v = v[:12] + "..."
            headers.setdefault(k, set()).add(v)
    return {
        "requests": [f"{e.method} {e.path} -> {e.status}{' (stream)' if e.streamed else ''}" for e in proxy.exchanges],
        "headers": {k: sorted(v)[:4] for k, v in sorted(headers.items())},
        "bodies": [describe_request(e) for e in proxy.turns()],
        "failures": proxy.failures(),
        "sessions": proxy.sessions(),
    }


def save_probe(name: str, proxy: CaptureProxy, run: HarnessRun | None, directory: Path) -> dict[str, Any]:
    """Write the run's full exchanges and :func:`probe_summary` to ``directory`` (and ``$BACKENDS_HARNESS_PROBE_DIR``
    when set), print the summary, and return it."""
    summary = probe_summary(proxy)
    if run is not None:
        summary["run"] = {"returncode": run.returncode, "seconds": round(run.seconds, 1), "result": run.result}
    full = {"summary": summary, "exchanges": [e.as_json() for e in proxy.exchanges]}
    targets = [directory]
    if os.environ.get("BACKENDS_HARNESS_PROBE_DIR"):
        targets.append(Path(os.environ["BACKENDS_HARNESS_PROBE_DIR"]))
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
    for target in targets:
        target.mkdir(parents=True, exist_ok=True)
        (target / f"probe-{safe}.json").write_text(json.dumps(full, indent=1, default=str), encoding="utf-8")
    compact = {k: summary[k] for k in ("requests", "failures", "sessions")}
    print(f"probe {name}: " + json.dumps(compact, default=str))
    return summary


@contextlib.contextmanager
def captured(gw: Any) -> Iterator[CaptureProxy]:
    """A :class:`CaptureProxy` in front of ``gw``."""
    with CaptureProxy(gw.url) as proxy:
        yield proxy
