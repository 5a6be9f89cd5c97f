"""The examples in examples/ run to the end, every fact they check holding."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
#: Seconds an example may take (a hang guard on a loaded two-core machine, not a speed check).
GUARD_S = 900.0


@pytest.mark.slow
def test_the_synchronous_rollout_loop_runs_its_50_steps(tiny_models) -> None:
    done = subprocess.run(
        [sys.executable, "-W", "error", str(EXAMPLES / "sync_rollout_loop.py"), "--models-dir", str(tiny_models.root)],
        capture_output=True,
        text=True,
        timeout=GUARD_S,
    )
    assert (done.returncode, done.stderr) == (0, "")
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines[:-1]] == ["step 10", "step 20", "step 30", "step 40"]
    assert lines[-1].startswith("50 steps, ") and lines[-1].endswith(" tokens sampled, every check held")
