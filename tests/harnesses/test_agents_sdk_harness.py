"""The OpenAI Agents SDK (``openai-agents``, its own venv) through the gateway: ``Runner.run`` and
``Runner.run_streamed``, on the default ``OpenAIProvider`` (the Responses API) and on chat completions
(``set_default_openai_api("chat_completions")``), one ``run_shell`` function tool, the ShellLoop."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from agent_engine import ShellLoop
from python_harnesses import (
    AGENTS_SDK,
    HarnessProcess,
    assert_clean,
    captured,
    check_tool_loop,
    ensure_harness_venv,
    save_probe,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def venv() -> Path:
    return ensure_harness_venv(AGENTS_SDK)


@pytest.mark.parametrize("mode", ["run", "streamed"])
@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_agents_sdk_runs_the_shell_loop(
    agent_gateway: Callable[..., Any], venv: Path, tmp_path: Path, api: str, mode: str
) -> None:
    with agent_gateway(ShellLoop()) as gw, captured(gw) as proxy:
        args = ["--api", api, "--mode", mode]
        run = HarnessProcess(venv, "agents_sdk.py", args, base_url=proxy.url + "/v1", workdir=tmp_path).run()
        save_probe(f"agents-sdk-{api}-{mode}", proxy, run, tmp_path)
        assert_clean(check_tool_loop(gw, proxy, run))
        wire = "/v1/responses" if api == "responses" else "/v1/chat/completions"
        assert {e.path for e in proxy.turns()} == {wire}
