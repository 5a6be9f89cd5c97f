"""The Dynamo backend's wire mapping on real captures (tests/fixtures/wire/dynamo and dynamo-vllm): golden parses,
every rule of the parser broken once, request bodies against what the 1.6.1 binary accepts, and streams."""

from __future__ import annotations

import base64
import copy
import json
import re
from typing import Any

import numpy as np
import pytest

from backends_core.errors import ResponseParseError
from backends_core.jsonnode import Node
from backends_core.types import GenerateRequest, SamplingParams, TeacherRequest
from backends_dynamo import wire
from backends_dynamo.wire import fold, parse_sse

from ._captures import FIXTURES, capture, request_body, sse_text

URL = "http://dynamo.test"


def vllm(name: str) -> dict[str, Any]:
    return capture(name, "dynamo-vllm")


def prompt_of(cap: dict[str, Any]) -> list[int]:
    """The prompt ids the worker saw (engine_data.prompt_token_ids) or that were sent."""
    nvext = cap["response"].get("nvext", {})
    if "engine_data" in nvext:
        return list(nvext["engine_data"]["prompt_token_ids"])
    body = request_body(cap)
    return list(body.get("nvext", {}).get("token_data") or body["prompt"])


def request_for(cap: dict[str, Any], **sampling: Any) -> GenerateRequest:
    return GenerateRequest(prompt_ids=prompt_of(cap), sampling=SamplingParams(**{"max_tokens": 16, **sampling}))


# -- golden parses -------------------------------------------------------------------------------------


def test_chat_answer_of_the_vllm_worker_parses_from_the_engine_channel() -> None:
    cap = vllm("chat_nvext_engine_data_logprobs")
    body = cap["response"]
    (result,) = wire.parse_generation(body, request_for(cap, max_tokens=8), URL)
    engine = body["nvext"]["engine_data"]
    assert list(result.completion_ids) == engine["completion_token_ids"] == body["nvext"]["completion_token_ids"]
    assert result.logprobs.dtype == np.float32
    np.testing.assert_array_equal(result.logprobs, np.asarray(engine["completion_logprobs"], np.float32))
    chat = [e["logprob"] for e in body["choices"][0]["logprobs"]["content"]]
    np.testing.assert_allclose(result.logprobs, chat, rtol=1e-6)  # both channels agree on this capture
    assert result.finish_reason == "length" and result.stop_reason is None
    assert result.request_id == body["id"] and result.server == URL
    assert result.usage is not None and (result.usage.prompt_tokens, result.usage.cached_tokens) == (23, 0)


def test_the_engine_channel_wins_over_the_chat_echo() -> None:
    cap = vllm("chat_nvext_engine_data_logprobs")
    body = copy.deepcopy(cap["response"])
    for entry in body["choices"][0]["logprobs"]["content"]:
        entry["logprob"] = -0.5
    (result,) = wire.parse_generation(body, request_for(cap), URL)
    np.testing.assert_array_equal(
        result.logprobs, np.asarray(body["nvext"]["engine_data"]["completion_logprobs"], np.float32)
    )


def test_token_data_answer_parses_with_the_prompt_echoed() -> None:
    cap = vllm("chat_token_data_engine_data")
    (result,) = wire.parse_generation(cap["response"], request_for(cap), URL)
    assert result.prompt_ids == tuple(request_body(cap)["nvext"]["token_data"])
    assert len(result.completion_ids) == 8 and result.usage is not None and result.usage.prompt_tokens == 23


@pytest.mark.parametrize(
    ("name", "finish", "stop"),
    [("completions_token_prompt_greedy", "length", None), ("completions_stop_token_ids", "stop", 390)],
)
def test_completions_answers_parse_with_stop_reasons(name: str, finish: str, stop: int | None) -> None:
    cap = vllm(name)
    body = copy.deepcopy(cap["response"])
    engine = body["nvext"]["engine_data"]
    engine.setdefault("completion_logprobs", [-1.0] * len(engine["completion_token_ids"]))  # as when asked for
    (result,) = wire.parse_generation(body, request_for(cap), URL)
    assert list(result.completion_ids) == cap["response"]["nvext"]["completion_token_ids"]
    assert result.finish_reason == finish and result.stop_reason == stop


def test_a_completions_logprob_channel_is_used_when_engine_data_is_missing() -> None:
    cap = vllm("completions_token_prompt_logprobs")
    body = copy.deepcopy(cap["response"])
    del body["nvext"]["engine_data"]
    body["choices"][0]["logprobs"]["tokens"] = [f"token_id:{t}" for t in body["nvext"]["completion_token_ids"]]
    (result,) = wire.parse_generation(body, request_for(cap), URL)
    np.testing.assert_allclose(result.logprobs, body["choices"][0]["logprobs"]["token_logprobs"], rtol=1e-6)
    body["choices"][0]["logprobs"]["tokens"][3] = "token_id:7"
    with pytest.raises(ResponseParseError, match=r"logprob entry is for 'token_id:7' but completion id 3"):
        wire.parse_generation(body, request_for(cap), URL)


def test_alternatives_need_token_ids_and_are_the_best_k() -> None:
    cap = vllm("chat_nvext_engine_data_logprobs")
    request = request_for(cap, top_logprobs=3)
    with pytest.raises(ResponseParseError, match="ignored return_tokens_as_token_ids"):
        wire.parse_generation(cap["response"], request, URL)
    body = copy.deepcopy(cap["response"])
    for entry in body["choices"][0]["logprobs"]["content"]:  # as with return_tokens_as_token_ids: true
        for i, alt in enumerate(entry["top_logprobs"]):
            alt["token"] = f"token_id:{entry['token_id'] if i == 0 else 100 + i}"
    (result,) = wire.parse_generation(body, request, URL)
    assert result.top_logprobs is not None and len(result.top_logprobs) == 8
    second = result.top_logprobs[1]  # sampled "war" (-3.18) is not among the best 3: TP, " human", "\ufffd"
    assert [a.token_id for a in second] == [101, 102, 103]
    assert [round(a.logprob, 4) for a in second] == [-2.0512, -2.5071, -2.6255]
    assert result.top_logprobs[0][0].token_id == result.completion_ids[0]  # sampled and best


def test_worker_ids_and_timing_are_exact() -> None:
    body = vllm("chat_nvext_engine_data_logprobs")["response"]
    ids = wire.worker_ids(body)
    assert ids is not None and ids.decode_worker_id == ids.prefill_worker_id == 17251580120541680439
    assert ids.prefill_dp_rank is None
    time = wire.timing(wire.Exchange((wire.Sample(body),)))
    assert time is not None and time.total_time_ms == pytest.approx(10467.152843)
    kv = json.loads((FIXTURES / "dynamo" / "chat_kv_extra_all_stream.sse").read_text().split("data: ")[1])
    assert wire.worker_ids(kv) is not None and wire.worker_ids(kv).decode_dp_rank == 0  # type: ignore[union-attr]
    assert wire.timing(capture("chat_basic")["response"]) is None
    bad = copy.deepcopy(body)
    bad["nvext"]["worker_id"]["decode_worker_id"] = 2**64
    with pytest.raises(ResponseParseError, match="must be a u64"):
        wire.worker_ids(bad)


# -- the parser's rules, broken one at a time ----------------------------------------------------------------


def engine_body() -> tuple[dict[str, Any], GenerateRequest]:
    cap = vllm("completions_token_prompt_greedy")
    return copy.deepcopy(cap["response"]), request_for(cap)


def test_ids_come_from_engine_data_else_nvext_and_must_agree() -> None:
    body, request = engine_body()
    body["nvext"]["completion_token_ids"][0] = 5
    with pytest.raises(ResponseParseError, match=r"disagree with nvext.completion_token_ids \[5, 1869"):
        wire.parse_generation(body, request, URL)
    body, request = engine_body()
    del body["nvext"]["completion_token_ids"]
    (result,) = wire.parse_generation(body, request, URL)
    assert list(result.completion_ids) == body["nvext"]["engine_data"]["completion_token_ids"]


def test_absent_ids_are_an_error_and_an_empty_list_an_empty_completion() -> None:
    body, request = engine_body()
    del body["nvext"]["completion_token_ids"], body["nvext"]["engine_data"]["completion_token_ids"]
    with pytest.raises(ResponseParseError, match="no completion token ids"):
        wire.parse_generation(body, request, URL)
    body, request = engine_body()
    body["nvext"]["completion_token_ids"] = body["nvext"]["engine_data"]["completion_token_ids"] = []
    body["nvext"]["engine_data"]["completion_logprobs"] = []
    body["usage"]["completion_tokens"] = 0
    body["choices"][0]["finish_reason"] = "stop"
    (result,) = wire.parse_generation(body, request, URL)
    assert result.completion_ids == () and result.logprobs.shape == (0,)
    assert result.finish_reason == "abort"  # "stop" with no token at all (not even EOS) can only be an abort


def test_logprobs_must_align_one_to_one_and_be_real() -> None:
    body, request = engine_body()
    body["nvext"]["engine_data"]["completion_logprobs"].pop()
    with pytest.raises(ResponseParseError, match="7 logprobs for 8 completion ids"):
        wire.parse_generation(body, request, URL)
    for bad in (float("nan"), -9999.0, 0.5, None):
        body, request = engine_body()
        body["nvext"]["engine_data"]["completion_logprobs"][2] = bad
        with pytest.raises(ResponseParseError, match=r"completion_logprobs\[2\]"):
            wire.parse_generation(body, request, URL)


def test_the_mocker_gives_ids_but_no_logprobs() -> None:
    cap = capture("chat_stop_str")
    body = cap["response"]
    nvext = Node(body["nvext"], "$.nvext")
    assert wire.completion_ids(nvext) == (1736,) and wire.stop_reason(nvext) == "t"
    request = GenerateRequest(prompt_ids=list(range(26)), sampling=SamplingParams(max_tokens=16))
    with pytest.raises(ResponseParseError, match="the Dynamo mocker never returns logprobs"):
        wire.parse_generation(body, request, URL)
    stopped = capture("chat_stop_token_ids_32")["response"]["nvext"]
    assert wire.stop_reason(Node(stopped)) == 1002


def test_prompt_echoes_must_match_the_ids_sent() -> None:
    body, request = engine_body()
    other = GenerateRequest(prompt_ids=[*request.prompt_ids[:-1], 7], sampling=SamplingParams(max_tokens=16))
    with pytest.raises(ResponseParseError, match="the worker received 16 prompt ids that differ from the 16 sent"):
        wire.parse_generation(body, other, URL)
    del body["nvext"]["engine_data"]["prompt_token_ids"]
    with pytest.raises(ResponseParseError, match=r"did not generate from nvext.token_data"):
        wire.parse_generation(body, GenerateRequest(prompt_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=16)), URL)


def test_the_abort_trap_is_undone_where_it_can_be_told() -> None:
    body, request = engine_body()
    body["choices"][0]["finish_reason"] = "stop"  # what an aborted request gets from Dynamo 1.6.1
    (plain,) = wire.parse_generation(body, request, URL)
    assert plain.finish_reason == "stop"  # could be EOS: nothing says otherwise
    (aborted,) = wire.parse_generation(wire.Exchange((wire.Sample(body, aborted=True),)), request, URL)
    assert aborted.finish_reason == "abort"
    ignoring = GenerateRequest(prompt_ids=request.prompt_ids, sampling=SamplingParams(max_tokens=16, ignore_eos=True))
    assert wire.parse_generation(body, ignoring, URL)[0].finish_reason == "abort"
    body["nvext"]["stop_reason"] = 1046  # a matched stop id is a real stop, aborted or not
    (stopped,) = wire.parse_generation(wire.Exchange((wire.Sample(body, aborted=True),)), request, URL)
    assert stopped.finish_reason == "stop" and stopped.stop_reason == 1046


def test_samples_carry_the_tracked_weight_version_and_must_match_n() -> None:
    body, request = engine_body()
    exchange = wire.Exchange((wire.Sample(body, weight_version="step-3"), wire.Sample(body)))
    two = GenerateRequest(prompt_ids=request.prompt_ids, sampling=SamplingParams(max_tokens=16, n=2))
    first, second = wire.parse_generation(exchange, two, URL)
    assert (first.weight_version, second.weight_version) == ("step-3", None)
    with pytest.raises(ResponseParseError, match="1 answer\\(s\\) for n=2"):
        wire.parse_generation(body, two, URL)


# -- routed experts (the CPU worker cannot produce them: the documented shape on a real MoE answer) --------


def with_routing(record: Any, where: str = "engine_data") -> tuple[dict[str, Any], GenerateRequest]:
    cap = vllm("moe_completions_routed_experts_requested")
    body = copy.deepcopy(cap["response"])
    (body["nvext"]["engine_data"] if where == "engine_data" else body["nvext"])["routed_experts"] = record
    prompt = body["nvext"]["engine_data"]["prompt_token_ids"]
    return body, GenerateRequest(
        prompt_ids=prompt, return_routed_experts=True, routed_experts_start=10, sampling=SamplingParams(max_tokens=16)
    )


def record(array: np.ndarray, dtype: str = "int32", start: int = 0) -> dict[str, Any]:
    data = base64.b64encode(np.ascontiguousarray(array, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()).decode()
    return {"data": data, "shape": list(array.shape), "start": start, "dtype": dtype}


def test_routed_experts_decode_and_are_trimmed_client_side() -> None:
    routing = (np.arange(19 * 2 * 2).reshape(19, 2, 2) % 8).astype(np.int32)  # 16 prompt + 4 completion - 1
    body, request = with_routing(record(routing))
    (result,) = wire.parse_generation(body, request, URL)
    assert result.routed_experts is not None and result.routed_experts.start == 10
    np.testing.assert_array_equal(result.routed_experts.experts, routing[10:])
    body, request = with_routing(record(routing[5:], dtype="uint8", start=5), where="nvext")  # nvext wins
    (result,) = wire.parse_generation(body, request, URL)
    np.testing.assert_array_equal(result.routed_experts.experts, routing[10:])  # type: ignore[union-attr]


@pytest.mark.parametrize("where", ["engine_data", "nvext"])
def test_routing_lifted_from_the_raw_body_decodes_like_the_parsed_string(where: str) -> None:
    from backends_core.jsonio import dumps, loads_lifting

    routing = (np.arange(19 * 64 * 8).reshape(19, 64, 8) % 8).astype(np.int32)  # 38 KiB of base64: lifted
    body, request = with_routing(record(routing), where=where)
    lifted = loads_lifting(dumps(body), ("routed_experts", "data"))
    assert isinstance(
        (lifted["nvext"] if where == "nvext" else lifted["nvext"]["engine_data"])["routed_experts"]["data"], memoryview
    )
    (from_view,) = wire.parse_generation(lifted, request, URL)
    (from_text,) = wire.parse_generation(body, request, URL)
    assert from_view.routed_experts is not None and from_text.routed_experts is not None
    np.testing.assert_array_equal(from_view.routed_experts.experts, from_text.routed_experts.experts)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r.update(shape=[19, 2, 3]), "not a multiple"),
        (lambda r: r.update(shape=[19, 4]), r"expected \[rows, layers, top_k\].* @ \$\.nvext\.engine_data\.routed"),
        (lambda r: r.update(dtype="float32"), "unsupported dtype"),
        (lambda r: r.update(start=12), "after the requested start 10"),
        (lambda r: r.update(data="%%%"), "not valid base64"),
        (lambda r: r.update(start=-1), r"start must be >= 0, got -1 @ \$\.nvext\.engine_data\.routed_experts\.start"),
        (
            lambda r: r.update(dtype=None),
            r"expected a string, got null @ \$\.nvext\.engine_data\.routed_experts\.dtype",
        ),
        (
            lambda r: r.pop("dtype"),
            r"it names no dtype: read as uint8\) @ \$\.nvext\.engine_data\.routed_experts\.data",
        ),
    ],
)
def test_bad_routing_records_are_refused(change: Any, message: str) -> None:
    routing = np.zeros((19, 2, 2), np.int32) if "start" not in message else np.zeros((7, 2, 2), np.int32)
    rec = record(routing)
    change(rec)
    body, request = with_routing(rec)
    with pytest.raises(ResponseParseError, match=message):
        wire.parse_generation(body, request, URL)


@pytest.mark.parametrize("where", ["engine_data", "nvext"])
@pytest.mark.parametrize("named", [(), ("start",)])
def test_a_routing_record_naming_no_dtype_decodes_as_uint8_like_the_whole_record(
    where: str, named: tuple[str, ...]
) -> None:
    routing = (np.arange(19 * 2 * 2).reshape(19, 2, 2) % 8).astype(np.uint8)  # 16 prompt + 4 completion - 1
    whole = record(routing, dtype="uint8")
    body, request = with_routing(whole, where=where)
    (expected,) = wire.parse_generation(body, request, URL)
    body, request = with_routing({key: whole[key] for key in ("data", "shape", *named)}, where=where)
    (result,) = wire.parse_generation(body, request, URL)
    assert result.routed_experts is not None and expected.routed_experts is not None
    assert result.routed_experts.start == expected.routed_experts.start == 10
    np.testing.assert_array_equal(result.routed_experts.experts, expected.routed_experts.experts)
    np.testing.assert_array_equal(result.routed_experts.experts, routing[10:])
    assert result.routed_experts.experts.dtype == np.uint8


def test_missing_routing_names_the_worker_flag() -> None:
    cap = vllm("moe_completions_routed_experts_requested")  # requested, never returned by the CPU build
    request = GenerateRequest(
        prompt_ids=prompt_of(cap), return_routed_experts=True, sampling=SamplingParams(max_tokens=16)
    )
    with pytest.raises(ResponseParseError, match="--enable-return-routed-experts"):
        wire.parse_generation(cap["response"], request, URL)


# -- teacher logprobs --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "k"), [("chat_teacher_prompt_logprobs", 1), ("completions_teacher_prompt_logprobs0", 0)]
)
def test_teacher_prompt_logprobs_parse_with_nan_at_zero(name: str, k: int) -> None:
    cap = vllm(name)
    ids = cap["response"]["nvext"]["engine_data"]["prompt_token_ids"]
    teacher = wire.parse_teacher(cap["response"], TeacherRequest(token_ids=ids, top_logprobs=k), URL)
    rows = cap["response"]["nvext"]["engine_data"]["prompt_logprobs"]
    assert teacher.logprobs.dtype == np.float32 and np.isnan(teacher.logprobs[0])
    np.testing.assert_allclose(teacher.logprobs[1:], [rows[i][str(ids[i])]["logprob"] for i in range(1, len(ids))])
    if k:
        assert teacher.top_logprobs is not None and teacher.top_logprobs[0] == ()
        assert all(len(row) == 1 and row[0].rank == 1 for row in teacher.top_logprobs[1:])
        assert teacher.top_logprobs[1][0].token_id == 169  # rank 1 at position 1, not the prompt's 426
    else:
        assert teacher.top_logprobs is None


def test_teacher_rows_come_from_nvext_when_engine_data_was_not_asked() -> None:
    cap = vllm("moe_teacher_vs_vllm_peer")
    ids = request_body(cap)["prompt"]
    teacher = wire.parse_teacher(cap["response"], TeacherRequest(token_ids=ids), URL, weight_version="v1")
    assert teacher.weight_version == "v1" and np.isfinite(teacher.logprobs[1:]).all()


def test_teacher_errors_name_what_is_wrong() -> None:
    cap = vllm("completions_teacher_prompt_logprobs0")
    ids = cap["response"]["nvext"]["engine_data"]["prompt_token_ids"]
    with pytest.raises(ResponseParseError, match="the worker received 16 prompt ids that differ from the 17 sent"):
        wire.parse_teacher(cap["response"], TeacherRequest(token_ids=[*ids, 5]), URL)
    body = copy.deepcopy(cap["response"])
    del body["nvext"]["engine_data"]["prompt_token_ids"]
    with pytest.raises(ResponseParseError, match="16 entries for 17 token ids"):
        wire.parse_teacher(body, TeacherRequest(token_ids=[*ids, 5]), URL)
    swapped = [*ids[:-1], 5]
    with pytest.raises(ResponseParseError, match=r"no entry for token 5 \(has \['286'\]\)"):
        wire.parse_teacher(body, TeacherRequest(token_ids=swapped), URL)
    with pytest.raises(ResponseParseError, match="the Dynamo mocker never returns them"):
        wire.parse_teacher(capture("chat_prompt_logprobs")["response"], TeacherRequest(token_ids=[1, 2]), URL)


def test_prompt_ids_of_the_server_come_from_the_engine_record() -> None:
    cap = vllm("chat_teacher_prompt_logprobs")
    assert wire.parse_prompt_ids(cap["response"], URL) == cap["response"]["nvext"]["engine_data"]["prompt_token_ids"]
    with pytest.raises(ResponseParseError, match="the mocker has none"):
        wire.parse_prompt_ids(capture("chat_basic")["response"], URL)


# -- request bodies against what the binary accepts ------------------------------------------------------------


def accepted_nvext_fields() -> set[str]:
    """The nvext fields the 1.6.1 binary lists in its own 400 answer."""
    message = capture("chat_nvext_unknown_field")["response"]["message"]
    return set(re.findall(r"`(\w+)`", message.split("expected one of", 1)[1]))


def accepted_top_level_fields() -> set[str]:
    """Top-level fields of every captured request the frontend answered 200 (plus the extensions the notes list
    as accepted and the OpenAI sampling fields)."""
    fields: set[str] = {"top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"}
    for kind in ("dynamo", "dynamo-vllm"):
        for path in (FIXTURES / kind).glob("*.json"):
            cap = json.loads(path.read_text())
            if isinstance(cap, dict) and "request" in cap and cap.get("status", 200) == 200:
                body = request_body(cap)
                if isinstance(body, dict) and "model" in body:
                    fields |= set(body)
    return fields


def generation_request(**more: Any) -> GenerateRequest:
    sampling = SamplingParams(max_tokens=7, seed=3, top_logprobs=2, stop_token_ids=[5, 6])
    return GenerateRequest(prompt_ids=[1, 2, 3], sampling=sampling, **more)


@pytest.mark.parametrize("transport", ["chat", "completions"])
def test_bodies_send_only_accepted_fields_and_every_sampling_field(transport: str) -> None:
    request = generation_request(cache_salt="v3", priority=2, return_routed_experts=True)
    path, body = wire.generation_payload(request, "tiny-qwen3", transport=transport, metadata=["worker_id", "timing"])
    assert path == ("/v1/chat/completions" if transport == "chat" else "/v1/completions")
    assert set(body) <= accepted_top_level_fields()
    assert set(body["nvext"]) <= accepted_nvext_fields()
    assert set(body["nvext"]["agent_hints"]) == {"priority"}
    for key in ("temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "ignore_eos", "min_tokens"):
        assert key in body
    assert body["n"] == 1 and body["seed"] == 3 and body["return_tokens_as_token_ids"] is True
    assert body["nvext"]["cache_salt"] == "v3" and body["nvext"]["agent_hints"]["priority"] == 2
    assert body["nvext"]["extra_fields"] == [
        "engine_data",
        "completion_token_ids",
        "stop_reason",
        "routed_experts",
        "worker_id",
        "timing",
    ]
    if transport == "chat":
        assert body["nvext"]["token_data"] == [1, 2, 3] and len(body["messages"]) == 1
        assert body["max_completion_tokens"] == 7 and "max_tokens" not in body
        assert body["logprobs"] is True and body["top_logprobs"] == 2
    else:
        assert body["prompt"] == [1, 2, 3] and "token_data" not in body["nvext"]
        assert body["max_tokens"] == 7 and body["logprobs"] == 2


def test_teacher_and_tokenize_bodies_send_only_accepted_fields() -> None:
    for transport in ("chat", "completions"):
        _, body = wire.teacher_payload(TeacherRequest(token_ids=[1, 2, 3], top_logprobs=2), "m", transport=transport)
        assert set(body) <= accepted_top_level_fields() and set(body["nvext"]) <= accepted_nvext_fields()
        assert body["prompt_logprobs"] == 2 and body["temperature"] == 1.0
        assert ("max_completion_tokens" if transport == "chat" else "max_tokens") in body
    _, body = wire.tokenize_payload([{"role": "user", "content": "hi"}], None, {"enable_thinking": False}, "m")
    assert set(body) <= accepted_top_level_fields() and body["nvext"] == {"extra_fields": ["engine_data"]}


def test_plain_requests_have_no_optional_fields() -> None:
    _, body = wire.generation_payload(
        GenerateRequest(prompt_ids=[1], sampling=SamplingParams(max_tokens=16)), "m", transport="chat", stream=True
    )
    assert "return_tokens_as_token_ids" not in body and body["top_logprobs"] == 0
    assert set(body["nvext"]) == {"token_data", "extra_fields"}
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


# -- streams ------------------------------------------------------------------------------------------------


def test_a_streamed_vllm_answer_folds_into_the_same_result() -> None:
    cap = vllm("chat_stream_engine_data")
    chunks = parse_sse(sse_text("chat_stream_engine_data", "dynamo-vllm"))
    assert len(chunks) == len(cap["sse_events"]) - 1  # [DONE] closes the stream
    body = fold(chunks)
    engine = body["nvext"]["engine_data"]
    assert body["nvext"]["completion_token_ids"] == engine["completion_token_ids"]  # the deltas add up
    assert body["usage"]["completion_tokens"] == 6 and len(body["choices"][0]["logprobs"]["content"]) == 6
    (result,) = wire.parse_generation(
        body, GenerateRequest(prompt_ids=engine["prompt_token_ids"], sampling=SamplingParams(max_tokens=16)), URL
    )
    assert list(result.completion_ids) == engine["completion_token_ids"] and result.finish_reason == "length"
    np.testing.assert_array_equal(result.logprobs, np.asarray(engine["completion_logprobs"], np.float32))


@pytest.mark.parametrize(
    ("name", "ids"),
    [
        ("chat_kv_extra_all_stream", [1441, 1673, 1530]),
        ("moe_cmpl_routed_experts_stream", [1455, 1860, 1057]),
        ("cmpl_token_ids_stream", [1708, 1065, 1537, 1129]),
        ("chat_kv_query_instance_id_extra_stream", []),
    ],
)
def test_captured_mocker_streams_fold_their_id_deltas(name: str, ids: list[int]) -> None:
    body = fold(parse_sse(sse_text(name)))
    assert body["nvext"]["completion_token_ids"] == ids
    assert wire.completion_ids(Node(body["nvext"])) == tuple(ids)


def test_stream_metadata_is_kept_from_the_last_chunk() -> None:
    body = fold(parse_sse(sse_text("chat_timing_stream_usage")))
    assert body["object"] == "chat.completion" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3 and "completion_token_ids" not in body["nvext"]
    assert wire.timing(body) is not None and wire.worker_ids(body) is not None
    plain = fold(parse_sse(sse_text("chat_basic_stream")))
    assert plain["choices"][0]["message"]["content"] == "Mañan http dx ❌ πηδά" and "nvext" not in plain
    assert fold(parse_sse(sse_text("chat_kv_query_instance_id_stream")))["nvext"]["token_ids"][0] == 1878


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('data: {"id": 1}\n\n', "ended without 'data: \\[DONE\\]'"),
        ("data: {nope\n\ndata: [DONE]\n\n", "event 0 is not JSON"),
        ('event: error\ndata: {"message": "worker died"}\n\n', "reported an error in event 0: .*worker died"),
    ],
)
def test_broken_streams_are_refused(text: str, message: str) -> None:
    with pytest.raises(ResponseParseError, match=message):
        parse_sse(text)


def test_folding_refuses_what_it_cannot_assign() -> None:
    with pytest.raises(ResponseParseError, match="no chunks"):
        fold([])
    two = [
        {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": "a"}, {"index": 1, "text": "b"}]},
        {"id": "x", "object": "text_completion", "choices": [], "nvext": {"completion_token_ids": [3]}},
    ]
    with pytest.raises(ResponseParseError, match="several choices"):
        fold(two)


def test_results_carry_worker_ids_and_timing_as_metadata() -> None:
    body = vllm("chat_nvext_engine_data_logprobs")["response"]
    prompt = body["nvext"]["engine_data"]["prompt_token_ids"]
    request = GenerateRequest(prompt_ids=prompt, sampling=SamplingParams(max_tokens=8))
    (result,) = wire.parse_generation(body, request, "http://frontend")
    assert result.metadata["worker_id"].decode_worker_id == 17251580120541680439
    assert result.metadata["timing"].total_time_ms == pytest.approx(10467.152843)


def test_an_abort_before_the_first_token_needs_no_logprobs() -> None:
    """Seen live on /v1/completions: aborted before its first token, the answer has no ids, no engine logprobs
    and ``logprobs: null``; that is an empty aborted completion, while ids without logprobs stay an error."""
    cap = vllm("completions_token_prompt_logprobs")
    body = copy.deepcopy(cap["response"])
    del body["nvext"]["engine_data"]
    body["nvext"]["completion_token_ids"] = []
    body["choices"][0]["logprobs"] = None
    body["choices"][0]["finish_reason"] = "stop"
    body["usage"]["completion_tokens"] = 0
    (result,) = wire.parse_generation(body, request_for(cap), URL)
    assert result.completion_ids == () and result.logprobs.shape == (0,) and result.finish_reason == "abort"
    body["nvext"]["completion_token_ids"] = [5]
    body["usage"]["completion_tokens"] = 1
    with pytest.raises(ResponseParseError, match="no logprobs"):
        wire.parse_generation(body, request_for(cap), URL)
