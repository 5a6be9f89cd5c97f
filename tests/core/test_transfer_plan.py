"""How a distributed weight update is cut into broadcasts: the plan functions of ``backends_core.transfer`` against
the engines' own rules, and ``Admin.transfer_plan`` per backend (pure bookkeeping: nothing is sent)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from backends_core import Client, ClientConfig
from backends_core.errors import InvalidRequestError, UnsupportedOperationError
from backends_core.transfer import aligned_order, capped_buckets, itemsize, one_by_one, overflow_buckets
from backends_core.types import DTYPE_BYTES, TensorSpec, TransferPlan

DTYPES = sorted(DTYPE_BYTES)


def spec(name: str, dtype: str, *shape: int) -> TensorSpec:
    return TensorSpec(name=name, dtype=dtype, shape=shape)


def vllm_consumer_chunks(tensors: Sequence[TensorSpec], buffer_size_bytes: int) -> list[list[str]]:
    """The names of each packed broadcast vLLM 0.32's receiver posts, written as its
    ``packed_nccl_broadcast_consumer`` (``distributed/weight_transfer/packed_tensor.py``) forms them: take the
    next announced tensor into the chunk, add ``prod(shape) * dtype.itemsize``, broadcast once the sum is past
    ``buffer_size_bytes``; at the end of the list, broadcast what remains."""
    iterator: Iterator[TensorSpec] = iter(tensors)
    target_packed_tensor_size = buffer_size_bytes
    chunks: list[list[str]] = []
    while True:
        meta: list[str] = []
        size = 0
        try:
            while True:
                t = next(iterator)
                tensor_size = math.prod(t.shape) * DTYPE_BYTES[t.dtype]
                meta.append(t.name)
                size += tensor_size
                if size > target_packed_tensor_size:
                    break
            chunks.append(meta)
        except StopIteration:
            if len(meta) > 0:
                chunks.append(meta)
            break
    return chunks


def names(plan: TransferPlan) -> list[list[str]]:
    return [[t.name for t in bucket] for bucket in plan.buckets]


# -- overflow_buckets: vLLM's packed transfer ------------------------------------------------------------------


def test_overflow_buckets_close_on_the_tensor_that_goes_past_the_size_as_vllm_cuts_them() -> None:
    tensors = [
        spec("a", "float32", 10),  # 40
        spec("b", "float32", 15),  # 60: 100, not past 100
        spec("c", "bfloat16", 2),  # 4: 104, past: closes a+b+c
        spec("big", "float32", 100),  # 400 alone: past at once
        spec("d", "int8", 7),
        spec("e", "float64", 3),  # 7 + 24 = 31: the rest
    ]
    plan = overflow_buckets(tensors, 100)
    assert plan.packed
    assert names(plan) == [["a", "b", "c"], ["big"], ["d", "e"]] == vllm_consumer_chunks(tensors, 100)
    assert plan.tensors == tensors  # vLLM reads the announced list in order: never reordered


def test_a_tensor_larger_than_the_size_closes_the_bucket_it_joins() -> None:
    tensors = [spec("a", "float32", 2), spec("huge", "float32", 1000), spec("b", "float32", 2)]
    plan = overflow_buckets(tensors, 64)
    assert names(plan) == [["a", "huge"], ["b"]] == vllm_consumer_chunks(tensors, 64)


def test_a_bucket_that_ends_exactly_at_the_list_end_leaves_no_empty_broadcast() -> None:
    tensors = [spec("a", "float32", 16), spec("b", "float32", 16)]  # 64, 128: past 100 on b, the last
    plan = overflow_buckets(tensors, 100)
    assert names(plan) == [["a", "b"]] == vllm_consumer_chunks(tensors, 100)


@given(
    shapes=st.lists(
        st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 40), min_size=0, max_size=3)),
        min_size=1,
        max_size=30,
    ),
    bucket_bytes=st.integers(1, 2000),
)
def test_overflow_buckets_equal_vllms_consumer_chunks_for_any_list(
    shapes: list[tuple[str, list[int]]], bucket_bytes: int
) -> None:
    tensors = [spec(f"t{i}", dtype, *shape) for i, (dtype, shape) in enumerate(shapes)]
    assert names(overflow_buckets(tensors, bucket_bytes)) == vllm_consumer_chunks(tensors, bucket_bytes)


# -- capped_buckets: SGLang's flattened buckets ----------------------------------------------------------------


def sglang_offsets(bucket: Sequence[TensorSpec]) -> list[int]:
    """Byte offsets as SGLang's ``FlattenedTensorBucket.empty`` lays a received bucket out (from 0, in order);
    it refuses a tensor whose offset is not a multiple of its element size."""
    offsets, offset = [], 0
    for t in bucket:
        offsets.append(offset)
        offset += t.nbytes
    return offsets


def test_capped_buckets_align_mixed_dtypes_and_keep_each_under_the_cap() -> None:
    tensors = [
        spec("norm", "bfloat16", 3),  # 6 bytes: would misalign what follows it
        spec("w1", "float32", 5),
        spec("mask", "bool", 1),
        spec("w2", "float64", 3),
        spec("ids", "int32", 2),
        spec("w3", "float32", 7),
    ]
    plan = capped_buckets(tensors, 40)
    assert plan.packed
    assert [t.name for t in plan.tensors] == ["w2", "w1", "ids", "w3", "norm", "mask"]  # by element size, stable
    for bucket in plan.buckets:
        for t, offset in zip(bucket, sglang_offsets(bucket), strict=True):
            assert offset % itemsize(t) == 0, f"{t.name} at byte {offset}"
        assert len(bucket) == 1 or sum(t.nbytes for t in bucket) <= 40
    assert names(plan) == [["w2"], ["w1", "ids"], ["w3", "norm", "mask"]]


def test_a_tensor_past_the_cap_travels_alone() -> None:
    tensors = [spec("small", "float32", 2), spec("huge", "float32", 100), spec("tail", "float32", 2)]
    assert names(capped_buckets(tensors, 32)) == [["small"], ["huge"], ["tail"]]


@given(
    shapes=st.lists(
        st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 30), min_size=0, max_size=3)),
        min_size=1,
        max_size=30,
    ),
    bucket_bytes=st.integers(1, 1500),
)
def test_capped_buckets_hold_every_tensor_once_aligned_and_capped(
    shapes: list[tuple[str, list[int]]], bucket_bytes: int
) -> None:
    tensors = [spec(f"t{i}", dtype, *shape) for i, (dtype, shape) in enumerate(shapes)]
    plan = capped_buckets(tensors, bucket_bytes)
    assert sorted(t.name for t in plan.tensors) == sorted(t.name for t in tensors)
    assert plan.tensors == aligned_order(tensors)
    for bucket in plan.buckets:
        assert bucket
        assert len(bucket) == 1 or sum(t.nbytes for t in bucket) <= bucket_bytes
        for t, offset in zip(bucket, sglang_offsets(bucket), strict=True):
            assert offset % itemsize(t) == 0


# -- one_by_one, and what no plan accepts ---------------------------------------------------------------------


def test_one_by_one_is_one_unpacked_bucket_in_the_given_order() -> None:
    tensors = [spec("b", "float16", 2), spec("a", "float32", 4)]
    plan = one_by_one(tensors)
    assert (plan.packed, names(plan)) == (False, [["b", "a"]])


@pytest.mark.parametrize(
    "make",
    [one_by_one, lambda t: overflow_buckets(t, 64), lambda t: capped_buckets(t, 64), aligned_order],
    ids=["one_by_one", "overflow_buckets", "capped_buckets", "aligned_order"],
)
def test_a_dtype_with_no_known_size_is_refused_naming_the_tensor(make) -> None:
    tensors = [spec("ok", "float32", 2), spec("model.layers.0.scale", "complex64", 2)]
    with pytest.raises(InvalidRequestError, match=r"'model\.layers\.0\.scale': dtype 'complex64' cannot be sent"):
        make(tensors)


# -- Admin.transfer_plan per backend ---------------------------------------------------------------------------


TENSORS = [spec("embed", "float32", 16, 4), spec("norm", "bfloat16", 3), spec("head", "float32", 16, 4)]


@pytest.fixture
def sent() -> list[httpx.Request]:
    return []


def client_for(backend: str, sent: list[httpx.Request]) -> Client:
    def record(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(500)

    options = {"worker_urls": ["http://worker:8081"]} if backend == "dynamo" else {}
    config = ClientConfig(backend=backend, base_url="http://server", model="m", backend_options=options)
    return Client(config, transport=httpx.MockTransport(record))


@pytest.mark.parametrize(
    ("backend", "bucket_bytes", "expected", "packed"),
    [
        ("vllm", None, [["embed", "norm", "head"]], False),
        ("vllm", 100, [["embed"], ["norm", "head"]], True),  # 256 past 100; 6 + 256 past 100 at head
        ("sglang", None, [["embed", "norm", "head"]], False),
        ("sglang", 300, [["embed"], ["head", "norm"]], True),  # float32 first; 256 + 256 > 300
        ("dynamo", None, [["embed", "norm", "head"]], False),
    ],
)
async def test_transfer_plan_is_the_backends_rule_and_sends_nothing(
    backend: str, bucket_bytes: int | None, expected: list[list[str]], packed: bool, sent: list[httpx.Request]
) -> None:
    async with client_for(backend, sent) as client:
        plan = client.admin.transfer_plan(TENSORS, bucket_bytes=bucket_bytes)
    assert (names(plan), plan.packed) == (expected, packed)
    assert sent == []


async def test_dynamo_refuses_packed_buckets(sent: list[httpx.Request]) -> None:
    async with client_for("dynamo", sent) as client:
        with pytest.raises(InvalidRequestError, match="without bucket_bytes"):
            client.admin.transfer_plan(TENSORS, bucket_bytes=1024)
    assert sent == []


@pytest.mark.parametrize("bucket_bytes", [0, -1, True, 1.5, "1024"])
async def test_a_bucket_size_that_is_not_a_positive_int_is_refused(
    bucket_bytes: object, sent: list[httpx.Request]
) -> None:
    async with client_for("vllm", sent) as client:
        with pytest.raises(InvalidRequestError, match="bucket_bytes must be a positive int"):
            client.admin.transfer_plan(TENSORS, bucket_bytes=bucket_bytes)
    assert sent == []


@pytest.mark.parametrize("tensors", [[], [("embed", "float32", [2])]], ids=["empty", "not-tensor-specs"])
async def test_tensors_that_are_not_a_list_of_tensor_specs_are_refused(
    tensors: list[object], sent: list[httpx.Request]
) -> None:
    async with client_for("vllm", sent) as client:
        with pytest.raises(InvalidRequestError):
            client.admin.transfer_plan(tensors)
    assert sent == []


async def test_a_backend_that_receives_no_distributed_update_has_no_plan(tiny_models) -> None:
    config = ClientConfig(backend="reference", base_url="http://server", model="m", tokenizer=str(tiny_models.dense))
    async with Client(config, transport=httpx.MockTransport(lambda r: httpx.Response(500))) as client:
        with pytest.raises(UnsupportedOperationError, match="admin_update_weights_distributed"):
            client.admin.transfer_plan(TENSORS)
