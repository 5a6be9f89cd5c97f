"""mini-swe-agent: the ``mini`` command's own code path (``minisweagent.run.mini.app``) with its default config
(``mini.yaml``: the ``bash`` tool by tool calls, the default LiteLLM model class, the local environment), made
non-interactive by the flags a headless user passes: ``--yolo`` (no confirmation), ``--exit-immediately`` (no prompt
at the end), ``--task``. The model is ``openai/<name>`` (LiteLLM's OpenAI-compatible provider, which reads
``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``); ``MSWEA_CONFIGURED`` skips the first-run setup wizard and
``MSWEA_COST_TRACKING=ignore_errors`` the cost lookup a local model has no price for (both set by the test)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common import TASK, emit, model
from minisweagent.run.mini import app


def main() -> None:
    out = Path("mini.traj.json").resolve()
    argv = ["--model", f"openai/{model()}", "--task", TASK, "--yolo", "--exit-immediately", "--output", str(out)]
    agent: Any = app(argv, standalone_mode=False)
    messages: list[dict[str, Any]] = agent.messages
    said = [str(m.get("content") or "") for m in messages if m.get("role") == "assistant"]
    emit(
        final=said[-1] if said else "",
        exit_status=messages[-1].get("extra", {}).get("exit_status") if messages else None,
        system=messages[0]["content"] if messages else "",
        tool_outputs=[str(m.get("content")) for m in messages if m.get("role") == "tool"],
        roles=[m.get("role") for m in messages],
        argv=argv,
    )


if __name__ == "__main__":
    main()
