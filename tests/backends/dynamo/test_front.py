"""Dynamo's frontend as a front (``[front] kind = "dynamo"``): workers read from ``GET /v1/rl/workers`` (a real
capture), and the admin hooks reach the workers discovered there instead of the configured ones."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from backends_core import ClientConfig, FrontConfig, FrontError
from backends_core.server import Server
from backends_dynamo.admin import worker_urls
from backends_dynamo.front import DynamoFront, rl_workers
from backends_dynamo.options import parse_options

CAPTURE = Path(__file__).resolve().parents[2] / "fixtures" / "wire" / "dynamo-vllm" / "rl_workers.json"
FRONTEND = "http://frontend:8200"


def front(workers_url: str | None = "http://frontend:8201") -> DynamoFront:
    http = httpx.AsyncClient()
    server = Server(
        base_url="http://frontend:8200", admin_url="http://frontend:8200", data_client=http, admin_client=http
    )
    return DynamoFront(server, FrontConfig(kind="dynamo", workers_url=workers_url))


def captured() -> dict[str, object]:
    data: dict[str, object] = json.loads(CAPTURE.read_text())["response"]
    return data


def test_the_captured_worker_list_gives_each_workers_system_url() -> None:
    (worker,) = rl_workers(captured(), front())
    assert worker.url == "http://127.0.0.1:8281" and worker.id == "13150621235194238294"


@pytest.mark.parametrize(
    ("raw", "where"),
    [({"workers": None}, "$.workers"), ({"workers": [{"instance_id": 1}]}, "$.workers[0].system_url")],
)
def test_a_malformed_worker_list_is_a_front_error_naming_the_path(raw: object, where: str) -> None:
    with pytest.raises(FrontError, match=where.replace("$", r"\$").replace("[", r"\[").replace("]", r"\]")):
        rl_workers(raw, front())


def test_the_admin_hooks_reach_the_discovered_workers_over_the_configured_ones() -> None:
    config = ClientConfig(
        backend="dynamo", base_url="http://frontend:8200", backend_options={"worker_urls": ["http://configured:1"]}
    )
    options = parse_options(config.backend_options, config)
    server = front().server
    assert worker_urls(server, options) == ("http://configured:1",)
    server.replicas = ("http://127.0.0.1:8281", "http://127.0.0.1:8282")
    assert worker_urls(server, options) == ("http://127.0.0.1:8281", "http://127.0.0.1:8282")


async def test_without_workers_url_the_error_says_where_dynamo_lists_its_workers() -> None:
    async def not_found(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, json={"message": "Not Found", "type": "Not Found", "code": 404})

    http = httpx.AsyncClient(transport=httpx.MockTransport(not_found))
    server = Server(
        base_url="http://frontend:8200", admin_url="http://frontend:8200", data_client=http, admin_client=http
    )
    with pytest.raises(FrontError, match=r"DYN_RL_PORT .* set front.workers_url"):
        await DynamoFront(server, FrontConfig(kind="dynamo")).replicas()


async def test_admin_behind_a_dynamo_front_reaches_the_workers_it_lists(tiny_models) -> None:
    from backends_core import Client, FleetPolicy
    from backends_dynamo_testing import DynamoEmulator
    from backends_testkit.engine import ReferenceEngine

    workers = ("http://w0:8081", "http://w1:8081")
    async with ReferenceEngine(tiny_models.dense) as engine:
        emulator = DynamoEmulator(engine, worker_urls=workers)
        config = ClientConfig(
            backend="dynamo",
            base_url=FRONTEND,
            model="tiny-qwen3",
            front=FrontConfig(kind="dynamo", workers_url="http://frontend:8201"),
            fleet=FleetPolicy(refresh_interval=None),
        )
        async with Client(config, transport=emulator.transport()) as client:
            assert await client.admin.pause(mode="keep") == [True]
            assert engine.state().paused
            await client.admin.resume()
            members = [(m.url, m.state) for m in client.fleet.members()]
    assert members == [(workers[0], "serving"), (workers[1], "serving")]
    engine_calls = [url for method, url in emulator.requests if "/engine/pause_generation" in url]
    assert sorted(engine_calls) == [f"{w}/engine/pause_generation" for w in workers]
    assert ("GET", "http://frontend:8201/v1/rl/workers") in emulator.requests


def test_a_worker_listed_unavailable_is_an_unhealthy_replica_when_known_and_left_out_otherwise() -> None:
    gone = {"instance_id": 7, "error": "Unavailable: TCP connection to 127.0.0.1:35581 failed", "routes": []}
    alive = {"instance_id": 8, "system_url": "http://127.0.0.1:8282"}
    raw = {"workers": [gone, alive]}
    known = rl_workers(raw, front(), {"7": "http://127.0.0.1:8281"})
    assert [(r.url, r.id, r.healthy) for r in known] == [
        ("http://127.0.0.1:8281", "7", False),
        ("http://127.0.0.1:8282", "8", True),
    ]
    assert [r.url for r in rl_workers(raw, front())] == ["http://127.0.0.1:8282"]
