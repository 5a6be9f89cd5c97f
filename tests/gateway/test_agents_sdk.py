"""An OpenAI Agents SDK agent with a function tool, over its chat-completions model and over its default Responses
model, through the gateway: the agent's loop runs unmodified, and the trajectory holds both turns on one branch of
exact ids."""

from __future__ import annotations

import json

import numpy as np
import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

set_tracing_disabled(True)  # the SDK would otherwise export traces to OpenAI

REPLIES = [
    '<think>\nI should look the weather up\n</think>\n\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}'
    "\n</tool_call><|im_end|>",
    "<think>\ngot it\n</think>\n\nIt is sunny in Oslo.<|im_end|>",
]


@pytest.mark.parametrize("model", [OpenAIChatCompletionsModel, OpenAIResponsesModel])
async def test_an_agents_sdk_agent_with_a_function_tool_runs_through_the_gateway(scripted_gateway, model) -> None:
    calls: list[str] = []

    @function_tool
    def weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    for stream in (False, True):
        async with scripted_gateway(list(REPLIES), name=f"agents-{stream}") as served:
            sdk = openai.AsyncOpenAI(base_url=f"{served.url}/s/agent/v1", api_key="unused", max_retries=0)
            agent = Agent(
                name="forecaster",
                instructions="Answer with the weather tool.",
                tools=[weather],
                model=model(model="tiny", openai_client=sdk),
                model_settings=ModelSettings(max_tokens=64),
            )
            if stream:
                run = Runner.run_streamed(agent, "What is the weather in Oslo?")
                async for _ in run.stream_events():
                    pass
                output = run.final_output
            else:
                output = (await Runner.run(agent, "What is the weather in Oslo?")).final_output
            await sdk.close()
            assert output == "It is sunny in Oslo."
            traj = await served.gateway.trajectory("agent")
            first, second = traj["turns"]
            assert [m["role"] for m in second["messages"]] == ["system", "user", "assistant", "tool"]
            assert json.loads(second["messages"][2]["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
            ids = first["prompt_ids"] + first["completion_ids"]
            assert second["prompt_ids"][: len(ids)] == ids and second["reused_ids"] == len(ids)
            assert second["branch"] == 0 and traj["bridged"] == 1 and traj["branched"] == 0
            (branch,) = traj["branches"]
            mask = np.asarray(branch["loss_mask"], bool)
            assert mask.sum() == len(first["completion_ids"]) + len(second["completion_ids"])
            assert len(served.script.requests) == 2
    assert calls == ["Oslo", "Oslo"]
