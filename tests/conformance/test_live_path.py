"""The ``--backend-url`` path: the conformance suite run against a real server process over real sockets."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def reference_server(tiny_models):
    proc = subprocess.Popen(
        [sys.executable, "-m", "backends_testkit.reference", "--model", str(tiny_models.dense), "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening on "), line
        yield line.split()[-1]
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        proc.stdout.close()


@pytest.mark.slow
def test_conformance_suite_runs_live_against_a_real_server(reference_server: str) -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-rs",
            str(ROOT / "tests/conformance/test_reference.py"),
            "--backend-url",
            reference_server,
            "--backend",
            "reference",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    summary = run.stdout.strip().splitlines()[-1]
    assert " passed" in summary
    # the MoE routing test is the only one a dense live server cannot run
    assert "skipped" in summary and "--backend-moe" in run.stdout
