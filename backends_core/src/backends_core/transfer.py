"""Building blocks for a backend's :func:`~backends_core.hookspecs.weight_transfer_plan`: the ways engines cut a
distributed weight update into buckets. Pure bookkeeping on :class:`~backends_core.types.TensorSpec` (names,
dtype names, shapes): no torch here.
"""

from __future__ import annotations

from collections.abc import Sequence

from backends_core.types import TensorSpec, TransferPlan

__all__ = ["aligned_order", "capped_buckets", "itemsize", "one_by_one", "overflow_buckets"]


def itemsize(spec: TensorSpec) -> int:
    """Bytes per element of ``spec``'s dtype.

    :raises InvalidRequestError: a dtype name outside :data:`~backends_core.types.DTYPE_BYTES`.
    """
    return TensorSpec(name=spec.name, dtype=spec.dtype, shape=()).nbytes


def one_by_one(tensors: Sequence[TensorSpec]) -> TransferPlan:
    """Every tensor its own broadcast in its own dtype, announced at once."""
    for spec in tensors:
        itemsize(spec)
    return TransferPlan(buckets=[list(tensors)], packed=False)


def overflow_buckets(tensors: Sequence[TensorSpec], bucket_bytes: int) -> TransferPlan:
    """Packed buckets closed by the tensor that takes them past ``bucket_bytes`` (that tensor included): the
    rule of a receiver that re-derives the buckets from the announced list and the size (vLLM's packed
    transfer). A tensor larger than the size is a bucket with what preceded it."""
    buckets: list[list[TensorSpec]] = []
    bucket: list[TensorSpec] = []
    total = 0
    for spec in tensors:
        itemsize(spec)
        bucket.append(spec)
        total += spec.nbytes
        if total > bucket_bytes:
            buckets.append(bucket)
            bucket, total = [], 0
    if bucket:
        buckets.append(bucket)
    return TransferPlan(buckets=buckets, packed=True)


def aligned_order(tensors: Sequence[TensorSpec]) -> list[TensorSpec]:
    """``tensors`` by element size, largest first (stable otherwise): packed one after another from offset 0,
    every tensor then starts at a multiple of its own element size."""
    return sorted(tensors, key=lambda spec: -itemsize(spec))


def capped_buckets(tensors: Sequence[TensorSpec], bucket_bytes: int) -> TransferPlan:
    """Packed buckets of at most ``bucket_bytes`` (a larger tensor goes alone), each announced by itself, so
    the trainer chooses the cut: the rule of a receiver told each bucket's tensors (SGLang's flattened
    buckets). Tensors are in :func:`aligned_order`."""
    buckets: list[list[TensorSpec]] = []
    bucket: list[TensorSpec] = []
    total = 0
    for spec in aligned_order(tensors):
        size = spec.nbytes
        if bucket and total + size > bucket_bytes:
            buckets.append(bucket)
            bucket, total = [], 0
        bucket.append(spec)
        total += size
    if bucket:
        buckets.append(bucket)
    return TransferPlan(buckets=buckets, packed=True)
