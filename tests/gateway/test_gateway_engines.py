"""The gateway over real HTTP engines (emulated): OpenAI's logprobs from the engine's channel, routed experts kept
when asked, and each session pinned to one server of a fleet while sessions spread over it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import openai

from backends_core import Client, ClientConfig, StatelessPolicy
from backends_gateway import Gateway, SQLiteStore, serve
from backends_testkit.engine import ReferenceEngine
from backends_vllm_testing.emulator import VllmEmulator


@contextlib.asynccontextmanager
async def gateway_over(engines: list[ReferenceEngine], store: Any, **emulator: Any) -> AsyncIterator[tuple[str, Any]]:
    emulators = [VllmEmulator(e, **emulator) for e in engines]
    async with contextlib.AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(e.serve()) for e in emulators]
        config = ClientConfig(
            backend="vllm",
            base_url=urls,
            model=emulators[0].served_model_name,
            tokenizer=str(engines[0].model_dir),
            stateless=StatelessPolicy(enabled=False),
        )
        client = await stack.enter_async_context(Client(config))
        gateway = await stack.enter_async_context(Gateway(client, SQLiteStore(store)))
        yield await stack.enter_async_context(serve(gateway)), gateway


async def test_logprobs_come_in_openais_shape_from_the_engines_channel(tiny_models, tmp_path) -> None:
    engine = ReferenceEngine(tiny_models.dense, seed=0)
    try:
        async with gateway_over([engine], tmp_path / "l.db") as (url, gateway):
            async with openai.AsyncOpenAI(base_url=f"{url}/s/lp/v1", api_key="unused", max_retries=0) as sdk:
                answer = await sdk.chat.completions.create(
                    model=gateway.model,
                    messages=[{"role": "user", "content": "hi"}],
                    max_tokens=6,
                    logprobs=True,
                    top_logprobs=3,
                )
            content = answer.choices[0].logprobs.content
            (turn,) = (await gateway.trajectory("lp"))["turns"]
            assert [c.logprob for c in content] == turn["logprobs"]
            assert all(len(c.top_logprobs) == 3 for c in content)
            tokenizer = gateway.client.tokenizer
            assert [c.token for c in content] == [tokenizer.decode([i]) for i in turn["completion_ids"]]
            for c in content:  # the sampled token is among the top 3 only if it ranks there
                assert max(t.logprob for t in c.top_logprobs) >= c.logprob - 1e-6
    finally:
        await engine.aclose()


async def test_routed_experts_are_kept_when_the_request_asks(tiny_models, tmp_path) -> None:
    engine = ReferenceEngine(tiny_models.moe, seed=0)
    try:
        async with gateway_over([engine], tmp_path / "r.db", enable_return_routed_experts=True) as (url, gateway):
            async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=60) as http:
                body = {"model": gateway.model, "messages": [{"role": "user", "content": "route"}], "max_tokens": 4}
                plain = await http.post("/s/r/v1/chat/completions", json=body)
                routed = await http.post("/s/r2/v1/chat/completions", json={**body, "return_routed_experts": True})
            assert plain.status_code == routed.status_code == 200
            (without,) = (await gateway.trajectory("r"))["turns"]
            (turn,) = (await gateway.trajectory("r2"))["turns"]
            assert "routed_experts" not in without
            experts = np.asarray(turn["routed_experts"]["experts"])
            assert experts.shape[0] == len(turn["prompt_ids"]) + len(turn["completion_ids"]) - 1
            assert list(experts.shape) == turn["routed_experts"]["shape"]
    finally:
        await engine.aclose()


async def test_each_session_sticks_to_one_server_of_a_fleet_and_sessions_spread(tiny_models, tmp_path) -> None:
    engines = [ReferenceEngine(tiny_models.dense, seed=0) for _ in range(2)]
    try:
        async with gateway_over(engines, tmp_path / "f.db") as (url, gateway):
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as sdk:
                for s in range(6):
                    messages: list[Any] = [{"role": "user", "content": f"task {s}"}]
                    for i in range(3):
                        answer = await sdk.chat.completions.create(
                            model=gateway.model,
                            messages=messages,
                            max_tokens=4,
                            extra_headers={"X-Session-ID": f"s{s}"},
                        )
                        reply = answer.choices[0].message.model_dump(exclude_none=True)
                        messages += [reply, {"role": "user", "content": f"step {i}"}]
            servers = []
            for s in range(6):
                turns = (await gateway.trajectory(f"s{s}"))["turns"]
                assert len({t["server"] for t in turns}) == 1 and [t["reused_ids"] > 0 for t in turns] == [
                    False,
                    True,
                    True,
                ]
                servers.append(turns[0]["server"])
            assert len(set(servers)) == 2
    finally:
        for engine in engines:
            await engine.aclose()
