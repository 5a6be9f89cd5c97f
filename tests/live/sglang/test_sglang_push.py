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
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
from safetensors.torch import load_file

from backends_core import Client, ClientConfig
from backends_core.errors import AdminError
from backends_core.types import DistributedGroup
from backends_testkit.engine import ReferenceEngine
from backends_testkit.tinymodel import TOKENIZER_SIZE, TinyModels, write_perturbed_weights
from backends_trainer import PushReport, WeightPusher

pytestmark = pytest.mark.live

WEIGHTS = "model.safetensors"
TOLERANCE = 2e-5
"""Largest accepted |Δ logprob| between the reference engine and SGLang (``test_sglang_parity.py``'s bound)."""
CHANGED = 1e-2
"""Smallest max |Δ logprob| that counts as "the push changed the outputs"."""
GROUP_TIMEOUT_S = 180.0
"""The group's rendezvous and collective timeout on the trainer's side."""
STEP_TIMEOUT_S = 300.0
"""A hang guard for one step (join, push, leave); each takes well under a few seconds when nothing is wrong."""
LARGEST = 1920 * 64 * 4
"""The largest tensors of the tiny model (the embedding and the LM head), in bytes."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _sequences() -> list[list[int]]:
    rng = np.random.default_rng(31)
    return [rng.integers(0, TOKENIZER_SIZE, size=n).tolist() for n in (16, 40)]


@pytest.fixture
async def client(sglang_dense_url: str, tiny_models: TinyModels) -> AsyncIterator[Client]:
    config = ClientConfig(
        backend="sglang", base_url=sglang_dense_url, model="tiny-qwen3", tokenizer=str(tiny_models.dense)
    )
    async with Client(config) as c:
        yield c


async def _version(client: Client) -> str | None:
    (state,) = await client.admin.state()
    return state.weight_version


async def _served(client: Client) -> list[npt.NDArray[np.float64]]:
    return [(await client.teacher_logprobs(ids)).logprobs[1:].astype(np.float64) for ids in _sequences()]


async def _engine(model_dir: Path) -> list[npt.NDArray[np.float64]]:
    out = []
    async with ReferenceEngine(model_dir) as engine:
        for ids in _sequences():
            scored = await engine.score(ids, top_k=0)
            assert scored.prompt_logprobs is not None
            out.append(scored.prompt_logprobs[1:].astype(np.float64))
    return out


def _max_delta(a: list[npt.NDArray[np.float64]], b: list[npt.NDArray[np.float64]]) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / WEIGHTS))


@pytest.fixture
async def original_version(client: Client, tiny_models: TinyModels) -> AsyncIterator[str]:
    """The server's version before the test; afterwards, checks the server is as found (weights and version),
    else reloads the weights from disk (``/update_weights_from_disk``: the last resort only) and fails."""
    version = await _version(client)
    assert version is not None, "the sglang backend reports the weight version (/model_info)"
    before = await _served(client)
    yield version
    if await _version(client) != version or _max_delta(await _served(client), before) > 0.0:
        await client.admin.update_weights(str(tiny_models.dense), version=version)
        pytest.fail("the test left the server changed: weights reloaded from disk")


async def _push(pusher: WeightPusher, tensors: dict[str, torch.Tensor], version: str) -> PushReport:
    async with asyncio.timeout(STEP_TIMEOUT_S):
        return await pusher.push(tensors, version=version)


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
    before = await _served(client)
    perturbed = write_perturbed_weights(tiny_models.dense, tmp_path / "perturbed", seed=47, scale=0.05)
    name = f"backends-push-{request.node.callspec.id}"
    group = DistributedGroup(
        master_address="127.0.0.1",
        master_port=_free_port(),
        world_size=2,
        rank_offset=1,
        backend="gloo",
        group_name=name,
        bucket_bytes=bucket_bytes,
    )
    pusher = WeightPusher(client, group=group, reference=tiny_models.dense, group_timeout_s=GROUP_TIMEOUT_S)
    try:
        async with asyncio.timeout(STEP_TIMEOUT_S):
            await pusher.start()
        try:
            report = await _push(pusher, _tensors(perturbed), "live-push-1")
            assert await _version(client) == "live-push-1"
            served = await _served(client)
            changed = _max_delta(served, before)
            assert changed > CHANGED, f"the pushed weights did not change the logprobs (max |Δ| {changed:.3g})"
            worst = _max_delta(served, await _engine(perturbed))
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
                assert report.buckets == 1 and report.bytes == sum(t.nbytes for t in _tensors(perturbed).values())
            else:
                assert bucket_bytes < LARGEST and report.buckets > 2
        finally:  # the next tests share this server: the original weights and version, through the same group
            await _push(pusher, _tensors(tiny_models.dense), original_version)
        assert await _version(client) == original_version
        assert _max_delta(await _served(client), before) == 0.0, "the original weights did not restore the outputs"
    finally:
        async with asyncio.timeout(STEP_TIMEOUT_S):
            await pusher.close()
    assert not pusher.started
    with pytest.raises(AdminError, match="does not exist"):  # close() made the server leave the group
        await client.admin.destroy_weight_transfer(name)


async def test_a_push_sglang_refuses_is_a_typed_error_and_the_group_stays_usable(
    client: Client, original_version: str, tiny_models: TinyModels, sglang_dense_url: str
) -> None:
    before = await _served(client)
    norm = _tensors(tiny_models.dense)["model.norm.weight"]
    name = "backends-push-refused"
    group = DistributedGroup(
        master_address="127.0.0.1",
        master_port=_free_port(),
        world_size=2,
        rank_offset=1,
        backend="gloo",
        group_name=name,
    )
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
        assert await _version(client) == original_version
        (state,) = await client.admin.state()
        assert state.paused is False  # resumed in the sync's finally
        assert _max_delta(await _served(client), before) == 0.0
        # the broadcast completed before SGLang refused: the group is in step and the next push goes through
        report = await _push(pusher, {"model.norm.weight": norm}, original_version)
        assert report.version == original_version
    finally:
        async with asyncio.timeout(STEP_TIMEOUT_S):
            await pusher.close()
    assert await _version(client) == original_version
    assert _max_delta(await _served(client), before) == 0.0
