"""smolagents: the default ``ToolCallingAgent`` over ``OpenAIModel`` (the OpenAI-compatible model class, which sends
``tool_choice: "required"`` by default) with a ``run_shell`` tool; ``--stream`` turns ``stream_outputs`` on."""

from __future__ import annotations

import argparse
from typing import Any

from common import TASK, api_key, base_url, emit, model, run_shell, tool_outputs
from smolagents import OpenAIModel, ToolCallingAgent, tool

shell_tool = tool(run_shell)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stream", action="store_true")
    args = parser.parse_args()
    llm = OpenAIModel(model_id=model(), api_base=base_url(), api_key=api_key())
    agent = ToolCallingAgent(tools=[shell_tool], model=llm, stream_outputs=args.stream)
    answer: Any = agent.run(TASK)
    steps = [type(step).__name__ for step in agent.memory.steps]
    errors = [str(getattr(step, "error", None)) for step in agent.memory.steps if getattr(step, "error", None)]
    emit(final=str(answer), system=agent.system_prompt, tool_outputs=tool_outputs, steps=steps, errors=errors)


if __name__ == "__main__":
    main()
