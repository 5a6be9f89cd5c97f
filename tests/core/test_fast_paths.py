"""The fast paths behind the benchmarks give exactly what the slow paths give, and fail the same way:
pybase64 vs binascii strict mode, orjson vs the stdlib, routed experts lifted out of the raw body as memoryviews,
and the bulk checks of result ids and prompt ids."""

from __future__ import annotations

import base64
import binascii
import enum
import io
import json
import operator

import attrs
import httpx
import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from backends_core import GenerateResult, InvalidRequestError, ResponseParseError, SamplingParams, decode_routed_experts
from backends_core.client import _with_cache_salt
from backends_core.driver import check_result
from backends_core.jsonio import dumps, loads, loads_lifting
from backends_core.routed_experts import _b64decode, npy_base64_length
from backends_core.server import Server
from backends_core.types import GenerateRequest, _token_ids

B64_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def strict(payload: bytes) -> bytes | str:
    try:
        return binascii.a2b_base64(payload, strict_mode=True)
    except (binascii.Error, ValueError) as exc:
        return f"error: {exc}"


def fast(payload: bytes) -> bytes | str:
    try:
        return _b64decode(payload)
    except (binascii.Error, ValueError) as exc:
        return f"error: {exc}"


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=B64_CHARS + "=\n -_.\x00é", max_size=24))
def test_base64_decoding_accepts_refuses_and_words_errors_like_binascii_strict(text: str) -> None:
    payload = text.encode()
    assert fast(payload) == strict(payload)


@pytest.mark.parametrize("payload", [b"", b"QQ==", b"QUJD=", b"QUJD====", b"QQ==QQ==", b"=QQ=", b"QQ", b"Q\nUJD"])
def test_base64_padding_edge_cases_match_binascii_strict(payload: bytes) -> None:
    assert fast(payload) == strict(payload)


def npy_b64(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return base64.b64encode(buffer.getvalue()).decode()


def test_a_memoryview_payload_decodes_like_the_string_without_copying_the_text() -> None:
    array = np.random.default_rng(0).integers(0, 128, size=(300, 48, 8), dtype=np.uint8)
    text = npy_b64(array)
    body = b'{"x":"' + text.encode() + b'"}'
    view = memoryview(body)[6:-2]
    from_view = decode_routed_experts(view)
    assert np.array_equal(from_view, decode_routed_experts(text)) and np.array_equal(from_view, array)
    owner = from_view
    while isinstance(owner, np.ndarray):
        owner = owner.base
    assert isinstance(owner, bytes)  # a view of the one decoded buffer
    raw = base64.b64encode(array.tobytes())
    from_raw = decode_routed_experts(memoryview(raw), num_layers=48, top_k=8, dtype="uint8")
    assert np.array_equal(from_raw, array)
    with pytest.raises(ResponseParseError, match="not valid base64"):
        decode_routed_experts(memoryview(b"QQ=?"))


def routed_body(*payloads: str, spaced: bool = False) -> bytes:
    sep = ": " if spaced else ":"
    choices = ",".join(
        f'{{"index"{sep}{i},"token_ids":[1,2],"routed_experts"{sep}"{p}","logprobs":{{"content":[{{"token_id":1}}]}}}}'
        for i, p in enumerate(payloads)
    )
    return f'{{"request_id":"r","choices":[{choices}],"usage":{{"prompt_tokens":3}}}}'.encode()


def plain(value: object) -> object:
    """``value`` with every memoryview turned back into the str it was cut from."""
    if isinstance(value, memoryview):
        return value.tobytes().decode()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


@pytest.mark.parametrize("spaced", [False, True])
def test_large_strings_come_back_as_views_of_the_body_and_the_rest_parses_as_usual(spaced: bool) -> None:
    first, second = "A" * 8192, "QUJD" * 3000
    body = routed_body(first, second, spaced=spaced)
    parsed = loads_lifting(body, ("routed_experts",))
    assert [type(ch["routed_experts"]) for ch in parsed["choices"]] == [memoryview, memoryview]
    assert plain(parsed) == json.loads(body)
    assert parsed["choices"][0]["routed_experts"].obj is body  # no copy of the base64 text


def test_small_absent_or_maybe_escaped_ending_strings_are_parsed_as_usual() -> None:
    small = routed_body("QUJD")
    assert loads_lifting(small, ("routed_experts",)) == json.loads(small)
    assert loads_lifting(b'{"routed_experts":null}', ("routed_experts",)) == {"routed_experts": None}
    quoted = routed_body("A" * 5000 + '\\"' + "B" * 10)  # its first quote is escaped: the end is further
    assert loads_lifting(quoted, ("routed_experts",)) == json.loads(quoted)


def test_an_escaped_payload_is_lifted_raw_and_decodes_like_the_parsed_string() -> None:
    array = np.random.default_rng(1).integers(0, 128, size=(300, 48, 8), dtype=np.uint8)
    text = npy_b64(array)
    body = routed_body(text.replace("/", "\\/"))  # JSON may escape every "/"
    assert b"\\/" in body
    lifted = loads_lifting(body, ("routed_experts",), sized=npy_base64_length)["choices"][0]["routed_experts"]
    assert isinstance(lifted, memoryview) and b"\\/" in lifted.tobytes()
    assert np.array_equal(decode_routed_experts(lifted), array)
    assert np.array_equal(decode_routed_experts(json.loads(body)["choices"][0]["routed_experts"]), array)
    with pytest.raises(ResponseParseError, match="not valid base64"):
        decode_routed_experts(memoryview(b"QUJD\\nQUJD"))  # an escape that unescapes to no base64


@pytest.mark.parametrize(
    "array",
    [
        np.zeros((0, 48, 8), np.uint8),
        np.arange(7 * 3 * 2, dtype=np.int32).reshape(7, 3, 2),
        np.ones((1279, 48, 8), np.uint16),
        np.ones((5, 4, 2), np.int16)[:, ::2],  # not contiguous: saved in C order
    ],
)
@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
def test_the_base64_length_of_a_npy_payload_is_read_from_its_header(
    array: np.ndarray, version: tuple[int, int]
) -> None:
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, array, version=version)
    text = base64.b64encode(buffer.getvalue())
    assert npy_base64_length(memoryview(text + b'","more":1}')) == len(text)


def test_what_is_not_a_readable_npy_payload_has_no_length() -> None:
    text = npy_b64(np.ones((4, 2, 2), np.uint8)).encode()
    assert npy_base64_length(memoryview(text[:12])) is None  # cut before its header ends
    assert npy_base64_length(memoryview(b"QUJD" * 100)) is None  # raw bytes, no header
    raw = base64.b64decode(text)
    broken = base64.b64encode(raw[:10] + b"{'descr': 'nope'" + raw[26:])
    assert npy_base64_length(memoryview(broken)) is None


def test_a_sized_payload_is_lifted_without_scanning_and_a_wrong_size_falls_back_to_scanning() -> None:
    text = npy_b64(np.ones((600, 48, 8), np.uint8))
    body = routed_body(text, "A" * 9000)
    calls: list[int] = []

    def sized(view: memoryview) -> int | None:
        calls.append(len(view))
        return npy_base64_length(view)

    parsed = loads_lifting(body, ("routed_experts",), sized=sized)
    assert plain(parsed) == json.loads(body) and len(calls) == 2
    wrong = loads_lifting(body, ("routed_experts",), sized=lambda view: 5000)  # no quote there: scanned instead
    assert plain(wrong) == json.loads(body)


def test_a_key_look_alike_inside_a_string_or_a_forged_placeholder_changes_nothing() -> None:
    inside = json.dumps({"text": '"routed_experts":"' + "A" * 5000, "routed_experts": "B" * 5000}).encode()
    assert plain(loads_lifting(inside, ("routed_experts",))) == json.loads(inside)
    forged = json.dumps({"a": "\x00deadbeefdeadbeef:0", "routed_experts": "C" * 5000}).encode()
    assert plain(loads_lifting(forged, ("routed_experts",))) == json.loads(forged)


def test_not_json_still_raises_the_stdlib_error() -> None:
    for bad in (b'{"routed_experts":"' + b"A" * 5000, b"{", b"\xff\xfe"):
        with pytest.raises((json.JSONDecodeError, UnicodeDecodeError)):
            loads_lifting(bad, ("routed_experts",))
        with pytest.raises((json.JSONDecodeError, UnicodeDecodeError)):
            loads(bad)


def test_what_orjson_refuses_takes_the_stdlib_path() -> None:
    assert loads(b'{"a": NaN, "b": 123456789012345678901234567890}')["b"] == 123456789012345678901234567890
    assert np.isnan(loads(b'{"a": NaN}')["a"])
    assert json.loads(dumps({1: "a", "big": 2**70})) == {"1": "a", "big": 2**70}
    assert dumps({"ids": (1, 2), "x": 0.5}) == b'{"ids":[1,2],"x":0.5}'

    class Flavour(enum.IntEnum):
        A = 3

    assert dumps({"k": Flavour.A}) == json.dumps({"k": Flavour.A}, separators=(",", ":")).encode()


async def test_server_request_lifts_only_when_asked() -> None:
    body = routed_body("D" * 6000)

    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body, headers={"content-type": "application/json"})

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    server = Server(base_url="http://s", admin_url="http://s", data_client=client, admin_client=client)
    lifted = await server.request("POST", "/g", json_body={"a": 1}, large_strings=("routed_experts",))
    assert isinstance(lifted["choices"][0]["routed_experts"], memoryview)
    assert plain(lifted) == await server.request("POST", "/g", json_body={"a": 1})
    await client.aclose()


def result(ids: tuple[object, ...]) -> GenerateResult:
    return GenerateResult(
        prompt_ids=(1,),
        completion_ids=ids,  # type: ignore[arg-type]
        logprobs=np.zeros(len(ids), np.float32),
        finish_reason="stop",
    )


@pytest.mark.parametrize(("ids", "bad"), [((1, True), "True"), ((1, -2), "-2"), ((3, 1.0), "1.0"), ((4, "5"), "'5'")])
def test_completion_ids_checks_name_the_first_bad_id(ids: tuple[object, ...], bad: str) -> None:
    with pytest.raises(ResponseParseError, match=f"completion id {bad} is not a token id"):
        check_result(result(ids), where="sample 0", url=None)
    check_result(result((0, 5, 7)), where="sample 0", url=None)
    check_result(result(()), where="sample 0", url=None)


def reference_token_ids(ids: tuple[object, ...], what: str) -> tuple[int, ...] | str:
    """What the one-pass check must decide, item by item: ints and integer types (not bools), none negative."""
    out = []
    for i, v in enumerate(ids):
        if isinstance(v, bool) or not hasattr(type(v), "__index__"):
            return f"{what} must be a sequence of ints: item {i} is {v!r}"
        if operator.index(v) < 0:
            return f"{what} contains a negative token id: {operator.index(v)} at position {i}"
        out.append(operator.index(v))
    return tuple(out)


class Token(enum.IntEnum):
    A = 4


token_items = st.one_of(
    st.integers(min_value=-3, max_value=2**70),
    st.integers(min_value=0, max_value=200).map(np.int64),
    st.integers(min_value=0, max_value=200).map(np.uint32),
    st.booleans(),
    st.floats(allow_nan=True),
    st.sampled_from(["1", b"1", None, Token.A, 1 + 0j]),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(st.integers(min_value=0, max_value=10**6), token_items), max_size=12))
def test_token_id_check_decides_like_an_item_by_item_check(items: list[object]) -> None:
    ids = tuple(items)
    expected = reference_token_ids(ids, "prompt_ids")
    try:
        got: tuple[int, ...] | str = _token_ids(ids, "prompt_ids")
    except InvalidRequestError as exc:
        got = str(exc)
    assert got == expected
    if isinstance(got, tuple):
        assert all(type(t) is int or type(t) is Token for t in got)


def test_a_request_keeps_the_callers_tuple_of_ints_and_converts_other_sequences() -> None:
    ids = (5, 6, 7)
    assert GenerateRequest(prompt_ids=ids, sampling=SamplingParams(max_tokens=16)).prompt_ids is ids
    assert GenerateRequest(prompt_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=16)).prompt_ids == ids
    converted = GenerateRequest(prompt_ids=np.array([5, 6, 7]), sampling=SamplingParams(max_tokens=16)).prompt_ids
    assert converted == ids and all(type(t) is int for t in converted)
    for bad in ("567", b"567", {5: 1}, 5, None):
        with pytest.raises(InvalidRequestError, match="sequence of ints"):
            GenerateRequest(prompt_ids=bad, sampling=SamplingParams(max_tokens=16))  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="item 1 is True"):
        GenerateRequest(prompt_ids=[5, True], sampling=SamplingParams(max_tokens=16))


def test_a_salted_request_equals_the_evolved_one_in_every_field() -> None:
    request = GenerateRequest(
        prompt_ids=[3, 4, 5],
        sampling=SamplingParams(max_tokens=7, stop_token_ids=[2], n=2),
        request_id="r",
        priority=1,
        lora="adapter",
        return_routed_experts=True,
        routed_experts_start=1,
        model="m",
    )
    salted = _with_cache_salt(request, "weights:v2")
    assert salted == attrs.evolve(request, cache_salt="weights:v2")
    assert type(salted) is GenerateRequest and request.cache_salt is None
    assert attrs.asdict(salted) == {**attrs.asdict(request), "cache_salt": "weights:v2"}
