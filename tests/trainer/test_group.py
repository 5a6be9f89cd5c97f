"""The trainer's end of a gloo transfer group (``backends_trainer.group``) against a receiver process that joins and
receives as SGLang 0.5.23 does (``init_custom_process_group``; per tensor, or one ``uint8`` broadcast per packed
bucket): every byte arrives in order, whether buckets are packed into new tensors or into the kept staging
buffers (the next bucket packed while the one before is sent, each buffer reused across buckets and pushes),
and the trainer leaves the group cleanly (``dist.destroy_process_group`` knows it)."""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from backends_core import DistributedGroup, TensorSpec
from backends_core.transfer import capped_buckets, one_by_one
from backends_trainer.group import Staging, broadcast_plan, join_as_trainer, leave

RECEIVER = textwrap.dedent(
    """
    import hashlib, json, os, sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world
    from torch.distributed.rendezvous import rendezvous

    port, name, pushes = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    timeout = timedelta(seconds=60)
    store, rank, size = next(rendezvous(f"tcp://127.0.0.1:{port}", 1, 2, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(
        size, rank, [], Backend("gloo"), PrefixStore(name, store), group_name=name, backend_options=None,
        timeout=timeout,
    )
    _world.pg_group_ranks[group] = {0: 0, 1: 1}
    out = []
    for push in pushes:
        got = {}
        for bucket in push["buckets"]:
            if push["packed"]:
                flat = torch.empty(sum(b for _, b in bucket), dtype=torch.uint8)
                dist.broadcast(flat, src=0, group=group)
                offset = 0
                for tensor_name, nbytes in bucket:
                    got[tensor_name] = flat[offset : offset + nbytes].clone()
                    offset += nbytes
            else:
                for tensor_name, nbytes in bucket:
                    got[tensor_name] = torch.empty(nbytes, dtype=torch.uint8)
                    dist.broadcast(got[tensor_name], src=0, group=group)
        out.append({n: hashlib.sha256(t.numpy().tobytes()).hexdigest() for n, t in got.items()})
    print(json.dumps(out), flush=True)
    # no teardown of its own: gloo aborts a process whose group is destroyed while the trainer, its peer, leaves
    # (the trainer's leaving is what is under test); the results are out, so the process ends here
    os._exit(0)
    """
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


BUCKET_BYTES = 12 << 20
"""Buckets of three 4 MiB tensors: far more than a socket buffer, so a bucket is still on the wire while the next is
packed (a buffer packed again too early would corrupt what is being sent)."""


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = {f"big.{i}": (1 << 20,) for i in range(12)} | {"b": (7, 11), "c": (1000,), "d": (5,), "e": (64, 4)}
    out = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    out["g"] = torch.arange(9, dtype=torch.int64)
    return out


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("mode", ["per tensor", "packed", "packed with staging"])
def test_broadcast_plan_reaches_an_sglang_style_receiver(mode: str, tmp_path: Path) -> None:
    pushes = [_tensors(1), _tensors(2)]  # two pushes: the staging buffers are reused by the second
    specs = [
        TensorSpec(name=n, dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape))
        for n, t in pushes[0].items()
    ]
    plan = one_by_one(specs) if mode == "per tensor" else capped_buckets(specs, BUCKET_BYTES)
    if plan.packed:
        assert len(plan.buckets) >= 4 and all(len(b) > 1 for b in plan.buckets)  # both staging buffers, reused
    announced = [
        {"packed": plan.packed, "buckets": [[(s.name, s.nbytes) for s in bucket] for bucket in plan.buckets]}
        for _ in pushes
    ]
    port, name = _free_port(), f"test-trainer-group-{mode.replace(' ', '-')}"
    receiver = subprocess.Popen(
        [sys.executable, "-c", RECEIVER, str(port), name, json.dumps(announced)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    joined: list[object] = []
    thread = threading.Thread(
        target=lambda: joined.append(
            join_as_trainer(
                DistributedGroup(
                    master_address="127.0.0.1",
                    master_port=port,
                    world_size=2,
                    rank_offset=1,
                    group_name=name,
                    backend="gloo",
                ),
                timeout_s=60,
            )
        )
    )
    try:
        thread.start()
        thread.join(60)
        assert joined, "the trainer did not join"
        group = joined[0]
        staging = Staging() if mode == "packed with staging" else None
        for tensors in pushes:
            sent = broadcast_plan(group, plan, tensors, device="cpu", staging=staging)
            assert sent == sum(t.numel() * t.element_size() for t in tensors.values())
        stdout, stderr = receiver.communicate(timeout=60)
        assert receiver.returncode == 0, stderr.decode()[-2000:]
        received = json.loads(stdout)
        for tensors, got in zip(pushes, received, strict=True):
            assert got == {n: _digest(t) for n, t in tensors.items()}
        leave(group)  # raised KeyError before the group was registered
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
