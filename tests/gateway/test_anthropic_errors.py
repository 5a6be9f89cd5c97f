"""Bad input on the Messages routes gets Anthropic's error shape naming the field, before anything reaches an engine;
what the gateway cannot do faithfully (images, server tools, forced tool choice, prefill...) is refused by name;
the middleware's own errors and engine failures answer in the same shape on these routes (and OpenAI's elsewhere)."""

from __future__ import annotations

import asyncio
from typing import Any

import anthropic
import httpx
import pytest

from backends_core import ServerStatusError
from backends_gateway import GatewayLimits

JSON = {"content-type": "application/json"}
USER = [{"role": "user", "content": "hi"}]
TOOL = {"name": "add", "input_schema": {"type": "object"}}


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "max_tokens": 8, "messages": USER, **fields}


def user(*blocks: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(blocks)}]


def assistant(*blocks: dict[str, Any]) -> list[dict[str, Any]]:
    return [*USER, {"role": "assistant", "content": list(blocks)}, *USER]


TEXT = {"type": "text", "text": "x"}
CALL = {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {}}
# a 2x2 PNG: a well-formed image, which the scripted backend (no image_refusal hook) does not send
IMAGE = {
    "type": "image",
    "source": {
        "type": "base64",
        "media_type": "image/png",
        "data": "iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAFklEQVR4nGP4z8DA8J+BkYHh////DAAe9gT9Ce00"
        "PgAAAABJRU5ErkJggg==",
    },
}

BAD = [
    ("unknown field", body(temprature=0.5), "temprature", "unknown_parameter"),
    ("no max_tokens", {"model": "tiny", "messages": USER}, "max_tokens", "missing_parameter"),
    ("max_tokens 0", body(max_tokens=0), "max_tokens", "invalid_value"),
    ("max_tokens past the limit", body(max_tokens=10**6), "max_tokens", "max_tokens_too_large"),
    ("no model", {"max_tokens": 8, "messages": USER}, "model", "invalid_type"),
    ("no messages", body(messages=[]), "messages", "invalid_type"),
    ("a tool role", body(messages=[{"role": "tool", "content": "x"}]), "messages[0].role", "invalid_value"),
    ("a message field", body(messages=[{**USER[0], "name": "bob"}]), "messages[0].name", "unknown_parameter"),
    (
        "an image in a tool result",
        body(messages=user({"type": "tool_result", "tool_use_id": "toolu_1", "content": [IMAGE]})),
        "messages[0].content[0].content[0]",
        "unsupported_content",
    ),
    (
        "a document",
        body(messages=user({"type": "document", "source": {"type": "text", "data": "x"}})),
        "messages[0].content[0]",
        "unsupported_content",
    ),
    (
        "redacted thinking",
        body(messages=assistant({"type": "redacted_thinking", "data": "opaque"}, TEXT)),
        "messages[1].content[0]",
        "unsupported_content",
    ),
    (
        "text before a tool result",
        body(messages=user(TEXT, {"type": "tool_result", "tool_use_id": "t"})),
        "messages[0].content[1]",
        "invalid_value",
    ),
    ("text after a tool call", body(messages=assistant(CALL, TEXT)), "messages[1].content[1]", "invalid_value"),
    (
        "tool input not an object",
        body(messages=assistant({**CALL, "input": "[]"})),
        "messages[1].content[0].input",
        "invalid_type",
    ),
    (
        "a tool result without its id",
        body(messages=user({"type": "tool_result", "content": "5"})),
        "messages[0].content[0].tool_use_id",
        "invalid_type",
    ),
    (
        "citations",
        body(messages=user({**TEXT, "citations": [{"type": "char_location"}]})),
        "messages[0].content[0].citations",
        "unsupported_parameter",
    ),
    (
        "a block field",
        body(messages=user({**TEXT, "colour": "red"})),
        "messages[0].content[0].colour",
        "unknown_parameter",
    ),
    (
        "prefill",
        body(messages=[*USER, {"role": "assistant", "content": "The answer is"}]),
        "messages[1]",
        "unsupported_content",
    ),
    ("system not text", body(system=[IMAGE]), "system[0]", "unsupported_content"),
    (
        "a server tool",
        body(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
        "tools[0].type",
        "unsupported_parameter",
    ),
    ("a tool without a schema", body(tools=[{"name": "add"}]), "tools[0].input_schema", "invalid_type"),
    ("a strict tool", body(tools=[{**TOOL, "strict": True}]), "tools[0].strict", "unsupported_parameter"),
    ("tool_choice any", body(tools=[TOOL], tool_choice={"type": "any"}), "tool_choice", "unsupported_parameter"),
    (
        "tool_choice tool",
        body(tools=[TOOL], tool_choice={"type": "tool", "name": "add"}),
        "tool_choice",
        "unsupported_parameter",
    ),
    (
        "tool_choice none with tools",
        body(tools=[TOOL], tool_choice={"type": "none"}),
        "tool_choice",
        "unsupported_parameter",
    ),
    (
        "parallel tool use off",
        body(tools=[TOOL], tool_choice={"type": "auto", "disable_parallel_tool_use": True}),
        "tool_choice.disable_parallel_tool_use",
        "unsupported_parameter",
    ),
    (
        "a small thinking budget",
        body(max_tokens=2000, thinking={"type": "enabled", "budget_tokens": 10}),
        "thinking.budget_tokens",
        "invalid_value",
    ),
    (
        "a budget past max_tokens",
        body(thinking={"type": "enabled", "budget_tokens": 2048}),
        "thinking.budget_tokens",
        "invalid_value",
    ),
    (
        "thinking display",
        body(thinking={"type": "adaptive", "display": "omitted"}),
        "thinking.display",
        "unsupported_parameter",
    ),
    (
        "thinking against the template switch",
        body(thinking={"type": "disabled"}, chat_template_kwargs={"enable_thinking": True}),
        "thinking",
        "invalid_value",
    ),
    ("temperature past 1", body(temperature=1.5), "temperature", "invalid_value"),
    ("top_k negative", body(top_k=-1), "top_k", "invalid_value"),
    ("stop_sequences a string", body(stop_sequences="END"), "stop_sequences", "invalid_type"),
    ("metadata field", body(metadata={"user_id": "u", "team": "t"}), "metadata.team", "unknown_parameter"),
    ("service_tier", body(service_tier="standard_only"), "service_tier", "unsupported_parameter"),
    ("container", body(container="c"), "container", "unsupported_parameter"),
    (
        "mcp_servers",
        body(mcp_servers=[{"type": "url", "url": "http://x", "name": "x"}]),
        "mcp_servers",
        "unsupported_parameter",
    ),
    (
        "context_management clearing tool uses",
        body(context_management={"edits": [{"type": "clear_tool_uses_20250919"}]}),
        "context_management.edits[0]",
        "unsupported_parameter",
    ),
    (
        "output_config verbosity",
        body(output_config={"verbosity": "low"}),
        "output_config.verbosity",
        "unknown_parameter",
    ),
    ("stream not a boolean", body(stream="yes"), "stream", "invalid_type"),
]


@pytest.mark.parametrize(("case", "payload", "param", "code"), BAD, ids=[c[0] for c in BAD])
async def test_bad_requests_are_refused_in_anthropics_shape_naming_the_field_before_the_engine_sees_them(
    scripted_gateway, case, payload, param, code
) -> None:
    async with scripted_gateway(["never<|im_end|>"]) as served:
        async with httpx.AsyncClient(base_url=served.url, trust_env=False) as http:
            response = await http.post("/v1/messages", json=payload)
        assert response.status_code == 400, response.text
        answer = response.json()
        assert answer["type"] == "error"
        error = answer["error"]
        assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")
        assert param.split("[")[0].split(".")[0] in error["message"]
        assert served.script.requests == []


async def test_count_tokens_refuses_what_a_turn_would_and_the_sampling_fields(scripted_gateway) -> None:
    async with scripted_gateway(["never<|im_end|>"]) as served:
        async with httpx.AsyncClient(base_url=served.url, trust_env=False) as http:
            image = await http.post("/v1/messages/count_tokens", json={"model": "tiny", "messages": user(IMAGE)})
            sampling = await http.post("/v1/messages/count_tokens", json=body())
            fine = await http.post("/v1/messages/count_tokens", json={"model": "tiny", "messages": USER})
        assert image.status_code == 400 and "image" in image.json()["error"]["message"]
        assert (sampling.status_code, sampling.json()["error"]["param"]) == (400, "max_tokens")
        assert fine.status_code == 200 and fine.json()["input_tokens"] > 0
        assert served.script.requests == []


async def test_the_sdk_raises_its_typed_errors_for_the_gateways_answers(scripted_gateway) -> None:
    async with scripted_gateway(["never<|im_end|>"]) as served:
        sdk = anthropic.AsyncAnthropic(base_url=served.url, api_key="x", max_retries=0)
        with pytest.raises(anthropic.BadRequestError) as bad:
            await sdk.messages.create(model="tiny", max_tokens=8, messages=user(IMAGE))
        assert "does not send images" in bad.value.message and "messages[0].content[0]" in bad.value.message
        with pytest.raises(anthropic.NotFoundError) as missing:
            await sdk.messages.create(model="claude-9", max_tokens=8, messages=USER)
        assert "claude-9" in missing.value.message
        await sdk.close()
        assert served.script.requests == []


async def test_the_middlewares_errors_on_the_messages_routes_are_in_anthropics_shape(scripted_gateway) -> None:
    async with scripted_gateway(["never<|im_end|>"], limits=GatewayLimits(max_body_bytes=4096)) as served:
        async with httpx.AsyncClient(base_url=served.url, trust_env=False) as http:
            cases = {
                "invalid_json": await http.post("/v1/messages", content=b"{not json", headers=JSON),
                "body_too_large": await http.post(
                    "/v1/messages", json=body(messages=[{"role": "user", "content": "x" * 8000}])
                ),
                "unknown_route": await http.post("/v1/messages/batches", json=body()),
                "model_not_found": await http.post("/s/a/v1/messages", json=body(model="claude-9")),
                "session_id": await http.post("/s/bad%20id/v1/messages", json=body()),
                "method_not_allowed": await http.get("/v1/messages"),
            }
            openai = await http.post("/v1/chat/completions", content=b"{not json", headers=JSON)
        types = {
            "invalid_json": "invalid_request_error",
            "body_too_large": "request_too_large",
            "unknown_route": "not_found_error",
            "model_not_found": "not_found_error",
            "session_id": "invalid_request_error",
            "method_not_allowed": "invalid_request_error",
        }
        for code, response in cases.items():
            answer = response.json()
            assert answer["type"] == "error", (code, response.text)
            assert (answer["error"]["code"], answer["error"]["type"]) == (code, types[code])
        assert [r.status_code for r in cases.values()] == [400, 413, 404, 404, 400, 405]
        assert "type" not in openai.json() and openai.json()["error"]["code"] == "invalid_json"
        assert served.script.requests == []


async def test_an_engine_failure_is_a_502_api_error_whole_or_streamed(scripted_gateway) -> None:
    async with scripted_gateway(["unused<|im_end|>"]) as served:
        served.script.fail = ServerStatusError(
            method="POST", url="http://scripted/generate", status_code=500, body="boom"
        )
        async with httpx.AsyncClient(base_url=served.url, trust_env=False) as http:
            whole = await http.post("/s/f/v1/messages", json=body())
        assert whole.status_code == 502
        error = whole.json()["error"]
        assert error["type"] == "api_error" and error["code"] == "engine" and "not re-sent" in error["message"]
        served.script.fail = ServerStatusError(  # raised once per setting
            method="POST", url="http://scripted/generate", status_code=500, body="boom"
        )
        sdk = anthropic.AsyncAnthropic(base_url=f"{served.url}/s/g", api_key="x", max_retries=0)
        with pytest.raises(anthropic.APIStatusError) as streamed:
            async with sdk.messages.stream(model="tiny", max_tokens=8, messages=USER) as events:
                await events.get_final_message()
        await sdk.close()
        # the engine failed before its first token: the stream never started, the status says so
        assert streamed.value.status_code == 502 and "not re-sent" in str(streamed.value.body)
        assert len(served.script.requests) == 2  # one each, never re-sent
        assert await served.gateway.sessions(group=None, status=None, limit=10, after=None) == []  # nothing kept


async def test_turns_past_max_in_flight_get_a_429_rate_limit_error_with_retry_after(scripted_gateway) -> None:
    limits = GatewayLimits(max_in_flight=1, retry_after_s=3)
    async with scripted_gateway(["held<|im_end|>"], limits=limits) as served:
        served.script.gate.clear()
        async with httpx.AsyncClient(base_url=served.url, trust_env=False, timeout=60) as http:
            held = asyncio.create_task(http.post("/s/a/v1/messages", json=body()))
            await asyncio.wait_for(served.script.entered.wait(), 60)
            refused = await http.post("/s/b/v1/messages", json=body())
            assert refused.status_code == 429 and refused.headers["Retry-After"] == "3"
            assert refused.json()["error"]["type"] == "rate_limit_error"
            served.script.gate.set()
            assert (await held).status_code == 200
        assert len(served.script.requests) == 1
