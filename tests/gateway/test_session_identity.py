"""Which session a turn joins when the request names none: the harness's own id where it sends one; otherwise the
one open session whose turn the history extends, and never a guess: history that two sessions hold, or a turn
another request already continued, starts a session of its own (counted in ``/health``'s ``unplaced``)."""

from __future__ import annotations

import json
from typing import Any

import httpx

from backends_gateway import Keys

USER = [{"role": "user", "content": "the task"}]
MORE = {"role": "user", "content": "go on"}


async def chat(http: httpx.AsyncClient, messages: list[Any], path: str = "/v1", **headers: str) -> httpx.Response:
    body = {"model": "tiny", "messages": messages, "max_tokens": 16}
    response = await http.post(f"{path}/chat/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    return response


def message(response: httpx.Response) -> dict[str, Any]:
    return {k: v for k, v in response.json()["choices"][0]["message"].items() if v is not None}


async def test_two_identical_rollouts_naming_no_session_never_share_one(scripted_gateway) -> None:
    same = "the same reply<|im_end|>"
    async with scripted_gateway([same] * 4) as served, httpx.AsyncClient(base_url=served.url, trust_env=False) as http:
        a1, b1 = await chat(http, USER), await chat(http, USER)
        assert a1.headers["X-Session-ID"] != b1.headers["X-Session-ID"]
        # both rollouts' second turns extend a reply both sessions hold: neither is placed by a guess
        a2 = await chat(http, [*USER, message(a1), MORE])
        b2 = await chat(http, [*USER, message(b1), MORE])
        sessions = {r.headers["X-Session-ID"] for r in (a1, b1, a2, b2)}
        assert len(sessions) == 4
        assert (await http.get("/health")).json()["unplaced"] == 2


async def test_a_turn_another_request_already_continued_is_not_joined(scripted_gateway) -> None:
    replies = ["one<|im_end|>", "two<|im_end|>", "three<|im_end|>"]
    async with scripted_gateway(replies) as served, httpx.AsyncClient(base_url=served.url, trust_env=False) as http:
        first = await chat(http, USER)
        history = [*USER, message(first), MORE]
        second = await chat(http, history)
        assert second.headers["X-Session-ID"] == first.headers["X-Session-ID"]
        # the same history again: another rollout that happened to sample alike, or an edit; not a guess
        third = await chat(http, history)
        assert third.headers["X-Session-ID"] != first.headers["X-Session-ID"]


async def test_a_harness_own_session_id_names_the_session(scripted_gateway) -> None:
    replies = [f"reply {i}<|im_end|>" for i in range(4)]
    async with scripted_gateway(replies) as served, httpx.AsyncClient(base_url=served.url, trust_env=False) as http:
        claude = await chat(http, USER, **{"x-claude-code-session-id": "6f1c-claude"})
        codex = await chat(http, USER, **{"session-id": "0199-codex", "thread-id": "0199-codex"})
        assert (claude.headers["X-Session-ID"], codex.headers["X-Session-ID"]) == ("6f1c-claude", "0199-codex")
        # a second run of the same task by Claude Code: its own session, although its history is the same
        other = await chat(http, USER, **{"x-claude-code-session-id": "7a2d-claude"})
        assert other.headers["X-Session-ID"] == "7a2d-claude"
        user_id = json.dumps({"device_id": "d", "account_uuid": "", "session_id": "from-metadata"})
        body = {"model": "tiny", "max_tokens": 8, "messages": USER, "metadata": {"user_id": user_id}}
        answered = await http.post("/v1/messages", json=body)
        assert answered.headers["X-Session-ID"] == "from-metadata"


async def test_a_harness_id_never_joins_another_keys_session(scripted_gateway) -> None:
    keys = Keys(
        harness={"a": "harness-key-aaaaaaaa", "b": "harness-key-bbbbbbbb"}, trainer={"t": "trainer-key-cccccccc"}
    )
    async with scripted_gateway(["x<|im_end|>", "y<|im_end|>"], keys=keys) as served:
        async with httpx.AsyncClient(base_url=served.url, trust_env=False) as http:
            first = await chat(
                http, USER, **{"x-claude-code-session-id": "shared", "Authorization": "Bearer harness-key-aaaaaaaa"}
            )
            second = await chat(
                http, USER, **{"x-claude-code-session-id": "shared", "Authorization": "Bearer harness-key-bbbbbbbb"}
            )
            listed = await http.get("/v1/sessions", headers={"Authorization": "Bearer trainer-key-cccccccc"})
        # each key's harness has its own "shared": two sessions of one turn each, as the trainer sees them
        assert first.headers["X-Session-ID"] == second.headers["X-Session-ID"] == "shared"
        assert first.headers["X-Turn"] == second.headers["X-Turn"] == "0"
        sessions = {s["session"]: (s["owner"], s["turns"]) for s in listed.json()["data"]}
        assert sessions == {"a~shared": ("a", 1), "b~shared": ("b", 1)}
