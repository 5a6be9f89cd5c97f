"""Distributed weight update over gloo against real SGLang 0.5.23 on the CPU, driven by a trainer process.

The trainer (``gloo_trainer.py``, run with the SGLang venv's python: torch CPU and safetensors, nothing of
SGLang) is rank 0 of a two-rank gloo group and hosts the rendezvous; the server joins as rank 1 through the
sglang backend's ``client.admin.init_weight_transfer(DistributedGroup(..., backend="gloo"))``
(``POST /init_weights_update_group``). Each update is ``client.admin.update_weights_distributed(...)``
(``/begin_weight_update`` -> ``/update_weights_from_distributed`` -> ``/end_weight_update``) while the trainer
broadcasts the same tensors, in the same order, from a safetensors file. Both sides block (rendezvous, then one
broadcast per tensor), so the trainer is told what to send before the HTTP call and answers once it is sent.

Checked: the version is the new one in ``/model_info`` and in responses; teacher and greedy logprobs equal the
numpy reference engine on the perturbed weights (``TOLERANCE``, as in ``test_sglang_parity.py``) and differ
from before; broadcasting the original weights restores the original outputs exactly. Failure paths: a shape
the model's parameter does not have is a typed ``AdminError`` naming the server and SGLang's cause, changes
nothing, and leaves no weight-update session open (the next update works); a tensor name the model does not
have is *accepted* by SGLang (``Qwen3ForCausalLM.load_weights`` only logs "Parameter ... not found") and the
version moves although no weight changed: a trap, pinned here so a change of behaviour is noticed.

The server is shared with the rest of the session: every test leaves the original weights, the original
version and no group behind: the fixture leaves the group with ``client.admin.destroy_weight_transfer(name)``
(``/destroy_weights_update_group``), then checks that a second teardown of the same name is refused as SGLang
refuses it (400 "does not exist": a typed ``AdminError`` naming the server and the route). A hang cannot wedge
the run: the trainer has a hard deadline and is killed in teardown, which also fails the server's pending
gloo receive instead of leaving it to the group's 30-minute timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from safetensors.numpy import load_file, save_file
from weight_push_checks import (
    CHANGED,
    WEIGHTS,
    free_port,
    left_as_found,
    loopback_gloo_group,
    max_delta,
    probe_sequences,
    served,
    weight_version,
)

from backends_core import Client, ClientConfig, SamplingParams
from backends_core.errors import AdminError, ServerStatusError
from backends_core.types import TensorSpec
from backends_testkit.engine import EngineRequest, ReferenceEngine
from backends_testkit.tinymodel import TinyModels, write_perturbed_weights

pytestmark = pytest.mark.live

TRAINER = Path(__file__).resolve().with_name("gloo_trainer.py")
TOLERANCE = 2e-5
"""Largest accepted |Δ logprob| between the reference engine and SGLang (the parity tests' bound)."""
GREEDY_TOKENS = 8
TRAINER_HARD_TIMEOUT_S = 600
"""The trainer process ends after this long whatever it is blocked on."""
GROUP_TIMEOUT_S = 300.0
"""The trainer's rendezvous and collective timeout."""
EVENT_TIMEOUT_S = 300.0
"""How long the test waits for one line of the trainer before it fails (a hang guard, not a speed check)."""


def _specs(path: Path) -> list[TensorSpec]:
    """Every tensor of a safetensors file, sorted by name: the order both sides use."""
    return [
        TensorSpec(name=name, dtype=str(array.dtype), shape=array.shape)
        for name, array in sorted(load_file(path).items())
    ]


class Trainer:
    """The trainer subprocess: one JSON command per stdin line, one JSON event per stdout line."""

    def __init__(self, process: asyncio.subprocess.Process, stderr: Path) -> None:
        self.process = process
        self.stderr = stderr

    @classmethod
    async def start(cls, python: Path, *, port: int, group_name: str, stderr: Path) -> Trainer:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        with stderr.open("wb") as err:
            process = await asyncio.create_subprocess_exec(
                str(python),
                str(TRAINER),
                "--master-address=127.0.0.1",
                f"--master-port={port}",
                "--world-size=2",
                f"--group-name={group_name}",
                f"--group-timeout={GROUP_TIMEOUT_S}",
                f"--hard-timeout={TRAINER_HARD_TIMEOUT_S}",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=err,
                env=env,
            )
        return cls(process, stderr)

    def _tail(self) -> str:
        return self.stderr.read_text(errors="replace")[-3000:]

    async def send(self, **command: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write((json.dumps(command) + "\n").encode())
        await self.process.stdin.drain()

    async def event(self, name: str) -> dict[str, Any]:
        assert self.process.stdout is not None
        try:
            async with asyncio.timeout(EVENT_TIMEOUT_S):
                line = await self.process.stdout.readline()
        except TimeoutError:
            raise AssertionError(
                f"no {name!r} from the trainer within {EVENT_TIMEOUT_S} s; stderr:\n{self._tail()}"
            ) from None
        if not line:
            code = await self.process.wait()
            raise AssertionError(f"the trainer exited ({code}) before {name!r}; stderr:\n{self._tail()}")
        event: dict[str, Any] = json.loads(line)
        assert event.get("event") == name, f"trainer said {event}, expected {name!r}; stderr:\n{self._tail()}"
        return event

    async def close(self) -> None:
        """Ask it to leave; kill it if it does not within a few seconds (or is blocked in a collective)."""
        try:
            if self.process.returncode is None and self.process.stdin is not None:
                with contextlib.suppress(ConnectionError):
                    await self.send(op="exit")
                    self.process.stdin.close()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(10):
                        await self.process.wait()
        finally:
            if self.process.returncode is None:
                self.process.kill()
            try:
                async with asyncio.timeout(30):
                    await self.process.wait()
            except TimeoutError:
                raise AssertionError(f"the trainer (pid {self.process.pid}) did not exit 30 s after SIGKILL") from None


@pytest.fixture
async def client(sglang_dense_url: str, tiny_models: TinyModels) -> AsyncIterator[Client]:
    config = ClientConfig(
        backend="sglang", base_url=sglang_dense_url, model="tiny-qwen3", tokenizer=str(tiny_models.dense)
    )
    async with Client(config) as c:
        yield c


async def _greedy(client: Client) -> list[tuple[list[int], npt.NDArray[np.float64], str | None]]:
    sampling = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
    results = []
    for ids in probe_sequences():
        r = await client.generate(prompt_ids=ids, sampling=sampling)
        results.append((list(r.completion_ids), r.logprobs.astype(np.float64), r.weight_version))
    return results


async def _max_delta_to_engine(client: Client, model_dir: Path) -> float:
    """Largest |Δ logprob| of SGLang (through the client) vs the reference engine on ``model_dir``, over teacher
    logprobs and greedy output logprobs; greedy tokens must be identical."""
    worst = 0.0
    teachers = await served(client)
    greedy = await _greedy(client)
    async with ReferenceEngine(model_dir) as engine:
        for ids, teacher, (tokens, logprobs, _) in zip(probe_sequences(), teachers, greedy, strict=True):
            scored = await engine.score(ids, top_k=0)
            assert scored.prompt_logprobs is not None
            worst = max(worst, float(np.max(np.abs(teacher - scored.prompt_logprobs[1:].astype(np.float64)))))
            ours = await engine.generate(
                EngineRequest(prompt_ids=ids, max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
            )
            assert tokens == list(ours.completion_ids), f"greedy tokens differ for a {len(ids)}-token prompt"
            assert ours.logprobs is not None
            worst = max(worst, float(np.max(np.abs(logprobs - ours.logprobs.astype(np.float64)))))
    return worst


async def _broadcast_update(
    client: Client, trainer: Trainer, group_name: str, weights: Path, *, version: str, names: Sequence[str] = ()
) -> tuple[float, dict[str, Any]]:
    """The trainer broadcasts ``weights`` (all its tensors, or ``names``) while the client runs the update;
    returns the update's wall time and the trainer's ``sent`` event."""
    specs = [s for s in _specs(weights) if not names or s.name in names]
    await trainer.send(op="broadcast", file=str(weights), names=[s.name for s in specs])
    started = time.perf_counter()
    values = await client.admin.update_weights_distributed(group_name, specs, version=version)
    elapsed = time.perf_counter() - started
    assert values == [True]
    sent = await trainer.event("sent")
    assert sent["count"] == len(specs)
    return elapsed, sent


class Group:
    """A trainer process and the server, joined in one gloo group."""

    def __init__(self, trainer: Trainer, name: str) -> None:
        self.trainer = trainer
        self.name = name


@pytest.fixture
async def gloo_group(
    request: pytest.FixtureRequest, client: Client, sglang_venv: Path, sglang_dense_url: str, tmp_path: Path
) -> AsyncIterator[Group]:
    """Trainer started, server joined through ``client.admin.init_weight_transfer`` (gloo); afterwards the
    trainer leaves (or is killed) and the server leaves the group through ``client.admin.destroy_weight_transfer``
    (asserted when the join succeeded; a second destroy of the name must be refused)."""
    name = f"backends-live-{request.node.name}"
    port = free_port()
    trainer = await Trainer.start(
        sglang_venv / "bin" / "python", port=port, group_name=name, stderr=tmp_path / "trainer.stderr"
    )
    joined = False
    try:
        group = loopback_gloo_group(port=port, group_name=name)
        started = time.perf_counter()
        assert await client.admin.init_weight_transfer(group) == [True]
        joined = True
        event = await trainer.event("joined")
        assert (event["rank"], event["size"]) == (0, 2)
        sys.stderr.write(f"\n[gloo] group {name} joined in {time.perf_counter() - started:.2f}s\n")
        yield Group(trainer, name)
    finally:
        await trainer.close()
        if joined:
            assert await client.admin.destroy_weight_transfer(name) == [True]
            with pytest.raises(AdminError) as gone:
                await client.admin.destroy_weight_transfer(name)
            error = gone.value.results[0].error
            assert isinstance(error, ServerStatusError) and error.status_code == 400, repr(error)
            assert error.url == f"{sglang_dense_url}/destroy_weights_update_group"
            assert "The group to be destroyed does not exist." in str(error), str(error)


@pytest.fixture
async def original_weights(client: Client, tiny_models: TinyModels) -> AsyncIterator[str | None]:
    """The server's version before the test; afterwards, the server must serve what it served before, within
    ``TOLERANCE`` (``weight_push_checks.left_as_found``)."""
    async with left_as_found(client, tiny_models.dense, tolerance=TOLERANCE) as version:
        yield version


async def test_gloo_update_from_a_trainer_process_then_restore(
    client: Client,
    gloo_group: Group,
    original_weights: str | None,
    tiny_models: TinyModels,
    tmp_path: Path,
    record_property: Any,
) -> None:
    original = tiny_models.dense / WEIGHTS
    perturbed_dir = write_perturbed_weights(tiny_models.dense, tmp_path / "perturbed", seed=41, scale=0.05)
    before = await served(client)
    greedy_before = await _greedy(client)
    assert all(v == original_weights for _, _, v in greedy_before)

    elapsed, sent = await _broadcast_update(
        client, gloo_group.trainer, gloo_group.name, perturbed_dir / WEIGHTS, version="live-gloo-1"
    )
    try:
        assert await weight_version(client) == "live-gloo-1"
        assert all(v == "live-gloo-1" for _, _, v in await _greedy(client))
        changed = max_delta(await served(client), before)
        assert changed > CHANGED, f"the broadcast weights did not change the logprobs (max |Δ| {changed:.3g})"
        worst = await _max_delta_to_engine(client, perturbed_dir)
        record_property("max_abs_delta_vs_engine", worst)
        record_property("update_seconds", elapsed)
        sys.stderr.write(
            f"\n[gloo] {sent['count']} tensors, {sent['bytes']} bytes: update {elapsed:.3f}s; logprobs moved "
            f"by up to {changed:.3g}; vs reference engine on the perturbed weights max |Δ| = {worst:.3g}\n"
        )
        assert worst <= TOLERANCE, f"SGLang vs engine on the broadcast weights: max |Δ logprob| {worst:.3g}"
    finally:
        # restore through the same group: the original tensors, the original version
        await _broadcast_update(client, gloo_group.trainer, gloo_group.name, original, version=str(original_weights))
    assert await weight_version(client) == original_weights
    assert max_delta(await served(client), before) == 0.0, "the original weights did not restore the outputs"
    # greedy decoding: same tokens; its logprobs move by float noise (4.8e-7 seen) with the prefix-cache state
    for (tokens, logprobs, _), (tokens0, logprobs0, _) in zip(await _greedy(client), greedy_before, strict=True):
        assert tokens == tokens0
        assert float(np.max(np.abs(logprobs - logprobs0))) <= TOLERANCE
    assert await _max_delta_to_engine(client, tiny_models.dense) <= TOLERANCE


async def test_gloo_update_failures(
    client: Client,
    gloo_group: Group,
    original_weights: str | None,
    sglang_dense_url: str,
    tiny_models: TinyModels,
    tmp_path: Path,
) -> None:
    original = tiny_models.dense / WEIGHTS
    before = await served(client)
    norm = load_file(original)["model.norm.weight"]  # (64,)

    # a shape the parameter does not have: received (both sides agree on it), then refused by the loader
    bad_shape = tmp_path / "bad-shape.safetensors"
    save_file({"model.norm.weight": norm[:32].copy()}, str(bad_shape))
    await gloo_group.trainer.send(op="broadcast", file=str(bad_shape), names=["model.norm.weight"])
    with pytest.raises(AdminError) as caught:
        await client.admin.update_weights_distributed(
            gloo_group.name, [TensorSpec(name="model.norm.weight", dtype="float32", shape=(32,))], version="live-bad"
        )
    assert (await gloo_group.trainer.event("sent"))["count"] == 1  # the group is still in step
    message = str(caught.value)
    sys.stderr.write(f"\n[gloo] shape mismatch: {message[:600]}\n")
    assert caught.value.operation == "admin_update_weights_distributed"
    assert sglang_dense_url in message and "update_weights_from_distributed" in message
    assert "Failed to update parameter online" in message, message
    assert await weight_version(client) == original_weights
    assert max_delta(await served(client), before) == 0.0

    # a name the model does not have: SGLang logs a warning, reports success and takes the version
    unknown = tmp_path / "unknown-name.safetensors"
    save_file({"model.no_such.weight": norm.copy()}, str(unknown))
    await _broadcast_update(client, gloo_group.trainer, gloo_group.name, unknown, version="live-unknown-name")
    assert await weight_version(client) == "live-unknown-name"
    assert max_delta(await served(client), before) == 0.0

    # no session was left open by the failure: a full update goes through (and restores the version)
    await _broadcast_update(client, gloo_group.trainer, gloo_group.name, original, version=str(original_weights))
    assert await weight_version(client) == original_weights
    assert max_delta(await served(client), before) == 0.0
