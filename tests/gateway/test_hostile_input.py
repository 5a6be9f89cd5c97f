"""A client's mistake is a 400 in the route's own error shape naming the field, never a server error, and nothing
reaches the engine: values of the wrong JSON type where a name or a boolean belongs, sampling values the library
refuses, bodies nested past what the store can write, broken compressed bodies, odd query values."""

from __future__ import annotations

import gzip
import json
from typing import Any

import httpx
import orjson
import pytest

CHAT, RESPONSES, MESSAGES = "/v1/chat/completions", "/v1/responses", "/v1/messages"
USER = [{"role": "user", "content": "hi"}]


def nested(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = {"a": value}
    return value


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": USER, "max_tokens": 8, **fields}


def responses(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "input": "hi", "max_output_tokens": 8, **fields}


def messages(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": USER, "max_tokens": 8, **fields}


BAD = [
    # a list or an object where a name belongs
    ("chat: a list as a role", CHAT, chat(messages=[{"role": ["user"], "content": "x"}]), "messages[0].role"),
    (
        "responses: an object as a role",
        RESPONSES,
        responses(input=[{"role": {"x": 1}, "content": "hi"}]),
        "input[0].role",
    ),
    (
        "responses: a list as an item type",
        RESPONSES,
        responses(input=[{"type": ["message"], "role": "user", "content": "hi"}]),
        "input[0].type",
    ),
    ("responses: a list in include", RESPONSES, responses(include=[["x"]]), "include[0]"),
    ("responses: an object in include", RESPONSES, responses(include=[{"a": 1}]), "include[0]"),
    # numbers where a boolean belongs (1 == True in Python, not in JSON)
    ("chat: stream 1", CHAT, chat(stream=1), "stream"),
    ("chat: logprobs 0", CHAT, chat(logprobs=0), "logprobs"),
    ("chat: n true", CHAT, chat(n=True), "n"),
    ("chat: parallel_tool_calls 1", CHAT, chat(parallel_tool_calls=1), "parallel_tool_calls"),
    ("responses: stream 1", RESPONSES, responses(stream=1), "stream"),
    ("responses: store 0", RESPONSES, responses(store=0), "store"),
    ("messages: stream 1", MESSAGES, messages(stream=1), "stream"),
    # sampling values the library refuses, named by the route's own field
    ("chat: top_p 0", CHAT, chat(top_p=0), "top_p"),
    ("chat: an empty stop string", CHAT, chat(stop=""), "stop"),
    ("chat: min_tokens above max_tokens", CHAT, chat(min_tokens=20), "min_tokens"),
    ("chat: a negative token id in logit_bias", CHAT, chat(logit_bias={"-5": 1}), "logit_bias"),
    ("responses: top_p 0", RESPONSES, responses(top_p=0), "top_p"),
    ("messages: top_p 0", MESSAGES, messages(top_p=0), "top_p"),
    # nested past what the store writes back
    ("chat: metadata 300 levels deep", CHAT, chat(metadata=nested(300)), "body"),
    ("responses: metadata 300 levels deep", RESPONSES, responses(metadata=nested(300)), "body"),
    ("messages: metadata 300 levels deep", MESSAGES, messages(metadata=nested(300)), "body"),
    ("chat: a tool 300 levels deep", CHAT, chat(tools=[{"type": "function", "function": nested(300)}]), "body"),
]


@pytest.mark.parametrize(("case", "path", "payload", "param"), BAD, ids=[c[0] for c in BAD])
async def test_a_clients_mistake_is_a_400_naming_the_field(scripted_gateway, case, path, payload, param) -> None:
    async with scripted_gateway(["never<|im_end|>"]) as served:
        async with httpx.AsyncClient(base_url=served.url, trust_env=False) as http:
            response = await http.post(path, content=json.dumps(payload), headers={"content-type": "application/json"})
        assert response.status_code == 400, response.text
        answer = response.json()
        error = answer["error"]
        if path == MESSAGES:
            assert answer["type"] == "error"
        assert (error["param"], error["type"]) == (param, "invalid_request_error"), error
        assert served.script.requests == []
        assert await served.gateway.sessions(group=None, status=None, limit=10, after=None) == []


async def test_a_body_nested_as_deep_as_a_real_tool_schema_is_served(scripted_gateway) -> None:
    schema = {"type": "object", "properties": {"x": nested(60)}}
    payload = chat(tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}])
    async with scripted_gateway(["done<|im_end|>"]) as served:
        async with httpx.AsyncClient(base_url=served.url, trust_env=False) as http:
            response = await http.post(CHAT, json=payload)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == "done"


async def test_a_broken_gzip_body_is_a_400_naming_its_encoding(scripted_gateway) -> None:
    broken = gzip.compress(orjson.dumps(chat()))[:-12] + b"garbage!"
    async with scripted_gateway(["never<|im_end|>"]) as served:
        async with httpx.AsyncClient(base_url=served.url, trust_env=False) as http:
            response = await http.post(
                CHAT, content=broken, headers={"content-type": "application/json", "content-encoding": "gzip"}
            )
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["code"]) == ("body", "invalid_body") and "gzip" in error["message"]
        assert served.script.requests == []


@pytest.mark.parametrize(
    ("query", "param"),
    [("limit=%C2%B2", "limit"), ("limit=0", "limit"), ("after=nan", "after"), ("after=inf", "after")],
    ids=["a superscript digit", "limit 0", "after nan", "after inf"],
)
async def test_an_odd_query_value_is_a_400_naming_it(scripted_gateway, query: str, param: str) -> None:
    async with scripted_gateway([]) as served:
        async with httpx.AsyncClient(base_url=served.url, trust_env=False) as http:
            response = await http.get(f"/v1/sessions?{query}")
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
