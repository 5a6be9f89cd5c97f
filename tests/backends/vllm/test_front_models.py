"""Behind a vllm-router front, the vllm backend reads ``/v1/models`` (model limits, served names) from a replica
directly: vllm-router sends every ``GET /v1/models`` to one fixed replica and keeps doing so after that replica
died (``tests/live/ROUTERS.md``), which would fail every request of a client that has not read it yet."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from backends_core import Client, ClientConfig, FrontConfig, SamplingParams
from backends_testkit.engine import ReferenceEngine
from backends_testkit.tinymodel import TinyModels
from backends_vllm_testing import VllmEmulator


@pytest.fixture
async def engine(tiny_models: TinyModels) -> AsyncIterator[ReferenceEngine]:
    async with ReferenceEngine(tiny_models.dense, seed=0) as eng:
        yield eng


def router(replica: VllmEmulator, seen: list[httpx.Request]) -> httpx.MockTransport:
    """vllm-router before replicas ``r0`` and ``r1`` (one emulator behind both names), whose fixed
    ``/v1/models`` replica is dead: it answers that route with its 500; every other route reaches a replica."""
    direct = replica.transport()

    async def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.host == "router":
            if request.url.path == "/workers":
                urls = ["http://r0", "http://r1"]
                return httpx.Response(200, json={"workers": [{"url": u, "is_healthy": True} for u in urls]})
            if request.url.path == "/v1/models":
                return httpx.Response(500, text="Request failed: error sending request for url (http://dead/v1/models)")
        return await direct.handle_async_request(request)

    return httpx.MockTransport(handle)


async def test_generation_behind_a_front_reads_the_model_list_from_a_replica_not_through_the_router(
    engine: ReferenceEngine, tiny_models: TinyModels
) -> None:
    seen: list[httpx.Request] = []
    config = ClientConfig(
        backend="vllm",
        base_url="http://router",
        model="tiny-qwen3",
        tokenizer=str(tiny_models.dense),
        front=FrontConfig(kind="vllm-router"),
    )
    async with Client(config, transport=router(VllmEmulator(engine), seen)) as client:
        result = await client.generate(prompt_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=2))
    assert len(result.completion_ids) == 2
    asked = [(r.url.host, r.url.path) for r in seen]
    assert ("r0", "/v1/models") in asked and ("router", "/v1/models") not in asked
    assert ("router", "/inference/v1/generate") in asked


async def test_a_replica_that_died_since_the_front_listed_it_is_skipped_for_the_model_list(
    engine: ReferenceEngine, tiny_models: TinyModels
) -> None:
    seen: list[httpx.Request] = []
    inner = router(VllmEmulator(engine), seen)

    async def handle(request: httpx.Request) -> httpx.Response:
        if request.url.host == "r0":
            raise httpx.ConnectError("connection refused", request=request)
        return await inner.handle_async_request(request)

    config = ClientConfig(
        backend="vllm",
        base_url="http://router",
        model="tiny-qwen3",
        tokenizer=str(tiny_models.dense),
        front=FrontConfig(kind="vllm-router", evict_unreachable=False),
    )
    async with Client(config, transport=httpx.MockTransport(handle)) as client:
        assert client.front_fleet is not None
        client.front_fleet.front.server.replicas = ("http://r0", "http://r1")  # as a listing just said
        result = await client.generate(prompt_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=2))
    assert len(result.completion_ids) == 2
    assert ("r1", "/v1/models") in [(r.url.host, r.url.path) for r in seen]
