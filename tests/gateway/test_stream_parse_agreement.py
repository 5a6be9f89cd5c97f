"""What a stream sends is what the whole parse gives, by construction, on every wire: text before a tool call as
the template writes it (``content + "\\n" + <tool_call>``), whitespace wherever a model puts it; a stream that
could not end as parsed keeps no turn (no harness received it)."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import openai
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from backends_core import Client, ClientConfig, GenerateResult
from backends_core.config import StatelessPolicy
from backends_core.multiturn.rendering import encode, load_tokenizer
from backends_gateway.gateway import _Splitter
from scripted_stream import StreamingScript

CALL = '<tool_call>\n{"name": "run", "arguments": {"command": "ls"}}\n</tool_call>'
# as a Qwen3 model writes it: its reasoning, then text, then the call the template puts after a newline
TEXT_THEN_CALL = f"<think>\nrun ls\n</think>\n\nI will run it.\n{CALL}<|im_end|>"
TOOL = {"type": "function", "function": {"name": "run", "parameters": {"type": "object", "properties": {}}}}
ANTHROPIC_TOOL = {"name": "run", "input_schema": {"type": "object", "properties": {}}}


async def test_text_then_a_tool_call_streams_on_chat_completions(scripted_gateway) -> None:
    async with scripted_gateway([TEXT_THEN_CALL]) as served:
        sdk = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="k", max_retries=0)
        stream = await sdk.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "go"}], tools=[TOOL], stream=True
        )
        content, names, finish = "", [], None
        async for chunk in stream:
            for choice in chunk.choices:
                content += choice.delta.content or ""
                names += [call.function.name for call in choice.delta.tool_calls or () if call.function]
                finish = choice.finish_reason or finish
        await sdk.close()
    assert (content, names, finish) == ("I will run it.", ["run"], "tool_calls")


async def test_text_then_a_tool_call_streams_on_responses(scripted_gateway) -> None:
    tool = {"type": "function", "name": "run", "parameters": {"type": "object", "properties": {}}}
    async with scripted_gateway([TEXT_THEN_CALL]) as served:
        sdk = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="k", max_retries=0)
        async with sdk.responses.stream(model="tiny", input="go", tools=[tool]) as stream:
            kinds = [event.type async for event in stream]
            final = await stream.get_final_response()
        await sdk.close()
    assert "error" not in kinds and kinds[-1] == "response.completed"
    assert final.output_text == "I will run it."
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]


async def test_text_then_a_tool_call_streams_on_messages(scripted_gateway) -> None:
    async with scripted_gateway([TEXT_THEN_CALL]) as served:
        sdk = anthropic.AsyncAnthropic(base_url=served.url, api_key="k", max_retries=0)
        async with sdk.messages.stream(
            model="tiny", max_tokens=64, messages=[{"role": "user", "content": "go"}], tools=[ANTHROPIC_TOOL]
        ) as stream:
            async for _ in stream:
                pass
            final = await stream.get_final_message()
        await sdk.close()
    assert [block.type for block in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[1].text == "I will run it."  # type: ignore[union-attr]
    assert final.stop_reason == "tool_use"


# -- by construction: every prefix of every completion releases a prefix of the whole parse -----------------

_PIECES = st.sampled_from(
    ["I", " will", " run", " it.", "\n", "\n\n", " ", "  ", "a < b", "<b>", "x", "\t", ".", "ok\n", "\n \n"]
)


@st.composite
def completions(draw: st.DrawFn) -> str:
    text = ""
    if draw(st.booleans()):
        text += "<think>\n" + "".join(draw(st.lists(_PIECES, max_size=6))) + "\n</think>\n\n"
    text += "".join(draw(st.lists(_PIECES, max_size=10)))
    for _ in range(draw(st.integers(0, 2))):
        text += draw(st.sampled_from(["\n", "", " \n"])) + CALL
    if draw(st.booleans()):
        text += "<|im_end|>"
    return text


@pytest.fixture(scope="module")
def parsing_client(tiny_models: Any) -> Client:
    config = ClientConfig(
        backend="scripted",
        base_url="http://scripted",
        model="tiny",
        tokenizer=str(tiny_models.dense),
        stateless=StatelessPolicy(enabled=False),
    )
    return Client(config, plugin=StreamingScript(load_tokenizer(str(tiny_models.dense)), []))


@hypothesis_settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=completions(), chunk=st.integers(1, 4))
def test_the_streamed_text_is_always_a_prefix_of_the_whole_parse(parsing_client: Client, text: str, chunk: int) -> None:
    ids = encode(parsing_client.tokenizer, text)
    prompt = (1, 2, 3)
    splitter = _Splitter(parsing_client, prompt)
    sent = {"reasoning": "", "content": ""}
    for at in range(0, len(ids), chunk):
        for event in splitter.feed(ids[at : at + chunk]):
            sent[event.kind] += event.text
    whole = parsing_client.parse_completion(
        GenerateResult(
            prompt_ids=prompt,
            completion_ids=tuple(ids),
            logprobs=[0.0] * len(ids),
            finish_reason="stop" if text.endswith("<|im_end|>") else "length",
        )
    )
    for event in splitter.finish(whole):  # raises if what was sent is not a prefix of the parse
        sent[event.kind] += event.text
    assert sent["content"] == (whole["content"] or "")
    assert sent["reasoning"] == (whole["reasoning_content"] or "")


# -- a stream that cannot end as parsed is no turn --------------------------------------------------------


async def test_a_stream_that_cannot_end_as_parsed_keeps_no_turn(scripted_gateway, monkeypatch) -> None:
    async with scripted_gateway(["<think>\nx\n</think>\n\nStreamed text.<|im_end|>"]) as served:
        parse = served.client.parse_completion

        def disagreeing(result: GenerateResult) -> dict[str, Any]:
            message = parse(result)
            if result.finish_reason == "stop":  # only the whole parse: the stream's partial parses are "length"
                message = {**message, "content": "Something else."}
            return message

        monkeypatch.setattr(served.client, "parse_completion", disagreeing)
        async with httpx.AsyncClient(base_url=served.url, trust_env=False, timeout=30) as http:
            body = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], "stream": True}
            text = (await http.post("/v1/chat/completions", json=body)).text
            events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
            assert events[-1]["error"]["code"] == "stream_parse" and text.rstrip().endswith("data: [DONE]")
            sessions = (await http.get("/v1/sessions")).json()["data"]
        assert sessions == []  # the turn was not kept, and the session it would have opened is not either
