"""The emulator's end of a weight-transfer group: it joins the trainer's gloo group and receives tensors as vLLM
0.32's ``NCCLWeightTransferEngine.receive_weights`` does (one broadcast per tensor, or packed chunks it cuts
itself from the announced list and ``packed_buffer_size_bytes``).

torch is imported inside the functions: the test kit depends on it only when a test makes the emulator receive
(``receive_weights=True``). Every function here blocks (a rendezvous, a collective): the emulator runs them on a
thread of their own, never on its event loop.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import torch

__all__ = ["Announced", "Joined", "join", "leave", "receive", "vllm_chunks"]


@attrs.frozen
class Announced:
    """One tensor of an ``update_info``: name, torch dtype name, shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]


@attrs.define
class Joined:
    """The emulator's membership of a trainer's group.

    :ivar group: the gloo process group (rank ``rank`` of ``world_size``).
    :ivar packed: updates arrive packed (``init_info.packed``).
    :ivar buffer_size_bytes: the packed chunk size the receiver cuts with (``init_info.packed_buffer_size_bytes``).
    """

    group: Any
    rank: int
    world_size: int
    packed: bool
    buffer_size_bytes: int


def join(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    packed: bool,
    buffer_size_bytes: int,
    timeout_s: float,
) -> Joined:
    """Join the trainer's group at ``rank``: the trainer (``backends_trainer.group.join_as_trainer``, SGLang's
    ``init_custom_process_group``) hosts the rendezvous store and builds its group with torch's
    ``_new_process_group_helper`` under ``group_name``, whose gloo backend reads its keys under
    ``<group_name>`` / ``<group_name>/`` / ``cpu/``. The same keys here, with a ``ProcessGroupGloo`` of this
    emulator's own: a trainer and an emulator in one process cannot both register a group of that name in
    torch's global registry, and the wire does not need it."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import PrefixStore
    from torch.distributed.rendezvous import rendezvous

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(
        rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    keys = PrefixStore("cpu/", PrefixStore(f"{group_name}/", PrefixStore(group_name, store)))
    group = dist.ProcessGroupGloo(keys, rank, world_size, timeout)
    return Joined(group, rank, world_size, packed, buffer_size_bytes)


def leave(joined: Joined) -> None:
    """Close the emulator's side of the group."""
    joined.group.shutdown()


def vllm_chunks(tensors: Sequence[Announced], buffer_size_bytes: int) -> list[list[Announced]]:
    """The packed broadcasts vLLM's ``packed_nccl_broadcast_consumer`` posts for ``tensors``: it takes the next
    announced tensor into the chunk and broadcasts once the chunk's bytes are past ``buffer_size_bytes`` (that
    tensor included); what remains at the end of the list is the last chunk."""
    import torch

    iterator: Iterator[Announced] = iter(tensors)
    chunks: list[list[Announced]] = []
    while True:
        chunk: list[Announced] = []
        size = 0
        try:
            while True:
                announced = next(iterator)
                chunk.append(announced)
                size += math.prod(announced.shape) * _dtype(torch, announced.dtype).itemsize
                if size > buffer_size_bytes:
                    break
            chunks.append(chunk)
        except StopIteration:
            if chunk:
                chunks.append(chunk)
            return chunks


def receive(joined: Joined, tensors: Sequence[Announced]) -> tuple[dict[str, npt.NDArray[Any]], list[int]]:
    """Receive ``tensors`` from rank 0 as vLLM does; returns them as numpy arrays (bfloat16 and the float8
    types, which numpy lacks, as float32) and the bytes of each broadcast.

    :raises ValueError: a dtype name torch does not have (as vLLM's ``getattr(torch, dtype_name)``).
    """
    import torch
    import torch.distributed as dist

    def broadcast(tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        joined.group.broadcast([tensor], options).wait()

    received: dict[str, npt.NDArray[Any]] = {}
    sizes: list[int] = []
    for announced in tensors:
        _dtype(torch, announced.dtype)  # refuse an unknown dtype before any broadcast is posted
    if joined.packed:
        for chunk in vllm_chunks(tensors, joined.buffer_size_bytes):
            bytes_ = [math.prod(a.shape) * _dtype(torch, a.dtype).itemsize for a in chunk]
            buffer = torch.empty(sum(bytes_), dtype=torch.uint8)
            broadcast(buffer)
            sizes.append(buffer.numel())
            offset = 0
            for announced, size in zip(chunk, bytes_, strict=True):
                part = buffer[offset : offset + size]
                offset += size
                # a copy starts at offset 0: a view of another element size needs an offset it divides
                tensor = part.clone().view(_dtype(torch, announced.dtype)).view(announced.shape)
                received[announced.name] = _numpy(torch, tensor)
    else:
        for announced in tensors:
            tensor = torch.empty(announced.shape, dtype=_dtype(torch, announced.dtype))
            broadcast(tensor)
            sizes.append(tensor.numel() * tensor.element_size())
            received[announced.name] = _numpy(torch, tensor)
    return received, sizes


def _dtype(torch_module: Any, name: str) -> torch.dtype:
    dtype = getattr(torch_module, name, None)
    if not isinstance(dtype, torch_module.dtype):
        raise ValueError(f"module 'torch' has no attribute '{name}'")
    return dtype  # type: ignore[no-any-return]


def _numpy(torch_module: Any, tensor: torch.Tensor) -> npt.NDArray[Any]:
    if tensor.dtype in (torch_module.bfloat16, torch_module.float8_e4m3fn, torch_module.float8_e5m2):
        tensor = tensor.to(torch_module.float32)
    return np.array(tensor.numpy(), copy=True)
