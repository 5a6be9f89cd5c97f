"""The SGLang backend against real captures from sglang 0.5.23 (copies in tests/fixtures/wire/sglang): the
parsers on the captured answers, the payloads it sends, and the hooks end to end through captured routes."""

from __future__ import annotations

import base64
import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
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
    ServerRefusedError,
    ServerStatusError,
)
from backends_core.types import DistributedGroup, GenerateRequest, TeacherRequest, TensorSpec
from backends_sglang import wire
from backends_sglang.experts import RoutingGeometry, geometry_from_model_dir
from backends_sglang.options import SglangOptions, parse_options
from backends_testkit.fakes import FakeServer
from backends_testkit.tinymodel import TinyModels

from ._helpers import capture

URL = "http://sglang.test"
MOE = RoutingGeometry(num_layers=2, top_k=2, source="test")


def answer(name: str) -> Any:
    return copy.deepcopy(capture(name)["response"])


def request_of(name: str, **fields: Any) -> GenerateRequest:
    body = capture(name)["request"]["json"]
    sampling = fields.pop("sampling", {})
    return GenerateRequest(
        prompt_ids=body["input_ids"], sampling=SamplingParams(**{"max_tokens": 16, **sampling}), **fields
    )


# -- generation answers ------------------------------------------------------------------------------------


def test_generate_capture_parses_ids_logprobs_alternatives_and_versions() -> None:
    body = answer("generate_ids_logprobs")
    (result,) = wire.parse_generate(body, request_of("generate_ids_logprobs", sampling={"top_logprobs": 2}), URL, None)
    meta = body["meta_info"]
    assert list(result.completion_ids) == body["output_ids"] == [578, 615, 1692, 1692]
    assert result.logprobs.dtype == np.float32
    np.testing.assert_allclose(result.logprobs, [e[0] for e in meta["output_token_logprobs"]], rtol=1e-6)
    assert result.top_logprobs is not None
    assert [(a.token_id, a.rank) for a in result.top_logprobs[0]] == [(578, 1), (829, 2)]
    assert result.finish_reason == "length" and result.stop_reason is None
    assert result.weight_version == "default" and result.weight_versions[0].end == 4
    assert result.request_id == meta["id"]
    assert result.usage is not None and (result.usage.prompt_tokens, result.usage.cached_tokens) == (5, 0)


@pytest.mark.parametrize(
    ("name", "finish", "stop_reason"),
    [("generate_stop_token_ids", "stop", 1867), ("generate_stop_str", "stop", " by")],
)
def test_stop_finish_reasons_carry_what_matched(name: str, finish: str, stop_reason: int | str) -> None:
    body = answer(name)
    body["meta_info"]["output_token_logprobs"] = [[-1.0, t, None] for t in body["output_ids"]]
    ids = capture(name)["request"]["json"].get("input_ids") or list(range(body["meta_info"]["prompt_tokens"]))
    (result,) = wire.parse_generate(
        body, GenerateRequest(prompt_ids=ids, sampling=SamplingParams(max_tokens=16)), URL, None
    )
    assert (result.finish_reason, result.stop_reason) == (finish, stop_reason)
    assert result.usage is not None and result.usage.cached_tokens == body["meta_info"]["cached_tokens"]


def test_an_aborted_request_keeps_its_tokens() -> None:
    body = answer("generate_ids_logprobs")
    body["meta_info"]["finish_reason"] = capture("abort_by_rid")["generate_long_1"]["meta_info"]["finish_reason"]
    (result,) = wire.parse_generate(body, request_of("generate_ids_logprobs"), URL, None)
    assert result.finish_reason == "abort" and len(result.completion_ids) == 4


def test_n_samples_come_back_as_a_list() -> None:
    first = answer("generate_ids_logprobs")
    second = copy.deepcopy(first)
    second["output_ids"] = [7, 8, 9, 10]
    second["meta_info"]["output_token_logprobs"] = [[-2.0, t, None] for t in second["output_ids"]]
    second["meta_info"]["id"] = "x_1"
    request = request_of("generate_ids_logprobs", sampling={"n": 2, "max_tokens": 4})
    results = wire.parse_generate([first, second], request, URL, None)
    assert [r.completion_ids for r in results] == [(578, 615, 1692, 1692), (7, 8, 9, 10)]
    assert results[1].request_id == "x_1"
    with pytest.raises(ResponseParseError, match=r"expected 2 sample\(s\) \(n=2\), got 1"):
        wire.parse_generate(first, request, URL, None)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda b: b["meta_info"]["output_token_logprobs"][2].__setitem__(1, 7),
            r"entry is for token 7 but output id 2",
        ),
        (lambda b: b["meta_info"]["output_token_logprobs"].pop(), "3 logprob entries for 4 output ids"),
        (lambda b: b["meta_info"]["output_token_logprobs"][1].__setitem__(0, None), r"output_token_logprobs\[1\]\[0\]"),
        (lambda b: b["meta_info"]["output_token_logprobs"][1].__setitem__(0, float("nan")), "not a finite"),
        (lambda b: b["meta_info"].pop("output_token_logprobs"), "return_logprob was sent"),
        (lambda b: b["meta_info"].__setitem__("prompt_tokens", 6), "prompt_tokens is 6 but 5 prompt ids"),
        (lambda b: b["meta_info"].__setitem__("finish_reason", {"type": "eos"}), "finish type 'eos'"),
        (lambda b: b["meta_info"]["output_top_logprobs"][0].reverse(), "descending"),
        (lambda b: b.pop("meta_info"), r"required field missing @ \$\.meta_info"),
    ],
)
def test_bad_answers_are_refused_naming_the_field(mutate: Callable[[Any], Any], message: str) -> None:
    body = answer("generate_ids_logprobs")
    mutate(body)
    with pytest.raises(ResponseParseError, match=message):
        wire.parse_generate(body, request_of("generate_ids_logprobs", sampling={"top_logprobs": 2}), URL, None)


# -- routed experts ----------------------------------------------------------------------------------------


def routed_request(start: int = 0) -> GenerateRequest:
    return request_of("moe_generate_routed", return_routed_experts=True, routed_experts_start=start)


def test_routed_experts_capture_decodes_to_tokens_layers_top_k() -> None:
    (result,) = wire.parse_generate(answer("moe_generate_routed"), routed_request(), URL, MOE)
    assert result.routed_experts is not None and result.routed_experts.start == 0
    assert result.routed_experts.experts.shape == (7, 2, 2)  # prompt 5 + completion 3 - 1
    assert result.routed_experts.experts[0].tolist() == [[6, 5], [4, 3]]


def test_routed_experts_delta_from_a_start_and_from_a_server_that_ignored_it() -> None:
    body = answer("moe_generate_routed")
    full = np.frombuffer(base64.b64decode(body["meta_info"]["routed_experts"]), "<i4").reshape(7, 2, 2)
    body["meta_info"]["routed_experts"] = base64.b64encode(full[3:].tobytes()).decode()
    (delta,) = wire.parse_generate(body, routed_request(3), URL, MOE)
    assert delta.routed_experts is not None and delta.routed_experts.start == 3
    np.testing.assert_array_equal(delta.routed_experts.experts, full[3:])
    (ignored,) = wire.parse_generate(answer("moe_generate_routed"), routed_request(3), URL, MOE)
    assert ignored.routed_experts is not None
    np.testing.assert_array_equal(ignored.routed_experts.experts, full[3:])


def test_routed_experts_start_past_the_prompt_is_sent_clipped_and_trimmed_here() -> None:
    request = routed_request(6)  # prompt 5: position 6 is a completion token
    assert wire.generate_payload(request)["routed_experts_start_len"] == 4
    body = answer("moe_generate_routed")
    full = np.frombuffer(base64.b64decode(body["meta_info"]["routed_experts"]), "<i4").reshape(7, 2, 2)
    body["meta_info"]["routed_experts"] = base64.b64encode(full[4:].tobytes()).decode()
    (result,) = wire.parse_generate(body, request, URL, MOE)
    assert result.routed_experts is not None and result.routed_experts.start == 6
    np.testing.assert_array_equal(result.routed_experts.experts, full[6:])


@pytest.mark.parametrize(
    ("name", "geometry", "message"),
    [
        ("moe_generate_no_routed", MOE, "--enable-return-routed-experts"),
        ("moe_generate_routed", None, "routed_experts_layers"),
        ("moe_generate_routed", RoutingGeometry(num_layers=3, top_k=2, source="cfg.json"), "top_k 2 from cfg.json"),
    ],
)
def test_routed_experts_problems_name_the_fix(name: str, geometry: RoutingGeometry | None, message: str) -> None:
    with pytest.raises(ResponseParseError, match=message):
        wire.parse_generate(answer(name), routed_request(), URL, geometry)


def test_routing_geometry_comes_from_the_model_config(tiny_models: TinyModels, tmp_path: Path) -> None:
    moe = geometry_from_model_dir(str(tiny_models.moe))
    assert moe is not None and (moe.num_layers, moe.top_k) == (2, 2) and moe.source.endswith("config.json")
    assert geometry_from_model_dir(str(tiny_models.dense)) is None  # dense: no num_experts_per_tok
    (tmp_path / "config.json").write_text(
        json.dumps({"text_config": {"num_hidden_layers": 4, "num_experts_per_tok": 8}})
    )
    nested = geometry_from_model_dir(str(tmp_path))
    assert nested is not None and (nested.num_layers, nested.top_k) == (4, 8)
    assert geometry_from_model_dir(str(tmp_path / "missing")) is None


# -- teacher -----------------------------------------------------------------------------------------------


def test_teacher_capture_parses_with_nan_at_zero() -> None:
    body = answer("score_max0")
    ids = capture("score_max0")["request"]["json"]["input_ids"]
    teacher = wire.parse_teacher(body, TeacherRequest(token_ids=ids), URL)
    assert np.isnan(teacher.logprobs[0]) and teacher.weight_version == "default"
    np.testing.assert_allclose(teacher.logprobs[1:], [e[0] for e in body["meta_info"]["input_token_logprobs"][1:]])


def test_teacher_alternatives_from_input_top_logprobs() -> None:
    ids = capture("generate_ids_logprobs")["request"]["json"]["input_ids"]
    teacher = wire.parse_teacher(answer("generate_ids_logprobs"), TeacherRequest(token_ids=ids, top_logprobs=2), URL)
    assert teacher.top_logprobs is not None and teacher.top_logprobs[0] == ()
    assert [a.token_id for a in teacher.top_logprobs[1]] == [791, 50]


def test_teacher_refuses_a_list_that_does_not_start_at_zero() -> None:
    """score_start3_nocache: with logprob_start_len 3 the list starts at position 3 and that entry is null."""
    ids = capture("score_start3_nocache")["request"]["json"]["input_ids"]
    with pytest.raises(ResponseParseError, match="3 entries for 6 token ids"):
        wire.parse_teacher(answer("score_start3_nocache"), TeacherRequest(token_ids=ids), URL)
    body = answer("score_max0")
    body["meta_info"]["input_token_logprobs"][0][0] = -1.0
    with pytest.raises(ResponseParseError, match="first entry must have a null logprob"):
        wire.parse_teacher(body, TeacherRequest(token_ids=[100, 200, 300, 400, 500, 600]), URL)


# -- payloads ----------------------------------------------------------------------------------------------


def test_generate_payload_maps_every_sampling_field_to_sglang_names() -> None:
    sampling = SamplingParams(max_tokens=3, seed=5, top_logprobs=2, stop_token_ids=[9], min_tokens=1)
    request = GenerateRequest(
        prompt_ids=[1, 2], sampling=sampling, request_id="r1", lora="tiny", cache_salt="s", priority=1
    )
    body = wire.generate_payload(request)
    params = body["sampling_params"]
    assert set(params) <= set(wire.SAMPLING_KEYS)  # anything else is a 400 on SGLang
    assert params == {
        "max_new_tokens": 3,
        "min_new_tokens": 1,
        "n": 1,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "stop_token_ids": [9],
        "ignore_eos": False,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "sampling_seed": 5,
    }
    assert (body["input_ids"], body["rid"], body["lora_path"], body["cache_salt"], body["priority"]) == (
        [1, 2],
        "r1",
        "tiny",
        "s",
        1,
    )
    assert body["return_logprob"] is True and body["top_logprobs_num"] == 2 and body["logprob_start_len"] == -1
    assert "return_routed_experts" not in body and "model" not in body
    assert (
        "sampling_seed"
        not in wire.generate_payload(GenerateRequest(prompt_ids=[1], sampling=SamplingParams(max_tokens=16)))[
            "sampling_params"
        ]
    )


def test_teacher_payload_scores_from_position_zero_without_generating() -> None:
    body = wire.teacher_payload(TeacherRequest(token_ids=[1, 2, 3], top_logprobs=1, lora="tiny", request_id="t"))
    assert body == {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 1,
        "return_text_in_logprobs": False,
        "rid": "t",
        "lora_path": "tiny",
    }


def test_admin_answers_parse() -> None:
    assert wire.max_req_input_len(answer("server_info"), URL) == 4090
    assert wire.max_req_input_len({"internal_states": [{"max_req_input_len": 7}]}, URL) == 7
    assert wire.weight_version(answer("model_info_after_version"), URL) == "step-2"
    assert wire.in_flight(answer("v1_loads"), URL) == 0
    assert wire.lora_names(answer("lora_v1_models"), URL) == ("tiny",)
    assert wire.lora_names(answer("v1_models"), URL) == ()
    with pytest.raises(ResponseParseError, match="no max_req_input_len"):
        wire.max_req_input_len(answer("model_info"), URL)


# -- options -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"flush_timeout": 1}, "unknown option @ $.backend_options.flush_timeout"),
        ({"check_prompt_length": "yes"}, "expected a boolean, got 'yes' @ $.backend_options.check_prompt_length"),
        ({"poll_interval": 0}, "must be a finite number > 0"),
        ({"flush_cache_timeout": -1}, "must be a finite number >= 0"),
        ({"routed_experts_layers": 2}, "give routed_experts_layers and routed_experts_top_k together"),
        ({"routed_experts_layers": 0, "routed_experts_top_k": 2}, "must be >= 1, got 0"),
        ({"admin_api_key_var": "sk-123 secret"}, "must be an environment variable NAME"),
        ({"admin_api_key_var": "SGLANG_TEST_UNSET_KEY"}, "SGLANG_TEST_UNSET_KEY is not set"),
    ],
)
def test_bad_backend_options_are_config_errors(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        Client(ClientConfig(backend="sglang", base_url=URL, backend_options=options))
    assert message in str(info.value)
    assert "sk-123" not in str(info.value)


def test_options_resolve_the_routing_geometry(tiny_models: TinyModels) -> None:
    from_model = parse_options({}, ClientConfig(backend="sglang", base_url=URL, tokenizer=str(tiny_models.moe)))
    assert from_model.routing is not None and from_model.routing.num_layers == 2
    given = parse_options(
        {"routed_experts_layers": 48, "routed_experts_top_k": 8},
        ClientConfig(backend="sglang", base_url=URL, tokenizer=str(tiny_models.moe)),
    )
    assert given.routing == RoutingGeometry(num_layers=48, top_k=8, source="backend_options")
    assert parse_options({}, ClientConfig(backend="sglang", base_url=URL, model="Qwen/Qwen3-30B-A3B")).routing is None


def test_the_admin_key_is_read_from_its_variable_and_never_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_ADMIN_KEY", "s3cret")
    options = parse_options({"admin_api_key_var": "SGLANG_ADMIN_KEY"}, ClientConfig(backend="sglang", base_url=URL))
    assert options.admin_headers() == {"authorization": "Bearer s3cret"}
    assert "s3cret" not in repr(options)
    monkeypatch.delenv("SGLANG_ADMIN_KEY")
    with pytest.raises(ConfigError, match="SGLANG_ADMIN_KEY"):
        options.admin_headers()
    assert SglangOptions().admin_headers() == {}


# -- the hooks end to end on captured routes ----------------------------------------------------------------


class Recorder(FakeServer):
    """A FakeServer that also records each request's Authorization header."""

    def __init__(self) -> None:
        super().__init__()
        self.auth: list[tuple[str, str | None]] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.auth.append((request.url.path, request.headers.get("authorization")))
        return super().handle(request)


def fake_sglang() -> Recorder:
    fake = Recorder()
    for method, path, name in [
        ("GET", "/server_info", "server_info"),
        ("POST", "/generate", "generate_ids_logprobs"),
        ("GET", "/model_info", "model_info_after_version"),
        ("GET", "/v1/loads", "v1_loads"),
        ("GET", "/v1/models", "lora_v1_models"),
        ("POST", "/flush_cache", "flush_cache"),
        ("POST", "/update_weights_from_disk", "update_weights_from_disk"),
        ("POST", "/update_weight_version", "update_weight_version"),
        ("POST", "/load_lora_adapter", "load_lora_adapter"),
        ("POST", "/unload_lora_adapter", "unload_lora_adapter"),
    ]:
        fake.add(method, path, json=answer(name))
    fake.add("POST", "/abort_request", content=b"")
    fake.add("GET", "/health", content=b"")
    fake.add("GET", "/health_generate", status=503, content=b"")
    pause = capture("pause_continue")
    fake.add("POST", "/pause_generation", json=pause["pause_abort"]["response"])
    fake.add("POST", "/continue_generation", json=pause["continue_after_abort"]["response"])
    fake.add("POST", "/release_memory_occupation", content=b"null")
    fake.add("POST", "/resume_memory_occupation", content=b"null")
    dist = capture("update_weights_from_distributed")
    fake.add("POST", "/init_weights_update_group", json=dist["init_weights_update_group"]["response"])
    fake.add("POST", "/begin_weight_update", json=dist["begin_scaled_x3"]["response"])
    fake.add(
        "POST",
        "/update_weights_from_distributed",
        json=dist["update_weights_from_distributed_scaled_x3"]["response"],
    )
    fake.add("POST", "/end_weight_update", json=dist["end_scaled_x3"]["response"])
    return fake


def client(fake: FakeServer, **options: Any) -> Client:
    config = ClientConfig(backend="sglang", base_url=URL, model="tiny-qwen3", backend_options=options)
    return Client(config, transport=fake.transport())


async def test_generation_through_captured_answers_reads_the_limit_once() -> None:
    fake = fake_sglang()
    ids = capture("generate_ids_logprobs")["request"]["json"]["input_ids"]
    async with client(fake) as c:
        result = await c.generate(prompt_ids=ids, sampling=SamplingParams(max_tokens=4, top_logprobs=2))
        await c.generate(prompt_ids=ids, sampling=SamplingParams(max_tokens=4, top_logprobs=2))
    assert result.completion_ids == (578, 615, 1692, 1692)
    assert [r.path for r in fake.requests].count("/server_info") == 1


async def test_prompts_sglang_would_cut_short_are_refused_before_sending() -> None:
    fake = fake_sglang()  # max_req_input_len 4090: max_req_len 4095, prompt + max_new_tokens <= 4094
    async with client(fake) as c:
        with pytest.raises(InvalidRequestError, match="exceeds max_req_input_len 4090"):
            await c.generate(prompt_ids=[5] * 4091, sampling=SamplingParams(max_tokens=1))
        with pytest.raises(InvalidRequestError, match="silently lower max_tokens to 94"):
            await c.generate(prompt_ids=[5] * 4000, sampling=SamplingParams(max_tokens=95))
        with pytest.raises(InvalidRequestError, match="exceeds max_req_input_len"):
            await c.teacher_logprobs([5] * 4091)
        assert "/generate" not in [r.path for r in fake.requests]
        with pytest.raises(ResponseParseError, match="prompt_tokens is 5"):  # at the limit it is sent (canned answer)
            await c.generate(prompt_ids=[5] * 4000, sampling=SamplingParams(max_tokens=94))
    assert [r.path for r in fake.requests].count("/generate") == 1


async def test_an_old_server_without_server_info_is_read_from_get_server_info() -> None:
    fake = fake_sglang()
    fake.add("GET", "/server_info", status=404, json={"detail": "Not Found"})
    fake.add("GET", "/get_server_info", json=answer("get_server_info"))
    async with client(fake) as c:
        await c.generate(prompt_ids=[100, 200, 300, 400, 500], sampling=SamplingParams(max_tokens=4))
    assert [r.path for r in fake.requests][:2] == ["/server_info", "/get_server_info"]


async def test_pause_modes_map_onto_sglang_modes() -> None:
    fake = fake_sglang()
    async with client(fake) as c:
        for mode in ("abort", "wait", "keep"):
            assert await c.admin.pause(mode, clear_cache=True) == [True]
        (state,) = await c.admin.state()
        assert state.paused is True
        assert await c.admin.resume() == [True]
        (state,) = await c.admin.state()
    sent = [(r.path, r.json) for r in fake.requests if r.path in ("/pause_generation", "/flush_cache", "/v1/loads")]
    assert sent[:6] == [
        ("/pause_generation", {"mode": "abort"}),
        ("/flush_cache", None),
        ("/v1/loads", None),  # wait: drained first
        ("/pause_generation", {"mode": "retract"}),
        ("/flush_cache", None),
        ("/pause_generation", {"mode": "in_place"}),  # keep: the frozen requests need their cache
    ]
    assert state.paused is False and state.weight_version == "step-2" and state.loras == ("tiny",)
    assert state.in_flight == 0 and state.sleeping is None


async def test_wait_polls_until_in_flight_requests_are_done() -> None:
    fake = fake_sglang()
    busy = copy.deepcopy(answer("v1_loads"))
    busy["loads"][0]["num_running_reqs"] = 2
    answers = iter([busy, busy, answer("v1_loads")])
    fake.add("GET", "/v1/loads", call=lambda r: httpx.Response(200, json=next(answers)))
    async with client(fake, poll_interval=0.001) as c:
        await c.admin.pause("wait")
    assert [r.path for r in fake.requests].count("/v1/loads") == 3


async def test_wait_pauses_with_retract_at_the_drain_deadline(caplog: pytest.LogCaptureFixture) -> None:
    fake = fake_sglang()
    busy = copy.deepcopy(answer("v1_loads"))
    busy["loads"][0]["num_waiting_reqs"] = 1
    fake.add("GET", "/v1/loads", json=busy)
    async with client(fake, poll_interval=0.001, pause_drain_timeout=0.01) as c:
        assert await c.admin.pause("wait") == [True]
    assert fake.requests[-1].json == {"mode": "retract"}
    assert "still in flight" in caplog.text


async def test_flush_is_retried_while_sglang_refuses_then_raises_with_the_reason() -> None:
    fake = fake_sglang()
    refusals = iter([400, 400, 200])
    flushed = answer("flush_cache")
    fake.add(
        "POST",
        "/flush_cache",
        call=lambda r: httpx.Response(s := next(refusals), text=flushed if s == 200 else "Flush cache failed.\n"),
    )
    async with client(fake, poll_interval=0.001) as c:
        assert await c.admin.flush_cache() == [True]
    assert [r.path for r in fake.requests].count("/flush_cache") == 3
    fake.add("POST", "/flush_cache", status=400, content=b"Flush cache failed.\n")
    async with client(fake, poll_interval=0.001, flush_cache_timeout=0.02) as c:
        with pytest.raises(AdminError) as info:
            await c.admin.flush_cache()
    error = info.value.results[0].error
    assert isinstance(error, ServerStatusError) and error.status_code == 400
    assert "refuses to flush while requests are running" in str(error) and "flush_cache_timeout" in str(error)


async def test_weight_updates_flush_only_when_idle_and_wrap_distributed_updates() -> None:
    fake = fake_sglang()
    async with client(fake) as c:
        assert await c.admin.update_weights("/ckpt/step-1", version="step-1") == [True]
        busy = copy.deepcopy(answer("v1_loads"))
        busy["loads"][0]["num_running_reqs"] = 1
        fake.add("GET", "/v1/loads", json=busy)
        assert await c.admin.update_weights("/ckpt/step-2") == [True]
        group = DistributedGroup(master_address="127.0.0.1", master_port=29555, world_size=2, rank_offset=1)
        assert await c.admin.init_weight_transfer(group) == [True]
        tensors = [TensorSpec(name="model.norm.weight", dtype="torch.bfloat16", shape=(64,))]
        assert await c.admin.update_weights_distributed("weight_sync", tensors, version="dist-1") == [True]
    sent = {r.path: r.json for r in fake.requests}
    updates = [r.json for r in fake.requests if r.path == "/update_weights_from_disk"]
    assert updates == [
        {"model_path": "/ckpt/step-1", "abort_all_requests": False, "flush_cache": True, "weight_version": "step-1"},
        {"model_path": "/ckpt/step-2", "abort_all_requests": False, "flush_cache": False},
    ]
    assert sent["/init_weights_update_group"] == {
        "master_address": "127.0.0.1",
        "master_port": 29555,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "weight_sync",
        "backend": "nccl",
    }
    assert sent["/update_weights_from_distributed"] == {
        "names": ["model.norm.weight"],
        "dtypes": ["bfloat16"],
        "shapes": [[64]],
        "group_name": "weight_sync",
        "abort_all_requests": False,
        "flush_cache": False,
        "weight_version": "dist-1",
    }
    order = [r.path for r in fake.requests if "weight_update" in r.path or r.path.endswith("distributed")]
    assert order == ["/begin_weight_update", "/update_weights_from_distributed", "/end_weight_update"]


async def test_destroy_weight_transfer_sends_the_group_name_and_a_missing_group_is_refused_once() -> None:
    dist = capture("update_weights_from_distributed")
    fake = fake_sglang()
    fake.add("POST", "/destroy_weights_update_group", json=dist["destroy_weights_update_group"]["response"])
    async with client(fake) as c:
        assert await c.admin.destroy_weight_transfer() == [True]
        assert await c.admin.destroy_weight_transfer("trainer-7") == [True]
        fake.add(
            "POST",
            "/destroy_weights_update_group",
            status=dist["destroy_again"]["status"],
            json=dist["destroy_again"]["response"],
        )
        with pytest.raises(AdminError) as info:
            await c.admin.destroy_weight_transfer("trainer-7")
    sent = [r.json for r in fake.requests if r.path == "/destroy_weights_update_group"]
    assert sent == [{"group_name": "weight_sync"}, {"group_name": "trainer-7"}, {"group_name": "trainer-7"}]
    assert info.value.operation == "admin_destroy_weight_transfer"
    error = info.value.results[0].error
    assert isinstance(error, ServerStatusError) and error.status_code == 400
    assert error.url == f"{URL}/destroy_weights_update_group"
    assert "does not exist" in str(error) and "no weight-update group 'trainer-7'" in str(error)
    assert URL in str(info.value)


async def test_destroy_weight_transfer_refused_in_a_2xx_answer_raises() -> None:
    fake = fake_sglang()
    refusal = {"success": False, "message": "Failed to destroy custom process group: boom."}
    fake.add("POST", "/destroy_weights_update_group", json=refusal)
    async with client(fake) as c:
        with pytest.raises(AdminError) as info:
            await c.admin.destroy_weight_transfer("g")
    error = info.value.results[0].error
    assert isinstance(error, ServerRefusedError) and error.body == refusal
    assert error.url == f"{URL}/destroy_weights_update_group" and "boom" in str(error)


@pytest.mark.parametrize("name", ["", None, 7])
async def test_destroy_weight_transfer_refuses_a_bad_group_name_before_sending(name: Any) -> None:
    fake = fake_sglang()
    async with client(fake) as c:
        with pytest.raises(InvalidRequestError, match="group_name must be a non-empty string"):
            await c.admin.destroy_weight_transfer(name)
    assert fake.requests == []


async def test_destroy_weight_transfer_is_never_retried_after_a_5xx() -> None:
    fake = fake_sglang()
    fake.add("POST", "/destroy_weights_update_group", status=503, json={"detail": "busy"})
    async with client(fake) as c:
        with pytest.raises(AdminError):
            await c.admin.destroy_weight_transfer("g")
    assert [r.path for r in fake.requests].count("/destroy_weights_update_group") == 1


async def test_destroy_weight_transfer_through_the_emulator_leaves_the_group_once(
    make_emulator: Callable[..., Any],
) -> None:
    emulator = make_emulator()
    config = ClientConfig(backend="sglang", base_url=URL, model="tiny-qwen3")
    group = DistributedGroup(
        master_address="127.0.0.1", master_port=29555, world_size=2, rank_offset=1, group_name="g1", backend="gloo"
    )
    async with Client(config, transport=emulator.transport()) as c:
        with pytest.raises(AdminError, match="does not exist"):
            await c.admin.destroy_weight_transfer("g1")
        assert await c.admin.init_weight_transfer(group) == [True]
        assert await c.admin.destroy_weight_transfer("g1") == [True]
        with pytest.raises(AdminError, match="does not exist"):
            await c.admin.destroy_weight_transfer("g1")
        assert await c.admin.init_weight_transfer(group) == [True]  # the name is free again


async def test_a_failed_distributed_update_still_closes_the_session() -> None:
    fake = fake_sglang()
    fake.add(
        "POST",
        "/update_weights_from_distributed",
        json={"success": False, "message": "Failed to update parameter online: timeout"},
    )
    async with client(fake) as c:
        with pytest.raises(AdminError) as info:
            await c.admin.update_weights_distributed("g", [TensorSpec(name="w", dtype="float32", shape=(2,))])
    assert isinstance(info.value.results[0].error, ServerRefusedError)
    assert "timeout" in str(info.value)
    assert [r.path for r in fake.requests][-1] == "/end_weight_update"


async def test_refusals_in_2xx_answers_raise() -> None:
    fake = fake_sglang()
    fake.add("POST", "/update_weights_from_disk", status=400, json=answer("update_weights_from_disk_bad"))
    fake.add("POST", "/load_lora_adapter", status=400, json=answer("load_lora_adapter_dup"))
    fake.add("POST", "/pause_generation", json={"message": "no", "status": "error"})
    async with client(fake) as c:
        with pytest.raises(AdminError, match="Failed to get weights iterator"):
            await c.admin.update_weights("/models/does-not-exist")
        with pytest.raises(AdminError, match="already loaded"):
            await c.admin.load_lora(LoraAdapter(name="tiny", path="/models/tiny-lora"))
        with pytest.raises(AdminError) as info:
            await c.admin.pause("abort")
    assert isinstance(info.value.results[0].error, ServerRefusedError)


async def test_lora_replace_unloads_a_loaded_name_first() -> None:
    fake = fake_sglang()
    async with client(fake) as c:
        await c.admin.load_lora(LoraAdapter(name="tiny", path="/models/tiny-lora", replace=True))
        await c.admin.load_lora(LoraAdapter(name="other", path="/models/other", replace=True))
        await c.admin.unload_lora("tiny")
    sent = [(r.path, r.json) for r in fake.requests if "lora" in r.path]
    assert sent == [
        ("/unload_lora_adapter", {"lora_name": "tiny"}),
        ("/load_lora_adapter", {"lora_name": "tiny", "lora_path": "/models/tiny-lora"}),
        ("/load_lora_adapter", {"lora_name": "other", "lora_path": "/models/other"}),
        ("/unload_lora_adapter", {"lora_name": "tiny"}),
    ]


async def test_health_of_a_paused_server_asks_no_generation() -> None:
    """SGLang's /health runs a 1-token generation: a paused server holds it and then answers 503 (and marks itself
    unhealthy). Health (is it alive?) asks a route the HTTP process answers itself."""
    fake = fake_sglang()
    fake.add("GET", "/health", status=503, content=b"")
    async with client(fake) as c:
        await c.admin.pause("keep")
        assert await c.admin.health() == [True]
    assert [path for path, _ in fake.auth if path.startswith("/health")] == []


async def test_abort_health_ready_sleep_and_wake() -> None:
    fake = fake_sglang()
    async with client(fake) as c:
        assert await c.admin.abort(["a", "b"]) == [-1]
        assert await c.admin.abort() == [-1]
        assert await c.admin.health() == [True]
        assert await c.admin.ready() == [False]  # 503: SGLang's 1-token health generation did not run
        assert await c.admin.sleep(2) == [True]
        (state,) = await c.admin.state()
        assert state.sleeping is True
        assert await c.admin.wake() == [True]
        busy = copy.deepcopy(answer("v1_loads"))
        busy["loads"][0]["num_running_reqs"] = 3
        fake.add("GET", "/v1/loads", json=busy)
        with pytest.raises(AdminError, match=r"3 request\(s\) in flight: SGLang releases memory only when idle"):
            await c.admin.sleep()
    assert [r.path for r in fake.requests].count("/release_memory_occupation") == 1
    aborts = [r.json for r in fake.requests if r.path == "/abort_request"]
    assert aborts == [{"rid": "a"}, {"rid": "b"}, {"abort_all": True}]
    assert next(r.json for r in fake.requests if r.path == "/release_memory_occupation") == {}


async def test_the_admin_key_goes_to_control_routes_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_ADMIN_KEY", "admin-key")
    monkeypatch.setenv("SGLANG_API_KEY", "user-key")
    fake = fake_sglang()
    config = ClientConfig(
        backend="sglang",
        base_url=URL,
        api_key_var="SGLANG_API_KEY",
        backend_options={"admin_api_key_var": "SGLANG_ADMIN_KEY"},
    )
    async with Client(config, transport=fake.transport()) as c:
        await c.generate(prompt_ids=[100, 200, 300, 400, 500], sampling=SamplingParams(max_tokens=4))
        await c.admin.pause("keep")
        await c.admin.state()
        await c.admin.flush_cache()
        await c.admin.health()
    auth = dict(fake.auth)
    assert auth["/pause_generation"] == auth["/flush_cache"] == "Bearer admin-key"
    for path in ("/generate", "/server_info", "/model_info", "/v1/loads", "/v1/models"):
        assert auth[path] == "Bearer user-key", path


async def test_a_refused_admin_key_names_the_option() -> None:
    fake = fake_sglang()
    fake.add("POST", "/flush_cache", status=401, json={"error": "Unauthorized"})
    async with client(fake) as c:
        with pytest.raises(AdminError, match="admin_api_key_var"):
            await c.admin.flush_cache()


def test_routed_experts_missing_behind_a_front_blame_the_router_not_the_servers_flags() -> None:
    with pytest.raises(ResponseParseError, match=r"sglang-router front .* drops meta_info.routed_experts") as info:
        wire.parse_generate(answer("moe_generate_no_routed"), routed_request(), URL, MOE, front="sglang-router")
    assert "--enable-return-routed-experts" not in str(info.value)
