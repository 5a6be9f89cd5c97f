"""The official ``anthropic`` SDK (sync and async, ``messages.create`` and ``messages.stream``) through the gateway's
Messages route: whole and streamed answers are the same message, tool loops keep each turn on the previous turn's
exact ids, and a session may mix the Messages API with OpenAI's chat completions on one history."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anthropic
import httpx
import numpy as np
import openai
import pytest
from test_openai_sdk import TOOL_REPLIES, TOOLS, assert_exact_chain, engine_logprobs, trajectory

from backends_core import loss_mask

ADD = {
    "name": "add",
    "description": "a + b",
    "input_schema": TOOLS[0]["function"]["parameters"],  # the OpenAI tests' tool: the same rendered prompt
}
USER = [{"role": "user", "content": "add 2, 3 and 5"}]

# reply shapes, each as the engine writes it and the blocks the SDK should hand the harness
SHAPES = {
    "text": ("Hello there.<|im_end|>", [{"type": "text", "text": "Hello there."}], "end_turn"),
    "thinking and text": (
        "<think>\nsay hi\n</think>\n\nHi!<|im_end|>",
        [{"type": "thinking", "thinking": "say hi"}, {"type": "text", "text": "Hi!"}],
        "end_turn",
    ),
    "tool_use": (
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>',
        [{"type": "tool_use", "name": "add", "input": {"a": 2, "b": 3}}],
        "tool_use",
    ),
    "thinking, text and two tool_uses": (
        '<think>\nboth\n</think>\n\nTwo calls: <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
        '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>',
        [
            {"type": "thinking", "thinking": "both"},
            {"type": "text", "text": "Two calls: "},
            {"type": "tool_use", "name": "add", "input": {"a": 1, "b": 2}},
            {"type": "tool_use", "name": "add", "input": {"a": 3, "b": 4}},
        ],
        "tool_use",
    ),
}


def blocks(message: Any) -> list[dict[str, Any]]:
    return [block.model_dump(exclude_none=True) for block in message.content]


def checked(message: Any, want: list[dict[str, Any]], stop: str) -> list[dict[str, Any]]:
    """The message's blocks, once checked against ``want`` (ids and signatures checked by form)."""
    got = blocks(message)
    assert message.stop_reason == stop and message.role == "assistant" and message.id.startswith("msg_")
    assert len(got) == len(want), got
    for block, expected in zip(got, want, strict=True):
        assert {k: v for k, v in block.items() if k in expected} == expected
        if block["type"] == "tool_use":
            assert block["id"].startswith("toolu_")
        if block["type"] == "thinking":
            assert block["signature"]
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0
    return got


@pytest.mark.parametrize("shape", list(SHAPES))
async def test_create_and_stream_answer_the_same_message_for_each_reply_shape(scripted_gateway, shape) -> None:
    raw, want, stop = SHAPES[shape]
    async with scripted_gateway([raw, raw]) as served:
        sdk = anthropic.AsyncAnthropic(base_url=served.url, api_key="x", max_retries=0)
        fields: dict[str, Any] = {"model": "tiny", "max_tokens": 64, "messages": USER, "tools": [ADD]}
        whole = await sdk.messages.create(**fields, extra_headers={"X-Session-ID": "whole"})
        async with sdk.messages.stream(**fields, extra_headers={"X-Session-ID": "streamed"}) as events:
            kinds = [event.type async for event in events]
            streamed = await events.get_final_message()
        await sdk.close()
    assert checked(whole, want, stop) == checked(streamed, want, stop)
    assert whole.usage == streamed.usage
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == len(want)
    assert len(served.script.requests) == 2


def tool_loop(url: str, session: str, stream: bool) -> list[Any]:
    """A harness's tool loop on the blocking SDK: call the tools the model asks for until it answers in text."""
    local = {"add": lambda a, b: a + b}
    answers = []
    with anthropic.Anthropic(base_url=f"{url}/s/{session}", api_key="x", max_retries=0) as sdk:
        messages: list[Any] = list(USER)
        while True:
            fields: dict[str, Any] = {"model": "tiny", "max_tokens": 64, "messages": messages, "tools": [ADD]}
            if stream:
                with sdk.messages.stream(**fields) as events:
                    answer = events.get_final_message()
            else:
                answer = sdk.messages.create(**fields)
            answers.append(answer)
            messages.append({"role": "assistant", "content": answer.content})
            calls = [b for b in answer.content if b.type == "tool_use"]
            if not calls:
                return answers
            results = [
                {"type": "tool_result", "tool_use_id": c.id, "content": str(local[c.name](**c.input))} for c in calls
            ]
            messages.append({"role": "user", "content": results})


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
async def test_a_tool_loop_keeps_every_turn_on_the_previous_turns_exact_ids(scripted_gateway, stream) -> None:
    async with scripted_gateway(list(TOOL_REPLIES)) as served:
        answers = await asyncio.to_thread(tool_loop, served.url, "tools", stream)
        assert [a.stop_reason for a in answers] == ["tool_use", "tool_use", "end_turn"]
        first, second, last = (blocks(a) for a in answers)
        assert first[0]["thinking"] == "add 2 and 3 first" and first[1]["input"] == {"a": 2, "b": 3}
        assert second[1] == {"type": "text", "text": "One more: "} and second[2]["input"] == {"a": 5, "b": 5}
        assert [b["type"] for b in last] == ["thinking", "text"]
        assert last[1]["text"] == "The answer is 10 (2 + 3 + 5)."
        traj = await trajectory(served.url, "tools")
        assert_exact_chain(traj)
        # the tool results reached the template as OpenAI's tool messages, after the call they answer
        tool = [m for m in traj["turns"][2]["messages"] if m["role"] == "tool"]
        assert [m["content"] for m in tool] == ["5", "10"]
        assert tool[0]["tool_call_id"] == first[1]["id"]
        tip = next(t for t in await served.gateway.store.turns("tools") if t.turn == 2)
        assert loss_mask(tip.result()).tolist() == traj["branches"][0]["loss_mask"]
        assert len(served.script.requests) == 3


async def test_a_session_started_over_openai_continues_over_messages_on_its_exact_ids(scripted_gateway) -> None:
    async with scripted_gateway(list(TOOL_REPLIES)) as served:

        def harness() -> list[Any]:
            with openai.OpenAI(base_url=f"{served.url}/s/mixed/v1", api_key="x", max_retries=0) as oai:
                answer = oai.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, max_tokens=64)
            (call,) = answer.choices[0].message.tool_calls or []
            history: list[Any] = [
                *USER,
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "add 2 and 3 first", "signature": ""},
                        {
                            "type": "tool_use",
                            "id": call.id,
                            "name": "add",
                            "input": json.loads(call.function.arguments),
                        },
                    ],
                },
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "5"}]},
            ]
            answers = [answer]
            with anthropic.Anthropic(base_url=f"{served.url}/s/mixed", api_key="x", max_retries=0) as sdk:
                second = sdk.messages.create(model="tiny", max_tokens=64, messages=history, tools=[ADD])
                answers.append(second)
                history += [
                    {"role": "assistant", "content": second.content},
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": second.content[-1].id, "content": "10"}],
                    },
                ]
                with sdk.messages.stream(model="tiny", max_tokens=64, messages=history, tools=[ADD]) as events:
                    answers.append(events.get_final_message())
            return answers

        answers = await asyncio.to_thread(harness)
        assert answers[-1].content[-1].text == "The answer is 10 (2 + 3 + 5)."
        traj = await trajectory(served.url, "mixed")
        assert_exact_chain(traj)  # bridged twice, every turn's reused ids its parent's whole sequence
        assert traj["bridged"] == 2 and all(t["reused_ids"] > 0 for t in traj["turns"][1:])


async def test_count_tokens_is_the_length_of_the_prompt_the_turn_is_sent(scripted_gateway) -> None:
    async with scripted_gateway(["Hi.<|im_end|>"]) as served:
        sdk = anthropic.AsyncAnthropic(base_url=served.url, api_key="x", max_retries=0)
        fields: dict[str, Any] = {"model": "tiny", "messages": USER, "tools": [ADD], "system": "Be brief."}
        counted = await sdk.messages.count_tokens(**fields)
        answer = await sdk.messages.create(**fields, max_tokens=8)
        await sdk.close()
        assert counted.input_tokens == answer.usage.input_tokens > 0
        assert len(served.script.requests) == 1  # counting sends nothing to the engine


async def test_two_turns_on_the_vllm_emulator_carry_the_engines_logprobs(vllm_gateway) -> None:
    served = vllm_gateway
    sdk = anthropic.AsyncAnthropic(base_url=f"{served.url}/s/emu", api_key="x", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "hello"}]
    first = await sdk.messages.create(model=served.model, max_tokens=8, messages=messages, system="Be brief.")
    messages += [{"role": "assistant", "content": first.content}, {"role": "user", "content": "go on"}]
    async with sdk.messages.stream(model=served.model, max_tokens=8, messages=messages, system="Be brief.") as events:
        second = await events.get_final_message()
    await sdk.close()
    assert {first.stop_reason, second.stop_reason} <= {"end_turn", "max_tokens"}
    traj = await trajectory(served.url, "emu")
    assert_exact_chain(traj)
    assert [t["reply"]["content"] for t in traj["turns"]] == [
        "".join(b.text for b in m.content if b.type == "text") for m in (first, second)
    ]
    (branch,) = traj["branches"]
    engine = await engine_logprobs(served, branch["input_ids"])
    sampled = np.asarray(branch["loss_mask"], bool)
    np.testing.assert_allclose(np.asarray(branch["logprobs"])[sampled], engine[sampled], atol=1e-4)


async def test_an_answer_names_its_session_turn_and_branch_in_headers(scripted_gateway) -> None:
    async with scripted_gateway(["A.<|im_end|>", "B.<|im_end|>"]) as served:
        async with httpx.AsyncClient(base_url=served.url, trust_env=False) as http:
            body = {"model": "tiny", "max_tokens": 8, "messages": USER}
            whole = await http.post("/v1/messages", json=body, headers={"X-Session-ID": "h"})
            streamed = await http.post(
                "/v1/messages",
                json={**body, "messages": [*USER, {"role": "assistant", "content": "A."}, *USER], "stream": True},
                headers={"X-Session-ID": "h"},
            )
        assert whole.status_code == streamed.status_code == 200
        assert (whole.headers["X-Session-ID"], whole.headers["X-Turn"], whole.headers["X-Branch"]) == ("h", "0", "0")
        assert streamed.headers["X-Session-ID"] == "h"
        assert streamed.headers["Content-Type"].startswith("text/event-stream")
        assert streamed.text.startswith("event: message_start\n") and "event: message_stop\n" in streamed.text
