"""The live-server harness never waits without a deadline: for the build lock of a server venv held by another
process, and for an install command that does not end."""

from __future__ import annotations

import fcntl
import sys
import time
from pathlib import Path

import pytest

from backends_testkit import live


def test_a_build_lock_held_elsewhere_is_waited_for_with_a_deadline(tmp_path: Path) -> None:
    lock = tmp_path / ".demo.lock"
    with lock.open("a") as other:  # another open file: another holder, as another process would be
        fcntl.flock(other.fileno(), fcntl.LOCK_EX)
        started = time.monotonic()
        held = pytest.raises(live.LiveServerError, match=r"another process has held .*\.demo\.lock for 1s")
        with held, live._exclusive_lock(lock, timeout=1.0):
            pass
        assert time.monotonic() - started < 10
    with live._exclusive_lock(lock, timeout=1.0):  # free again: taken at once
        pass


def test_an_install_command_that_does_not_end_is_killed_and_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BACKENDS_SERVER_VENVS", str(tmp_path / "venvs"))
    monkeypatch.setattr(live, "INSTALL_COMMAND_TIMEOUT_S", 1.0)
    started = time.monotonic()
    with pytest.raises(live.VenvInstallError, match=r"exited with -9") as info:
        live.ensure_venv(
            "stuck",
            python=sys.executable,
            venv_args=["--without-pip"],
            install=[["python", "-c", "import time; time.sleep(60)"]],
        )
    assert time.monotonic() - started < 30
    assert "killed: still running after 1s" in str(info.value)
