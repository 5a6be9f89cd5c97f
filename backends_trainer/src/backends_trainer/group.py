"""The trainer's end of a weight-transfer group: rank 0, host of the rendezvous, and the broadcasts a
:class:`~backends_core.types.TransferPlan` asks for.

The group is built as the engines build theirs (SGLang's ``init_weights_update_group``, the OpenRLHF-style
helper most trainers copy): a rendezvous on ``tcp://<master>:<port>``, the store under a prefix of the group's
name, then a process group beside any default group the trainer has, so a trainer already running
``torch.distributed`` (FSDP, DDP) keeps its own group untouched. torch offers no public call for a second group
on its own store; ``_new_process_group_helper`` is the one the engines use, and the two sides' store keys must
match.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, GroupName, PrefixStore, _new_process_group_helper, _world
from torch.distributed.rendezvous import rendezvous

from backends_core.types import DistributedGroup, TransferPlan

__all__ = ["Staging", "broadcast_plan", "join_as_trainer", "leave"]


def join_as_trainer(group: DistributedGroup, *, timeout_s: float) -> dist.ProcessGroup:
    """Host the rendezvous and join ``group`` as rank 0; returns once every rank joined (or raises after
    ``timeout_s``)."""
    timeout = timedelta(seconds=timeout_s)
    url = f"tcp://{group.master_address}:{group.master_port}"
    store, rank, world_size = next(rendezvous(url, 0, group.world_size, timeout=timeout))
    store.set_timeout(timeout)
    process_group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(group.backend),
        PrefixStore(group.group_name, store),
        group_name=GroupName(group.group_name),
        backend_options=None,
        timeout=timeout,
    )
    assert isinstance(process_group, dist.ProcessGroup)
    # what torch's new_group records beside the helper (SGLang's init_custom_process_group too): the group's
    # ranks by global rank, which destroy_process_group removes (and fails on when they are missing)
    _world.pg_group_ranks[process_group] = {rank: rank for rank in range(world_size)}
    return process_group


def leave(process_group: dist.ProcessGroup) -> None:
    """Free the trainer's side of the group."""
    dist.destroy_process_group(process_group)


class Staging:
    """Two buffers that packed buckets are copied into, kept from push to push (host memory, for gloo).

    Packing into a fresh ``torch.cat`` result costs a page fault per 4 KiB page on every push (the allocator
    hands blocks this large back to the kernel when they are freed); packing into memory already mapped is a
    plain copy. Two, so that a bucket is packed while the one before it is on the wire. Each holds the largest
    packed bucket sent so far (at most ``bucket_bytes``; a tensor alone in its bucket is sent as it is, never
    copied). ``bench/bench_push.py`` measures both effects.
    """

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor | None] = [None, None]

    def take(self, size: int, slot: int = 0) -> torch.Tensor:
        """``size`` bytes of buffer ``slot`` (0 or 1), grown first if it is smaller."""
        buffer = self._buffers[slot]
        if buffer is None or buffer.numel() < size:
            self._buffers[slot] = None  # the old one is freed before the new one is allocated
            self._buffers[slot] = buffer = torch.empty(size, dtype=torch.uint8)
        return buffer[:size]

    def release(self) -> None:
        self._buffers = [None, None]


def broadcast_plan(
    process_group: dist.ProcessGroup,
    plan: TransferPlan,
    tensors: Mapping[str, torch.Tensor],
    *,
    device: str,
    staging: Staging | None = None,
) -> int:
    """Send ``tensors`` as ``plan`` says, from rank 0: a packed bucket is one ``uint8`` broadcast of its tensors'
    bytes in order, otherwise one broadcast per tensor. Returns the bytes sent.

    :param device: where the group's backend takes tensors from (``"cpu"`` for gloo).
    :param staging: pack buckets into these buffers (host memory) instead of a new tensor each, the next bucket
        while the one before it is sent (its broadcast is waited for before its buffer is packed again).
    """
    sent = 0
    pending: dist.Work | None = None
    for index, bucket in enumerate(plan.buckets):
        parts = [_wire(tensors[spec.name], device) for spec in bucket]
        if plan.packed:
            if len(parts) == 1:
                flat = parts[0].reshape(-1).view(torch.uint8)
            else:
                flat = _pack(parts, None if staging is None else staging.take(_size(parts), index % 2))
            if pending is not None:
                pending.wait()
                pending = None
            if staging is None:
                dist.broadcast(flat, group=process_group, group_src=0)
            else:
                pending = dist.broadcast(flat, group=process_group, group_src=0, async_op=True)
            sent += flat.numel()
        else:
            for part in parts:
                dist.broadcast(part, group=process_group, group_src=0)
                sent += part.numel() * part.element_size()
    if pending is not None:
        pending.wait()
    return sent


def _wire(tensor: torch.Tensor, device: str) -> torch.Tensor:
    return tensor.detach().to(device).contiguous()


def _size(parts: list[torch.Tensor]) -> int:
    return sum(part.numel() * part.element_size() for part in parts)


def _pack(parts: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    flat = [part.reshape(-1).view(torch.uint8) for part in parts]
    return torch.cat(flat) if out is None else torch.cat(flat, out=out)
