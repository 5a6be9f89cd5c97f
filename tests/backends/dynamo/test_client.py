"""The ``dynamo`` backend end to end through ``Client`` over scripted deployments answering with real captured
bodies: what is sent (bodies, headers, fan-out, workers), what is refused before sending, and the admin
family (route detection, errors in 200 bodies, pause before updates, LoRA reloads, client-side state)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import pytest
import pytest_asyncio

from backends_core import (
    AdminError,
    Client,
    ClientConfig,
    ConfigError,
    DistributedGroup,
    InvalidRequestError,
    LoraAdapter,
    RetryPolicy,
    SamplingParams,
    ServerRefusedError,
    ServerStatusError,
    UnsupportedOperationError,
)
from backends_dynamo.admin import REQUEST_ID_HEADER, dynamo_request_id, generate_instances, wake_probe
from backends_dynamo_testing import WORKER_URL, DynamoEmulator
from backends_testkit.engine import ReferenceEngine
from backends_testkit.tinymodel import TinyModels

from ._captures import FIXTURES, capture, sse_text
from ._fake import FRONTEND, WORKERS, Deployment

W1, W2 = WORKERS


def vllm(name: str) -> dict[str, Any]:
    return capture(name, "dynamo-vllm")


ANSWER = vllm("chat_token_data_engine_data")["response"]
PROMPT = ANSWER["nvext"]["engine_data"]["prompt_token_ids"]


def echo_id(body: dict[str, Any], prefix: str = "chatcmpl") -> Any:
    """An answer whose id carries the request's x-dynamo-request-id, as the real frontend's does."""

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={**body, "id": f"{prefix}-{request.headers[REQUEST_ID_HEADER]}"})

    return answer


def config(**more: Any) -> ClientConfig:
    """A client config; the scripted deployments answer no ``/v1/models``, so the length check is off unless a
    test turns it on (``test_overlong_prompts_are_refused_before_sending``)."""
    options = {"check_prompt_length": False, **more.pop("backend_options", {"worker_urls": list(WORKERS)})}
    return ClientConfig(backend="dynamo", base_url=FRONTEND, model="tiny-qwen3", backend_options=options, **more)


@pytest_asyncio.fixture
async def deployment() -> AsyncIterator[Deployment]:
    yield Deployment()


def client(deployment: Deployment, **more: Any) -> Client:
    return Client(config(**more), transport=deployment.transport())


# -- generation ----------------------------------------------------------------------------------------------


async def test_generation_sends_token_in_chat_with_a_request_uuid(deployment: Deployment) -> None:
    deployment.call(FRONTEND, "POST", "/v1/chat/completions", echo_id(ANSWER))
    async with client(deployment) as c:
        result = await c.generate(
            prompt_ids=PROMPT,
            sampling=SamplingParams(max_tokens=8, seed=7, temperature=1.0),
            request_id="rollout-3",
            cache_salt="step-2",
            priority=4,
        )
    (sent,) = deployment.sent
    assert sent.path == "/v1/chat/completions"
    assert (
        sent.headers[REQUEST_ID_HEADER]
        == dynamo_request_id("rollout-3")
        == str(uuid.UUID(sent.headers[REQUEST_ID_HEADER]))
    )
    assert sent.body["nvext"]["token_data"] == PROMPT and sent.body["model"] == "tiny-qwen3"
    assert sent.body["nvext"]["cache_salt"] == "step-2" and sent.body["nvext"]["agent_hints"] == {"priority": 4}
    assert sent.body["seed"] == 7 and sent.body["max_completion_tokens"] == 8
    assert list(result.completion_ids) == ANSWER["nvext"]["engine_data"]["completion_token_ids"]
    assert result.request_id == f"chatcmpl-{sent.headers[REQUEST_ID_HEADER]}"
    assert result.weight_version is None  # nothing set by this client yet


async def test_a_caller_uuid_is_sent_as_it_is(deployment: Deployment) -> None:
    deployment.call(FRONTEND, "POST", "/v1/completions", echo_id(vllm("completions_token_prompt_greedy")["response"]))
    rid = str(uuid.uuid4())
    prompt = vllm("completions_token_prompt_greedy")["response"]["nvext"]["engine_data"]["prompt_token_ids"]
    async with client(deployment, backend_options={"transport": "completions", "worker_urls": list(WORKERS)}) as c:
        await c.generate(prompt_ids=prompt, sampling=SamplingParams(max_tokens=8), request_id=rid)
    assert deployment.sent[0].headers[REQUEST_ID_HEADER] == rid and deployment.sent[0].path == "/v1/completions"
    assert deployment.sent[0].body["prompt"] == prompt


async def test_n_fans_out_into_single_sample_requests(deployment: Deployment) -> None:
    deployment.call(FRONTEND, "POST", "/v1/chat/completions", echo_id(ANSWER))
    async with client(deployment) as c:
        results = await c.generate_samples(prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=8, n=3, seed=10))
    assert len(results) == 3
    bodies = [s.body for s in deployment.sent]
    assert sorted(b["seed"] for b in bodies) == [10, 11, 12] and all(b["n"] == 1 for b in bodies)
    assert len({s.headers[REQUEST_ID_HEADER] for s in deployment.sent}) == 3
    async with client(deployment, backend_options={"fan_out_n": False, "worker_urls": [W1]}) as c:
        with pytest.raises(InvalidRequestError, match="refuses n > 1 together with completion token ids"):
            await c.generate_samples(prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=16, n=2))
    assert len(deployment.sent) == 3


async def test_stream_option_folds_the_events(deployment: Deployment) -> None:
    text = sse_text("chat_stream_engine_data", "dynamo-vllm")
    deployment.add(FRONTEND, "POST", "/v1/chat/completions", text=text)
    prompt = vllm("chat_stream_engine_data")["sse_events"][-3]["nvext"]["engine_data"]["prompt_token_ids"]
    async with client(deployment, backend_options={"stream": True, "worker_urls": [W1]}) as c:
        result = await c.generate(prompt_ids=prompt, sampling=SamplingParams(max_tokens=6))
    assert deployment.sent[0].body["stream"] is True
    assert list(result.completion_ids) == [1582, 346, 176, 1340, 176, 1869]


async def test_limits_are_refused_before_sending(deployment: Deployment) -> None:
    async with client(deployment) as c:
        with pytest.raises(InvalidRequestError, match=r"33 stop_token_ids: Dynamo 1\.6\.1 accepts at most 32"):
            await c.generate(prompt_ids=[1, 2], sampling=SamplingParams(max_tokens=16, stop_token_ids=list(range(33))))
        with pytest.raises(InvalidRequestError, match="u32"):
            await c.generate(prompt_ids=[1, 2**32], sampling=SamplingParams(max_tokens=16))
        with pytest.raises(InvalidRequestError, match="i32"):
            await c.generate(prompt_ids=[1, 2], priority=2**31, sampling=SamplingParams(max_tokens=16))
        image = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {}}]}]
        with pytest.raises(InvalidRequestError, match=r"messages\[0\]\.content\[1\]\.image_url\.url needs an"):
            await c.generate(messages=image, sampling=SamplingParams(max_tokens=16))
        png = {"type": "image", "image": np.zeros((4, 4, 3), np.uint8)}
        with pytest.raises(UnsupportedOperationError, match=r"images \(messages\[0\]\.content\[1\]\).*Dynamo 1\.6\.1"):
            await c.generate(
                messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, png]}],
                sampling=SamplingParams(max_tokens=16),
            )
    assert deployment.sent == []


async def test_overlong_prompts_are_refused_before_sending(deployment: Deployment) -> None:
    """The frontend answers 400 ``context_length`` when prompt + max_tokens exceeds the model's context_window
    (2048 on the vLLM worker): the client refuses that first, reading the window once per frontend and model."""
    models = vllm("frontend_models_after_lora")["response"]  # tiny-qwen3 and tiny-lora, context_window 2048
    deployment.add(FRONTEND, "GET", "/v1/models", json_body=models)
    deployment.call(FRONTEND, "POST", "/v1/chat/completions", echo_id(ANSWER))
    checked = {"worker_urls": list(WORKERS), "check_prompt_length": True}
    async with client(deployment, backend_options=checked) as c:
        with pytest.raises(
            InvalidRequestError, match=r"2044 tokens \+ max_tokens 5 = 2049 exceeds the context_window 2048"
        ):
            await c.generate(prompt_ids=[5] * 2044, sampling=SamplingParams(max_tokens=5))
        with pytest.raises(InvalidRequestError, match="context_window 2048 of 'tiny-lora'"):
            await c.generate(prompt_ids=[5] * 2048, lora="tiny-lora", sampling=SamplingParams(max_tokens=1))
        await c.generate(prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=8))
        with pytest.raises(
            InvalidRequestError, match=r"'other' is not served by .* \(it serves \['tiny-lora', 'tiny-qwen3'\]\)"
        ):
            await c.generate(prompt_ids=PROMPT, model="other", sampling=SamplingParams(max_tokens=16))
    paths = [(s.method, s.path) for s in deployment.sent]
    # one read, one more for the unknown model (an adapter may have been loaded since), one generation
    assert paths == [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")]


async def test_a_window_of_zero_is_unknown_and_checks_nothing(deployment: Deployment) -> None:
    models = capture("get_v1_models")["response"]  # the mocker: context_window 0
    assert models["data"][0]["context_window"] == 0
    deployment.add(FRONTEND, "GET", "/v1/models", json_body=models)
    deployment.call(FRONTEND, "POST", "/v1/chat/completions", echo_id(ANSWER))
    async with client(deployment, backend_options={"worker_urls": list(WORKERS), "check_prompt_length": True}) as c:
        await c.generate(prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=4000))
        await c.generate(prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=4000))
    assert [s.path for s in deployment.sent].count("/v1/models") == 1


@pytest.mark.parametrize(
    ("name", "kind", "hint"),
    [
        ("chat_nvext_unknown_field", "dynamo", "deny-unknown"),
        ("chat_bad_model", "dynamo", "GET /v1/models lists what is"),
        ("request_while_sleeping", "dynamo-vllm", "asleep"),
    ],
)
async def test_refusals_carry_the_servers_words_and_a_hint(
    deployment: Deployment, name: str, kind: str, hint: str
) -> None:
    cap = capture(name, kind)
    deployment.add(FRONTEND, "POST", "/v1/chat/completions", json_body=cap["response"], status=cap["status"])
    async with client(deployment) as c:
        with pytest.raises(ServerStatusError, match=hint) as info:
            await c.generate(prompt_ids=[1, 2], sampling=SamplingParams(max_tokens=16))
    assert info.value.status_code == cap["status"] and info.value.body == cap["response"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"transport": "grpc"}, "expected one of ['chat', 'completions'], got 'grpc' @ $.backend_options.transport"),
        ({"trasnport": "chat"}, "unknown option @ $.backend_options.trasnport"),
        ({"worker_urls": "http://w"}, "expected a list, got 'http://w' @ $.backend_options.worker_urls"),
        ({"worker_urls": []}, "needs a non-empty list of worker system URLs @ $.backend_options.worker_urls"),
        ({"worker_urls": ["w1:8081"]}, "expected an http(s) URL, got 'w1:8081' @ $.backend_options.worker_urls[0]"),
        ({"worker_urls": {"http://other:8000": [W1]}}, "'http://other:8000' is not one of base_url"),
        (
            {"extra_fields": ["engine_data"]},
            "expected one of ['worker_id', 'timing'], got 'engine_data' @ $.backend_options.extra_fields[0]",
        ),
        ({"stream": "yes"}, "expected a boolean, got 'yes' @ $.backend_options.stream"),
    ],
)
def test_bad_options_are_config_errors(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        Client(config(backend_options=options))
    assert message in str(info.value)


def test_a_worker_list_needs_a_single_frontend() -> None:
    with pytest.raises(ConfigError, match="give a mapping"):
        Client(
            ClientConfig(backend="dynamo", base_url=[FRONTEND, "http://f2:8000"], backend_options={"worker_urls": [W1]})
        )
    mapping = {FRONTEND: [W1], "http://f2:8000/": [W2]}
    Client(
        ClientConfig(backend="dynamo", base_url=[FRONTEND, "http://f2:8000"], backend_options={"worker_urls": mapping})
    )


# -- admin -------------------------------------------------------------------------------------------------------


def on_workers(deployment: Deployment, route: str, name: str, *, workers: tuple[str, ...] = WORKERS) -> None:
    cap = vllm(name)
    for w in workers:
        deployment.add(w, "POST", f"/engine/{route}", json_body=cap["response"], status=cap["status"])


async def test_pause_resume_flush_reach_every_worker(deployment: Deployment) -> None:
    on_workers(deployment, "pause_generation", "engine_pause_abort")
    on_workers(deployment, "resume_generation", "engine_resume_after_abort")
    on_workers(deployment, "flush_cache", "engine_flush_cache")
    async with client(deployment) as c:
        assert await c.admin.pause("abort", clear_cache=True) == [True]
        assert await c.admin.ready() == [False]  # paused by this client: not ready, nothing asked
        await c.admin.pause("keep", clear_cache=True)
        assert await c.admin.resume() == [True]
        assert await c.admin.flush_cache() == [True]
    for w in WORKERS:
        pauses = deployment.to(w, "/engine/pause_generation")
        assert [p.body for p in pauses] == [
            {"mode": "abort", "clear_cache": True},
            {"mode": "keep", "clear_cache": False},
        ]
        assert len(deployment.to(w, "/engine/flush_cache")) == 1
    assert deployment.to(FRONTEND) == []


async def test_an_error_status_in_a_200_body_is_a_failure(deployment: Deployment) -> None:
    on_workers(deployment, "pause_generation", "engine_pause_invalid_mode", workers=(W2,))
    async with client(deployment, backend_options={"worker_urls": [W2]}) as c:
        with pytest.raises(AdminError) as info:
            await c.admin.pause("wait")
    error = info.value.results[0].error
    assert isinstance(error, ServerRefusedError) and "Invalid mode" in str(error) and "w2.test" in str(error)


async def test_missing_routes_are_told_apart(deployment: Deployment) -> None:
    cap = vllm("engine_load_lora_without_enable_lora")
    deployment.add(W1, "POST", "/engine/load_lora", json_body=cap["response"], status=404)
    async with client(deployment, backend_options={"worker_urls": [W1]}) as c:
        with pytest.raises(AdminError) as info:
            await c.admin.load_lora(LoraAdapter(name="a", path="/a"))
    error = info.value.results[0].error
    assert isinstance(error, UnsupportedOperationError) and error.operation == "admin_load_lora"
    assert "/engine/load_lora (404)" in str(error) and "--enable-lora" in str(error)
    async with client(deployment, backend_options={}) as c:  # no worker URLs: admin goes to the frontend
        with pytest.raises(AdminError) as info:
            await c.admin.resume()
    error = info.value.results[0].error
    assert isinstance(error, ConfigError) and "answered like a Dynamo frontend" in str(error)
    assert "backend_options.worker_urls" in str(error)


async def test_updates_pause_first_only_where_needed_and_track_the_version(deployment: Deployment) -> None:
    refused, done = vllm("engine_update_weights_from_disk_unpaused"), vllm("engine_update_weights_from_disk_perturbed")
    deployment.add(W1, "POST", "/engine/update_weights_from_disk", json_body=refused["response"])
    deployment.add(W1, "POST", "/engine/update_weights_from_disk", json_body=done["response"])
    deployment.add(W2, "POST", "/engine/update_weights_from_disk", json_body=done["response"])  # already paused
    on_workers(deployment, "pause_generation", "engine_pause_for_update")
    on_workers(deployment, "resume_generation", "engine_resume_after_update")
    deployment.call(FRONTEND, "POST", "/v1/chat/completions", echo_id(ANSWER))
    async with client(deployment) as c:
        await c.admin.update_weights("/models/tiny-qwen3-perturbed", version="v2-perturbed")
        result = await c.generate(prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=8))
    assert result.weight_version == "v2-perturbed"
    assert [s.path.rsplit("/", 1)[1] for s in deployment.to(W1)] == [
        "update_weights_from_disk",
        "pause_generation",
        "update_weights_from_disk",
        "resume_generation",
    ]
    assert deployment.to(W1, "/engine/pause_generation")[0].body == {"mode": "wait", "clear_cache": False}
    assert [s.path for s in deployment.to(W2)] == ["/engine/update_weights_from_disk"]
    assert deployment.to(W2)[0].body == {"model_path": "/models/tiny-qwen3-perturbed", "weight_version": "v2-perturbed"}


async def test_lora_paths_become_uris_and_a_loaded_name_is_reloaded_only_on_replace(
    deployment: Deployment, tmp_path: Any
) -> None:
    again, loaded = vllm("engine_load_lora_again")["response"], vllm("engine_load_lora")["response"]
    deployment.add(W1, "POST", "/engine/load_lora", json_body=again)
    deployment.add(W1, "POST", "/engine/load_lora", json_body=again)
    deployment.add(W1, "POST", "/engine/load_lora", json_body=loaded)
    on_workers(deployment, "unload_lora", "engine_unload_lora", workers=(W1,))
    deployment.add(FRONTEND, "GET", "/v1/models", json_body=vllm("frontend_models_after_lora")["response"])
    ready = {**capture("get_v1_models_tiny-qwen3_ready")["response"], "model": "tiny-lora"}
    deployment.add(FRONTEND, "GET", "/v1/models/tiny-lora/ready", json_body=ready)
    on_workers(deployment, "flush_cache", "engine_flush_cache", workers=(W1,))  # after a swap, if the core asks
    adapter = LoraAdapter(name="tiny-lora", path=str(tmp_path / "lora"))
    async with client(deployment, backend_options={"worker_urls": [W1]}) as c:
        with pytest.raises(AdminError) as info:
            await c.admin.load_lora(adapter)
        assert isinstance(info.value.results[0].error, ServerRefusedError)
        assert "Dynamo kept the loaded adapter" in str(info.value)
        assert await c.admin.load_lora(LoraAdapter(name="tiny-lora", path="s3://bucket/lora", replace=True)) == [True]
    assert [s.path for s in deployment.to(FRONTEND)] == ["/v1/models", "/v1/models/tiny-lora/ready"]
    sent = [s for s in deployment.to(W1) if s.path != "/engine/flush_cache"]
    assert sent[0].body == {"lora_name": "tiny-lora", "source": {"uri": (tmp_path / "lora").as_uri()}}
    assert [s.path for s in sent[1:]] == ["/engine/load_lora", "/engine/unload_lora", "/engine/load_lora"]
    assert sent[1].body["source"] == {"uri": "s3://bucket/lora"}


async def test_unloading_an_unknown_adapter_is_refused(deployment: Deployment) -> None:
    on_workers(deployment, "unload_lora", "engine_unload_lora_again", workers=(W1,))
    async with client(deployment, backend_options={"worker_urls": [W1]}) as c:
        with pytest.raises(AdminError, match=r"not found\. Available LoRAs"):
            await c.admin.unload_lora("tiny-lora")


def frontend_state(deployment: Deployment) -> None:
    deployment.add(FRONTEND, "GET", "/metrics", text=(FIXTURES / "dynamo" / "get_metrics.txt").read_text())
    deployment.add(FRONTEND, "GET", "/v1/models", json_body=vllm("frontend_models_after_lora")["response"])


async def test_state_combines_frontend_workers_and_this_clients_knowledge(deployment: Deployment) -> None:
    frontend_state(deployment)
    on_workers(deployment, "get_weight_version", "engine_get_weight_version_after_update")
    on_workers(deployment, "control/sleep", "engine_control_sleep")
    async with client(deployment) as c:
        (state,) = await c.admin.state()
        assert (state.paused, state.sleeping, state.weight_version) == (None, None, "v2-perturbed")
        assert state.in_flight == 0 and state.loras == ("tiny-lora",)
        await c.admin.sleep(1)
        (state,) = await c.admin.state()
        assert state.sleeping is True
    assert deployment.to(W1, "/engine/control/sleep")[0].body == {"level": 1}


async def test_workers_that_disagree_on_the_version_are_reported(deployment: Deployment) -> None:
    frontend_state(deployment)
    on_workers(deployment, "get_weight_version", "engine_get_weight_version_after_update", workers=(W1,))
    on_workers(deployment, "get_weight_version", "engine_get_weight_version_initial", workers=(W2,))
    async with client(deployment) as c:
        with pytest.raises(AdminError, match=r"report different weight versions \['v2-perturbed', None\]"):
            await c.admin.state()


async def test_the_mocker_has_no_version_route_and_state_says_unknown(deployment: Deployment) -> None:
    frontend_state(deployment)  # workers answer 404 in their own shape: no RL routes
    async with client(deployment) as c:
        (state,) = await c.admin.state()
    assert state.weight_version is None


async def test_health_checks_frontend_and_each_worker_system_port(deployment: Deployment) -> None:
    deployment.add(FRONTEND, "GET", "/health", json_body=capture("get_health")["response"])
    deployment.add(W1, "GET", "/health", json_body=vllm("system_health_while_sleeping")["response"])
    deployment.add(W2, "GET", "/health", json_body=capture("system_get_health")["response"], status=503)
    async with client(deployment) as c:
        assert await c.admin.health() == [False]  # w2 is "notready"
    async with client(deployment, backend_options={"worker_urls": [W1]}) as c:
        assert await c.admin.health() == [True]


async def test_ready_and_wake_follow_the_frontend(deployment: Deployment) -> None:
    on_workers(deployment, "control/wake_up", "engine_control_wake_up", workers=(W1,))
    ready = capture("get_v1_models_tiny-qwen3_ready")["response"]
    health = capture("get_health")["response"]
    (instance,) = generate_instances(health, FRONTEND)
    deployment.add(
        FRONTEND,
        "GET",
        "/v1/models/tiny-qwen3/ready",
        json_body={"message": "Model not found", "type": "Not Found", "code": 404},
        status=404,
    )
    deployment.add(FRONTEND, "GET", "/v1/models/tiny-qwen3/ready", json_body=ready)
    deployment.add(FRONTEND, "GET", "/health", json_body=health)
    unavailable = {"message": "Service temporarily unavailable", "type": "Service Unavailable", "code": 503}
    deployment.add(FRONTEND, "POST", "/v1/completions", json_body=unavailable, status=503)
    deployment.add(FRONTEND, "POST", "/v1/completions", json_body=vllm("completions_token_prompt_greedy")["response"])
    async with client(deployment, backend_options={"worker_urls": [W1]}) as c:
        assert await c.admin.wake() == [True]  # polled the frontend until the model was back and routed to
        assert await c.admin.ready() == [True]
    assert len(deployment.to(FRONTEND, "/v1/models/tiny-qwen3/ready")) == 3
    probes = deployment.to(FRONTEND, "/v1/completions")
    assert [p.body for p in probes] == [wake_probe("tiny-qwen3", instance)] * 2


async def test_wake_returns_once_the_frontend_routes_to_the_woken_worker(tiny_models: TinyModels) -> None:
    # the emulated frontend says ready and lists the worker at once, but answers 503 for a while (wake_lag)
    emulator = DynamoEmulator(ReferenceEngine(tiny_models.dense), wake_lag=0.3)
    config = ClientConfig(
        backend="dynamo",
        base_url=FRONTEND,
        model="tiny-qwen3",
        retry=RetryPolicy(attempts=1),
        backend_options={"worker_urls": [WORKER_URL]},
    )
    try:
        async with Client(config, transport=emulator.transport()) as c:
            await c.admin.sleep(1)
            await c.admin.wake()
            result = await c.generate(prompt_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=2))
    finally:
        await emulator.aclose()
    assert len(result.completion_ids) >= 1


async def test_abort_sends_the_bare_uuid_to_every_worker(deployment: Deployment) -> None:
    on_workers(deployment, "abort_request", "engine_abort_request_inflight_uuid")
    async with client(deployment) as c:
        assert await c.admin.abort(["rollout-9"]) == [-1]
        assert await c.admin.abort() == [0]  # nothing of this client's in flight: nothing to send
    for w in WORKERS:
        assert [s.body for s in deployment.to(w)] == [{"request_id": dynamo_request_id("rollout-9")}]


async def test_abort_by_id_is_refused_when_the_frontend_ignores_request_ids(deployment: Deployment) -> None:
    deployment.add(FRONTEND, "POST", "/v1/chat/completions", json_body=ANSWER)  # a fixed id, not ours
    async with client(deployment) as c:
        await c.generate(prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=8))
        with pytest.raises(AdminError, match="does not take request ids from x-dynamo-request-id"):
            await c.admin.abort(["rollout-9"])


async def test_distributed_transfer_is_forwarded_and_its_refusal_surfaces(deployment: Deployment) -> None:
    on_workers(deployment, "init_weights_update_group", "engine_init_weights_update_group", workers=(W1,))
    group = DistributedGroup(master_address="127.0.0.1", master_port=29555, world_size=2, rank_offset=1)
    async with client(deployment, backend_options={"worker_urls": [W1]}) as c:
        with pytest.raises(AdminError, match="'CPUWorker' object has no attribute 'init_broadcaster'"):
            await c.admin.init_weight_transfer(group)
    assert deployment.to(W1)[0].body == {
        "master_address": "127.0.0.1",
        "master_port": 29555,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "weight_sync",
        "backend": "nccl",
    }
    async with client(deployment) as c:
        with pytest.raises(AdminError, match="2 workers but a DistributedGroup gives one rank_offset per server"):
            await c.admin.init_weight_transfer(group)


async def test_destroy_weight_transfer_reaches_every_worker_with_the_group_name(deployment: Deployment) -> None:
    # the handler's own success answer (dynamo/vllm/handlers.py destroy_weights_update_group)
    for w in WORKERS:
        deployment.add(
            w,
            "POST",
            "/engine/destroy_weights_update_group",
            json_body={"status": "ok", "message": "Weight update group destroyed"},
        )
    async with client(deployment) as c:
        assert await c.admin.destroy_weight_transfer("trainer-7") == [True]
    for w in WORKERS:
        sent = deployment.to(w, "/engine/destroy_weights_update_group")
        assert [s.body for s in sent] == [{"group_name": "trainer-7"}]
    assert deployment.to(FRONTEND) == []


async def test_destroy_weight_transfer_refused_by_one_worker_names_it_and_the_route(deployment: Deployment) -> None:
    deployment.add(
        W1, "POST", "/engine/destroy_weights_update_group", json_body={"status": "ok", "message": "destroyed"}
    )
    on_workers(deployment, "destroy_weights_update_group", "engine_destroy_weights_update_group", workers=(W2,))
    async with client(deployment) as c:
        with pytest.raises(AdminError) as info:
            await c.admin.destroy_weight_transfer()
    assert info.value.operation == "admin_destroy_weight_transfer"
    workers = info.value.results[0].error  # every worker's outcome, and which one left the group
    assert isinstance(workers, AdminError) and [o.server for o in workers.results] == [W1, W2]
    assert workers.results[0].ok and f"{W1} left group 'weight_sync', {W2} did not" in str(workers)
    error = workers.results[1].error
    assert isinstance(error, ServerRefusedError)
    assert error.url == f"{W2}/engine/destroy_weights_update_group"
    assert "'CPUWorker' object has no attribute 'destroy_broadcaster'" in str(error)
    assert [s.body for s in deployment.to(W2)] == [{"group_name": "weight_sync"}]  # sent once: never retried


async def test_destroy_weight_transfer_without_the_rl_routes_is_unsupported(deployment: Deployment) -> None:
    async with client(deployment, backend_options={"worker_urls": [W1]}) as c:  # W1 answers a worker 404
        with pytest.raises(AdminError) as info:
            await c.admin.destroy_weight_transfer()
    error = info.value.results[0].error
    assert isinstance(error, UnsupportedOperationError)
    assert error.operation == "admin_destroy_weight_transfer" and "destroy_weights_update_group" in str(error)


async def test_destroy_weight_transfer_on_the_emulated_cpu_worker_is_refused(tiny_models: TinyModels) -> None:
    emulator = DynamoEmulator(ReferenceEngine(tiny_models.dense))
    config = ClientConfig(
        backend="dynamo", base_url=FRONTEND, model="tiny-qwen3", backend_options={"worker_urls": [WORKER_URL]}
    )
    try:
        async with Client(config, transport=emulator.transport()) as c:
            with pytest.raises(AdminError, match="no attribute 'destroy_broadcaster'") as info:
                await c.admin.destroy_weight_transfer("g")
    finally:
        await emulator.aclose()
    assert isinstance(info.value.results[0].error, ServerRefusedError)
    assert f"{WORKER_URL}/engine/destroy_weights_update_group" in str(info.value)
