"""``wire.parse_generate``, which takes the usual answer in bulk, against a value-by-value walk through
:class:`Node` kept here as the reference: on real captures, on a benchmark-sized answer with routed experts, and
on fuzzed mutations, the outcome (results or the exact error) is the walk's."""

from __future__ import annotations

import base64
import copy
import io
import json
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from backends_core import GenerateRequest, GenerateResult, ResponseParseError, SamplingParams
from backends_core.jsonnode import Node
from backends_core.types import TopLogprob, WeightVersionSpan
from backends_vllm import wire

CAPTURES = Path(__file__).resolve().parents[2] / "fixtures" / "wire" / "vllm"
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def capture(name: str) -> dict[str, Any]:
    return json.loads((CAPTURES / f"{name}.json").read_text())


def npy_b64(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return base64.b64encode(buffer.getvalue()).decode()


PROMPT = list(range(100, 116))
COMPLETION = [7, 8, 9, 10]


def answer(*, routed: bool = False, n: int = 1) -> dict[str, Any]:
    rows = len(PROMPT) + len(COMPLETION) - 1 - 2
    experts = np.arange(rows * 3 * 2, dtype=np.uint8).reshape(rows, 3, 2) % 8
    choice = {
        "finish_reason": "length",
        "stop_reason": None,
        "token_ids": COMPLETION,
        "routed_experts": npy_b64(experts) if routed else None,
        "weight_versions": [{"version": "v1", "start": 0, "end": 4}],
        "logprobs": {
            "content": [
                {"token_id": t, "logprob": -0.5 - i / 8, "rank": 1, "top_logprobs": []}
                for i, t in enumerate(COMPLETION)
            ]
        },
    }
    choices = [dict(copy.deepcopy(choice), index=n - 1 - i) for i in range(n)]
    usage = {"prompt_tokens": len(PROMPT), "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 3}}
    return {"request_id": "generate-tokens-x", "usage": usage, "choices": choices}


REQUEST = GenerateRequest(prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=4))
ROUTED = GenerateRequest(
    prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=4), return_routed_experts=True, routed_experts_start=2
)


def walk_generate(raw: Any, request: GenerateRequest, server_url: str) -> list[GenerateResult]:
    """The reference: every value read through :class:`Node`, one at a time, in the parser's order."""
    body = Node(raw, "$", server_url)
    request_id = body.get("request_id").string()
    results = []
    for choice in wire._choices(body, request.sampling.n):
        completion = wire._ids(choice.get("token_ids"))
        entries = choice.get("logprobs").get("content").items() if choice.get("logprobs").value is not None else None
        if entries is None:
            raise choice.get("logprobs").fail("no logprobs in the answer (sampling_params.logprobs was sent)")
        if len(entries) != len(completion):
            raise (
                choice.get("logprobs")
                .get("content")
                .fail(f"{len(entries)} logprob entries for {len(completion)} token ids")
            )
        logprobs = np.empty(len(completion), dtype=np.float32)
        top: list[tuple[TopLogprob, ...]] = []
        k = request.sampling.top_logprobs
        for i, (token, entry) in enumerate(zip(completion, entries, strict=True)):
            claimed = entry.get("token_id").integer()
            if claimed != token:
                raise entry.get("token_id").fail(
                    f"logprob entry is for token {claimed} but completion id {i} is {token}"
                )
            logprobs[i] = entry.get("logprob").logprob()
            if k:
                alts = [
                    TopLogprob(
                        token_id=a.get("token_id").integer(),
                        logprob=a.get("logprob").logprob(),
                        rank=a.get("rank", required=False).optional_integer(),
                    )
                    for a in entry.get("top_logprobs").items()
                ]
                top.append(wire._top_k(alts, k, entry.get("top_logprobs")))
        spans = tuple(
            WeightVersionSpan(
                version=s.get("version").string() or "", start=s.get("start").integer(), end=s.get("end").integer()
            )
            for s in choice.get("weight_versions", required=False).optional_items() or ()
        )
        results.append(
            GenerateResult(
                prompt_ids=request.prompt_ids,
                completion_ids=completion,
                logprobs=logprobs,
                finish_reason=wire._finish(choice),
                stop_reason=wire._stop_reason(choice),
                top_logprobs=tuple(top) if k else None,
                routed_experts=wire._routed(choice, request, completion, len(request.prompt_ids)),
                weight_version=spans[-1].version if spans else None,
                weight_versions=spans,
                usage=wire._usage(body, len(completion), len(request.prompt_ids)),
                request_id=request_id,
                server=server_url,
            )
        )
    return results


def outcome(parse: Any, raw: Any, request: GenerateRequest) -> Any:
    try:
        return ("ok", parse(raw, request, "http://v"))
    except ResponseParseError as exc:
        return ("error", str(exc))


@pytest.mark.parametrize(
    ("raw", "request_"),
    [
        (answer(), REQUEST),
        (answer(routed=True), ROUTED),
        (answer(n=3), GenerateRequest(prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=4, n=3))),
        (capture("moe_generate")["response"]["body"], None),
    ],
)
def test_the_usual_answers_give_the_walks_results(raw: Any, request_: Any) -> None:
    if request_ is None:
        body = capture("moe_generate")["request"]["body"]
        request_ = GenerateRequest(prompt_ids=body["token_ids"], sampling=SamplingParams(max_tokens=4))
    assert wire.parse_generate(raw, request_, "http://v") == walk_generate(raw, request_, "http://v")


def test_alternatives_and_integer_logprobs_give_the_walks_results() -> None:
    raw = answer()
    raw["choices"][0]["logprobs"]["content"][1]["logprob"] = -1
    assert wire.parse_generate(raw, REQUEST, "http://v") == walk_generate(raw, REQUEST, "http://v")
    alternatives = GenerateRequest(prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=4, top_logprobs=1))
    for entry in raw["choices"][0]["logprobs"]["content"]:
        entry["top_logprobs"] = [{"token_id": entry["token_id"], "logprob": entry["logprob"], "rank": 1}]
    assert wire.parse_generate(raw, alternatives, "http://v") == walk_generate(raw, alternatives, "http://v")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda r: r["choices"][0]["logprobs"]["content"][2].update(token_id=99), "logprob entry is for token 99"),
        (lambda r: r["choices"][0]["logprobs"]["content"][0].update(logprob=float("nan")), "not a finite"),
        (lambda r: r["choices"][0]["logprobs"]["content"][0].update(logprob=-9999.0), "not a finite"),
        (lambda r: r["choices"][0]["token_ids"].append(True), "expected an integer, got True"),
        (lambda r: r["choices"][0].update(finish_reason="tool_calls"), "finish_reason"),
        (lambda r: r["usage"].update(prompt_tokens=3), "prompt_tokens is 3"),
        (lambda r: r["choices"][0].update(routed_experts=None), "routed experts were requested"),
        (lambda r: r["choices"][0].update(routed_experts="QQ=?"), "not valid base64"),
    ],
)
def test_refusals_are_the_walks_errors(edit: Any, message: str) -> None:
    raw = answer(routed=True)
    edit(raw)
    got = outcome(wire.parse_generate, raw, ROUTED)
    assert got == outcome(walk_generate, raw, ROUTED)
    assert got[0] == "error" and message in got[1]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 2**33) | st.floats(allow_nan=True) | st.text(max_size=6),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=8,
)


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += paths(v, (*prefix, i))
    return out


@st.composite
def mutated(draw: Any, original: Any) -> Any:
    doc = copy.deepcopy(original)
    for _ in range(draw(st.integers(1, 3))):
        candidates = [p for p in paths(doc) if p]
        path = draw(st.sampled_from(candidates))
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        op = draw(st.sampled_from(["replace", "delete"]))
        if op == "delete" and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(json_values)
    return doc


@SETTINGS
@given(raw=mutated(answer(routed=True)), routed=st.booleans())
def test_on_any_mutation_parse_generate_answers_like_the_walk(raw: Any, routed: bool) -> None:
    request = ROUTED if routed else REQUEST
    assert outcome(wire.parse_generate, raw, request) == outcome(walk_generate, raw, request)
