"""``wire.StreamFold`` reads the usual generate chunk with plain type checks (``_plain_token_chunk``) and every
other one field by field. Folded both ways (the field-by-field way alone as the reference), a stream gives the same
deltas, the same state, the same final result, or the same error: on the usual stream and on fuzzed mutations of
its chunks (wrong types, bools and floats for ints, NaN / infinite / positive / placeholder logprobs, ids that do
not match their entries, extra choices, a finish or routed experts on a chunk, missing fields)."""

from __future__ import annotations

import copy
import math
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from backends_core import GenerateRequest, ResponseParseError, SamplingParams, StreamDelta
from backends_vllm import wire

SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PROMPT = list(range(100, 116))
COMPLETION = [7, 8, 9, 10]
REQUEST = GenerateRequest(prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=4))


def chunks(completion: list[int] = COMPLETION, per_chunk: int = 1) -> list[Any]:
    """The chunks vLLM 0.32 streams for ``completion`` on ``/inference/v1/generate`` (with the usage chunk)."""
    out: list[Any] = []
    for at in range(0, len(completion), per_chunk):
        ids = completion[at : at + per_chunk]
        last = at + per_chunk >= len(completion)
        choice = {
            "index": 0,
            "finish_reason": "length" if last else None,
            "stop_reason": None,
            "token_ids": ids,
            "routed_experts": None,
            "sampling_mask": None,
            "weight_versions": [{"version": "v1", "start": 0, "end": len(completion)}] if last else None,
            "logprobs": {
                "content": [
                    {"token_id": t, "logprob": -0.5 - (at + i) / 8, "rank": 1, "top_logprobs": []}
                    for i, t in enumerate(ids)
                ]
            },
        }
        out.append({"request_id": "generate-tokens-x", "usage": None, "output_mode": "tokens", "choices": [choice]})
    usage = {"prompt_tokens": len(PROMPT), "total_tokens": len(PROMPT) + len(completion)}
    usage["completion_tokens"] = len(completion)
    out.append({"request_id": "generate-tokens-x", "usage": usage, "output_mode": "tokens", "choices": []})
    return out


def fold(raws: list[Any], *, plain: bool, request: GenerateRequest = REQUEST) -> Any:
    """Each chunk's delta (ids, logprob bytes) and the fold's state after it, then the result; or the error."""
    f = wire.StreamFold(request, "http://v", transport="generate")
    f._plain = plain and f._plain
    out: list[Any] = []
    try:
        for raw in raws:
            delta = f.chunk(raw)
            state = (f.chunks, f.request_id, list(f.ids), copy.deepcopy(f.entries), f.finish, f.usage)
            if delta is None:
                out.append((None, state))
            else:
                assert isinstance(delta, StreamDelta) and delta.logprobs.dtype == np.float32
                out.append(((delta.completion_ids, delta.logprobs.tobytes()), state))
        out.append(f.result())
    except ResponseParseError as exc:
        out.append(("error", str(exc)))
    return out


def test_the_usual_chunks_take_the_plain_way_and_fold_to_the_reference() -> None:
    f = wire.StreamFold(REQUEST, "http://v", transport="generate")
    assert all(f._plain_token_chunk(raw) is not None for raw in chunks()[:-2])  # all but the finish and usage
    for per_chunk in (1, 2, 3):
        raws = chunks(per_chunk=per_chunk)
        assert fold(raws, plain=True) == fold(raws, plain=False)
        assert not isinstance(fold(raws, plain=True)[-1], tuple)  # a result, no error


def test_alternatives_asked_for_or_the_completions_transport_never_take_the_plain_way() -> None:
    top = GenerateRequest(prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=4, top_logprobs=2))
    assert not wire.StreamFold(top, "http://v", transport="generate")._plain
    assert not wire.StreamFold(REQUEST, "http://v", transport="completions")._plain


BAD_VALUES = [
    None,
    True,
    False,
    0,
    1,
    -1,
    7.0,
    "7",
    [],
    {},
    [7],
    math.nan,
    math.inf,
    -math.inf,
    0.5,
    1e-3,
    0.0,
    -9999.0,
    -9999,
    -1e300,
]
PATHS = [
    ("request_id",),
    ("choices",),
    ("choices", 0),
    ("choices", 0, "index"),
    ("choices", 0, "finish_reason"),
    ("choices", 0, "token_ids"),
    ("choices", 0, "token_ids", 0),
    ("choices", 0, "routed_experts"),
    ("choices", 0, "logprobs"),
    ("choices", 0, "logprobs", "content"),
    ("choices", 0, "logprobs", "content", 0),
    ("choices", 0, "logprobs", "content", 0, "token_id"),
    ("choices", 0, "logprobs", "content", 0, "logprob"),
]


def mutate(raw: Any, path: tuple[Any, ...], value: Any, how: str) -> Any:
    raw = copy.deepcopy(raw)
    node = raw
    for key in path[:-1]:
        node = node[key]
    last = path[-1]
    if how == "delete" and isinstance(node, dict):
        node.pop(last, None)
    elif how == "append" and isinstance(node[last], list):
        node[last].append(copy.deepcopy(node[last][0]) if node[last] else value)
    else:
        node[last] = value
    return raw


@SETTINGS
@given(
    at=st.integers(0, len(COMPLETION)),
    path=st.sampled_from(PATHS),
    value=st.sampled_from(BAD_VALUES),
    how=st.sampled_from(["set", "set", "delete", "append"]),
    per_chunk=st.sampled_from([1, 2]),
)
def test_a_mutated_chunk_folds_to_the_reference_outcome(
    at: int, path: tuple[Any, ...], value: Any, how: str, per_chunk: int
) -> None:
    raws = chunks(per_chunk=per_chunk)
    at = min(at, len(raws) - 1)
    try:
        raws[at] = mutate(raws[at], path, value, how)
    except (IndexError, KeyError, TypeError):  # the path is not in this chunk (the usage chunk has no choice)
        return
    assert fold(raws, plain=True) == fold(raws, plain=False)


@pytest.mark.parametrize(
    "change",
    [
        lambda c: c["choices"][0]["logprobs"]["content"][0].update(token_id=99),  # entry for another id
        lambda c: c["choices"][0].update(token_ids=[True]),  # a bool for an id
        lambda c: c["choices"][0]["logprobs"]["content"][0].update(logprob=-1),  # an int logprob (valid)
        lambda c: c["choices"][0]["logprobs"]["content"][0].update(logprob=math.nan),
        lambda c: c["choices"][0].update(index=True),
        lambda c: c.update(request_id=7),
        lambda c: c["choices"][0].update(token_ids=[]),
        lambda c: c["choices"][0].update(routed_experts="AAAA"),
        lambda c: c["choices"].append(copy.deepcopy(c["choices"][0])),
    ],
)
def test_unusual_chunks_are_left_to_the_field_by_field_way(change: Any) -> None:
    raws = chunks()
    change(raws[1])
    f = wire.StreamFold(REQUEST, "http://v", transport="generate")
    f.chunk(raws[0])
    before = (f.chunks, list(f.ids), list(f.entries))
    assert f._plain_token_chunk(raws[1]) is None
    assert (f.chunks, list(f.ids), list(f.entries)) == before  # refused before any state changed
    assert fold(raws, plain=True) == fold(raws, plain=False)
