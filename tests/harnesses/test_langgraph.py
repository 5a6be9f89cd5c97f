"""LangGraph (``langgraph`` + ``langchain-openai``, their own venv) through the gateway: the prebuilt ReAct agent over
``ChatOpenAI`` (chat completions) with a ``run_shell`` tool and a system prompt, invoked and streamed in every stream
mode ("values", "updates", "messages")."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from agent_engine import ShellLoop
from python_harnesses import (
    LANGGRAPH,
    HarnessProcess,
    assert_clean,
    captured,
    check_concurrent_runs,
    check_tool_loop,
    ensure_harness_venv,
    save_probe,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def venv() -> Path:
    return ensure_harness_venv(LANGGRAPH)


@pytest.mark.parametrize("mode", ["invoke", "values", "updates", "messages"])
def test_langgraph_react_agent_runs_the_shell_loop(
    agent_gateway: Callable[..., Any], venv: Path, tmp_path: Path, mode: str
) -> None:
    with agent_gateway(ShellLoop()) as gw, captured(gw) as proxy:
        args = ["--mode", mode]
        run = HarnessProcess(venv, "langgraph_react.py", args, base_url=proxy.url + "/v1", workdir=tmp_path).run()
        save_probe(f"langgraph-{mode}", proxy, run, tmp_path)
        assert_clean(check_tool_loop(gw, proxy, run))


def test_two_identical_langgraph_runs_at_once_keep_their_own_sessions(
    agent_gateway: Callable[..., Any], venv: Path, tmp_path: Path
) -> None:
    """Two invocations of the same graph on the same task at the same time, no session in the URL: each must end in
    a session of its own, one branch each."""
    with agent_gateway(ShellLoop()) as gw, captured(gw) as first, captured(gw) as second:
        proxies = (first, second)
        procs = [
            HarnessProcess(
                venv, "langgraph_react.py", ["--mode", "invoke"], base_url=p.url + "/v1", workdir=tmp_path / f"run-{i}"
            ).start()
            for i, p in enumerate(proxies)
        ]
        runs = [p.finish() for p in procs]
        assert_clean(check_concurrent_runs(gw, proxies, runs, name="langgraph-concurrent", directory=tmp_path))
