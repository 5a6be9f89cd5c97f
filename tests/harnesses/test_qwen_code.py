"""Qwen Code (``@qwen-code/qwen-code``, pinned) headless with its default settings, on OpenAI's chat completions
wire, through the gateway: the shell loop with its own ``run_shell_command`` tool, read back as the trainer reads
it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from agent_engine import ShellLoop
from capture_proxy import CaptureProxy
from npm_clis import QWEN_CODE, base_env, check_harness_run, ensure_cli, probe_log, run_cli

pytestmark = pytest.mark.slow

TASK = "Run `echo backends-probe` in the shell twice, then tell me you are done."

#: ``~/.qwen/settings.json``: usage statistics (on by default, sent to Alibaba), telemetry and the auto-updater
#: off; nothing about the model.
SETTINGS = {
    "general": {"enableAutoUpdate": False},
    "privacy": {"usageStatisticsEnabled": False},
    "telemetry": {"enabled": False},
}


def qwen_env(prefix: Path, home: Path, base_url: str) -> dict[str, str]:
    """A new user's environment pointed at ``base_url`` by the OpenAI-compatible provider's three variables."""
    env = base_env(prefix, home)
    (home / ".qwen").mkdir(parents=True, exist_ok=True)
    (home / ".qwen" / "settings.json").write_text(json.dumps(SETTINGS, indent=2))
    return {
        **env,
        "OPENAI_BASE_URL": base_url + "/v1",
        "OPENAI_API_KEY": "sk-backends-test",
        "OPENAI_MODEL": "tiny",
    }


def qwen_argv(prefix: Path) -> list[str]:
    # --approval-mode yolo: headless Qwen Code refuses a shell command it would have to ask about; yolo approves
    # its tools (a permission, not a model setting). The OPENAI_* variables alone select its OpenAI-compatible
    # provider (no --auth-type needed). The prompt is positional (-p is deprecated in this version).
    qwen = str(prefix / "node_modules" / ".bin" / QWEN_CODE.bin)
    return [qwen, "--output-format", "json", "--approval-mode", "yolo", TASK]


def test_qwen_code_runs_the_shell_loop(agent_gateway: Callable[..., Any], tmp_path: Path) -> None:
    prefix = ensure_cli(QWEN_CODE)
    loop = ShellLoop()
    work = tmp_path / "work"
    work.mkdir()
    with agent_gateway(loop) as gw, CaptureProxy(gw.url, log=probe_log(tmp_path, "qwen-code")) as proxy:
        run = run_cli(qwen_argv(prefix), env=qwen_env(prefix, tmp_path / "home", proxy.url), cwd=work)
        checked = check_harness_run(gw, proxy, run, loop)

        # its system prompt reached the model
        turns = [e for e in proxy.exchanges if e.path.endswith("/v1/chat/completions") and isinstance(e.body, dict)]
        first = next(e.body for e in turns if e.body.get("tools"))
        system = [m for m in first["messages"] if m["role"] == "system"]
        assert system, json.dumps(first)[:2000]
        prompt = next(p for p in gw.engine.prompts if "run_shell_command" in p)
        for message in system:
            content = message["content"]
            for text in [content] if isinstance(content, str) else [part["text"] for part in content]:
                assert text.strip() in prompt, text[:200]
        print("main session", checked.session, "side sessions", {k: len(v) for k, v in checked.side.items()})


def probe_command(tmp: Path, base_url: str) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of a run (for a probe outside pytest)."""
    prefix = ensure_cli(QWEN_CODE)
    return qwen_argv(prefix), qwen_env(prefix, tmp / "home", base_url)
