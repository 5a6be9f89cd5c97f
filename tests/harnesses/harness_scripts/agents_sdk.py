"""OpenAI Agents SDK (openai-agents): one agent with a ``run_shell`` function tool, on the default model provider.

``--api responses`` is the SDK's default (``OpenAIProvider`` uses the Responses API unless told otherwise);
``--api chat_completions`` is ``set_default_openai_api("chat_completions")``. ``--mode run`` is ``Runner.run``,
``--mode streamed`` ``Runner.run_streamed`` with every event consumed. The gateway comes from ``OPENAI_BASE_URL`` /
``OPENAI_API_KEY``, as the SDK's own client reads them."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from agents import Agent, Runner, function_tool, set_default_openai_api, set_tracing_disabled
from common import TASK, emit, model, run_shell, tool_outputs

INSTRUCTIONS = "You are the backends probe agent. Use the run_shell tool to run shell commands for the user."

shell_tool = function_tool(run_shell)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--api", choices=["responses", "chat_completions"], default="responses")
    parser.add_argument("--mode", choices=["run", "streamed"], default="run")
    args = parser.parse_args()
    set_tracing_disabled(True)
    if args.api == "chat_completions":
        set_default_openai_api("chat_completions")
    agent = Agent(name="probe", instructions=INSTRUCTIONS, tools=[shell_tool], model=model())
    events: list[str] = []
    if args.mode == "run":
        result: Any = await Runner.run(agent, TASK)
    else:
        result = Runner.run_streamed(agent, TASK)
        async for event in result.stream_events():
            name = getattr(event, "name", None) or getattr(getattr(event, "data", None), "type", None)
            events.append(f"{event.type}:{name}")
    emit(
        final=str(result.final_output),
        system=INSTRUCTIONS,
        tool_outputs=tool_outputs,
        items=[type(item).__name__ for item in result.new_items],
        events=sorted(set(events)),
    )


if __name__ == "__main__":
    asyncio.run(main())
