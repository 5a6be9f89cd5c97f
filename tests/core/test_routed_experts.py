from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from backends_core import ResponseParseError, align_routed_experts, decode_routed_experts
from backends_core.jsonnode import Node
from backends_core.routed_experts import decode_routed_object

WIRE = Path(__file__).resolve().parents[1] / "fixtures" / "wire"  # real captures copied from ../shared/wire


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def npy(array: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, array)
    return b64(buf.getvalue())


def test_decodes_a_real_sglang_capture() -> None:
    capture = json.loads((WIRE / "sglang" / "moe_generate_routed.json").read_text())
    meta = capture["response"]["meta_info"]
    experts = decode_routed_experts(meta["routed_experts"], num_layers=2, top_k=2, num_experts=8)
    # prompt 5 + completion 3 - 1 (the last sampled token is never routed) = 7 rows
    assert experts.shape == (meta["prompt_tokens"] + meta["completion_tokens"] - 1, 2, 2)
    assert experts.dtype == np.int32
    assert experts[0].tolist() == [[6, 5], [4, 3]]


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int16", "int32"])
def test_raw_and_npy_payloads_decode_for_every_dtype(dtype: str) -> None:
    array = np.arange(5 * 3 * 2, dtype=dtype).reshape(5, 3, 2) % 8
    raw = decode_routed_experts(b64(array.tobytes()), num_layers=3, top_k=2, dtype=dtype)
    from_npy = decode_routed_experts(npy(array))
    assert np.array_equal(raw, array) and raw.dtype == np.dtype(dtype)
    assert np.array_equal(from_npy, array) and from_npy.dtype == np.dtype(dtype)


def test_decoding_views_the_decoded_bytes_without_copying() -> None:
    array = np.ones((1000, 4, 2), dtype=np.uint8)
    for payload in (b64(array.tobytes()), npy(array)):
        out = decode_routed_experts(payload, num_layers=4, top_k=2, dtype="uint8")
        assert isinstance(out.base, bytes | np.ndarray)
        assert not out.flags.owndata and not out.flags.writeable


def test_fortran_order_npy_keeps_its_layout() -> None:
    array = np.asfortranarray(np.arange(24, dtype=np.int32).reshape(4, 3, 2))
    assert np.array_equal(decode_routed_experts(npy(array)), array)


@pytest.mark.parametrize(
    ("payload", "kwargs", "message"),
    [
        ("not base64!!", {"num_layers": 2, "top_k": 2}, "not valid base64"),
        (b64(b"\x00" * 10), {"num_layers": 2, "top_k": 2}, "10 bytes, not a multiple of 16"),
        (b64(b"\x00" * 16), {}, "num_layers and top_k are needed"),
        (
            b64(np.zeros((2, 2, 2), np.float32).tobytes()),
            {"num_layers": 2, "top_k": 2, "dtype": "float32"},
            "unsupported dtype",
        ),
        (npy(np.zeros((2, 3, 2), np.int32)), {"num_layers": 2}, "has 3 layers, expected 2"),
        (npy(np.zeros((2, 2, 4), np.int32)), {"top_k": 2}, "top_k 4, expected 2"),
        (npy(np.zeros((2, 4), np.int32)), {}, "3 dimensions"),
        (npy(np.full((2, 2, 2), 9, np.int32)), {"num_experts": 8}, "expert ids in [9, 9]"),
        (npy(np.full((2, 2, 2), -1, np.int32)), {}, "expert ids in [-1, -1]"),
        (npy(np.zeros((2, 2, 2), np.float64)), {}, "unsupported dtype"),
        (npy(np.zeros((2, 2, 2), np.int32))[:-8], {}, "payload has"),
        (123, {}, "must be a base64 string"),
    ],
)
def test_bad_payloads_raise_with_the_reason(payload: object, kwargs: dict, message: str) -> None:
    with pytest.raises(ResponseParseError) as info:
        decode_routed_experts(payload, **kwargs)  # type: ignore[arg-type]
    assert message in str(info.value)


def test_align_trims_to_the_wanted_start_when_the_server_honoured_it() -> None:
    rows = np.arange(6 * 2 * 2, dtype=np.int32).reshape(6, 2, 2)  # 10 tokens, server start 3 -> 6 rows
    out = align_routed_experts(rows, total_tokens=10, server_start=3, wanted_start=5)
    assert out.start == 5 and np.array_equal(out.experts, rows[2:])


def test_align_trims_when_the_server_ignored_the_start() -> None:
    rows = np.arange(9 * 2 * 2, dtype=np.int32).reshape(9, 2, 2)  # full routing of 10 tokens
    out = align_routed_experts(rows, total_tokens=10, server_start=4, wanted_start=4)
    assert out.start == 4 and np.array_equal(out.experts, rows[4:])
    assert np.shares_memory(out.experts, rows)


def test_align_refuses_row_counts_that_fit_no_reading() -> None:
    with pytest.raises(ResponseParseError, match="has 7 rows"):
        align_routed_experts(np.zeros((7, 2, 2), np.int32), total_tokens=10, server_start=0, wanted_start=0)
    with pytest.raises(ResponseParseError, match="after the requested start"):
        align_routed_experts(np.zeros((6, 2, 2), np.int32), total_tokens=10, server_start=3, wanted_start=1)


# -- the object form, whole and as prime-rl's vLLM server sent it before it named dtype and start --------------


def routed_object(array: np.ndarray, **fields: object) -> dict[str, object]:
    """``{"data", "shape"}`` of ``array`` (little-endian, C order) and ``fields`` beside them."""
    data = b64(np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes())
    return {"data": data, "shape": list(array.shape), **fields}


@settings(max_examples=200, deadline=None)
@given(
    shape=st.tuples(st.integers(0, 12), st.integers(1, 4), st.integers(1, 4)),
    seed=st.integers(0, 2**32 - 1),
    start=st.integers(0, 50),
)
def test_a_record_without_dtype_or_start_decodes_like_the_whole_record(
    shape: tuple[int, int, int], seed: int, start: int
) -> None:
    array = np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)
    whole, whole_start = decode_routed_object(Node(routed_object(array, start=start, dtype="uint8")))
    for peer in (routed_object(array), routed_object(array, start=start)):
        experts, named_start = decode_routed_object(Node(peer))
        assert experts.dtype == np.uint8 and np.array_equal(experts, whole)
        assert named_start == (whole_start if "start" in peer else None)


@settings(max_examples=200, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 12), st.integers(1, 4), st.integers(1, 4)),
    dtype=st.sampled_from(["uint16", "int16", "int32"]),
)
def test_a_wider_payload_naming_no_dtype_is_refused_naming_the_data(shape: tuple[int, int, int], dtype: str) -> None:
    record = routed_object(np.zeros(shape, dtype), start=0)
    with pytest.raises(ResponseParseError, match=r"it names no dtype: read as uint8\) @ \$\.routed_experts\.data"):
        decode_routed_object(Node(record, "$.routed_experts"))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dtype": None}, r"expected a string, got null @ \$\.r\.dtype"),
        ({"dtype": "float32"}, r"unsupported dtype 'float32'.* @ \$\.r\.dtype"),
        ({"dtype": "uint7"}, r"unknown dtype 'uint7' @ \$\.r\.dtype"),
        ({"start": None}, r"expected an integer, got null @ \$\.r\.start"),
        ({"start": -1}, r"start must be >= 0, got -1 @ \$\.r\.start"),
        ({"shape": [4, 0, 2]}, r"at least one layer and one expert per token.* @ \$\.r\.shape"),
        ({"data": [[[1, 2]]]}, r"\$\.r\.data must be a base64 string, got list"),
    ],
)
def test_a_present_but_bad_field_is_refused_by_name(change: dict[str, object], message: str) -> None:
    with pytest.raises(ResponseParseError, match=message):
        decode_routed_object(Node({**routed_object(np.zeros((4, 3, 2), np.uint8)), **change}, "$.r"))
