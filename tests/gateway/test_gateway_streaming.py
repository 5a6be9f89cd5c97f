"""A streamed turn, as the official SDK accumulates it, is the same message as the turn answered whole; text is
streamed as it settles (reasoning once its block closes, content up to a ``<`` that may open markup)."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

REPLIES = {
    "reasoning then content": "<think>\nweigh it\n</think>\n\nA plain answer.<|im_end|>",
    "content with markup-like text": "<think>\n\n</think>\n\nuse a < b and <b>bold</b> here<|im_end|>",
    "content then a tool call": '<think>\nx\n</think>\n\nLet me check. <tool_call>\n{"name": "ls", "arguments": '
    '{"path": "/tmp"}}\n</tool_call><|im_end|>',
    "two tool calls": '<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "cat", '
    '"arguments": {"f": "a"}}\n</tool_call><|im_end|>',
    "cut by max_tokens": "<think>\nan unfinished thought that goes on",
    "no reasoning block": "Just text, no think block.<|im_end|>",
}


def message_of(completion: Any) -> tuple[Any, ...]:
    choice = completion.choices[0]
    m = choice.message
    calls = [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or ()]
    return (m.content or "", (m.model_extra or {}).get("reasoning_content"), calls, choice.finish_reason)


@pytest.mark.parametrize("case", list(REPLIES))
async def test_the_sdks_accumulated_stream_is_the_whole_answer(scripted_gateway, case) -> None:
    reply = REPLIES[case]
    async with scripted_gateway([reply, reply]) as served:

        def harness() -> tuple[Any, Any, list[Any]]:
            with openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0) as sdk:
                body = {"model": "tiny", "messages": [{"role": "user", "content": case}], "max_tokens": 64}
                whole = sdk.chat.completions.create(**body)
                events = []
                with sdk.chat.completions.stream(**body) as stream:
                    for event in stream:
                        events.append(event.type)
                    try:
                        streamed = stream.get_final_completion()
                    except openai.LengthFinishReasonError as exc:  # the helper's own refusal of a cut answer
                        streamed = exc.completion
                return whole, streamed, events

        whole, streamed, events = await asyncio.to_thread(harness)
        assert message_of(streamed) == message_of(whole)
        if "<tool_call>" in reply:
            assert "tool_calls.function.arguments.done" in events


async def test_content_streams_in_several_chunks_once_reasoning_closed(scripted_gateway) -> None:
    reply = "<think>\nshort\n</think>\n\n" + " ".join(f"word{i}" for i in range(20)) + "<|im_end|>"
    async with scripted_gateway([reply]) as served:
        sdk = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
        pieces = []
        stream = await sdk.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "go"}], max_tokens=64, stream=True
        )
        async for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    pieces.append(choice.delta.content)
        await sdk.close()
        assert "".join(pieces) == " ".join(f"word{i}" for i in range(20)) and len(pieces) > 10
