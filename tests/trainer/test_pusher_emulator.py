"""``WeightPusher`` end to end against the vLLM emulator served in-process: over a real two-rank gloo group (the
trainer is rank 0 and hosts the rendezvous, the emulator joins as rank 1 and receives as vLLM 0.32 does), packed
and one broadcast per tensor, and through a checkpoint directory. Afterwards the emulator serves exactly the
pushed weights: its teacher logprobs equal a reference engine loaded from them, and its version is the new one.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from backends_core import Client, ClientConfig, DistributedGroup, SyncClient, TensorSpec
from backends_core.errors import AdminError
from backends_testkit.engine import ReferenceEngine
from backends_testkit.tinymodel import TOKENIZER_SIZE, write_perturbed_weights
from backends_trainer import CheckpointDir, SyncWeightPusher, WeightPusher
from backends_vllm_testing import VllmEmulator

DEADLINE_S = 120.0
"""A hang guard for one push (a rendezvous and the broadcasts); a push takes well under a second."""
GROUP_TIMEOUT_S = 60.0
TOLERANCE = 1e-9
"""Both sides compute in float64 from the same float32 weights: equal but for summation order."""
LARGEST = 1920 * 64 * 4
"""The largest tensor of the tiny model (the embedding and the LM head), in bytes."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def sequence() -> list[int]:
    return np.random.default_rng(5).integers(0, TOKENIZER_SIZE, size=24).tolist()


async def engine_logprobs(model_dir: Path) -> np.ndarray:
    async with ReferenceEngine(model_dir) as engine:
        scored = await engine.score(sequence(), top_k=0)
    assert scored.prompt_logprobs is not None
    return scored.prompt_logprobs[1:].astype(np.float64)


async def served_logprobs(client: Client) -> np.ndarray:
    return (await client.teacher_logprobs(sequence())).logprobs[1:].astype(np.float64)


class Served:
    """The emulator (receiving through the group) and a client of it, in-process."""

    def __init__(self, emulator: VllmEmulator, client: Client) -> None:
        self.emulator = emulator
        self.client = client


@pytest.fixture
def group_name(request: pytest.FixtureRequest) -> str:
    return f"push-{request.node.name}"


@pytest.fixture
async def served(tiny_models, group_name: str) -> AsyncIterator[Served]:
    engine = ReferenceEngine(tiny_models.dense)
    emulator = VllmEmulator(
        engine, receive_weights=True, transfer_group_name=group_name, transfer_timeout_s=GROUP_TIMEOUT_S
    )
    config = ClientConfig(backend="vllm", base_url="http://vllm", model="tiny-qwen3", tokenizer=str(tiny_models.dense))
    try:
        async with Client(config, transport=emulator.transport()) as client:
            yield Served(emulator, client)
    finally:
        await emulator.aclose()


@pytest.fixture
def perturbed(tiny_models, tmp_path: Path) -> Path:
    return write_perturbed_weights(tiny_models.dense, tmp_path / "perturbed", seed=11, scale=0.05)


def group(name: str, bucket_bytes: int | None) -> DistributedGroup:
    return DistributedGroup(
        master_address="127.0.0.1",
        master_port=free_port(),
        world_size=2,
        rank_offset=1,
        backend="gloo",
        group_name=name,
        bucket_bytes=bucket_bytes,
    )


@pytest.mark.parametrize(
    "bucket_bytes",
    [None, 1 << 20, LARGEST // 2, 4096],
    ids=["one-per-tensor", "packed-1MiB", "packed-smaller-than-the-largest-tensor", "packed-4KiB"],
)
async def test_a_group_push_is_served_exactly(
    served: Served, perturbed: Path, tiny_models, group_name: str, bucket_bytes: int | None, record_property
) -> None:
    client, emulator = served.client, served.emulator
    before = await served_logprobs(client)
    tensors = load_file(str(perturbed / "model.safetensors"))
    pusher = WeightPusher(
        client, group=group(group_name, bucket_bytes), reference=tiny_models.dense, group_timeout_s=GROUP_TIMEOUT_S
    )
    try:
        async with asyncio.timeout(DEADLINE_S):
            await pusher.start()
            report = await pusher.push(tensors, version="step-1")
    finally:
        async with asyncio.timeout(DEADLINE_S):
            await pusher.close()
    assert not emulator.weight_transfer.initialized  # close() made the server leave

    plan = client.admin.transfer_plan(specs(tensors), bucket_bytes=bucket_bytes)
    expected_broadcasts = (
        [t.nbytes for t in plan.tensors] if bucket_bytes is None else [sum(t.nbytes for t in b) for b in plan.buckets]
    )
    assert emulator.weight_transfer.broadcasts == expected_broadcasts
    assert report.buckets == len(plan.buckets) and report.bytes == sum(expected_broadcasts)
    if bucket_bytes is not None and bucket_bytes < LARGEST:
        assert len(plan.buckets) > 2
    assert sorted(emulator.weight_transfer.received) == sorted(tensors)
    assert emulator.weight_transfer.finished == ["step-1"]

    (state,) = await client.admin.state()
    assert state.weight_version == "step-1" and report.version == "step-1"
    served_after = await served_logprobs(client)
    assert np.max(np.abs(served_after - before)) > 1e-2, "the push did not change the logprobs"
    delta = float(np.max(np.abs(served_after - await engine_logprobs(perturbed))))
    record_property("max_abs_delta_vs_engine", delta)
    record_property("push_seconds", report.duration_s)
    assert delta <= TOLERANCE, f"emulator vs engine on the pushed weights: max |Δ logprob| {delta:.3g}"


def specs(tensors: dict[str, torch.Tensor]) -> list[TensorSpec]:
    """The tensors as the pusher announces them, in its order."""
    return [
        TensorSpec(name=n, dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape)) for n, t in tensors.items()
    ]


async def test_a_partial_push_changes_only_the_tensors_sent(
    served: Served, perturbed: Path, tiny_models, group_name: str, tmp_path: Path
) -> None:
    client = served.client
    noisy = load_file(str(perturbed / "model.safetensors"))
    subset = {name: noisy[name] for name in ("model.norm.weight", "lm_head.weight")}
    expected = load_file(str(tiny_models.dense / "model.safetensors")) | subset
    mixed = Path(shutil.copytree(tiny_models.dense, tmp_path / "mixed"))
    save_file(expected, str(mixed / "model.safetensors"))
    async with asyncio.timeout(DEADLINE_S):
        async with WeightPusher(
            client, group=group(group_name, 1 << 16), reference=tiny_models.dense, group_timeout_s=GROUP_TIMEOUT_S
        ) as pusher:
            await pusher.push(subset, version="step-2")
    assert served.emulator.weight_transfer.received == ["model.norm.weight", "lm_head.weight"]
    delta = float(np.max(np.abs(await served_logprobs(client) - await engine_logprobs(mixed))))
    assert delta <= TOLERANCE


async def test_a_checkpoint_push_is_served_exactly(
    served: Served, perturbed: Path, tiny_models, tmp_path: Path
) -> None:
    client, emulator = served.client, served.emulator
    target = CheckpointDir(path=tmp_path / "ckpt", config_from=tiny_models.dense)
    pusher = WeightPusher(client, checkpoint=target, reference=tiny_models.dense)
    tensors = load_file(str(perturbed / "model.safetensors"))
    async with asyncio.timeout(DEADLINE_S):
        report = await pusher.push(tensors, version="ckpt-1")
    assert report.path == target.local("ckpt-1") and report.buckets == 1
    assert emulator.weight_transfer.calls == []  # nothing went through a group
    (state,) = await client.admin.state()
    assert state.weight_version == "ckpt-1"
    delta = float(np.max(np.abs(await served_logprobs(client) - await engine_logprobs(perturbed))))
    assert delta <= TOLERANCE


async def test_a_tensor_the_server_refuses_fails_the_push_and_leaves_the_group_in_step(
    served: Served, perturbed: Path, tiny_models, group_name: str
) -> None:
    client, emulator = served.client, served.emulator
    before = await served_logprobs(client)
    noisy = load_file(str(perturbed / "model.safetensors"))
    async with asyncio.timeout(DEADLINE_S):
        async with WeightPusher(client, group=group(group_name, None), group_timeout_s=GROUP_TIMEOUT_S) as pusher:
            with pytest.raises(AdminError) as caught:  # no reference: the server is the one to refuse
                await pusher.push(
                    {"model.norm.weight": noisy["model.norm.weight"], "model.extra": torch.ones(3)}, version="bad"
                )
            assert "the model has no tensor(s) model.extra" in str(caught.value)
            assert emulator.engine.state().paused is False
            report = await pusher.push({"model.norm.weight": noisy["model.norm.weight"]}, version="good")
    assert report.version == "good"
    assert float(np.max(np.abs(await served_logprobs(client) - before))) > 0


def test_a_synchronous_trainer_pushes_through_a_sync_client(tiny_models, perturbed: Path) -> None:
    engine = ReferenceEngine(tiny_models.dense)
    emulator = VllmEmulator(
        engine, receive_weights=True, transfer_group_name="sync", transfer_timeout_s=GROUP_TIMEOUT_S
    )
    config = ClientConfig(backend="vllm", base_url="http://vllm", model="tiny-qwen3", tokenizer=str(tiny_models.dense))
    with SyncClient(config, transport=emulator.transport()) as client:
        try:
            with SyncWeightPusher(
                client, group=group("sync", 1 << 16), reference=tiny_models.dense, group_timeout_s=GROUP_TIMEOUT_S
            ) as pusher:
                report = pusher.push(load_file(str(perturbed / "model.safetensors")), version="sync-1")
            assert report.version == "sync-1" and report.buckets > 2
            (state,) = client.admin.state()
            assert state.weight_version == "sync-1"
            assert not emulator.weight_transfer.initialized  # the pusher's close() made the server leave
        finally:
            client.run(lambda _client: emulator.aclose())


def test_the_emulator_imports_torch_only_to_receive() -> None:
    probe = "import sys, backends_core, backends_vllm, backends_vllm_testing.emulator; print('torch' in sys.modules)"
    answer = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    assert answer.stdout.strip() == "False"
