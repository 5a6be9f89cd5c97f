"""Codex CLI (``@openai/codex``, pinned) headless with its default settings, on OpenAI's Responses wire (its only
wire), through the gateway: the shell loop with its own shell tool, read back as the trainer reads it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from agent_engine import ShellLoop
from capture_proxy import CaptureProxy
from npm_clis import CODEX, base_env, check_harness_run, ensure_cli, probe_log, run_cli

pytestmark = pytest.mark.slow

TASK = "Run `echo backends-probe` in the shell twice, then tell me you are done."
KEY_ENV = "BACKENDS_GATEWAY_KEY"

#: A model provider for the gateway (``wire_api = "responses"``: Codex speaks nothing else), its key read from
#: :data:`KEY_ENV`; update checks, analytics and feedback uploads off. Nothing else is set: the model's settings
#: (reasoning, verbosity, tools) stay Codex's defaults.
CONFIG = """\
model = "tiny"
model_provider = "gateway"
check_for_update_on_startup = false

[analytics]
enabled = false

[feedback]
enabled = false

[model_providers.gateway]
name = "backends gateway"
base_url = "{base_url}/v1"
env_key = "{key_env}"
wire_api = "responses"
"""


def codex_env(prefix: Path, home: Path, base_url: str) -> dict[str, str]:
    """A new user's environment whose ``~/.codex/config.toml`` points Codex at ``base_url``."""
    env = base_env(prefix, home)
    (home / ".codex").mkdir(parents=True, exist_ok=True)
    (home / ".codex" / "config.toml").write_text(CONFIG.format(base_url=base_url, key_env=KEY_ENV))
    return {**env, KEY_ENV: "sk-backends-test"}


def codex_argv(prefix: Path) -> list[str]:
    # --skip-git-repo-check: the working directory is a fresh tmp dir, not a git repository.
    codex = str(prefix / "node_modules" / ".bin" / CODEX.bin)
    return [codex, "exec", "--skip-git-repo-check", TASK]


def test_codex_runs_the_shell_loop(agent_gateway: Callable[..., Any], tmp_path: Path) -> None:
    prefix = ensure_cli(CODEX)
    loop = ShellLoop()
    work = tmp_path / "work"
    work.mkdir()
    with agent_gateway(loop) as gw, CaptureProxy(gw.url, log=probe_log(tmp_path, "codex")) as proxy:
        run = run_cli(codex_argv(prefix), env=codex_env(prefix, tmp_path / "home", proxy.url), cwd=work)
        checked = check_harness_run(gw, proxy, run, loop)

        # its instructions and developer messages reached the model
        turns = [e for e in proxy.exchanges if e.path.endswith("/v1/responses") and isinstance(e.body, dict)]
        first = turns[0].body
        prompt = next(p for p in gw.engine.prompts if "backends-probe" in p)
        texts = [first["instructions"]] if first.get("instructions") else []
        for item in first["input"]:
            if item.get("role") in ("developer", "system"):
                content = item["content"]
                texts += [content] if isinstance(content, str) else [part["text"] for part in content]
        assert texts, json.dumps(first)[:2000]
        for text in texts:
            assert text.strip() in prompt, text[:200]
        print("main session", checked.session, "side sessions", {k: len(v) for k, v in checked.side.items()})


def probe_command(tmp: Path, base_url: str) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of a run (for a probe outside pytest)."""
    prefix = ensure_cli(CODEX)
    return codex_argv(prefix), codex_env(prefix, tmp / "home", base_url)
