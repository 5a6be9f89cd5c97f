"""Bad input gets OpenAI's error shape naming the field, before anything reaches an engine; engine failures map to
the API's statuses and are never re-sent; limits answer 400, and overload 429 with Retry-After."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from backends_core import ServerStatusError
from backends_gateway import GatewayLimits

JSON = {"content-type": "application/json"}
USER = [{"role": "user", "content": "hi"}]
# a 2x2 PNG
URL = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAFklEQVR4nGP4z8DA8J+BkYHh////DAAe9gT9Ce00"
    "PgAAAABJRU5ErkJggg=="
)


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": USER, "max_tokens": 8, **fields}


BAD = [
    ("unknown field", body(temperatur=0.5), "temperatur", "unknown_parameter"),
    ("n > 1", body(n=2), "n", "unsupported_parameter"),
    ("legacy functions", body(functions=[{"name": "f"}]), "functions", "unsupported_parameter"),
    ("tool_choice required without tools", body(tool_choice="required"), "tool_choice", "invalid_value"),
    ("parallel_tool_calls off", body(parallel_tool_calls=False), "parallel_tool_calls", "unsupported_parameter"),
    ("reasoning_effort", body(reasoning_effort="high"), "reasoning_effort", "unsupported_parameter"),
    ("no messages", body(messages=[]), "messages", "invalid_type"),
    ("a bad role", body(messages=[{"role": "robot", "content": "x"}]), "messages[0].role", "invalid_value"),
    (
        "an image that is no data URL",
        body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]}]),
        "messages[0].content[0].image_url.url",
        "invalid_image",
    ),
    (
        "an image the gateway would read from its own disk",
        body(
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/x.png"}}]}]
        ),
        "messages[0].content[0].image_url.url",
        "invalid_image",
    ),
    (
        "an image detail the processor decides",
        body(
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": URL, "detail": "low"}}]}]
        ),
        "messages[0].content[0].image_url.detail",
        "unsupported_parameter",
    ),
    (
        "an image in a system message",
        body(messages=[{"role": "system", "content": [{"type": "image_url", "image_url": {"url": URL}}]}]),
        "messages[0].content[0]",
        "unsupported_content",
    ),
    ("max_tokens 0", body(max_tokens=0), "max_tokens", "invalid_value"),
    ("max_tokens past the limit", body(max_tokens=10**6), "max_tokens", "max_tokens_too_large"),
    ("temperature a string", body(temperature="hot"), "temperature", "invalid_type"),
    ("top_p out of range", body(top_p=1.5), "top_p", "invalid_value"),
    ("stream_options without stream", body(stream_options={"include_usage": True}), "stream_options", "invalid_value"),
    ("top_logprobs without logprobs", body(top_logprobs=3), "top_logprobs", "invalid_value"),
    ("logit_bias key", body(logit_bias={"abc": 1}), "logit_bias", "invalid_value"),
    (
        "a tool without a name",
        body(tools=[{"type": "function", "function": {}}]),
        "tools[0].function.name",
        "invalid_value",
    ),
    ("response_format", body(response_format={"type": "xml"}), "response_format", "invalid_value"),
    ("no model", {"messages": USER}, "model", "invalid_type"),
]


@pytest.mark.parametrize(("case", "payload", "param", "code"), BAD, ids=[c[0] for c in BAD])
async def test_bad_requests_are_refused_naming_the_field_before_the_engine_sees_them(
    scripted_gateway, case, payload, param, code
) -> None:
    async with scripted_gateway(["never<|im_end|>"]) as served:
        async with httpx.AsyncClient(base_url=served.url, trust_env=False) as http:
            response = await http.post("/v1/chat/completions", json=payload)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")
        assert param.split("[")[0].split(".")[0] in error["message"]
        assert served.script.requests == []


async def test_malformed_oversized_unrouted_and_wrong_model_requests_get_the_error_shape(scripted_gateway) -> None:
    async with scripted_gateway(["never<|im_end|>"], limits=GatewayLimits(max_body_bytes=4096)) as served:
        async with httpx.AsyncClient(base_url=served.url, trust_env=False) as http:
            cases = {
                "invalid_json": await http.post("/v1/chat/completions", content=b"{not json", headers=JSON),
                "body_too_large": await http.post(
                    "/v1/chat/completions", json=body(messages=[{"role": "user", "content": "x" * 8000}])
                ),
                "unknown_route": await http.get("/v2/nothing"),
                "model_not_found": await http.post("/v1/chat/completions", json={**body(), "model": "gpt-9"}),
                "session_id": await http.post("/s/bad%20id/v1/chat/completions", json=body()),
                "method_not_allowed": await http.get("/v1/chat/completions"),
            }
        for code, response in cases.items():
            assert response.json()["error"]["code"] == code, (code, response.text)
        assert [r.status_code for r in cases.values()] == [400, 413, 404, 404, 400, 405]
        assert served.script.requests == []


async def test_an_engine_failure_maps_to_502_and_the_generation_is_never_resent(scripted_gateway) -> None:
    async with scripted_gateway(["unused<|im_end|>"]) as served:
        served.script.fail = ServerStatusError(
            method="POST", url="http://scripted/generate", status_code=500, body="boom"
        )
        async with httpx.AsyncClient(base_url=served.url, trust_env=False) as http:
            response = await http.post("/s/f/v1/chat/completions", json=body())
        assert response.status_code == 502
        error = response.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "engine" and "not re-sent" in error["message"]
        assert len(served.script.requests) == 1
        # nothing answered, nothing kept: not even the session the request named
        assert await served.gateway.sessions(group=None, status=None, limit=10, after=None) == []


async def test_turns_past_max_in_flight_get_429_with_retry_after(scripted_gateway) -> None:
    limits = GatewayLimits(max_in_flight=1, retry_after_s=3)
    async with scripted_gateway(["held<|im_end|>"], limits=limits) as served:
        served.script.gate.clear()
        async with httpx.AsyncClient(base_url=served.url, trust_env=False, timeout=60) as http:
            held = asyncio.create_task(http.post("/s/a/v1/chat/completions", json=body()))
            await asyncio.wait_for(served.script.entered.wait(), 60)
            refused = await http.post("/s/b/v1/chat/completions", json=body())
            assert refused.status_code == 429 and refused.headers["Retry-After"] == "3"
            assert refused.json()["error"]["type"] == "rate_limit_error"
            served.script.gate.set()
            assert (await held).status_code == 200
        assert len(served.script.requests) == 1


async def test_session_limits_are_named(scripted_gateway) -> None:
    limits = GatewayLimits(max_sessions=1, max_turns_per_session=1, max_tokens_per_session=64, max_completion_tokens=48)
    async with scripted_gateway(["one<|im_end|>", "two<|im_end|>"], limits=limits) as served:
        async with httpx.AsyncClient(base_url=served.url, trust_env=False) as http:
            first = await http.post("/s/only/v1/chat/completions", json=body())
            assert first.status_code == 200
            message = first.json()["choices"][0]["message"]
            more = body(messages=[*USER, message, {"role": "user", "content": "more"}])
            turn_limit = await http.post("/s/only/v1/chat/completions", json=more)
            assert turn_limit.status_code == 400 and turn_limit.json()["error"]["code"] == "session_turn_limit"
            second = await http.post("/s/another/v1/chat/completions", json=body())
            assert second.status_code == 429 and second.json()["error"]["code"] == "too_many_sessions"
            await http.post("/v1/sessions/only/close")
            token_limit = await http.post("/s/another/v1/chat/completions", json=body(max_tokens=48))
            assert token_limit.status_code == 200  # an empty session: 0 + 48 <= 64
        assert len(served.script.requests) == 2


async def test_a_turn_that_could_pass_the_sessions_token_bound_is_refused_before_sending(scripted_gateway) -> None:
    async with scripted_gateway(
        ["one<|im_end|>", "two<|im_end|>"], limits=GatewayLimits(max_tokens_per_session=64)
    ) as served:
        async with httpx.AsyncClient(base_url=served.url, trust_env=False) as http:
            first = await http.post("/s/t/v1/chat/completions", json=body(max_tokens=56))
            assert first.status_code == 200
            message = first.json()["choices"][0]["message"]
            more = body(messages=[*USER, message, {"role": "user", "content": "more"}], max_tokens=56)
            refused = await http.post("/s/t/v1/chat/completions", json=more)
            assert refused.status_code == 400 and refused.json()["error"]["code"] == "session_token_limit"
            assert refused.json()["error"]["param"] == "max_tokens"
        assert len(served.script.requests) == 1


async def test_a_turn_the_store_could_not_keep_is_not_answered_and_not_extended(scripted_gateway, monkeypatch) -> None:
    async with scripted_gateway(["lost<|im_end|>", "kept<|im_end|>", "next<|im_end|>"]) as served:
        store = served.gateway.store
        real = store.record_turn
        failures = iter([OSError("disk full")])

        async def flaky(*args: Any) -> None:
            failure = next(failures, None)
            if failure is not None:
                raise failure
            await real(*args)

        monkeypatch.setattr(store, "record_turn", flaky)
        async with httpx.AsyncClient(base_url=served.url, trust_env=False) as http:
            failed = await http.post("/s/d/v1/chat/completions", json=body())
            assert failed.status_code == 500 and failed.json()["error"]["code"] == "internal"
            assert "disk full" in failed.json()["error"]["message"]
            again = await http.post("/s/d/v1/chat/completions", json=body())  # the harness retries the turn
            assert again.status_code == 200 and again.headers["X-Turn"] == "0"
            message = again.json()["choices"][0]["message"]
            assert message["content"] == "kept"
            later = await http.post("/s/d/v1/chat/completions", json=body(messages=[*USER, message, *USER]))
            assert later.status_code == 200 and later.headers["X-Turn"] == "1"
        traj = await served.gateway.trajectory("d")
        assert [(t["turn"], t["branch"], t["parent"]) for t in traj["turns"]] == [(0, 0, None), (1, 0, 0)]
        assert traj["branches"][0]["turns"] == [0, 1]


async def test_a_reward_the_store_cannot_keep_is_refused_and_changes_nothing(scripted_gateway) -> None:
    deep: dict[str, object] = {}
    for _ in range(300):  # deeper than the JSON writer goes
        deep = {"d": deep}
    async with (
        scripted_gateway(["ok<|im_end|>"]) as served,
        httpx.AsyncClient(base_url=served.url, trust_env=False, timeout=30) as http,
    ):
        assert (await http.post("/s/r/v1/chat/completions", json=body())).status_code == 200
        refused = await http.post("/v1/sessions/r/reward", json={"reward": 1.0, "info": deep})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "body"
        assert (await http.get("/v1/sessions")).status_code == 200
        summary = (await http.get("/v1/sessions/r")).json()
        assert summary["reward"] is None
        kept = await http.post("/v1/sessions/r/reward", json={"reward": 0.5, "info": {"ok": True}})
        assert kept.status_code == 200 and (await http.get("/v1/sessions/r")).json()["reward"] == 0.5
