"""A turn is a training sample only if its harness received it: a client that goes away aborts its generation, an
answer that could not be written is kept out of the training view, and a retry of the same request gets the
answer kept for it (nothing generated twice). A request refused before anything was generated leaves nothing."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import httpx
import openai
import pytest

from backends_gateway import GatewayLimits

USER = [{"role": "user", "content": "hi"}]


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": USER, "max_tokens": 16, **fields}


async def wait_until(condition: Any) -> None:
    """Wait (at most 30 s) for ``condition()`` to hold: a state the gateway reaches once it saw the client go."""
    async with asyncio.timeout(30):
        while not condition():  # noqa: ASYNC110  (the gateway's in-flight count has no event to wait on)
            await asyncio.sleep(0.01)


async def test_an_answer_written_to_a_client_that_went_away_is_no_sample_and_a_retry_gets_it(
    scripted_gateway, monkeypatch
) -> None:
    import backends_gateway.streaming as streaming

    async with scripted_gateway(["kept once<|im_end|>", "never generated<|im_end|>"]) as served:
        real = streaming.web.Response.write_eof
        calls = {"n": 0}

        async def hang_up(self: Any, *args: Any) -> None:
            calls["n"] += 1
            if calls["n"] == 1:
                raise ConnectionResetError("the client went away")
            await real(self, *args)

        monkeypatch.setattr(streaming.web.Response, "write_eof", hang_up)
        async with httpx.AsyncClient(base_url=served.url, trust_env=False, timeout=30) as http:
            with contextlib.suppress(httpx.HTTPError):
                await http.post("/s/r/v1/chat/completions", json=body())
            traj = await served.gateway.trajectory("r")
            assert [t["delivered"] for t in traj["turns"]] == [False]
            assert traj["branches"][0]["turns"] == [] and traj["undelivered"] == 1  # no training sample
            retry = await http.post("/s/r/v1/chat/completions", json=body(), headers={"x-stainless-retry-count": "1"})
        assert retry.json()["choices"][0]["message"]["content"] == "kept once"
        assert len(served.script.requests) == 1  # the retry was answered with the kept turn
        traj = await served.gateway.trajectory("r")
        assert [t["delivered"] for t in traj["turns"]] == [True] and traj["branches"][0]["turns"] == [0]
        assert (traj["replayed"], traj["undelivered"]) == (1, 0)


async def test_a_client_that_goes_away_mid_generation_aborts_it_and_keeps_no_turn(scripted_gateway) -> None:
    async with scripted_gateway(["too late<|im_end|>"]) as served:
        served.script.gate.clear()  # the engine holds the generation
        async with httpx.AsyncClient(base_url=served.url, trust_env=False, timeout=30) as http:
            sent = asyncio.create_task(http.post("/s/gone/v1/chat/completions", json=body()))
            await asyncio.wait_for(served.script.entered.wait(), 30)
            sent.cancel()  # the harness gives up: its connection closes
        await wait_until(lambda: served.gateway._in_flight == 0)
        served.script.gate.set()
        async with httpx.AsyncClient(base_url=served.url, trust_env=False) as http:
            sessions = (await http.get("/v1/sessions")).json()["data"]
        assert sessions == []  # no turn, and the session the request would have opened is not left behind


async def test_a_streamed_answer_cut_by_the_client_keeps_no_turn(scripted_gateway) -> None:
    reply = "<think>\nx\n</think>\n\n" + " ".join(f"w{i}" for i in range(40)) + "<|im_end|>"
    async with scripted_gateway([reply]) as served:
        sdk = openai.AsyncOpenAI(base_url=f"{served.url}/s/cut/v1", api_key="k", max_retries=0)
        stream = await sdk.chat.completions.create(model="tiny", messages=USER, stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                break  # the harness stops reading after the first text
        await stream.close()
        await sdk.close()
        await wait_until(lambda: served.gateway._in_flight == 0)
        async with httpx.AsyncClient(base_url=served.url, trust_env=False) as http:
            sessions = (await http.get("/v1/sessions")).json()["data"]
        # aborted before its end (no turn), or ended as the client went (kept, undelivered): no sample either way
        for session in sessions:
            traj = await served.gateway.trajectory(session["session"])
            assert [t["delivered"] for t in traj["turns"]] == [False]
            assert [b["turns"] for b in traj["branches"]] == [[]]


async def test_sdk_retries_of_an_answered_turn_are_answered_with_it(scripted_gateway) -> None:
    async with scripted_gateway(["the answer<|im_end|>", "a second sample<|im_end|>"]) as served:
        async with httpx.AsyncClient(base_url=served.url, trust_env=False, timeout=30) as http:
            first = await http.post("/s/twice/v1/chat/completions", json=body())
            again = await http.post(
                "/s/twice/v1/chat/completions", json=body(), headers={"x-stainless-retry-count": "2"}
            )
        assert again.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
        assert again.headers["X-Turn"] == first.headers["X-Turn"] == "0"
        assert len(served.script.requests) == 1
        traj = await served.gateway.trajectory("twice")
        assert len(traj["turns"]) == 1 and traj["replayed"] == 1


async def test_requests_refused_before_generation_leave_no_session(scripted_gateway) -> None:
    async with scripted_gateway([]) as served, httpx.AsyncClient(base_url=served.url, trust_env=False) as http:
        for _ in range(3):
            refused = await http.post("/v1/chat/completions", json=body(max_tokens=10**6))
            assert refused.status_code == 400
        bad_image = [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}
        ]
        assert (await http.post("/s/named/v1/chat/completions", json=body(messages=bad_image))).status_code == 400
        assert (await http.get("/v1/sessions")).json()["data"] == []
        assert served.gateway.open_sessions == 0


async def test_a_request_refused_once_placed_in_a_new_session_leaves_no_session(scripted_gateway) -> None:
    async with scripted_gateway([], limits=GatewayLimits(max_tokens_per_session=8)) as served:
        async with httpx.AsyncClient(base_url=served.url, trust_env=False) as http:
            for _ in range(3):  # a harness retrying what the session's limit refuses
                refused = await http.post("/s/limited/v1/chat/completions", json=body(max_tokens=16))
                assert refused.status_code == 400 and refused.json()["error"]["code"] == "session_token_limit"
            assert (await http.get("/v1/sessions")).json()["data"] == []
        assert served.gateway.open_sessions == 0  # nothing counts toward max_sessions


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_client_that_goes_away_is_no_error_in_the_log(
    scripted_gateway, caplog: pytest.LogCaptureFixture, stream: bool
) -> None:
    caplog.set_level(logging.INFO, logger="backends_gateway")
    async with scripted_gateway(["held reply<|im_end|>"]) as served:
        served.script.gate.clear()
        async with httpx.AsyncClient(base_url=served.url, trust_env=False, timeout=60) as http:
            payload = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
            call = asyncio.create_task(http.post("/s/gone/v1/chat/completions", json=payload))
            await asyncio.wait_for(served.script.entered.wait(), 60)
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)
        served.script.gate.set()
        assert await served.gateway.sessions(group=None, status=None, limit=10, after=None) == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
