"""Limits hold under concurrency: the check and the count of a turn are one step, so requests arriving together
cannot all pass a check that only some of them may."""

from __future__ import annotations

import asyncio

import httpx

from backends_gateway import GatewayLimits

USER = [{"role": "user", "content": "hi"}]


async def test_max_in_flight_holds_for_simultaneous_first_turns(scripted_gateway) -> None:
    async with scripted_gateway(["held<|im_end|>"] * 20, limits=GatewayLimits(max_in_flight=2)) as served:
        served.script.gate.clear()  # the engine holds every generation
        async with httpx.AsyncClient(base_url=served.url, trust_env=False, timeout=60) as http:
            body = {"model": "tiny", "messages": USER, "max_tokens": 8}
            sent = [asyncio.create_task(http.post(f"/s/s{i}/v1/chat/completions", json=body)) for i in range(20)]
            # the refusals come back while two generations are held
            for refused, task in enumerate(asyncio.as_completed(sent), start=1):
                assert (await task).status_code == 429
                if refused == 18:
                    break
            served.script.gate.set()
            statuses = sorted(response.status_code for response in await asyncio.gather(*sent))
        assert statuses == [200, 200] + [429] * 18 and served.script.started == 2


async def test_max_turns_per_session_holds_for_concurrent_turns(scripted_gateway) -> None:
    limits = GatewayLimits(max_turns_per_session=3)
    async with scripted_gateway(["a turn<|im_end|>"] * 8, limits=limits) as served:
        served.script.gate.clear()
        async with httpx.AsyncClient(base_url=served.url, trust_env=False, timeout=60) as http:
            body = {"model": "tiny", "messages": USER, "max_tokens": 8}
            sent = [asyncio.create_task(http.post("/s/one/v1/chat/completions", json=body)) for _ in range(8)]
            await asyncio.wait_for(served.script.entered.wait(), 60)
            served.script.gate.set()
            statuses = sorted([(await task).status_code for task in sent])
        assert statuses == [200] * 3 + [400] * 5
        assert len((await served.gateway.trajectory("one"))["turns"]) == 3


async def test_max_sessions_counts_the_sessions_an_earlier_run_left_open(scripted_gateway) -> None:
    limits = GatewayLimits(max_sessions=2)
    body = {"model": "tiny", "messages": USER, "max_tokens": 8}
    async with (
        scripted_gateway(["a<|im_end|>", "b<|im_end|>"], limits=limits, name="kept") as first,
        httpx.AsyncClient(base_url=first.url, trust_env=False, timeout=60) as http,
    ):
        for session in ("one", "two"):
            assert (await http.post(f"/s/{session}/v1/chat/completions", json=body)).status_code == 200
    # the same store, a new process: both sessions are still open
    async with scripted_gateway(["c<|im_end|>"], limits=limits, name="kept") as again:
        async with httpx.AsyncClient(base_url=again.url, trust_env=False, timeout=60) as http:
            refused = await http.post("/s/three/v1/chat/completions", json=body)
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_sessions"
            assert (await http.get("/health")).json()["open_sessions"] == 2
            assert (await http.post("/v1/sessions/one/close")).status_code == 200
            assert (await http.post("/s/three/v1/chat/completions", json=body)).status_code == 200
        assert again.script.started == 1
