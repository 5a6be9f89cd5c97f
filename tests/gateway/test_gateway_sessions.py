"""Sessions and branches: where a request's turn goes, and that no turn is ever re-tokenised inside a branch."""

from __future__ import annotations

from typing import Any

import httpx

REPLIES = ["first answer<|im_end|>", "second answer<|im_end|>", "third answer<|im_end|>", "fourth answer<|im_end|>"]


async def chat(url: str, messages: list[Any], *, path: str = "/v1", **headers: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=60) as http:
        body = {"model": "tiny", "messages": messages, "max_tokens": 16}
        return await http.post(f"{path}/chat/completions", json=body, headers=headers)


async def get(url: str, path: str) -> Any:
    async with httpx.AsyncClient(base_url=url, trust_env=False) as http:
        response = await http.get(path)
        assert response.status_code == 200, response.text
        return response.json()


def reply(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    return {k: v for k, v in message.items() if v is not None}


async def test_a_request_naming_no_session_joins_the_open_session_it_extends(scripted_gateway) -> None:
    async with scripted_gateway(list(REPLIES)) as served:
        first = [{"role": "user", "content": "hi"}]
        r1 = await chat(served.url, first)
        session = r1.headers["X-Session-ID"]
        r2 = await chat(served.url, [*first, reply(r1), {"role": "user", "content": "and?"}])
        assert r2.headers["X-Session-ID"] == session and r2.headers["X-Turn"] == "1"
        other = await chat(served.url, [{"role": "user", "content": "a new task"}])
        assert other.headers["X-Session-ID"] != session
        traj = await get(served.url, f"/v1/sessions/{session}/trajectory")
        assert [t["parent"] for t in traj["turns"]] == [None, 0] and traj["bridged"] == 1


async def test_a_harness_that_drops_reasoning_and_rewrites_call_ids_stays_on_one_branch(scripted_gateway) -> None:
    replies = [
        '<think>\nplan\n</think>\n\n<tool_call>\n{"name": "ls", "arguments": {"path": "."}}\n</tool_call><|im_end|>',
        "<think>\nok\n</think>\n\ndone<|im_end|>",
    ]
    async with scripted_gateway(replies) as served:
        first = [{"role": "user", "content": "list"}]
        message = reply(await chat(served.url, first, path="/s/s1/v1"))
        assert message["reasoning_content"] == "plan"
        held = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_mine", "type": "function", "function": {"name": "ls", "arguments": '{"path":"."}'}}
            ],
        }
        r2 = await chat(
            served.url,
            [*first, held, {"role": "tool", "tool_call_id": "call_mine", "content": "a.py"}],
            path="/s/s1/v1",
        )
        assert reply(r2)["content"] == "done"
        traj = await get(served.url, "/v1/sessions/s1/trajectory")
        assert [t["branch"] for t in traj["turns"]] == [0, 0] and traj["bridged"] == 1 and traj["branched"] == 0


async def test_an_edited_earlier_turn_starts_a_branch_on_that_turns_exact_ids(scripted_gateway) -> None:
    async with scripted_gateway(list(REPLIES)) as served:
        first = [{"role": "user", "content": "hi"}]
        a1 = reply(await chat(served.url, first, **{"X-Session-ID": "e"}))
        second = [*first, a1, {"role": "user", "content": "tell me more"}]
        a2 = reply(await chat(served.url, second, **{"X-Session-ID": "e"}))
        await chat(served.url, [*second, a2, {"role": "user", "content": "thanks"}], **{"X-Session-ID": "e"})
        # the harness goes back and edits the second user message: it extends turn 0, not the branch's tip
        edited = await chat(
            served.url, [*first, a1, {"role": "user", "content": "tell me less"}], **{"X-Session-ID": "e"}
        )
        assert edited.headers["X-Branch"] == "1"
        traj = await get(served.url, "/v1/sessions/e/trajectory")
        turns = traj["turns"]
        assert [t["branch"] for t in turns] == [0, 0, 0, 1] and turns[3]["parent"] == 0
        base = turns[0]["prompt_ids"] + turns[0]["completion_ids"]
        assert turns[3]["prompt_ids"][: len(base)] == base and turns[3]["reused_ids"] == len(base)
        branches = {b["branch"]: b for b in traj["branches"]}
        assert branches[1]["parent_branch"] == 0 and branches[1]["parent_turn"] == 0
        assert branches[1]["reason"] == "edited" and branches[1]["turns"] == [0, 3]
        assert sum(branches[1]["loss_mask"]) == len(turns[0]["completion_ids"]) + len(turns[3]["completion_ids"])
        assert (traj["bridged"], traj["branched"], traj["rerendered"]) == (3, 1, 0)


async def test_rewritten_history_starts_a_branch_rendered_whole_never_a_silent_retokenisation(scripted_gateway) -> None:
    async with scripted_gateway(list(REPLIES)) as served:
        first = [{"role": "user", "content": "a long task"}]
        a1 = reply(await chat(served.url, first, path="/s/c/v1"))
        await chat(served.url, [*first, a1, {"role": "user", "content": "step 2"}], path="/s/c/v1")
        # compaction: the harness replaces the history with a summary
        compacted = [{"role": "user", "content": "summary of the task so far"}, {"role": "user", "content": "go on"}]
        r3 = await chat(served.url, compacted, path="/s/c/v1")
        assert r3.headers["X-Branch"] == "1"
        # an assistant reply that is not what the engine said (the harness edited it) is refused by the bridge
        forged = [*first, {"role": "assistant", "content": "something else"}, {"role": "user", "content": "step 2"}]
        r4 = await chat(served.url, forged, path="/s/c/v1")
        assert r4.headers["X-Branch"] == "2"
        traj = await get(served.url, "/v1/sessions/c/trajectory")
        reasons = {b["branch"]: (b["reason"], b["parent_turn"]) for b in traj["branches"]}
        assert reasons == {0: ("first", None), 1: ("rewritten", None), 2: ("rewritten", None)}
        assert [t["reused_ids"] for t in traj["turns"]][2:] == [0, 0]
        assert (traj["bridged"], traj["branched"], traj["rerendered"]) == (1, 2, 2)
        for b in traj["branches"]:  # every branch is one exact sequence
            last = traj["turns"][b["turns"][-1]]
            assert b["input_ids"] == last["prompt_ids"] + last["completion_ids"]


async def test_a_reply_the_bridge_refuses_starts_a_branch_named_by_the_refusal(scripted_gateway) -> None:
    replies = ["<think>\nsecret plan\n</think>\n\nok<|im_end|>", "fine<|im_end|>"]
    async with scripted_gateway(replies) as served:
        first = [{"role": "user", "content": "go"}]
        message = reply(await chat(served.url, first, path="/s/r/v1"))
        # same content, but reasoning text the engine never produced: the digest matches, the bridge refuses it
        edited = {**message, "reasoning_content": "another plan"}
        r2 = await chat(served.url, [*first, edited, {"role": "user", "content": "next"}], path="/s/r/v1")
        assert r2.status_code == 200 and r2.headers["X-Branch"] == "1"
        traj = await get(served.url, "/v1/sessions/r/trajectory")
        assert traj["branches"][1]["reason"] == "assistant_mismatch" and traj["turns"][1]["reused_ids"] == 0
        assert traj["rerendered"] == 1


async def test_a_reply_that_stopped_on_the_models_second_end_token_bridges_even_after_a_restart(
    scripted_gateway,
) -> None:
    first = [{"role": "user", "content": "go"}]
    async with scripted_gateway(["bye<|endoftext|>"], name="second-end") as served:
        message = reply(await chat(served.url, first, path="/s/e/v1"))
        assert message["content"] == "bye"  # the stop token is no text of the reply
    # the turn comes back from the store: it still knows which token ended it
    async with scripted_gateway(["fine<|im_end|>"], name="second-end") as served:
        r2 = await chat(served.url, [*first, message, {"role": "user", "content": "next"}], path="/s/e/v1")
        assert r2.headers["X-Branch"] == "0" and r2.headers["X-Turn"] == "1"
        traj = await get(served.url, "/v1/sessions/e/trajectory")
    turn0, turn1 = traj["turns"]
    endoftext = turn0["completion_ids"][-1]
    assert turn0["stop_reason"] == endoftext and turn0["finish_reason"] == "stop"
    assert turn1["prompt_ids"][: len(turn0["prompt_ids"]) + len(turn0["completion_ids"])] == (
        turn0["prompt_ids"] + turn0["completion_ids"]
    )
    assert turn1["parent"] == 0 and traj["bridged"] == 1 and traj["rerendered"] == 0


async def test_sessions_are_listed_by_group_and_status_and_a_closed_one_takes_no_turn(scripted_gateway) -> None:
    async with scripted_gateway(list(REPLIES)) as served:
        for name in ("g1", "g2"):
            r = await chat(
                served.url, [{"role": "user", "content": name}], path=f"/s/{name}/v1", **{"X-Session-Group": "step-3"}
            )
            assert r.status_code == 200
        await chat(served.url, [{"role": "user", "content": "x"}], path="/s/lone/v1")
        async with httpx.AsyncClient(base_url=served.url, trust_env=False) as http:
            assert (await http.post("/v1/sessions/g1/close")).json()["status"] == "closed"
            listed = (await http.get("/v1/sessions", params={"group": "step-3"})).json()["data"]
            assert sorted(s["session"] for s in listed) == ["g1", "g2"]
            closed = (await http.get("/v1/sessions", params={"status": "closed"})).json()["data"]
            assert [s["session"] for s in closed] == ["g1"]
            again = await http.post(
                "/s/g1/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "more"}]}
            )
            assert again.status_code == 409 and again.json()["error"]["code"] == "session_closed"
            wrong_group = await http.post(
                "/s/g2/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "m"}]},
                headers={"X-Session-Group": "other"},
            )
            assert wrong_group.status_code == 400 and wrong_group.json()["error"]["param"] == "X-Session-Group"
            missing = await http.get("/v1/sessions/nope/trajectory")
            assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
        assert len(served.script.requests) == 3
