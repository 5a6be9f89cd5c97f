"""Every fault between client and server gives one exact, typed error; nothing that may have reached the
engine is sent twice; fleets resume every paused server. (The README's reliability table mirrors this file.)"""

from __future__ import annotations

import base64
import io
from typing import Any

import httpx
import numpy as np
import pytest

from backends_core import (
    AdminError,
    Client,
    ClientConfig,
    NetworkError,
    RequestTimeout,
    ResponseParseError,
    RetryPolicy,
    SamplingParams,
    ServerStatusError,
)
from backends_testkit.engine import ReferenceEngine
from backends_testkit.faults import Fault, FaultyTransport
from backends_vllm_testing import VllmEmulator

PROMPT = [1, 2, 3, 4, 5, 6]


def first_choice(mutate):
    def apply(body: dict[str, Any]) -> dict[str, Any]:
        mutate(body["choices"][0])
        return body

    return apply


def swap_logprob_id(choice: dict[str, Any]) -> None:
    choice["logprobs"]["content"][0]["token_id"] += 1


def drop_logprob(choice: dict[str, Any]) -> None:
    choice["logprobs"]["content"].pop()


def nan_logprob(choice: dict[str, Any]) -> None:
    choice["logprobs"]["content"][0]["logprob"] = float("nan")


def placeholder_logprob(choice: dict[str, Any]) -> None:
    choice["logprobs"]["content"][0]["logprob"] = -9999.0


def npy(array: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, array)
    return base64.b64encode(buf.getvalue()).decode()


def truncate_routing(choice: dict[str, Any]) -> None:
    raw = base64.b64decode(choice["routed_experts"])
    choice["routed_experts"] = base64.b64encode(raw[:-4]).decode()


def float_routing(choice: dict[str, Any]) -> None:
    choice["routed_experts"] = npy(np.zeros((3, 2, 2), np.float32))


ENGINE_ERROR = {
    "error": {
        "message": "This model's maximum context length is 2048 tokens.",
        "type": "BadRequestError",
        "param": "input_tokens",
        "code": 400,
    }
}

# (fault, expected error, message fragment, requests that reached the server)
GENERATE_FAULTS = [
    (Fault(kind="refuse"), NetworkError, "Connection refused", 0),
    (Fault(kind="reset_before_send"), NetworkError, "Connection reset", 0),
    (Fault(kind="reset_after_send"), NetworkError, "Connection reset", 1),
    (Fault(kind="read_timeout"), RequestTimeout, "timed out", 1),
    (Fault(kind="status", status=500), ServerStatusError, "server answered 500", 1),
    (Fault(kind="status", status=500, body={"error": {"message": "engine dead"}}), ServerStatusError, "engine dead", 1),
    (Fault(kind="status", status=400, body=ENGINE_ERROR), ServerStatusError, "maximum context length", 1),
    (Fault(kind="truncated_json"), ResponseParseError, "body is not JSON", 1),
    (
        Fault(kind="mutate", mutate=lambda body: {"unexpected": True}),
        ResponseParseError,
        "required field missing @ $.request_id",
        1,
    ),
    (Fault(kind="mutate", mutate=first_choice(swap_logprob_id)), ResponseParseError, "logprob entry is for token", 1),
    (Fault(kind="mutate", mutate=first_choice(drop_logprob)), ResponseParseError, "logprob entries for", 1),
    (Fault(kind="mutate", mutate=first_choice(nan_logprob)), ResponseParseError, "not a finite log-probability", 1),
    (Fault(kind="mutate", mutate=first_choice(placeholder_logprob)), ResponseParseError, "placeholder is -9999", 1),
]


@pytest.fixture
async def dense_engine(tiny_models):
    engine = ReferenceEngine(tiny_models.dense)
    yield engine
    await engine.aclose()


@pytest.mark.parametrize(
    ("fault", "error", "fragment", "reached"),
    GENERATE_FAULTS,
    ids=[f"{f.kind}-{f.status}" if f.kind == "status" else f.kind for f, *_ in GENERATE_FAULTS],
)
async def test_generate_faults(dense_engine, tiny_models, fault, error, fragment, reached) -> None:
    emulator = VllmEmulator(dense_engine)
    faulty = FaultyTransport(emulator.handle, lambda r, n: fault if r.url.path == "/inference/v1/generate" else None)
    config = ClientConfig(
        backend="vllm", base_url="http://vllm", model="tiny-qwen3", retry=RetryPolicy(attempts=3, backoff=0)
    )
    async with Client(config, transport=faulty) as client:
        with pytest.raises(error) as info:
            await client.generate(prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=3, seed=1))
    assert fragment in str(info.value)
    generate_reached = [r for r in faulty.reached if r.url.path == "/inference/v1/generate"]
    assert len(generate_reached) == reached  # a request that may have reached the engine is never re-sent
    if reached == 0:
        assert not info.value.maybe_processed  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("mutate", "fragment"), [(truncate_routing, "payload has"), (float_routing, "unsupported dtype")]
)
async def test_corrupt_routed_experts_are_refused(tiny_models, mutate, fragment) -> None:
    engine = ReferenceEngine(tiny_models.moe)
    emulator = VllmEmulator(engine, enable_lora=False, enable_return_routed_experts=True)
    fault = Fault(kind="mutate", mutate=first_choice(mutate))
    faulty = FaultyTransport(emulator.handle, lambda r, n: fault if r.url.path == "/inference/v1/generate" else None)
    config = ClientConfig(backend="vllm", base_url="http://vllm", model="tiny-qwen3-moe")
    try:
        async with Client(config, transport=faulty) as client:
            with pytest.raises(ResponseParseError, match=fragment):
                await client.generate(
                    prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=3), return_routed_experts=True
                )
    finally:
        await engine.aclose()


async def test_a_503_is_retried_and_a_fleet_fails_over_only_what_never_arrived(tiny_models) -> None:
    engines = [ReferenceEngine(tiny_models.dense, seed=i) for i in range(2)]
    emulators = {"a": VllmEmulator(engines[0]), "b": VllmEmulator(engines[1])}
    busy = iter([True, False])

    def plan(request: httpx.Request, n: int) -> Fault | None:
        if request.url.path != "/inference/v1/generate":
            return None
        if request.url.host == "a":
            return Fault(kind="reset_before_send")
        return Fault(kind="status", status=503) if next(busy, False) else None

    async def route(request: httpx.Request) -> httpx.Response:
        return await emulators[request.url.host].handle(request)

    faulty = FaultyTransport(route, plan)
    config = ClientConfig(
        backend="vllm", base_url=["http://a", "http://b"], model="tiny-qwen3", retry=RetryPolicy(attempts=3, backoff=0)
    )
    try:
        async with Client(config, transport=faulty) as client:
            result = await client.generate(prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=2), server=None)
        assert result.server == "http://b"
        hosts = [r.url.host for r in faulty.reached if r.url.path == "/inference/v1/generate"]
        assert hosts == ["b", "b"]  # the 503 was retried on b; a never received anything
    finally:
        for e in engines:
            await e.aclose()


async def test_a_server_dying_mid_weight_sync_still_gets_every_paused_server_resumed(tiny_models, tmp_path) -> None:
    from backends_testkit.tinymodel import write_perturbed_weights

    engines = [ReferenceEngine(tiny_models.dense, seed=i) for i in range(3)]
    emulators = {f"s{i}": VllmEmulator(e) for i, e in enumerate(engines)}
    dead: set[str] = set()

    def plan(request: httpx.Request, n: int) -> Fault | None:
        if request.url.host == "s2" and request.url.path == "/collective_rpc":
            dead.add("s2")  # dies while loading weights
            return Fault(kind="reset_after_send")
        return Fault(kind="refuse") if request.url.host in dead else None

    async def route(request: httpx.Request) -> httpx.Response:
        return await emulators[request.url.host].handle(request)

    new = write_perturbed_weights(tiny_models.dense, tmp_path / "w", seed=1, scale=0.1)
    config = ClientConfig(backend="vllm", base_url=[f"http://s{i}" for i in range(3)], model="tiny-qwen3")
    try:
        async with Client(config, transport=FaultyTransport(route, plan)) as client:
            with pytest.raises(AdminError) as info:
                await client.admin.weight_sync(path=str(new), version="v1", mode="wait")
        assert "weight_sync: update failed on 1 of 3" in str(info.value)
        resumed = info.value.phases["resume"]
        assert [o.ok for o in resumed] == [True, True, False]  # resume was attempted on every paused server
        assert isinstance(resumed[2].error, NetworkError)
        assert [e.state().paused for e in engines[:2]] == [False, False]  # the live ones were resumed
        assert client.weight_version is None
    finally:
        for e in engines:
            await e.aclose()
