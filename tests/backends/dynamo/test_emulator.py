"""The Dynamo emulator against the captures: every captured request is replayed (after the requests it depended
on) and the answer must have the captured status and JSON structure (keys, types; values differ because the
engines do). Mocker captures replay against a worker without RL or LoRA routes, and the mocker's known gaps
(no engine data, no logprobs, ``n`` ignored) are allowed; vLLM-worker captures must match as they are."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import pytest_asyncio

from backends_core import Client, ClientConfig, SamplingParams
from backends_core.types import GenerateRequest
from backends_dynamo import wire
from backends_dynamo.wire import fold, parse_sse
from backends_dynamo_testing import WORKER_URL, DynamoEmulator
from backends_testkit.engine import ReferenceEngine
from backends_testkit.tinymodel import TinyModels, write_perturbed_weights

from ._captures import FIXTURES, capture, request_body, request_path

FRONTEND = "http://dynamo.test:8000"
_FREE_KEYS = re.compile(r"(prompt_logprobs\[\d+\]|logprobs\.top_logprobs\[\d+\])$")
#: What the mocker never returns but Dynamo's vLLM worker (and so the emulator) does.
_MOCKER_GAPS = {"engine_data", "prompt_logprobs", "routed_experts", "logprobs"}
#: Present or not depending on what the engine generated (a delta without text, a stop without a matched id),
#: or on the router mode (the KV router adds ranks and hit rates).
_OPTIONAL = {"stop_reason", "content", "kv_hit_rate", "router_queue_depth", "prefill_dp_rank", "decode_dp_rank"}

SKIPPED = {
    "chat_no_max_tokens": "the mocker requires max_tokens; the vLLM worker does not",
    "chat_min_tokens_gt_max": "the mocker ignores min_tokens > max_tokens; vLLM refuses it",
    "chat_stop_str": "stop strings: the reference engine has none (the emulator refuses them)",
    "chat_backend_instance_id_real": "names the mocker's worker instance id",
    "chat_kv_query_instance_id": "--router-mode kv (GAIE stage 1) is not emulated",
    "chat_kv_query_instance_id_extra": "--router-mode kv (GAIE stage 1) is not emulated",
    "get_engine_health": "the emulated frontend answers /engine/* for its worker (one URL in-process)",
    "responses_basic": "/v1/responses is not emulated (the backend does not use it)",
    "responses_input_tokens": "/v1/responses is not emulated (the backend does not use it)",
    "system_get_health": "the mocker ran without DYN_SYSTEM_STARTING_HEALTH_STATUS=ready",
    "system_get_live": "the mocker ran without DYN_SYSTEM_STARTING_HEALTH_STATUS=ready",
}
#: vLLM-worker captures that depend on earlier admin calls: replayed after them.
BEFORE = {
    "engine_load_lora_again": ["engine_load_lora"],
    "engine_unload_lora": ["engine_load_lora"],
    "engine_control_sleep_again": ["engine_control_sleep"],
    "engine_control_wake_up": ["engine_control_sleep"],
    "engine_get_weight_version_after_set": ["engine_set_weight_version"],
    "engine_get_weight_version_after_update": ["engine_pause_for_update", "engine_update_weights_from_disk_perturbed"],
    "engine_get_weight_version_after_revert": [
        "engine_pause_for_update",
        "engine_update_weights_from_distributed_reload_rpc",
    ],
    "engine_update_weights_from_disk_perturbed": ["engine_pause_for_update"],
    "engine_update_weights_from_distributed_reload_rpc": ["engine_pause_for_update"],
    "frontend_models_after_lora": ["engine_load_lora"],
    "frontend_models_after_unload": ["engine_load_lora", "engine_unload_lora"],
    "frontend_models_while_sleeping": ["engine_control_sleep"],
    "lora_adapter_greedy": ["engine_load_lora"],
    "lora_vs_vllm_peer": ["engine_load_lora"],
    "lora_after_unload_request": ["engine_load_lora", "engine_unload_lora"],
    "request_while_sleeping": ["engine_control_sleep"],
    "request_after_wake": ["engine_control_sleep", "engine_control_wake_up"],
    "system_health_while_sleeping": ["engine_control_sleep"],
    "weights_after_update_perturbed_greedy": [
        "engine_pause_for_update",
        "engine_update_weights_from_disk_perturbed",
        "engine_resume_after_update",
    ],
}
EMULATOR_OPTIONS = {"engine_load_lora_without_enable_lora": {"enable_lora": False}}


def replayable(kind: str) -> Iterator[Any]:
    for path in sorted((FIXTURES / kind).glob("*.json")):
        cap = json.loads(path.read_text())
        if not isinstance(cap, dict) or "request" not in cap or not ({"response", "sse_events"} & set(cap)):
            continue
        reason = SKIPPED.get(path.stem)
        yield pytest.param(kind, path.stem, id=f"{kind}/{path.stem}", marks=pytest.mark.skip(reason) if reason else ())


def shape_diff(got: Any, want: Any, path: str = "$", *, mocker: bool) -> list[str]:
    """Where ``got`` differs from ``want`` in structure: object keys, list element shapes, value kinds."""

    def kind(v: Any) -> str:
        return "number" if isinstance(v, int | float) and not isinstance(v, bool) else type(v).__name__

    if isinstance(want, dict) and isinstance(got, dict):
        if _FREE_KEYS.search(path):  # keyed by token ids / token text: compare one value
            values = list(zip(got.values(), want.values(), strict=False))[:1]
            return [d for g, w in values for d in shape_diff(g, w, f"{path}.*", mocker=mocker)]
        problems = []
        for key in sorted(set(got) | set(want)):
            if key in _OPTIONAL or (mocker and key in _MOCKER_GAPS and key not in want):
                continue
            if mocker and key == "nvext" and key not in want and set(got[key]) <= _MOCKER_GAPS:
                continue
            if key not in got or key not in want:
                problems.append(f"{path}.{key}: {'missing' if key not in got else 'unexpected'}")
                continue
            if mocker and key in _MOCKER_GAPS and want[key] is None:
                continue
            problems += shape_diff(got[key], want[key], f"{path}.{key}", mocker=mocker)
        return problems
    if isinstance(want, list) and isinstance(got, list):
        return shape_diff(got[0], want[0], f"{path}[0]", mocker=mocker) if got and want else []
    if kind(got) != kind(want):
        return [f"{path}: {kind(got)} where the capture has {kind(want)} ({str(want)[:40]})"]
    return []


class Replay:
    """A fresh emulator for one capture kind, with capture paths rewritten to local model directories."""

    def __init__(self, kind: str, emulator: DynamoEmulator, paths: dict[str, str]) -> None:
        self.kind, self.emulator, self.paths = kind, emulator, paths

    def localize(self, value: Any) -> Any:
        text = json.dumps(value)
        for old, new in self.paths.items():
            text = text.replace(old, new)
        return json.loads(text)

    async def send(self, name: str) -> tuple[httpx.Response, dict[str, Any]]:
        cap = capture(name, self.kind)
        request = cap["request"]
        body = request_body(cap)
        default = "/v1/completions" if isinstance(body, dict) and "prompt" in body else "/v1/chat/completions"
        url = httpx.URL(request.get("url", FRONTEND + request_path(cap, default)))
        base = WORKER_URL if url.port in (8081, 8281) else FRONTEND
        method = request.get("method", "POST")
        content = None if body is None or method == "GET" else json.dumps(self.localize(body)).encode()
        headers = dict(request.get("headers") or {})
        sent = httpx.Request(method, base + url.path, content=content, headers=headers)
        response = await self.emulator.handle(sent)
        await response.aread()  # a streamed answer's events, as produced
        return response, cap


@pytest_asyncio.fixture
async def engines(tiny_models: TinyModels) -> AsyncIterator[dict[str, ReferenceEngine]]:
    made = {"tiny-qwen3": ReferenceEngine(tiny_models.dense), "tiny-qwen3-moe": ReferenceEngine(tiny_models.moe)}
    yield made
    for engine in made.values():
        await engine.aclose()


@pytest.fixture(scope="module")
def perturbed(tmp_path_factory: pytest.TempPathFactory, tiny_models: TinyModels) -> Path:
    return write_perturbed_weights(tiny_models.dense, tmp_path_factory.mktemp("perturbed") / "w", seed=1, scale=0.5)


def replay_for(
    kind: str, name: str, engines: dict[str, ReferenceEngine], models: TinyModels, perturbed: Path
) -> Replay:
    cap = capture(name, kind)
    body = request_body(cap)
    model = body.get("model") if isinstance(body, dict) else None
    engine = engines["tiny-qwen3-moe" if model == "tiny-qwen3-moe" else "tiny-qwen3"]
    mocker = kind == "dynamo"
    options = {"enable_rl": not mocker, "enable_lora": not mocker, **EMULATOR_OPTIONS.get(name, {})}
    emulator = DynamoEmulator(engine, **options)
    paths = {
        "/models/tiny-qwen3-perturbed": str(perturbed),
        "/models/tiny-lora": str(models.lora),
        "/models/tiny-qwen3": str(models.dense),
    }
    return Replay(kind, emulator, paths)


@pytest.mark.parametrize(("kind", "name"), [*replayable("dynamo"), *replayable("dynamo-vllm")])
async def test_captured_requests_get_the_captured_status_and_structure(
    kind: str, name: str, engines: dict[str, ReferenceEngine], tiny_models: TinyModels, perturbed: Path
) -> None:
    replay = replay_for(kind, name, engines, tiny_models, perturbed)
    for earlier in BEFORE.get(name, []):
        response, _ = await replay.send(earlier)
        assert response.status_code == 200 and json.loads(response.content).get("status") in ("ok", "success")
    response, cap = await replay.send(name)
    assert response.status_code == cap.get("status", 200), response.text[:300]
    mocker = kind == "dynamo"
    if "sse_events" in cap and response.status_code != 200:  # a refused stream answers plain JSON
        problems = shape_diff(json.loads(response.content), json.loads(cap["raw"]), mocker=mocker)
    elif "sse_events" in cap:
        got, want = parse_sse(response.text), [e for e in cap["sse_events"] if e != "[DONE]"]
        problems = shape_diff(got[0], want[0], "$[0]", mocker=mocker)
        if not mocker:  # the vLLM worker's last token chunk carries the finish reason and the engine record
            problems += shape_diff(got[-2], want[-2], "$[-2]", mocker=mocker)
        problems += shape_diff(got[-1], want[-1], "$[-1]", mocker=mocker)
    elif "response_text" in cap:
        problems = [] if response.text == cap["response_text"] else [f"text {response.text!r}"]
    else:
        problems = shape_diff(json.loads(response.content), cap["response"], mocker=mocker)
    assert not problems, "\n".join(problems)


# -- behaviours the structure replay cannot show -------------------------------------------------------------


@pytest_asyncio.fixture
async def emulator(tiny_models: TinyModels) -> AsyncIterator[DynamoEmulator]:
    emu = DynamoEmulator(ReferenceEngine(tiny_models.dense))
    yield emu
    await emu.aclose()


async def post(emu: DynamoEmulator, path: str, body: Any, *, base: str = FRONTEND, **headers: str) -> httpx.Response:
    response = await emu.handle(httpx.Request("POST", base + path, json=body, headers=headers))
    await response.aread()  # a streamed answer's events, as produced
    return response


@pytest.mark.parametrize(
    "name", ["chat_nvext_unknown_field", "chat_agent_hints_bad", "chat_unknown_top_field", "chat_nvext_ignore_eos"]
)
async def test_deny_unknown_messages_are_the_binarys_own(emulator: DynamoEmulator, name: str) -> None:
    cap = capture(name)
    content = json.dumps(request_body(cap), separators=(",", ":"))  # as the capture client sent it
    response = await emulator.handle(httpx.Request("POST", FRONTEND + "/v1/chat/completions", content=content))
    assert response.status_code == 400 and response.json() == cap["response"]


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "actual"),
    [(2044, 4, None), (2047, 1, None), (2044, 5, 2049), (2048, 1, 2048), (2038, 100, 2138)],
)
async def test_the_context_length_400_is_the_frontends(
    emulator: DynamoEmulator, prompt: int, max_tokens: int, actual: int | None
) -> None:
    """As probed on 1.6.1 with the vLLM worker (context_window 2048): prompt + max_tokens above the window, or a
    prompt that fills it, is a 400 with ``details`` (``actual`` is the prompt alone when the prompt fills it)."""
    for path, body in (
        ("/v1/completions", {"model": "tiny-qwen3", "prompt": [5] * prompt, "max_tokens": max_tokens}),
        (
            "/v1/chat/completions",
            wire.generation_payload(
                GenerateRequest(prompt_ids=[5] * prompt, sampling=SamplingParams(max_tokens=max_tokens)),
                "tiny-qwen3",
                transport="chat",
            )[1],
        ),
    ):
        response = await post(emulator, path, body)
        if actual is None:
            assert response.status_code == 200, response.text
        else:
            details = {"type": "context_length", "limit": 2048, "actual": actual}
            assert response.status_code == 400
            assert response.json() == {
                "message": "Invalid request",
                "type": "Bad Request",
                "code": 400,
                "details": details,
            }


async def test_an_abort_needs_the_bare_uuid_and_ends_with_stop(emulator: DynamoEmulator) -> None:
    rid = str(uuid.uuid4())
    body = {"model": "tiny-qwen3", "prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": True, "logprobs": 0}
    body["nvext"] = {"extra_fields": ["engine_data", "completion_token_ids"]}
    task = asyncio.create_task(post(emulator, "/v1/completions", body, **{"x-dynamo-request-id": rid}))
    while not emulator.deployment.in_flight():  # noqa: ASYNC110 - polling the engine, as a client would
        await asyncio.sleep(0.002)
    prefixed = await post(emulator, "/engine/abort_request", {"request_id": f"cmpl-{rid}"}, base=WORKER_URL)
    assert prefixed.json() == {"status": "ok", "request_id": f"cmpl-{rid}"}  # "ok", and nothing happens
    assert emulator.deployment.in_flight() == 1
    bare = await post(emulator, "/engine/abort_request", {"request_id": rid}, base=WORKER_URL)
    assert bare.json()["status"] == "ok"
    answer = (await task).json()
    assert answer["id"] == f"cmpl-{rid}" and answer["choices"][0]["finish_reason"] == "stop"  # the trap
    assert len(answer["nvext"]["completion_token_ids"]) < 400
    assert answer["nvext"]["engine_data"]["completion_token_ids"] == answer["nvext"]["completion_token_ids"]


async def test_weight_updates_need_a_pause_and_sleep_leaves_discovery(
    emulator: DynamoEmulator, tiny_models: TinyModels
) -> None:
    update = {"model_path": str(tiny_models.dense), "weight_version": "v9"}
    refused = (await post(emulator, "/engine/update_weights_from_disk", update, base=WORKER_URL)).json()
    assert refused["status"] == "error" and "must be paused" in refused["message"]
    await post(emulator, "/engine/pause_generation", {"mode": "wait"}, base=WORKER_URL)
    done = (await post(emulator, "/engine/update_weights_from_disk", update, base=WORKER_URL)).json()
    assert done == {"status": "ok", "version": "v9", "version_declared": True}
    await post(emulator, "/engine/control/sleep", {"level": 1}, base=WORKER_URL)
    models = await emulator.handle(httpx.Request("GET", FRONTEND + "/v1/models"))
    assert models.json()["data"] == []
    asleep = await post(emulator, "/v1/completions", {"model": "tiny-qwen3", "prompt": [1, 2], "max_tokens": 2})
    assert asleep.status_code == 503 and "not ready" in asleep.json()["message"]


async def test_worker_and_frontend_share_paths_but_not_answers(emulator: DynamoEmulator) -> None:
    worker = await emulator.handle(httpx.Request("GET", WORKER_URL + "/health"))
    front = await emulator.handle(httpx.Request("GET", FRONTEND + "/health"))
    assert worker.json()["status"] == "ready" and worker.headers["content-type"].startswith("text/plain")
    assert front.json()["status"] == "healthy" and front.json()["instances"][0]["instance_id"] > 2**63
    metrics = await emulator.handle(httpx.Request("GET", FRONTEND + "/metrics"))
    assert "dynamo_request_plane_inflight_requests 0" in metrics.text
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=emulator.asgi()), base_url=FRONTEND) as http:
        assert (await http.get("/live")).json() == {"status": "live", "message": "Service is live"}


async def test_a_stream_folds_to_the_non_streamed_answer(emulator: DynamoEmulator) -> None:
    body = {"model": "tiny-qwen3", "messages": [{"role": "user", "content": "x"}], "max_tokens": 6, "seed": 5}
    body |= {"logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True}
    body["nvext"] = {"token_data": [1, 2, 3, 4], "extra_fields": ["engine_data", "completion_token_ids", "timing"]}
    plain = (await post(emulator, "/v1/chat/completions", body)).json()
    streamed = await post(emulator, "/v1/chat/completions", body | {"stream": True})
    assert streamed.headers["content-type"] == "text/event-stream"
    folded = fold(parse_sse(streamed.text))
    request = GenerateRequest(prompt_ids=[1, 2, 3, 4], sampling=SamplingParams(max_tokens=6, top_logprobs=2))
    (a,), (b,) = wire.parse_generation(plain, request, FRONTEND), wire.parse_generation(folded, request, FRONTEND)
    assert a.completion_ids == b.completion_ids and a.top_logprobs == b.top_logprobs
    np.testing.assert_array_equal(a.logprobs, b.logprobs)


async def test_the_servers_rendering_is_checked_against_the_trainers(tiny_models: TinyModels) -> None:
    engine = ReferenceEngine(tiny_models.dense)
    emu = DynamoEmulator(engine)
    config = ClientConfig(backend="dynamo", base_url=FRONTEND, model="tiny-qwen3", tokenizer=str(tiny_models.dense))
    async with Client(config, transport=emu.transport()) as client:
        check = await client.check_tokenizer([{"role": "user", "content": "Name three colors."}])
    await emu.aclose()
    assert check.match and len(check.server_ids) > 5


@pytest.mark.parametrize(
    "options", [{"transport": "completions"}, {"stream": True}, {"transport": "completions", "stream": True}]
)
async def test_every_transport_gives_the_same_sample_and_scores(
    tiny_models: TinyModels, options: dict[str, Any]
) -> None:
    sampling = SamplingParams(max_tokens=6, seed=4, top_logprobs=2)
    results = []
    for backend_options in ({}, options):
        emu = DynamoEmulator(ReferenceEngine(tiny_models.dense))
        config = ClientConfig(backend="dynamo", base_url=FRONTEND, model="tiny-qwen3", backend_options=backend_options)
        async with Client(config, transport=emu.transport()) as client:
            sample = await client.generate(prompt_ids=[5, 6, 7, 8], sampling=sampling, request_id="same")
            teacher = await client.teacher_logprobs(sample.token_ids, top_logprobs=1)
            results.append((sample, teacher))
        await emu.aclose()
    (a, ta), (b, tb) = results
    assert a.completion_ids == b.completion_ids and a.top_logprobs == b.top_logprobs
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    np.testing.assert_array_equal(ta.logprobs, tb.logprobs)
    np.testing.assert_allclose(ta.logprobs[4:], a.logprobs, atol=1e-5)
