"""One frontend, two workers, and an admin operation that only some of them carry out: the error names every
worker with its outcome (successes included) and states what the deployment now serves; the client records no
weight version it does not know every worker serves."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from backends_core import (
    AdminError,
    Client,
    ClientConfig,
    LoraAdapter,
    NetworkError,
    SamplingParams,
    ServerRefusedError,
)
from backends_core.types import TensorSpec
from backends_dynamo.admin import tracker

from ._captures import capture
from ._fake import FRONTEND, WORKERS, Deployment
from .test_client import ANSWER, PROMPT, echo_id

W1, W2 = WORKERS
CHECKPOINT = "/ckpt/step-7"
VERSION_OK = {"status": "ok", "version": "step-7", "version_declared": True}
REFUSED_UPDATE = {"status": "error", "message": "Failed to update weights: shape mismatch for lm_head.weight"}


def vllm(name: str) -> Any:
    return capture(name, "dynamo-vllm")["response"]


@pytest.fixture
def deployment() -> Deployment:
    return Deployment()


def client(deployment: Deployment) -> Client:
    options = {"worker_urls": list(WORKERS), "check_prompt_length": False}  # the scripted frontend lists no models
    config = ClientConfig(backend="dynamo", base_url=FRONTEND, model="tiny-qwen3", backend_options=options)
    return Client(config, transport=deployment.transport())


def inner(info: pytest.ExceptionInfo[AdminError]) -> AdminError:
    """The frontend's outcome inside the fleet's AdminError: the per-worker AdminError."""
    (outcome,) = info.value.results
    assert outcome.server == FRONTEND
    assert isinstance(outcome.error, AdminError), repr(outcome.error)
    return outcome.error


def by_worker(error: AdminError) -> dict[str, Any]:
    return {o.server: o for o in error.results}


def paused_and_resumed(deployment: Deployment) -> None:
    for w in WORKERS:
        deployment.add(w, "POST", "/engine/pause_generation", json_body=vllm("engine_pause_for_update"))
        deployment.add(w, "POST", "/engine/resume_generation", json_body=vllm("engine_resume_after_update"))


async def test_update_weights_switched_on_one_worker_only_names_both_and_records_no_version(
    deployment: Deployment,
) -> None:
    earlier = {"status": "ok", "version": "step-6", "version_declared": True}
    deployment.add(W1, "POST", "/engine/update_weights_from_disk", json_body=earlier)
    deployment.add(W1, "POST", "/engine/update_weights_from_disk", json_body=VERSION_OK)
    deployment.add(W2, "POST", "/engine/update_weights_from_disk", json_body=earlier)
    deployment.add(W2, "POST", "/engine/update_weights_from_disk", json_body=REFUSED_UPDATE)
    paused_and_resumed(deployment)
    deployment.call(FRONTEND, "POST", "/v1/chat/completions", echo_id(ANSWER))
    async with client(deployment) as c:
        await c.admin.update_weights("/ckpt/step-6", version="step-6")
        assert c.weight_version == "step-6"
        with pytest.raises(AdminError) as info:
            await c.admin.update_weights(CHECKPOINT, version="step-7")
        # the client keeps no version: W1 serves step-7, W2 step-6
        assert c.weight_version == "step-6"  # the fleet's version moves only on success (cache salt)
        assert tracker(c.servers[0]).weight_version is None
        result = await c.generate(prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=8))
    assert result.weight_version is None  # neither step-6 nor step-7 can be promised for this answer
    error = inner(info)
    assert error.operation == f"admin_update_weights on the workers behind {FRONTEND}"
    outcomes = by_worker(error)
    assert set(outcomes) == {W1, W2}
    assert outcomes[W1].ok and outcomes[W1].value is not None
    assert isinstance(outcomes[W2].error, ServerRefusedError) and "shape mismatch" in str(outcomes[W2].error)
    message = str(info.value)
    assert f"mixed weights behind {FRONTEND}: {W1} switched to {CHECKPOINT} (version 'step-7'), {W2} did not" in (
        message
    )
    assert "retry update_weights or roll back to the previous checkpoint" in message
    assert W1 in str(error) and W2 in str(error)


async def test_update_weights_that_no_worker_took_says_the_old_weights_are_served(deployment: Deployment) -> None:
    for w in WORKERS:
        deployment.add(w, "POST", "/engine/update_weights_from_disk", json_body=REFUSED_UPDATE)
    async with client(deployment) as c:
        with pytest.raises(AdminError) as info:
            await c.admin.update_weights(CHECKPOINT, version="step-7")
        assert tracker(c.servers[0]).weight_version is None
    error = inner(info)
    assert all(not o.ok for o in error.results) and {o.server for o in error.results} == set(WORKERS)
    assert f"no worker behind {FRONTEND} switched to {CHECKPOINT}" in str(error)


async def test_update_weights_applied_but_left_paused_says_so(deployment: Deployment) -> None:
    unpaused = vllm("engine_update_weights_from_disk_unpaused")
    for w in WORKERS:
        deployment.add(w, "POST", "/engine/update_weights_from_disk", json_body=unpaused)
        deployment.add(w, "POST", "/engine/update_weights_from_disk", json_body=VERSION_OK)
        deployment.add(w, "POST", "/engine/pause_generation", json_body=vllm("engine_pause_for_update"))
    deployment.add(W1, "POST", "/engine/resume_generation", json_body=vllm("engine_resume_after_update"))
    deployment.add(W2, "POST", "/engine/resume_generation", json_body={"status": "error", "message": "engine busy"})
    async with client(deployment) as c:
        with pytest.raises(AdminError) as info:
            await c.admin.update_weights(CHECKPOINT, version="step-7")
    error = inner(info)
    assert by_worker(error)[W1].ok and not by_worker(error)[W2].ok
    assert f"every worker behind {FRONTEND} switched to {CHECKPOINT} (version 'step-7')" in str(error)
    assert f"{W2} stays paused (its resume failed): call resume" in str(error)


async def test_distributed_update_on_one_worker_only_names_both(deployment: Deployment) -> None:
    deployment.add(W1, "POST", "/engine/update_weights_from_distributed", json_body=VERSION_OK)
    cpu = vllm("engine_update_weights_from_distributed_default_rpc")
    deployment.add(W2, "POST", "/engine/update_weights_from_distributed", json_body=cpu)
    tensors = [TensorSpec(name="lm_head.weight", dtype="float32", shape=(8, 4))]
    async with client(deployment) as c:
        with pytest.raises(AdminError) as info:
            await c.admin.update_weights_distributed("g7", tensors, version="step-7")
        assert tracker(c.servers[0]).weight_version is None and c.weight_version is None
    error = inner(info)
    assert error.operation == f"admin_update_weights_distributed on the workers behind {FRONTEND}"
    assert by_worker(error)[W1].ok and isinstance(by_worker(error)[W2].error, ServerRefusedError)
    assert f"{W1} switched to the weights broadcast in group 'g7' (version 'step-7'), {W2} did not" in str(error)


async def test_load_lora_on_one_worker_only_names_both_and_how_to_recover(deployment: Deployment) -> None:
    deployment.add(W1, "POST", "/engine/load_lora", json_body=vllm("engine_load_lora"))
    deployment.add(W2, "POST", "/engine/load_lora", json_body=vllm("engine_load_lora_bad_path"))
    async with client(deployment) as c:
        with pytest.raises(AdminError) as info:
            await c.admin.load_lora(LoraAdapter(name="tiny-lora", path="/adapters/tiny"))
    error = inner(info)
    assert error.operation == f"admin_load_lora on the workers behind {FRONTEND}"
    assert by_worker(error)[W1].ok and "Local LoRA not found" in str(by_worker(error)[W2].error)
    assert f"adapter 'tiny-lora' is loaded on {W1} only" in str(error)
    assert "load_lora again with replace=True, or unload_lora('tiny-lora')" in str(error)
    assert deployment.to(FRONTEND) == []  # no wait for the frontend after a failure


async def test_unload_lora_on_one_worker_only_names_both(deployment: Deployment) -> None:
    deployment.add(W1, "POST", "/engine/unload_lora", json_body=vllm("engine_unload_lora"))
    busy = {
        "status": "error",
        "message": "Cannot unload LoRA 'tiny-lora' while generation is paused with active requests; resume "
        "generation or abort the requests first",
        "lora_name": "tiny-lora",
    }
    deployment.add(W2, "POST", "/engine/unload_lora", json_body=busy)
    async with client(deployment) as c:
        with pytest.raises(AdminError) as info:
            await c.admin.unload_lora("tiny-lora")
    error = inner(info)
    assert by_worker(error)[W1].ok and "paused with active requests" in str(by_worker(error)[W2].error)
    assert f"adapter 'tiny-lora' is unloaded from {W1} but still loaded on {W2}" in str(error)
    assert "retry unload_lora" in str(error)


async def test_pause_refused_by_one_worker_resumes_the_other_and_says_nothing_is_paused(
    deployment: Deployment,
) -> None:
    deployment.add(W1, "POST", "/engine/pause_generation", json_body=vllm("engine_pause_wait"))
    deployment.add(W1, "POST", "/engine/resume_generation", json_body=vllm("engine_resume_after_wait"))
    deployment.add(W2, "POST", "/engine/pause_generation", json_body=vllm("engine_pause_invalid_mode"))
    async with client(deployment) as c:
        with pytest.raises(AdminError) as info:
            await c.admin.pause("wait")
        assert tracker(c.servers[0]).paused is None  # never paused by this client
    error = inner(info)
    assert by_worker(error)[W1].ok and "Invalid mode" in str(by_worker(error)[W2].error)
    assert f"{W1} paused, {W2} did not; {W1} was resumed again, so nothing behind {FRONTEND} is paused" in str(error)
    assert [s.path for s in deployment.to(W1)] == ["/engine/pause_generation", "/engine/resume_generation"]


async def test_resume_refused_by_one_worker_says_which_stays_paused(deployment: Deployment) -> None:
    for w in WORKERS:
        deployment.add(w, "POST", "/engine/pause_generation", json_body=vllm("engine_pause_wait"))
    deployment.add(W1, "POST", "/engine/resume_generation", json_body=vllm("engine_resume_after_wait"))
    deployment.add(W2, "POST", "/engine/resume_generation", json_body={"status": "error", "message": "engine busy"})
    async with client(deployment) as c:
        await c.admin.pause("wait")
        with pytest.raises(AdminError) as info:
            await c.admin.resume()
        assert tracker(c.servers[0]).paused is None  # partly paused: not known as either
    error = inner(info)
    assert f"{W1} resumed, {W2} stays paused; retry resume" in str(error)


async def test_a_single_worker_keeps_its_own_error(deployment: Deployment) -> None:
    deployment.add(W1, "POST", "/engine/update_weights_from_disk", json_body=REFUSED_UPDATE)
    options = {"worker_urls": [W1]}
    config = ClientConfig(backend="dynamo", base_url=FRONTEND, model="tiny-qwen3", backend_options=options)
    async with Client(config, transport=deployment.transport()) as c:
        with pytest.raises(AdminError) as info:
            await c.admin.update_weights(CHECKPOINT, version="step-7")
    assert isinstance(info.value.results[0].error, ServerRefusedError)  # nothing partial to report


async def test_an_unreachable_single_worker_keeps_its_network_error(deployment: Deployment) -> None:
    """A pause that never reached the only worker changed nothing: its error as it is, and no resume is sent."""

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    deployment.call(W1, "POST", "/engine/pause_generation", refuse)
    options = {"worker_urls": [W1]}
    config = ClientConfig(backend="dynamo", base_url=FRONTEND, model="tiny-qwen3", backend_options=options)
    async with Client(config, transport=deployment.transport()) as c:
        with pytest.raises(AdminError) as info:
            await c.admin.pause("wait")
    assert isinstance(info.value.results[0].error, NetworkError)
    assert deployment.to(W1, "/engine/resume_generation") == []


async def test_a_pause_whose_answer_was_lost_is_undone_too(deployment: Deployment) -> None:
    """A worker whose pause answer was lost may have paused: it is resumed with the ones that did."""

    def lost(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadError("connection reset", request=request)

    deployment.add(W1, "POST", "/engine/pause_generation", json_body=vllm("engine_pause_wait"))
    deployment.call(W2, "POST", "/engine/pause_generation", lost)
    for w in WORKERS:
        deployment.add(w, "POST", "/engine/resume_generation", json_body=vllm("engine_resume_after_wait"))
    async with client(deployment) as c:
        with pytest.raises(AdminError) as info:
            await c.admin.pause("wait")
    error = inner(info)
    assert isinstance(by_worker(error)[W2].error, NetworkError)
    assert f"{W1} and {W2} were resumed again, so nothing behind {FRONTEND} is paused" in str(error)
    assert all(len(deployment.to(w, "/engine/resume_generation")) == 1 for w in WORKERS)
