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
