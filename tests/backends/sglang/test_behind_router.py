"""The sglang backend in front of an sglang-router: a router mistaken for a server is named once, and behind a
configured front the engine limits are read from a replica."""

from __future__ import annotations

import httpx
import pytest

from backends_core import Client, ClientConfig, ConfigError, FleetPolicy, FrontConfig, SamplingParams

ROUTER_INFO = {"router_manager": True, "routers_count": 1, "workers_count": 2}  # tests/live/ROUTERS.md


def router_transport(replica: httpx.AsyncBaseTransport, seen: list[httpx.Request]) -> httpx.MockTransport:
    """sglang-router 0.3.2 as observed: ``/server_info`` 404, ``/get_server_info`` its own, ``/workers`` the list,
    ``/generate`` forwarded; the replica (host ``replica``) answers directly."""

    async def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.host == "replica":
            return await replica.handle_async_request(request)
        if request.url.path == "/server_info":
            return httpx.Response(404)
        if request.url.path == "/get_server_info":
            return httpx.Response(200, json=ROUTER_INFO)
        if request.url.path == "/workers":
            return httpx.Response(200, json={"workers": [{"url": "http://replica", "id": "w0", "is_healthy": True}]})
        forwarded = httpx.Request(
            request.method, request.url.copy_with(host="replica"), headers=request.headers, content=request.content
        )
        return await replica.handle_async_request(forwarded)

    return httpx.MockTransport(handle)


async def test_a_router_mistaken_for_a_server_is_a_config_error_asked_once(make_emulator, tiny_models) -> None:
    seen: list[httpx.Request] = []
    transport = router_transport(make_emulator().transport(), seen)
    cfg = ClientConfig(backend="sglang", base_url="http://router", model="tiny-qwen3", tokenizer=str(tiny_models.dense))
    async with Client(cfg, transport=transport) as client:
        for _ in range(3):
            with pytest.raises(ConfigError, match=r"is an sglang-router .*\[front\] kind = 'sglang-router'"):
                await client.generate(prompt_ids=[1, 2], sampling=SamplingParams(max_tokens=1))
    assert sum(r.url.path.endswith("server_info") for r in seen) == 2  # /server_info, /get_server_info: once
    assert not [r for r in seen if r.url.path == "/generate"]


async def test_behind_an_sglang_router_front_the_prompt_limit_is_read_from_a_replica(
    make_emulator, tiny_models
) -> None:
    seen: list[httpx.Request] = []
    transport = router_transport(make_emulator().transport(), seen)
    cfg = ClientConfig(
        backend="sglang",
        base_url="http://router",
        model="tiny-qwen3",
        tokenizer=str(tiny_models.dense),
        front=FrontConfig(kind="sglang-router"),
        fleet=FleetPolicy(refresh_interval=None),
    )
    async with Client(cfg, transport=transport) as client:
        result = await client.generate(prompt_ids=[1, 2], sampling=SamplingParams(max_tokens=1), session="k")
    assert len(result.completion_ids) == 1
    info = [r for r in seen if r.url.path.endswith("server_info")]
    assert [(r.url.host, r.url.path) for r in info] == [("replica", "/server_info")]
    (sent,) = [r for r in seen if r.url.host == "router" and r.url.path == "/generate"]
    assert sent.headers["x-smg-routing-key"] == "k"


async def test_behind_a_front_a_dead_replica_is_skipped_when_the_prompt_limit_is_read(
    make_emulator, tiny_models
) -> None:
    seen: list[httpx.Request] = []
    inner = router_transport(make_emulator().transport(), seen)

    async def handle(request: httpx.Request) -> httpx.Response:
        if request.url.host == "dead":
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/workers":
            workers = [{"url": u, "id": u[-4:], "is_healthy": True} for u in ("http://dead", "http://replica")]
            return httpx.Response(200, json={"workers": workers})
        return await inner.handle_async_request(request)

    cfg = ClientConfig(
        backend="sglang",
        base_url="http://router",
        model="tiny-qwen3",
        tokenizer=str(tiny_models.dense),
        front=FrontConfig(kind="sglang-router", evict_unreachable=False),
        fleet=FleetPolicy(refresh_interval=None),
    )
    async with Client(cfg, transport=httpx.MockTransport(handle)) as client:
        client.front_fleet.front.server.replicas = ("http://dead", "http://replica")  # as a listing just said
        result = await client.generate(prompt_ids=[1, 2], sampling=SamplingParams(max_tokens=1))
    assert len(result.completion_ids) == 1
    assert [(r.url.host, r.url.path) for r in seen if r.url.path.endswith("server_info")] == [
        ("replica", "/server_info")
    ]
