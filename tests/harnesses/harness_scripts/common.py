"""What every harness script shares (standard library only: it runs inside each harness's own venv).

A script reads the gateway's address from the environment the test sets (``OPENAI_BASE_URL``, ``OPENAI_API_KEY``,
``HARNESS_MODEL``), runs its harness once with :func:`run_shell` (under the harness's own tool decorator) as its shell
tool, and prints one line ``HARNESS_RESULT {json}`` last."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

RESULT_PREFIX = "HARNESS_RESULT "
TASK = "Run the shell command `echo backends-probe` twice, then tell me what it printed."
"""The task every harness gets (the scripted engine ignores it: its policy decides the loop)."""


def model() -> str:
    return os.environ["HARNESS_MODEL"]


def base_url() -> str:
    return os.environ["OPENAI_BASE_URL"]


def api_key() -> str:
    return os.environ["OPENAI_API_KEY"]


def run_command(command: str) -> str:
    """Run ``command`` in a shell; its stdout and stderr (the harness's shell tool)."""
    done = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=60, check=False)
    return done.stdout + done.stderr


tool_outputs: list[str] = []
"""What :func:`run_shell` returned, in order (a script reports it in its result)."""


def run_shell(command: str) -> str:
    """Run a shell command and return what it printed.

    Args:
        command: The command line to run.
    """
    out = run_command(command)
    tool_outputs.append(out)
    return out


def emit(**fields: Any) -> None:
    """Print the result line the test parses (last line of stdout)."""
    sys.stdout.flush()
    print(RESULT_PREFIX + json.dumps(fields, default=repr), flush=True)
