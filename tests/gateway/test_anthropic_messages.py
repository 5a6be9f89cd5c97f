"""How the Messages route's blocks become the OpenAI-shaped messages the template renders, how ``thinking`` reaches
the template's switch, and Anthropic's stop reasons."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np

from backends_core import GenerateResult
from backends_gateway.anthropic_messages import stop_of

CALL = {"type": "tool_use", "id": "toolu_a", "name": "add", "input": {"a": 1, "b": 2}}
TOOLS = [{"name": "add", "description": "a + b", "input_schema": {"type": "object"}}]


async def post(url: str, session: str, **fields: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, trust_env=False) as http:
        return await http.post(f"/s/{session}/v1/messages", json={"model": "tiny", "max_tokens": 8, **fields})


async def test_blocks_become_the_messages_the_template_renders(scripted_gateway) -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "add"}, {"type": "text", "text": "please"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "two calls", "signature": "anything"},
                {"type": "text", "text": "Calling.", "citations": None},
                CALL,
                {**CALL, "id": "toolu_b", "cache_control": {"type": "ephemeral"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_a", "content": "3"},
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_b",
                    "content": [{"type": "text", "text": "no"}],
                    "is_error": True,
                },
                {"type": "text", "text": "go on"},
            ],
        },
    ]
    system = [
        {"type": "text", "text": "Be brief."},
        {"type": "text", "text": "Use tools.", "cache_control": {"type": "ephemeral"}},
    ]
    async with scripted_gateway(["ok<|im_end|>"]) as served:
        response = await post(
            served.url, "c", messages=messages, system=system, tools=TOOLS, metadata={"user_id": "u1"}
        )
        assert response.status_code == 200, response.text
        (turn,) = await served.gateway.store.turns("c")
    arguments = '{"a":1,"b":2}'
    assert turn.messages == [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}]},
        {"role": "user", "content": [{"type": "text", "text": "add"}, {"type": "text", "text": "please"}]},
        {
            "role": "assistant",
            "content": "Calling.",
            "reasoning_content": "two calls",
            "tool_calls": [
                {"id": "toolu_a", "type": "function", "function": {"name": "add", "arguments": arguments}},
                {"id": "toolu_b", "type": "function", "function": {"name": "add", "arguments": arguments}},
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_a", "content": "3"},
        {"role": "tool", "tool_call_id": "toolu_b", "content": "no", "is_error": True},
        {"role": "user", "content": "go on"},
    ]
    assert turn.tools == [
        {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {"type": "object"}}}
    ]
    assert turn.request["metadata"] == {"user_id": "u1"}


async def test_thinking_switches_the_templates_reasoning(scripted_gateway) -> None:
    user = [{"role": "user", "content": "hi"}]
    async with scripted_gateway(["a<|im_end|>", "b<|im_end|>", "c<|im_end|>"]) as served:
        on = await post(
            served.url, "on", messages=user, max_tokens=2048, thinking={"type": "enabled", "budget_tokens": 1024}
        )
        off = await post(served.url, "off", messages=user, thinking={"type": "disabled"})
        default = await post(served.url, "default", messages=user)
        assert on.status_code == off.status_code == default.status_code == 200
        kwargs = [(await served.gateway.store.turns(s))[0].chat_template_kwargs for s in ("on", "off", "default")]
        prompts = [r.prompt_ids for r in served.script.requests]
    assert kwargs == [{"enable_thinking": True}, {"enable_thinking": False}, None]
    assert prompts[0] != prompts[1]  # the switch reached the template


async def test_a_reply_cut_at_max_tokens_says_so(scripted_gateway) -> None:
    async with scripted_gateway(["cut sho"]) as served:
        response = await post(served.url, "cut", messages=[{"role": "user", "content": "hi"}])
    answer = response.json()
    assert (answer["stop_reason"], answer["stop_sequence"]) == ("max_tokens", None)
    assert answer["content"] == [{"type": "text", "text": "cut sho"}]


def test_stop_reasons_follow_the_finish_and_the_requests_stop_sequences() -> None:
    def result(finish: str, stop_reason: str | int | None = None) -> GenerateResult:
        return GenerateResult(
            prompt_ids=(1,),
            completion_ids=(2,),
            logprobs=np.zeros(1, np.float32),
            finish_reason=finish,
            stop_reason=stop_reason,  # type: ignore[arg-type]
        )

    text = {"role": "assistant", "content": "x"}
    calls = {**text, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    assert stop_of(text, result("stop", "END"), ["END"]) == ("stop_sequence", "END")
    assert stop_of(text, result("stop", 151645), ["END"]) == ("end_turn", None)
    assert stop_of(text, result("stop", "<|im_end|>"), ["END"]) == ("end_turn", None)
    assert stop_of(calls, result("stop"), []) == ("tool_use", None)
    assert stop_of(calls, result("length"), []) == ("max_tokens", None)
    assert stop_of(text, result("abort"), []) == ("pause_turn", None)
