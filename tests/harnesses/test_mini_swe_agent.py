"""mini-swe-agent (its own venv) through the gateway, as the ``mini`` command runs it headless with its default
config (``mini.yaml``): the ``bash`` tool by tool calls on chat completions through LiteLLM. The agent ends when a
command prints ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` first, so :class:`MiniLoop` ends the ShellLoop with that
command instead of a bare answer."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from agent_engine import END, ShellLoop, last_task, tools_in
from python_harnesses import (
    ANSWER,
    MINI_SWE_AGENT,
    HarnessProcess,
    assert_clean,
    captured,
    check_concurrent_runs,
    check_session,
    check_tool_loop,
    ensure_harness_venv,
    save_probe,
)

pytestmark = pytest.mark.slow

SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
#: What ``mini`` needs from the environment to run unattended: no first-run setup wizard, no price lookup for a model
#: LiteLLM has no price for.
MINI_ENV = {"MSWEA_CONFIGURED": "1", "MSWEA_COST_TRACKING": "ignore_errors"}


class MiniLoop(ShellLoop):
    """The ShellLoop on mini-swe-agent's ``bash`` tool, ending with the submit command (the answer as its text)."""

    def __init__(self) -> None:
        super().__init__(shell_names=("bash",))

    def __call__(self, prompt: str) -> str:
        tool = self.shell(tools_in(prompt))
        if tool is None or last_task(prompt).count("<tool_response>") < 2:
            return super().__call__(prompt)
        body = json.dumps({"name": tool["name"], "arguments": {"command": SUBMIT}})
        return f"{self.answer.removesuffix(END)}\n<tool_call>\n{body}\n</tool_call>{END}"


@pytest.fixture(scope="module")
def venv() -> Path:
    return ensure_harness_venv(MINI_SWE_AGENT)


def mini(venv: Path, base_url: str, workdir: Path) -> HarnessProcess:
    return HarnessProcess(venv, "mini_swe_agent.py", [], base_url=base_url, workdir=workdir, env=MINI_ENV)


def test_mini_swe_agent_runs_the_shell_loop(agent_gateway: Callable[..., Any], venv: Path, tmp_path: Path) -> None:
    with agent_gateway(MiniLoop()) as gw, captured(gw) as proxy:
        run = mini(venv, proxy.url + "/v1", tmp_path).start().finish()
        save_probe("mini-swe-agent", proxy, run, tmp_path)
        assert_clean(check_tool_loop(gw, proxy, run, final=ANSWER))
        assert (run.result or {}).get("exit_status") == "Submitted"


def test_two_identical_mini_runs_at_once_keep_their_own_sessions(
    agent_gateway: Callable[..., Any], venv: Path, tmp_path: Path
) -> None:
    """Two runs of the same task at the same time, no session in the URL: each must end in a session of its own."""
    with agent_gateway(MiniLoop()) as gw, captured(gw) as first, captured(gw) as second:
        proxies = (first, second)
        procs = [mini(venv, p.url + "/v1", tmp_path / f"run-{i}").start() for i, p in enumerate(proxies)]
        runs = [p.finish() for p in procs]
        assert_clean(check_concurrent_runs(gw, proxies, runs, name="mini-swe-agent-concurrent", directory=tmp_path))


def test_grpo_rollouts_with_a_session_in_the_url_keep_their_own_sessions(
    agent_gateway: Callable[..., Any], venv: Path, tmp_path: Path
) -> None:
    """A GRPO group: the same task three times at once, each rollout at ``/s/<id>/v1``; each rollout's turns must be
    in its own session, one branch each."""
    ids = [f"grpo-rollout-{i}" for i in range(3)]
    with agent_gateway(MiniLoop()) as gw, captured(gw) as a, captured(gw) as b, captured(gw) as c:
        proxies = [a, b, c]
        procs = [mini(venv, f"{p.url}/s/{sid}/v1", tmp_path / sid).start() for p, sid in zip(proxies, ids, strict=True)]
        runs = [p.finish() for p in procs]
        problems = []
        for sid, proxy, run in zip(ids, proxies, runs, strict=True):
            save_probe(f"mini-swe-agent-grpo-{sid}", proxy, run, tmp_path)
            if run.returncode != 0 or ANSWER not in str((run.result or {}).get("final")):
                problems.append(f"{sid} did not finish its loop: {run.returncode} {run.result}\n{run.tail(15)}")
            if proxy.sessions() != [sid]:
                problems.append(f"{sid}'s answers name sessions {proxy.sessions()}")
            problems.extend(f"{sid}: {p}" for p in check_session(gw.trajectory(sid), proxy))
        assert_clean(problems)
        assert sorted(s["session"] for s in gw.sessions()) == ids
