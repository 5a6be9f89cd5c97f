"""Claude Code (``@anthropic-ai/claude-code``, pinned) headless with its default settings, on Anthropic's Messages
wire, through the gateway: the shell loop with its own ``Bash`` tool, read back as the trainer reads it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from agent_engine import ShellLoop
from capture_proxy import CaptureProxy
from npm_clis import CLAUDE_CODE, base_env, check_harness_run, ensure_cli, probe_log, run_cli

pytestmark = pytest.mark.slow

TASK = "Run `echo backends-probe` in the shell twice, then tell me you are done."


def claude_env(prefix: Path, home: Path, base_url: str) -> dict[str, str]:
    """A new user's environment pointed at ``base_url`` by a key and a model name, with nonessential traffic
    (telemetry, error reports, the auto-updater, release notes) off."""
    return {
        **base_env(prefix, home),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": "sk-ant-backends-test",
        "ANTHROPIC_MODEL": "tiny",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
    }


def claude_argv(prefix: Path) -> list[str]:
    # --allowedTools Bash: headless (-p) Claude Code asks before running a command and, with nobody to ask, refuses;
    # this pre-approves its Bash tool (a permission, not a model setting). --dangerously-skip-permissions would too,
    # but Claude Code refuses it as root, which the test may well be.
    claude = str(prefix / "node_modules" / ".bin" / CLAUDE_CODE.bin)
    return [claude, "-p", TASK, "--output-format", "json", "--allowedTools", "Bash"]


def test_claude_code_runs_the_shell_loop(agent_gateway: Callable[..., Any], tmp_path: Path) -> None:
    prefix = ensure_cli(CLAUDE_CODE)
    loop = ShellLoop()
    work = tmp_path / "work"
    work.mkdir()
    with agent_gateway(loop) as gw, CaptureProxy(gw.url, log=probe_log(tmp_path, "claude-code")) as proxy:
        run = run_cli(claude_argv(prefix), env=claude_env(prefix, tmp_path / "home", proxy.url), cwd=work)
        checked = check_harness_run(gw, proxy, run, loop)

        result = json.loads(run.stdout)
        assert result["is_error"] is False, result
        assert loop.answer.removesuffix("<|im_end|>") in result["result"]
        # its system prompt reached the model: every system block of its main requests is in the rendered prompt
        main = [e for e in proxy.exchanges if e.path.startswith("/v1/messages") and "count_tokens" not in e.path]
        main = [e for e in main if isinstance(e.body, dict) and any(t.get("name") == "Bash" for t in e.body["tools"])]
        assert main, proxy.summary()
        system = main[0].body["system"]
        blocks = [system] if isinstance(system, str) else [b["text"] for b in system]
        prompt = _first_with(gw.engine.prompts, "Bash")
        for text in blocks:
            if text.startswith("x-anthropic-billing-header"):
                continue  # a per-build header, not instructions: the gateway may drop it
            assert text in prompt, text[:200]
        print("main session", checked.session, "side sessions", {k: len(v) for k, v in checked.side.items()})


def _first_with(prompts: list[str], tool: str) -> str:
    for prompt in prompts:
        if f'"name": "{tool}"' in prompt:
            return prompt
    raise AssertionError(f"no prompt offered the {tool} tool")


def probe_command(tmp: Path, base_url: str) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of a run (for a probe outside pytest)."""
    prefix = ensure_cli(CLAUDE_CODE)
    return claude_argv(prefix), claude_env(prefix, tmp / "home", base_url)
