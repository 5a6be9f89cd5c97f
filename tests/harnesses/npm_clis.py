"""The real agent programs from npm: installed at pinned versions into cached directories outside the workspace,
run headless with a fresh ``HOME``, and watched through a recording proxy in front of the gateway.

* :func:`ensure_cli` installs one CLI with :func:`backends_testkit.live.ensure_venv` (a directory per CLI and
  version under ``$BACKENDS_SERVER_VENVS``, a marker holding the recipe's hash, a lock against concurrent runs):
  ``npm install --prefix <dir>/npm <package>@<version>``, with npm's cache beside the installs, never in the
  workspace. Node and npm come from the machine; where they are missing, :func:`ensure_node` installs Debian's
  ``nodejs`` and ``npm`` (sudo when not root), as ``./dev`` installs Chromium. A CLI needing a newer Node than
  the machine's gets npm's ``node`` package of that major in its own directory.
* :func:`run_cli` runs one headless, in its own process group, killed whole on timeout.
* The tests watch each run through :class:`~capture_proxy.CaptureProxy` (its exchanges logged by
  :func:`probe_log`'s path) for the probe report and for failure messages.
* :func:`check_trajectory` holds what every harness test asserts on the trainer's view of its main session.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
from capture_proxy import CaptureProxy

from backends_testkit.live import ensure_venv, server_venvs_dir

__all__ = [
    "CLAUDE_CODE",
    "CODEX",
    "QWEN_CODE",
    "CliRun",
    "NpmCli",
    "base_env",
    "Checked",
    "check_harness_run",
    "check_trajectory",
    "ensure_cli",
    "ensure_node",
    "probe_log",
    "run_cli",
]

RUN_TIMEOUT_S = 180.0
"""Seconds one headless run may take before its process group is killed."""
NODE_INSTALL_LOCK_TIMEOUT_S = 1800.0


@attrs.frozen
class NpmCli:
    """One agent program on npm.

    :ivar package: the npm package.
    :ivar version: the pinned version.
    :ivar bin: the executable's name in ``node_modules/.bin``.
    :ivar scripts: whether npm runs install scripts (Claude Code's postinstall puts its platform binary in
        place; Codex and Qwen Code find theirs among their optional dependencies without one).
    :ivar min_node: the oldest Node major the package supports (its ``engines``).
    """

    package: str
    version: str
    bin: str
    scripts: bool
    min_node: int

    @property
    def slug(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", self.package.lower()).strip("-") + "-" + self.version


CLAUDE_CODE = NpmCli("@anthropic-ai/claude-code", "2.1.197", "claude", scripts=True, min_node=18)
CODEX = NpmCli("@openai/codex", "0.171.0", "codex", scripts=False, min_node=16)
QWEN_CODE = NpmCli("@qwen-code/qwen-code", "0.15.10", "qwen", scripts=False, min_node=20)


# -- installing --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _locked(path: Path, timeout: float) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout
    with path.open("a") as handle:
        while True:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"another process has held {path} for {timeout:.0f}s") from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def ensure_node() -> tuple[str, str]:
    """The machine's ``node`` and ``npm``; installs Debian's ``nodejs`` and ``npm`` packages first when either is
    missing (``apt-get update`` only if the install fails on stale lists; sudo when not root).

    :raises RuntimeError: they are missing and cannot be installed.
    """
    node, npm = shutil.which("node"), shutil.which("npm")
    if node and npm:
        return node, npm
    with _locked(server_venvs_dir() / ".nodejs-apt.lock", NODE_INSTALL_LOCK_TIMEOUT_S):
        node, npm = shutil.which("node"), shutil.which("npm")
        if node and npm:
            return node, npm
        sudo: list[str] = []
        if os.geteuid() != 0:
            if shutil.which("sudo") is None:
                raise RuntimeError("node and npm are missing and this user cannot install them (not root, no sudo)")
            sudo = ["sudo"]
        # a dpkg lock another install holds is waited for, not failed on
        apt = [*sudo, "env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "-o", "DPkg::Lock::Timeout=600"]
        install = [*apt, "install", "-y", "-qq", "--no-install-recommends", "nodejs", "npm"]
        quiet: dict[str, Any] = {"stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE, "stdin": subprocess.DEVNULL}
        if subprocess.run(install, check=False, **quiet).returncode != 0:
            update = subprocess.run([*apt, "update", "-qq"], check=False, **quiet)
            done = subprocess.run(install, check=False, **quiet)
            if update.returncode != 0 or done.returncode != 0:
                raise RuntimeError(f"apt-get could not install nodejs and npm: {done.stderr.decode()[-2000:]}")
    node, npm = shutil.which("node"), shutil.which("npm")
    if not (node and npm):
        raise RuntimeError("apt-get installed nodejs and npm, yet node or npm is not on PATH")
    return node, npm


def node_major(node: str) -> int:
    out = subprocess.run([node, "--version"], capture_output=True, text=True, check=True, timeout=60).stdout
    return int(out.strip().lstrip("v").split(".")[0])


def npm_cache_dir() -> Path:
    """npm's download cache for these installs: beside the cached directories, never in the workspace or the
    user's ``~/.npm``."""
    return server_venvs_dir() / ".npm-cache"


def ensure_cli(cli: NpmCli) -> Path:
    """The directory holding ``cli`` installed (its executable is ``<dir>/node_modules/.bin/<bin>``), installing it
    first if missing or built by another recipe. Returns the npm prefix."""
    node, npm = ensure_node()
    major = node_major(node)
    packages = [f"{cli.package}@{cli.version}"]
    if major < cli.min_node:  # e.g. Debian bookworm's Node 18 for Qwen Code: npm's Node binary of the major it needs
        packages.append(f"node@{cli.min_node}")
    install = [npm, "install", "--prefix", "{venv}/npm", "--no-audit", "--no-fund", "--no-update-notifier"]
    install += ["--cache", str(npm_cache_dir()), "--loglevel", "warn"]
    if not cli.scripts and len(packages) == 1:
        install.append("--ignore-scripts")
    venv = ensure_venv(
        f"npm-{cli.slug}",
        python=sys.executable,
        venv_args=["--without-pip"],
        install=[[*install, *packages]],
        marker_extra=f"node {major}",
    )
    prefix = venv / "npm"
    if not (prefix / "node_modules" / ".bin" / cli.bin).exists():
        raise RuntimeError(f"{cli.package}@{cli.version} installed without node_modules/.bin/{cli.bin} in {prefix}")
    return prefix


# -- running -----------------------------------------------------------------------------------------------


def base_env(prefix: Path, home: Path) -> dict[str, str]:
    """A new user's environment: only ``PATH`` (the CLI's ``.bin`` first, then the machine's Node), a fresh
    ``HOME`` and its XDG directories, a UTF-8 locale, a dumb terminal; nothing else of this process's environment
    (no proxies, no keys, no config)."""
    node, _ = ensure_node()
    path = [str(prefix / "node_modules" / ".bin"), str(Path(node).parent), "/usr/local/bin", "/usr/bin", "/bin"]
    for sub in (".config", ".cache", ".local/share", "tmp"):
        (home / sub).mkdir(parents=True, exist_ok=True)
    return {
        "PATH": os.pathsep.join(dict.fromkeys(path)),
        "HOME": str(home),
        "USER": "agent",
        "LOGNAME": "agent",
        "SHELL": "/bin/bash",
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
        "CI": "1",
        "TMPDIR": str(home / "tmp"),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_DATA_HOME": str(home / ".local/share"),
    }


@attrs.frozen
class CliRun:
    argv: list[str]
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool

    def describe(self) -> str:
        status = "timed out" if self.timed_out else f"exit {self.returncode}"
        return (
            f"$ {' '.join(self.argv)}\n{status} after {self.seconds:.1f}s\n"
            f"--- stdout (tail)\n{self.stdout[-4000:]}\n--- stderr (tail)\n{self.stderr[-4000:]}"
        )


def run_cli(
    argv: Sequence[str], *, env: Mapping[str, str], cwd: Path, timeout: float = RUN_TIMEOUT_S, stdin: str | None = None
) -> CliRun:
    """Run ``argv`` in its own session (``stdin``: its input; ``None``: none, ``/dev/null``); on timeout kill its
    whole process group."""
    started = time.monotonic()
    proc = subprocess.Popen(
        list(argv),
        cwd=cwd,
        env=dict(env),
        stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    timed_out = False
    try:
        out, err = proc.communicate(None if stdin is None else stdin.encode(), timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever it left behind in its group
    return CliRun(
        argv=list(argv),
        returncode=None if timed_out else proc.returncode,
        stdout=out.decode("utf-8", "replace"),
        stderr=err.decode("utf-8", "replace"),
        seconds=time.monotonic() - started,
        timed_out=timed_out,
    )


# -- the trainer's view ------------------------------------------------------------------------------------


def check_trajectory(trajectory: Mapping[str, Any], *, expected_turns: int) -> list[dict[str, Any]]:
    """Assert the session is one branch whose every turn's prompt starts with the previous turn's exact prompt and
    completion ids; returns its turns in order."""
    turns: list[dict[str, Any]] = sorted(trajectory["turns"], key=lambda t: t["turn"])
    assert len(turns) == expected_turns, [t["reply"] for t in turns]
    branches = [b for b in trajectory["branches"] if b["turns"]]
    assert len(branches) == 1, [(b["branch"], b["turns"], b.get("reason")) for b in trajectory["branches"]]
    assert branches[0]["turns"] == [t["turn"] for t in turns]
    for before, turn in itertools.pairwise(turns):
        seen = before["prompt_ids"] + before["completion_ids"]
        assert turn["prompt_ids"][: len(seen)] == seen, f"turn {turn['turn']} does not extend turn {before['turn']}"
    last = turns[-1]
    assert branches[0]["input_ids"] == last["prompt_ids"] + last["completion_ids"]
    return turns


@attrs.frozen
class Checked:
    """What :func:`check_harness_run` found: the main session's id and turns, and the side sessions."""

    session: str
    turns: list[dict[str, Any]]
    side: dict[str, list[dict[str, Any]]]


def check_harness_run(gw: Any, proxy: CaptureProxy, run: CliRun, loop: Any) -> Checked:
    """What every harness test asserts after one headless run of the :class:`~agent_engine.ShellLoop`:

    * the CLI exited 0 and printed the loop's final answer;
    * the engine saw both tool responses holding the command's output;
    * the main session (the one whose turns called the shell tool) is one branch of three turns, each extending
      the one before by its exact ids, with two tool calls of distinct ids;
    * the session holds exactly the turns whose answers reached the harness (a 200 on a turn route naming the
      session), no more.
    """
    context = f"{run.describe()}\n--- requests\n{proxy.summary()}"
    assert not run.timed_out and run.returncode == 0, context
    final = loop.answer.removesuffix("<|im_end|>")
    assert final in run.stdout, context
    probes = [p for p in gw.engine.prompts if p.count("<tool_response>") >= 2]
    assert probes, context
    responses = re.findall(r"<tool_response>(.*?)</tool_response>", probes[-1], re.S)
    # the command's output, a line of its own (a harness may echo the command itself too)
    output = re.compile(r"^(?:Output: )?backends-probe\s*$", re.M)
    assert len(responses) >= 2 and all(output.search(r) for r in responses[-2:]), responses

    sessions = {s["session"]: gw.trajectory(s["session"]) for s in gw.sessions()}
    calls_of = {sid: [t for t in traj["turns"] if t["reply"].get("tool_calls")] for sid, traj in sessions.items()}
    main = [sid for sid, calls in calls_of.items() if calls]
    assert len(main) == 1, (main, context)
    session = main[0]
    turns = check_trajectory(sessions[session], expected_turns=3)
    ids = [call["id"] for turn in turns for call in turn["reply"].get("tool_calls") or []]
    assert len(ids) == 2 and len(set(ids)) == 2, ids
    assert final in json.dumps(turns[-1]["reply"]), turns[-1]["reply"]

    answered = [e for e in proxy.turns() if e.status == 200 and e.session == session]
    assert len(answered) == len(turns), context
    for exchange in answered:
        assert exchange.error is None, exchange.short()
    got = [e.call_ids() for e in answered]
    assert [len(g) for g in got] == [len(t["reply"].get("tool_calls") or []) for t in turns], got
    flat = [i for g in got for i in g]
    assert len(set(flat)) == 2, f"the harness got tool call ids {flat}"
    side = {sid: sessions[sid]["turns"] for sid in sessions if sid != session}
    return Checked(session=session, turns=turns, side=side)


def probe_log(tmp_path: Path, name: str) -> Path:
    """Where a run's exchanges are written (JSON lines): ``$BACKENDS_HARNESS_PROBE_DIR/<name>.jsonl`` when set
    (kept for a probe report), else in ``tmp_path``."""
    root = Path(os.environ.get("BACKENDS_HARNESS_PROBE_DIR") or tmp_path)
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{name}.jsonl"
    path.unlink(missing_ok=True)
    return path
