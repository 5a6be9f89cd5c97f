"""Installs into a clean virtual environment as a user on a new machine would: uv with a cache of its own.

Tests that install the wheels of this checkout into a fresh venv take the third-party packages at the lock's
versions from the package index, through a uv cache that this test session created empty
(:func:`fresh_uv_env`). They never read a cache an earlier command may have filled: ``uv sync --locked`` installs
from the lock's URLs and leaves no index entries behind, so an ``--offline`` resolution passes only on a machine
with history.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

__all__ = ["fresh_uv_env", "install_locked_third_party", "run_uv", "uv"]


def uv() -> str:
    found = os.environ.get("UV") or shutil.which("uv")
    if found is None:
        pytest.skip("needs uv to build and install wheels (run through ./dev, which sets $UV)")
    return found


def fresh_uv_env(cache: Path) -> dict[str, str]:
    """The environment for uv commands that see only ``cache`` (empty when the session made it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("UV_") and k != "VIRTUAL_ENV"}
    env["UV_CACHE_DIR"] = str(cache)
    return env


def run_uv(*args: str, cwd: Path, env: dict[str, str], timeout: float = 600) -> str:
    """``uv *args``; its stdout, or an AssertionError with the command and everything it printed."""
    done = subprocess.run((uv(), *args), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"uv {' '.join(args)}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def install_locked_third_party(
    python: Path, root: Path, package: str, *, extras: tuple[str, ...] = (), cwd: Path, env: dict[str, str]
) -> None:
    """Install the third-party dependencies of workspace ``package`` (with ``extras``) at the versions uv.lock
    pins, from the package index, into the venv of ``python``; the workspace's own distributions are left out."""
    exported = run_uv(
        *("export", "--project", str(root), "--frozen", "--no-hashes", "--no-header", "--no-annotate"),
        *("--no-default-groups", "--package", package, "--no-emit-workspace"),
        *(a for extra in extras for a in ("--extra", extra)),
        cwd=cwd,
        env=env,
    )
    requirements = cwd / f"{package}-third-party.txt"
    requirements.write_text(exported)
    run_uv("pip", "install", "--python", str(python), "--no-deps", "-r", str(requirements), cwd=cwd, env=env)
