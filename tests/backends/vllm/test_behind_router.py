"""A vllm-router configured as if it were a vLLM server: admin operations are refused, naming the fix, instead of
reaching one replica (the router passes each admin call to ONE replica and answers with its success)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from backends_core import AdminError, Client, ClientConfig, ConfigError, SamplingParams
from backends_testkit.engine import ReferenceEngine
from backends_testkit.tinymodel import TinyModels
from backends_vllm_testing import VllmEmulator


@pytest.fixture
async def engine(tiny_models: TinyModels) -> AsyncIterator[ReferenceEngine]:
    async with ReferenceEngine(tiny_models.dense, seed=0) as eng:
        yield eng


def router_before(emulator: VllmEmulator, seen: list[httpx.Request]) -> httpx.MockTransport:
    """vllm-router 0.1.17 as observed: ``/list_workers`` is its own, every other route goes to the replica."""
    replica = emulator.transport()

    async def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/list_workers":
            return httpx.Response(200, json={"urls": ["http://127.0.0.1:8100", "http://127.0.0.1:8101"]})
        return await replica.handle_async_request(request)

    return httpx.MockTransport(handle)


def config(tiny_models: TinyModels) -> ClientConfig:
    return ClientConfig(backend="vllm", base_url="http://router", model="tiny-qwen3", tokenizer=str(tiny_models.dense))


async def test_an_admin_call_to_a_router_taken_for_a_server_is_refused_before_it_acts(
    engine: ReferenceEngine, tiny_models: TinyModels
) -> None:
    seen: list[httpx.Request] = []
    async with Client(config(tiny_models), transport=router_before(VllmEmulator(engine), seen)) as client:
        generated = await client.generate(prompt_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=1))
        with pytest.raises(
            AdminError, match=r"is a vllm-router in front of 2 replica\(s\).*kind = 'vllm-router'"
        ) as info:
            await client.admin.pause()
    assert isinstance(info.value.results[0].error, ConfigError)
    assert len(generated.completion_ids) == 1  # generation through a router works: only admin is refused
    assert not engine.state().paused
    assert [r.url.path for r in seen if r.url.path == "/pause"] == []


async def test_a_vllm_server_is_asked_once_whether_it_is_a_router(engine: ReferenceEngine, tiny_models) -> None:
    emulator = VllmEmulator(engine)
    async with Client(config(tiny_models), transport=emulator.transport()) as client:
        await client.admin.pause(mode="keep")
        await client.admin.resume()
    assert [path for _method, path in emulator.requests].count("/list_workers") == 1
