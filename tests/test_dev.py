"""``./dev`` syncs the environment from uv.lock without removing what the user installed into it."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run_dev(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], list[list[str]]]:
    """Run the real ``./dev`` with a recording ``uv`` first on ``PATH``: every uv call it makes, in order."""
    calls = tmp_path / "calls"
    fake = tmp_path / "bin" / "uv"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {shlex.quote(str(calls))}\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run([str(ROOT / "dev"), *args], env=env, capture_output=True, text=True, timeout=60)
    return done, [line.split() for line in calls.read_text().splitlines()]


def test_dev_syncs_without_removing_packages_the_lock_does_not_list(tmp_path: Path) -> None:
    done, calls = _run_dev(tmp_path, "lint")
    assert done.returncode == 0, done.stderr
    sync = calls[0]
    assert sync[0] == "sync"
    assert "--inexact" in sync  # extraneous packages (a user's plugin) stay installed
    assert "--locked" in sync  # what the lock pins is still installed exactly
    assert "--exact" not in sync
    assert [call[:3] for call in calls[1:]] == [
        ["run", "--no-sync", "ruff"],
        ["run", "--no-sync", "ruff"],
        ["run", "--no-sync", "mypy"],
    ]
