"""``load_lora`` returns once the frontend routes to the adapter and ``unload_lora`` once it no longer lists it:
Dynamo's workers publish and withdraw an adapter's model card in discovery, and the frontend picks the change
up later (seen on a loaded machine: ``/v1/models`` without the adapter right after ``load_lora``)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from backends_core import AdminError, AdminPolicy, Client, ClientConfig, LoraAdapter, RequestTimeout

from ._captures import capture
from ._fake import FRONTEND, WORKERS, Deployment

W1, W2 = WORKERS
NAME = "tiny-lora"
BASE = "tiny-qwen3"


def vllm(name: str) -> Any:
    return capture(name, "dynamo-vllm")["response"]


def models(*names: str) -> dict[str, Any]:
    entry = vllm("frontend_models_after_lora")["data"][0]
    return {"object": "list", "data": [{**entry, "id": n} for n in names]}


def ready(name: str) -> dict[str, Any]:
    body: dict[str, Any] = capture("get_v1_models_tiny-qwen3_ready")["response"]
    return {**body, "model": name}


@pytest.fixture
def deployment() -> Deployment:
    return Deployment()


def client(deployment: Deployment, *, deadline: float | None = None) -> Client:
    config = ClientConfig(
        backend="dynamo",
        base_url=FRONTEND,
        model=BASE,
        backend_options={"worker_urls": list(WORKERS)},
        admin=AdminPolicy(deadlines={} if deadline is None else {"load_lora": deadline, "unload_lora": deadline}),
    )
    return Client(config, transport=deployment.transport())


def loads_everywhere(deployment: Deployment) -> None:
    for w in WORKERS:
        deployment.add(w, "POST", "/engine/load_lora", json_body=vllm("engine_load_lora"))


async def test_load_lora_returns_once_the_frontend_lists_and_routes_to_the_adapter(deployment: Deployment) -> None:
    loads_everywhere(deployment)
    for _ in range(3):  # the frontend has not picked the adapter's card up yet
        deployment.add(FRONTEND, "GET", "/v1/models", json_body=models(BASE))
    deployment.add(FRONTEND, "GET", "/v1/models", json_body=models(BASE, NAME))
    deployment.add(FRONTEND, "GET", f"/v1/models/{NAME}/ready", json_body=ready(NAME))
    async with client(deployment) as c:
        assert await c.admin.load_lora(LoraAdapter(name=NAME, path="/adapters/tiny")) == [True]
    assert len(deployment.to(FRONTEND, "/v1/models")) == 4
    assert len(deployment.to(FRONTEND, f"/v1/models/{NAME}/ready")) == 1
    # the workers loaded it before the frontend was asked
    first_poll = next(i for i, s in enumerate(deployment.sent) if s.path == "/v1/models")
    assert {s.host for s in deployment.sent[:first_poll]} == {"w1.test", "w2.test"}


async def test_load_lora_waits_for_the_frontend_to_call_the_adapter_ready(deployment: Deployment) -> None:
    loads_everywhere(deployment)
    deployment.add(FRONTEND, "GET", "/v1/models", json_body=models(BASE, NAME))
    deployment.add(FRONTEND, "GET", f"/v1/models/{NAME}/ready", json_body={**ready(NAME), "ready": False})
    deployment.add(FRONTEND, "GET", f"/v1/models/{NAME}/ready", json_body=ready(NAME))
    async with client(deployment) as c:
        assert await c.admin.load_lora(LoraAdapter(name=NAME, path="/adapters/tiny")) == [True]
    assert len(deployment.to(FRONTEND, f"/v1/models/{NAME}/ready")) == 2


async def test_load_lora_never_listed_is_a_timeout_naming_the_adapter_within_the_deadline(
    deployment: Deployment,
) -> None:
    loads_everywhere(deployment)
    deployment.add(FRONTEND, "GET", "/v1/models", json_body=models(BASE))
    started = time.monotonic()
    async with client(deployment, deadline=2.0) as c:
        with pytest.raises(AdminError) as info:
            await c.admin.load_lora(LoraAdapter(name=NAME, path="/adapters/tiny"))
    elapsed = time.monotonic() - started
    error = info.value.results[0].error
    assert isinstance(error, RequestTimeout), repr(error)
    text = str(error)
    assert f"load_lora of {NAME!r}" in text and "every worker loaded it" in text
    assert f"{FRONTEND}/v1/models did not list {NAME!r} within" in text
    assert "exceeded its" not in text  # ours, not the fleet's generic deadline error
    assert 1.0 < elapsed < 5.0  # the wait ends before the 2 s deadline, leaving a margin
    assert len(deployment.to(FRONTEND, "/v1/models")) >= 3  # polled, not slept through


async def test_unload_lora_returns_once_the_frontend_no_longer_lists_it(deployment: Deployment) -> None:
    for w in WORKERS:
        deployment.add(w, "POST", "/engine/unload_lora", json_body=vllm("engine_unload_lora"))
    deployment.add(FRONTEND, "GET", "/v1/models", json_body=models(BASE, NAME))
    deployment.add(FRONTEND, "GET", "/v1/models", json_body=models(BASE, NAME))
    deployment.add(FRONTEND, "GET", "/v1/models", json_body=models(BASE))
    async with client(deployment) as c:
        assert await c.admin.unload_lora(NAME) == [True]
    assert len(deployment.to(FRONTEND, "/v1/models")) == 3


async def test_unload_lora_still_listed_is_a_timeout_naming_the_adapter(deployment: Deployment) -> None:
    for w in WORKERS:
        deployment.add(w, "POST", "/engine/unload_lora", json_body=vllm("engine_unload_lora"))
    deployment.add(FRONTEND, "GET", "/v1/models", json_body=models(BASE, NAME))
    async with client(deployment, deadline=2.0) as c:
        with pytest.raises(AdminError) as info:
            await c.admin.unload_lora(NAME)
    error = info.value.results[0].error
    assert isinstance(error, RequestTimeout), repr(error)
    assert f"unload_lora of {NAME!r}" in str(error) and f"{FRONTEND}/v1/models still listed {NAME!r}" in str(error)


async def test_unload_lora_where_one_worker_never_had_it_is_done(deployment: Deployment) -> None:
    """The way out of a load that reached one worker only: unloading leaves no worker with the adapter."""
    deployment.add(W1, "POST", "/engine/unload_lora", json_body=vllm("engine_unload_lora"))
    deployment.add(W2, "POST", "/engine/unload_lora", json_body=vllm("engine_unload_lora_again"))
    deployment.add(FRONTEND, "GET", "/v1/models", json_body=models(BASE))
    async with client(deployment) as c:
        assert await c.admin.unload_lora(NAME) == [True]
