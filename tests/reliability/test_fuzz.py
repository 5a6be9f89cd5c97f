"""Fuzzing: arbitrary and mutated real captures into every backend's response parsers and the routed-experts decoder.
Only documented error types may escape, and anything returned must satisfy the result invariants."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import numpy as np
from hypothesis import HealthCheck, given, settings

from backends_core import GenerateRequest, ResponseParseError, SamplingParams, TeacherRequest, decode_routed_experts
from backends_core.driver import check_result, check_teacher
from backends_dynamo import wire as dynamo_wire
from backends_sglang import wire as sglang_wire
from backends_sglang.experts import RoutingGeometry
from backends_testkit.reference import wire as reference_wire
from backends_vllm import wire as vllm_wire

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "wire"
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


def body(name: str) -> Any:
    return json.loads((FIXTURES / name).read_text())["response"]["body"]


def paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += paths(v, (*prefix, i))
    return out


@st.composite
def mutated(draw, original: Any) -> Any:
    """The capture with 1-3 random edits: a value replaced, a key deleted, or a list shortened."""
    doc = copy.deepcopy(original)
    for _ in range(draw(st.integers(1, 3))):
        candidates = [p for p in paths(doc) if p]
        if not candidates:
            break
        path = draw(st.sampled_from(candidates))
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        op = draw(st.sampled_from(["replace", "delete", "shorten"]))
        if op == "delete" and isinstance(parent, dict):
            del parent[path[-1]]
        elif op == "shorten" and isinstance(parent[path[-1]], list) and parent[path[-1]]:
            parent[path[-1]].pop()
        else:
            parent[path[-1]] = draw(json_values)
    return doc


GENERATE_CAPTURE = body("vllm/generate_tokens_logprobs.json")
GEN_REQUEST = GenerateRequest(
    prompt_ids=json.loads((FIXTURES / "vllm/generate_tokens_logprobs.json").read_text())["request"]["body"][
        "token_ids"
    ],
    sampling=SamplingParams(max_tokens=5, top_logprobs=1),
)
TEACHER_CAPTURE = body("vllm/completions_teacher_prompt_logprobs.json")
TEACHER_REQUEST = TeacherRequest(
    token_ids=json.loads((FIXTURES / "vllm/completions_teacher_prompt_logprobs.json").read_text())["request"]["body"][
        "prompt"
    ]
)


def parse_or_refuse(parse, raw) -> list:
    try:
        results = parse(raw)
    except ResponseParseError:
        return []
    return results if isinstance(results, list) else [results]


@SETTINGS
@given(raw=mutated(GENERATE_CAPTURE) | json_values)
def test_vllm_generate_parser(raw) -> None:
    for result in parse_or_refuse(lambda r: vllm_wire.parse_generate(r, GEN_REQUEST, "http://v"), raw):
        check_result(result, where="fuzz", url=None)


@SETTINGS
@given(raw=mutated(GENERATE_CAPTURE) | json_values)
def test_vllm_generate_parser_with_routed_experts(raw) -> None:
    request = GenerateRequest(
        prompt_ids=GEN_REQUEST.prompt_ids,
        return_routed_experts=True,
        routed_experts_start=3,
        sampling=SamplingParams(max_tokens=16),
    )
    for result in parse_or_refuse(lambda r: vllm_wire.parse_generate(r, request, "http://v"), raw):
        check_result(result, where="fuzz", url=None)


@SETTINGS
@given(raw=mutated(TEACHER_CAPTURE) | json_values)
def test_vllm_teacher_parser(raw) -> None:
    for result in parse_or_refuse(
        lambda r: vllm_wire.parse_prompt_logprobs(r, TEACHER_REQUEST, "http://v", transport="completions"), raw
    ):
        check_teacher(result, TEACHER_REQUEST, url=None)


REFERENCE_CAPTURE = {
    "request_id": "r",
    "weight_version": "default",
    "prompt_tokens": 3,
    "cached_tokens": 0,
    "samples": [
        {
            "output_ids": [5, 6],
            "output_logprobs": [-1.0, -2.0],
            "top_logprobs": [[[5, -1.0]], [[6, -2.0]]],
            "finish_reason": "length",
            "stop_reason": None,
            "routed_experts": None,
            "routed_experts_start": 0,
            "weight_versions": [{"version": "default", "start": 0, "end": 2}],
        }
    ],
}


@SETTINGS
@given(raw=mutated(REFERENCE_CAPTURE) | json_values)
def test_reference_generate_parser(raw) -> None:
    request = GenerateRequest(prompt_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=16, top_logprobs=1))
    for result in parse_or_refuse(lambda r: reference_wire.parse_generate(r, request, "http://r"), raw):
        check_result(result, where="fuzz", url=None)


@SETTINGS
@given(
    payload=st.binary(max_size=200).map(lambda b: __import__("base64").b64encode(b).decode()) | st.text(max_size=50),
    layers=st.integers(1, 4),
    top_k=st.integers(1, 4),
    dtype=st.sampled_from(["uint8", "uint16", "int16", "int32", "float32"]),
)
def test_routed_experts_decoder(payload, layers, top_k, dtype) -> None:
    try:
        out = decode_routed_experts(payload, num_layers=layers, top_k=top_k, dtype=dtype, num_experts=8)
    except ResponseParseError:
        return
    assert out.ndim == 3 and out.shape[1:] == (layers, top_k)
    assert out.size == 0 or (int(out.min()) >= 0 and int(out.max()) < 8)
    assert np.issubdtype(out.dtype, np.integer)


# -- SGLang and Dynamo ------------------------------------------------------------------------------------


def capture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())


SGLANG_ROUTED = capture("sglang/moe_generate_routed.json")
SGLANG_REQUEST = GenerateRequest(
    prompt_ids=SGLANG_ROUTED["request"]["json"]["input_ids"],
    sampling=SamplingParams(max_tokens=3),
    return_routed_experts=True,
)
SGLANG_SCORE = capture("sglang/score_max0.json")
SGLANG_TEACHER = TeacherRequest(token_ids=SGLANG_SCORE["request"]["json"]["input_ids"])
DYNAMO_ANSWER = capture("dynamo-vllm/chat_nvext_engine_data_logprobs.json")["response"]
DYNAMO_REQUEST = GenerateRequest(
    prompt_ids=DYNAMO_ANSWER["nvext"]["engine_data"]["prompt_token_ids"], sampling=SamplingParams(max_tokens=8)
)


@SETTINGS
@given(raw=mutated(SGLANG_ROUTED["response"]) | json_values)
def test_sglang_generate_parser(raw) -> None:
    geometry = RoutingGeometry(num_layers=2, top_k=2, source="test")
    for result in parse_or_refuse(lambda r: sglang_wire.parse_generate(r, SGLANG_REQUEST, "http://s", geometry), raw):
        check_result(result, where="fuzz", url=None)


@SETTINGS
@given(raw=mutated(SGLANG_SCORE["response"]) | json_values)
def test_sglang_teacher_parser(raw) -> None:
    for result in parse_or_refuse(lambda r: sglang_wire.parse_teacher(r, SGLANG_TEACHER, "http://s"), raw):
        check_teacher(result, SGLANG_TEACHER, url=None)


@SETTINGS
@given(raw=mutated(DYNAMO_ANSWER) | json_values)
def test_dynamo_generate_parser(raw) -> None:
    for result in parse_or_refuse(lambda r: dynamo_wire.parse_generation(r, DYNAMO_REQUEST, "http://d"), raw):
        check_result(result, where="fuzz", url=None)
