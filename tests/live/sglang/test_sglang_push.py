"""``WeightPusher`` from the test process into real SGLang 0.5.23 on the CPU over a two-rank gloo group.

The test process is the trainer: rank 0 of the group, host of the rendezvous (``backends_trainer.group``, the
main venv's torch 2.13 CPU; the SGLang venv has the same torch, whose gloo it speaks). The server joins as rank
1 through the sglang backend (``/init_weights_update_group``). A push is one ``weight_sync``: paused, every
tensor received while the pusher broadcasts it, versioned, flushed, resumed, checked. Unpacked, every tensor is
its own broadcast; packed (``bucket_bytes``), the tensors travel in capped buckets, largest element size first,
each one ``uint8`` broadcast announced by its own ``/update_weights_from_distributed`` with ``load_format:
"flattened_bucket"``.

Checked: after a push of perturbed weights the server's version is the new one and its teacher logprobs of fixed
sequences equal the numpy reference engine on those weights (``TOLERANCE``, the parity tests' bound); pushing the
original weights back with the original version restores the original logprobs exactly; ``close()`` makes the
server leave the group (a second leave is refused: the group is gone).

The server is shared with the session and the trainer lives in this process, so nothing may hang: every step runs
under a deadline, the group's own timeout is minutes rather than SGLang's default half hour, and the restore and
``close()`` run in ``finally``. If the server is left changed anyway, it is reloaded from disk and the test fails.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from weight_push_checks import (
    left_as_found,
    loopback_gloo_group,
    max_delta,
    new_weights_vs_engine,
    served,
    tensors,
    weight_version,
)

from backends_core import Client, ClientConfig
from backends_core.errors import AdminError
from backends_testkit.tinymodel import TinyModels, write_perturbed_weights
from backends_trainer import PushReport, WeightPusher

pytestmark = pytest.mark.live

TOLERANCE = 2e-5
"""Largest accepted |Δ logprob| between the reference engine and SGLang (``test_sglang_parity.py``'s bound)."""
GROUP_TIMEOUT_S = 180.0
"""The group's rendezvous and collective timeout on the trainer's side."""
STEP_TIMEOUT_S = 300.0
"""A hang guard for one step (join, push, leave); each takes well under a few seconds when nothing is wrong."""
LARGEST = 1920 * 64 * 4
"""The largest tensors of the tiny model (the embedding and the LM head), in bytes."""


@pytest.fixture
async def client(sglang_dense_url: str, tiny_models: TinyModels) -> AsyncIterator[Client]:
    config = ClientConfig(
        backend="sglang", base_url=sglang_dense_url, model="tiny-qwen3", tokenizer=str(tiny_models.dense)
    )
    async with Client(config) as c:
        yield c


@pytest.fixture
async def original_version(client: Client, tiny_models: TinyModels) -> AsyncIterator[str]:
    """The server's version before the test; afterwards, the server must serve exactly what it served before
    (``weight_push_checks.left_as_found``)."""
    async with left_as_found(client, tiny_models.dense, tolerance=0.0) as version:
        yield version


async def _push(pusher: WeightPusher, weights: dict[str, torch.Tensor], version: str) -> PushReport:
    async with asyncio.timeout(STEP_TIMEOUT_S):
        return await pusher.push(weights, version=version)


@pytest.mark.parametrize("bucket_bytes", [None, 64 << 10], ids=["one-broadcast-per-tensor", "packed-64KiB-buckets"])
async def test_a_push_from_the_trainer_process_is_served_exactly_then_the_original_is_pushed_back(
    client: Client,
    original_version: str,
    tiny_models: TinyModels,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    record_property: Any,
    bucket_bytes: int | None,
) -> None:
    before = await served(client)
    perturbed = write_perturbed_weights(tiny_models.dense, tmp_path / "perturbed", seed=47, scale=0.05)
    name = f"backends-push-{request.node.callspec.id}"
    group = loopback_gloo_group(group_name=name, bucket_bytes=bucket_bytes)
    pusher = WeightPusher(client, group=group, reference=tiny_models.dense, group_timeout_s=GROUP_TIMEOUT_S)
    try:
        async with asyncio.timeout(STEP_TIMEOUT_S):
            await pusher.start()
        try:
            report = await _push(pusher, tensors(perturbed), "live-push-1")
            assert await weight_version(client) == "live-push-1"
            worst = await new_weights_vs_engine(client, before, perturbed)
            record_property("max_abs_delta_vs_engine", worst)
            record_property("push_seconds", report.duration_s)
            record_property("send_seconds", report.send_s)
            sys.stderr.write(
                f"\n[push {request.node.callspec.id}] {report.tensors} tensors, {report.bytes} bytes in "
                f"{report.buckets} bucket(s): broadcast {report.send_s:.3f}s, push {report.duration_s:.3f}s; "
                f"vs reference engine max |Δ| = {worst:.3g}\n"
            )
            assert worst <= TOLERANCE, f"SGLang vs engine on the pushed weights: max |Δ logprob| {worst:.3g}"
            if bucket_bytes is None:
                assert report.buckets == 1 and report.bytes == sum(t.nbytes for t in tensors(perturbed).values())
            else:
                assert bucket_bytes < LARGEST and report.buckets > 2
        finally:  # the next tests share this server: the original weights and version, through the same group
            await _push(pusher, tensors(tiny_models.dense), original_version)
        assert await weight_version(client) == original_version
        assert max_delta(await served(client), before) == 0.0, "the original weights did not restore the outputs"
    finally:
        async with asyncio.timeout(STEP_TIMEOUT_S):
            await pusher.close()
    assert not pusher.started
    with pytest.raises(AdminError, match="does not exist"):  # close() made the server leave the group
        await client.admin.destroy_weight_transfer(name)


async def test_a_push_sglang_refuses_is_a_typed_error_and_the_group_stays_usable(
    client: Client, original_version: str, tiny_models: TinyModels, sglang_dense_url: str
) -> None:
    before = await served(client)
    norm = tensors(tiny_models.dense)["model.norm.weight"]
    name = "backends-push-refused"
    group = loopback_gloo_group(group_name=name)
    # no reference: nothing is checked on the trainer's side, the server is the one to refuse
    pusher = WeightPusher(client, group=group, group_timeout_s=GROUP_TIMEOUT_S)
    try:
        async with asyncio.timeout(STEP_TIMEOUT_S):
            await pusher.start()
        with pytest.raises(AdminError) as caught:
            await _push(pusher, {"model.norm.weight": norm[:32].clone()}, "live-push-refused")
        message = str(caught.value)
        sys.stderr.write(f"\n[push refused] {message[:400]}\n")
        assert "weight_sync: update" in message and sglang_dense_url in message
        assert "Failed to update parameter online" in message, message
        assert await weight_version(client) == original_version
        (state,) = await client.admin.state()
        assert state.paused is False  # resumed in the sync's finally
        assert max_delta(await served(client), before) == 0.0
        # the broadcast completed before SGLang refused: the group is in step and the next push goes through
        report = await _push(pusher, {"model.norm.weight": norm}, original_version)
        assert report.version == original_version
    finally:
        async with asyncio.timeout(STEP_TIMEOUT_S):
            await pusher.close()
    assert await weight_version(client) == original_version
    assert max_delta(await served(client), before) == 0.0
