"""smolagents (its own venv) through the gateway: the default ``ToolCallingAgent`` over ``OpenAIModel`` (chat
completions, ``tool_choice: "required"``) with a ``run_shell`` tool, ``stream_outputs`` off and on.

smolagents re-sends its history as text: an earlier tool call comes back as an assistant message ``Calling
tools:\\n[{...}]`` and its result as a user message ``Observation:\\n...`` (its ``tool_role_conversions``), never as
``tool_calls`` / ``tool`` messages. :class:`SmolLoop` counts those observations, and ends by calling smolagents'
``final_answer`` tool, the only way its run returns."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from agent_engine import END, ShellLoop, tools_in
from python_harnesses import (
    ANSWER,
    SMOLAGENTS,
    HarnessProcess,
    assert_clean,
    captured,
    check_tool_loop,
    ensure_harness_venv,
    save_probe,
)

pytestmark = pytest.mark.slow

_OBSERVATION = re.compile(r"<\|im_start\|>user\n((?:Call id: \S+\n)?Observation:.*?)<\|im_end\|>", re.S)


def observations(prompt: str) -> list[str]:
    """smolagents' tool results in a rendered prompt: its ``Observation:`` user messages."""
    return _OBSERVATION.findall(prompt)


class SmolLoop(ShellLoop):
    """The ShellLoop on smolagents' ``run_shell`` tool, counting its ``Observation:`` messages, ending with
    ``final_answer``."""

    def __init__(self) -> None:
        super().__init__(shell_names=("run_shell",))

    def __call__(self, prompt: str) -> str:
        tools = {tool["name"]: tool for tool in tools_in(prompt)}
        shell = self.shell(list(tools.values()))
        if shell is None:
            return self.side_reply
        task = prompt.rfind("New task:")
        done = len(observations(prompt[task:] if task >= 0 else prompt))
        if done == 0:
            return self.call(shell, "I will run it.")
        if done == 1:
            return self.call(shell, "Once more, to be sure.")
        body = json.dumps({"name": "final_answer", "arguments": {"answer": ANSWER}})
        return f"I have the output.\n<tool_call>\n{body}\n</tool_call>{END}"


@pytest.fixture(scope="module")
def venv() -> Path:
    return ensure_harness_venv(SMOLAGENTS)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream_outputs"])
def test_smolagents_tool_calling_agent_runs_the_shell_loop(
    agent_gateway: Callable[..., Any], venv: Path, tmp_path: Path, stream: bool
) -> None:
    """smolagents sends ``tool_choice: "required"`` (honoured: the engine is constrained to the template's
    tool-call markup) and resends its history as text, so no turn extends the one before it: with its session in
    the base URL (what the README says for a harness that names none) the run is one session, each turn a branch
    of its own rendered whole, each branch's training view its own turn as the model saw it."""
    with agent_gateway(SmolLoop()) as gw, captured(gw) as proxy:
        args = ["--stream"] if stream else []
        url = f"{proxy.url}/s/smol-{'stream' if stream else 'plain'}/v1"
        run = HarnessProcess(venv, "smolagents_agent.py", args, base_url=url, workdir=tmp_path).run()
        save_probe(f"smolagents-{'stream' if stream else 'plain'}", proxy, run, tmp_path)
        # the run's own checks, but for those of one branch extending itself (asserted as they are, below)
        found = check_tool_loop(gw, proxy, run, responses=observations)
        problems = [p for p in found if not p.startswith(("session smol-", "gateway failures", "--- stdout"))]
        assert_clean(problems)
        sent = [e.body for e in proxy.turns()]
        assert all(body.get("tool_choice") == "required" for body in sent), "smolagents' default tool_choice"
        (session,) = proxy.sessions()
        trajectory = gw.trajectory(session)
        assert [b["reason"] for b in trajectory["branches"]] == ["first", "rewritten", "rewritten"]
        assert [b["turns"] for b in trajectory["branches"]] == [[0], [1], [2]]
        for turn in trajectory["turns"]:  # constrained: every reply is calls only, the calls smolagents ran
            assert turn["reply"]["tool_calls"] and not turn["reply"]["content"], turn["reply"]
