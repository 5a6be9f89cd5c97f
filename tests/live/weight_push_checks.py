"""Weights pushed into real servers, checked by what the servers then serve: the helpers of the live push, weight
update and GRPO tests of every backend.

Two comparisons. A push of given weights: the server's teacher logprobs of fixed probe sequences against the numpy
reference engine on the same weights (``served``, ``engine_logprobs``, ``max_delta``). Training: the server's
logprobs of one fixed sequence against the model the trainer holds, after every optimizer step of TRL's
``GRPOTrainer`` (``policy_as_served``, ``grpo_run``, ``train_and_check_every_step``). The servers are shared with
the session, so every test leaves them as it found them (``left_as_found`` checks it).
"""

from __future__ import annotations

import contextlib
import socket
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from backends_core import Client, SyncClient
from backends_core.types import DistributedGroup
from backends_testkit.engine import ReferenceEngine
from backends_testkit.tinymodel import TOKENIZER_SIZE
from backends_trainer import SyncWeightPusher
from backends_trainer.trl import BackendsRollout, WeightSyncCallback, grpo_kwargs

Logprobs = npt.NDArray[np.float64]

WEIGHTS = "model.safetensors"
"""The checkpoint file of a tiny model's directory."""
CHANGED = 1e-2
"""The smallest max |Δ logprob| that counts as "the new weights changed what the server serves"."""
GRPO_STEPS = 3
GENERATIONS = 4
"""Completions per prompt in a GRPO step (two prompts a step)."""
GRPO_TOLERANCE = 1e-4
"""|Δ logprob| accepted between a server's float32 CPU kernels and the trainer's float32 torch forward."""


def free_port() -> int:
    """A loopback port nobody listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def loopback_gloo_group(*, port: int | None = None, **fields: Any) -> DistributedGroup:
    """A two-rank gloo group on loopback: the trainer (this process, or one it starts) is rank 0 and hosts the
    rendezvous on ``port`` (a free one unless given), the one server joins as rank 1. ``fields``: the group's other
    fields (its name, its bucket size)."""
    return DistributedGroup(
        master_address="127.0.0.1",
        master_port=free_port() if port is None else port,
        world_size=2,
        rank_offset=1,
        backend="gloo",
        **fields,
    )


def tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in ``model_dir``, by name."""
    return load_file(str(model_dir / WEIGHTS))


def max_delta(a: Sequence[Logprobs], b: Sequence[Logprobs]) -> float:
    """The largest |Δ| between paired logprob arrays."""
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


def probe_sequences() -> list[list[int]]:
    """The fixed token sequences a push is checked on (16 and 40 tokens)."""
    rng = np.random.default_rng(31)
    return [rng.integers(0, TOKENIZER_SIZE, size=n).tolist() for n in (16, 40)]


async def weight_version(client: Client) -> str | None:
    """The weight version the client's (first) server reports now."""
    (state,) = await client.admin.state()
    return state.weight_version


async def served(client: Client) -> list[Logprobs]:
    """The server's teacher logprobs (positions 1..) of the probe sequences."""
    return [(await client.teacher_logprobs(ids)).logprobs[1:].astype(np.float64) for ids in probe_sequences()]


async def engine_logprobs(model_dir: Path) -> list[Logprobs]:
    """The numpy reference engine's logprobs (positions 1..) of the probe sequences on the weights in ``model_dir``:
    what a server that loaded exactly those weights serves."""
    out = []
    async with ReferenceEngine(model_dir) as engine:
        for ids in probe_sequences():
            scored = await engine.score(ids, top_k=0)
            assert scored.prompt_logprobs is not None
            out.append(scored.prompt_logprobs[1:].astype(np.float64))
    return out


async def new_weights_vs_engine(client: Client, before: Sequence[Logprobs], model_dir: Path) -> float:
    """Checks the server took new weights: its logprobs of the probe sequences moved from ``before`` by more than
    ``CHANGED``. Gives the max |Δ| between them and the reference engine's on the weights in ``model_dir`` (each
    backend bounds it by its own parity tolerance)."""
    after = await served(client)
    changed = max_delta(after, before)
    assert changed > CHANGED, f"the pushed weights did not change the logprobs (max |Δ| {changed:.3g})"
    return max_delta(after, await engine_logprobs(model_dir))


@contextlib.asynccontextmanager
async def left_as_found(client: Client, model_dir: Path, *, tolerance: float) -> AsyncIterator[str]:
    """Gives the server's weight version (it must report one); when the block ends, checks the server is as found:
    the same version, and its logprobs of the probe sequences within ``tolerance`` of before. If not, the weights
    are reloaded from ``model_dir`` with the original version (``/update_weights_from_disk`` also renames the served
    model to the path: the last resort only) and the test fails."""
    version = await weight_version(client)
    assert version is not None, "the backend reports the weight version"
    before = await served(client)
    yield version
    if await weight_version(client) != version or max_delta(await served(client), before) > tolerance:
        await client.admin.update_weights(str(model_dir), version=version)
        pytest.fail("the test left the server changed: weights reloaded from disk")


def fixed_sequence(seed: int) -> list[int]:
    """32 token ids drawn with ``seed``: the sequence a GRPO test compares the server and the trainer on."""
    return np.random.default_rng(seed).integers(0, TOKENIZER_SIZE, size=32).tolist()


def model_logprobs(model: torch.nn.Module, ids: list[int]) -> Logprobs:
    """The model's logprob of every token of ``ids`` after the first, at temperature 1, in its own dtype."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
    picked = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    result: Logprobs = picked.numpy()
    return result


def served_logprobs(client: SyncClient, ids: list[int]) -> Logprobs:
    """The server's teacher logprob of every token of ``ids`` after the first."""
    return client.teacher_logprobs(ids).logprobs[1:].astype(np.float64)


class ServedEqualsTrained(TrainerCallback):
    """After each step's push (the callback before this one): the version the server reports, and the max |Δ|
    between its logprobs of ``ids`` and the trained model's."""

    def __init__(self, client: SyncClient, ids: list[int]) -> None:
        self.client = client
        self.ids = ids
        self.deltas: list[float] = []
        self.versions: list[str | None] = []

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        (found,) = self.client.admin.state()
        self.versions.append(found.weight_version)
        delta = np.abs(served_logprobs(self.client, self.ids) - model_logprobs(model, self.ids))
        self.deltas.append(float(np.max(delta)))


@attrs.frozen
class Policy:
    """What a GRPO test starts from: the server's weight version and its logprobs of ``ids``, and the model it
    serves, loaded for training."""

    ids: list[int]
    version: str
    served: Logprobs
    model: Any
    tokenizer: Any


def policy_as_served(client: SyncClient, model_dir: Path, ids: list[int], *, server: str) -> Policy:
    """The server's version and logprobs of ``ids``, and the model in ``model_dir``. Checks the model is float32 (the
    checkpoint's dtype, and the server's ``--dtype``) and that ``server`` and the model agree on ``ids`` within
    ``GRPO_TOLERANCE`` before training."""
    (found,) = client.admin.state()
    assert found.weight_version is not None
    before = served_logprobs(client, ids)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    assert model.dtype == torch.float32  # the checkpoint's dtype, and the server's --dtype
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    start_delta = float(np.max(np.abs(before - model_logprobs(model, ids))))
    assert start_delta <= GRPO_TOLERANCE, (
        f"{server} and the trainer disagree before training: max |Δ| {start_delta:.3g}"
    )
    return Policy(ids=ids, version=found.weight_version, served=before, model=model, tokenizer=tokenizer)


@attrs.frozen
class GRPORun:
    """A ``GRPOTrainer`` generating on a server, and what it records: the push callback's reports, the check after
    each step, and per batch the versions it was generated from, its max |Δ| between the sampling logprobs and the
    policy's own, and its generation seconds."""

    trainer: GRPOTrainer
    push: WeightSyncCallback
    check: ServedEqualsTrained
    batches: list[dict[str, Any]]


def grpo_run(client: SyncClient, pusher: SyncWeightPusher, policy: Policy, out_dir: Path) -> GRPORun:
    """TRL's ``GRPOTrainer`` on ``policy``'s model through ``backends_trainer.trl.grpo_kwargs(client, pusher)``:
    ``GRPO_STEPS`` steps of two prompts with ``GENERATIONS`` completions each, every batch generated by the server,
    every step pushed by the one callback ``grpo_kwargs`` gives and then checked by ``ServedEqualsTrained``."""
    kwargs = grpo_kwargs(client, pusher, seed=0)
    rollout: BackendsRollout = kwargs["rollout_func"]
    (push,) = kwargs["callbacks"]
    assert isinstance(push, WeightSyncCallback)
    check = ServedEqualsTrained(client, policy.ids)
    batches: list[dict[str, Any]] = []

    def recording(prompts: list[Any], trainer: Any) -> dict[str, Any]:
        began = time.perf_counter()
        out = rollout(prompts, trainer)
        seconds = time.perf_counter() - began
        deltas = [
            float(np.max(np.abs(model_logprobs(trainer.model, p + c)[len(p) - 1 :] - np.asarray(lp))))
            for p, c, lp in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"], strict=True)
        ]
        batches.append({"versions": set(out["weight_version"]), "delta": max(deltas), "seconds": seconds})
        return out

    args = GRPOConfig(
        output_dir=str(out_dir),
        per_device_train_batch_size=GENERATIONS * 2,
        num_generations=GENERATIONS,
        max_completion_length=16,
        max_steps=GRPO_STEPS,
        learning_rate=1e-2,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        seed=0,
        bf16=False,  # TRL's default bf16 autocast would score the policy in bfloat16; the server holds float32
    )
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Count to {i}."}] for i in range(16)]})
    trainer = GRPOTrainer(
        model=policy.model,
        reward_funcs=lambda completion_ids, **_: [float(sum(ids) % 7) for ids in completion_ids],
        args=args,
        train_dataset=dataset,
        processing_class=policy.tokenizer,
        rollout_func=recording,
        callbacks=[push, check],
    )
    return GRPORun(trainer=trainer, push=push, check=check, batches=batches)


def train_and_check_every_step(
    client: SyncClient, run: GRPORun, policy: Policy, *, server: str, label: str, record_property: Any
) -> None:
    """Trains, then checks: ``GRPO_STEPS`` steps, each pushed as version ``step-N``, which the server reports after
    it; the first batch generated from the original weights and each later one from the step before it; after every
    step the server's logprobs of ``policy.ids`` equal the trained model's, and every batch's sampling logprobs equal
    the policy's own (``GRPO_TOLERANCE``); training changed what ``server`` serves (``CHANGED``). Records the worst
    deltas and the training seconds, and writes the figures to stderr under ``label``."""
    push, check, batches = run.push, run.check, run.batches
    began = time.perf_counter()
    run.trainer.train()
    train_s = time.perf_counter() - began
    versions = [f"step-{s}" for s in range(1, GRPO_STEPS + 1)]
    assert run.trainer.state.global_step == GRPO_STEPS
    assert [r.version for r in push.reports] == versions
    assert check.versions == versions
    assert [b["versions"] for b in batches] == [{policy.version}, *({v} for v in versions[:-1])]
    worst_served = max(check.deltas)
    worst_rollout = max(b["delta"] for b in batches)
    changed = float(np.max(np.abs(served_logprobs(client, policy.ids) - policy.served)))
    record_property("max_abs_delta_served_vs_trained", worst_served)
    record_property("max_abs_delta_rollout_vs_policy", worst_rollout)
    record_property("train_seconds", train_s)
    rollout_deltas = [f"{b['delta']:.2g}" for b in batches]
    sys.stderr.write(
        f"\n[{label}] {GRPO_STEPS} steps in {train_s:.1f}s; served vs trained max |Δ| per step "
        f"{[f'{d:.2g}' for d in check.deltas]}; rollout vs policy max |Δ| per batch {rollout_deltas}; "
        f"generation {[round(b['seconds'], 2) for b in batches]} s; pushes "
        f"{[round(r.duration_s, 2) for r in push.reports]} s (the trainer's part "
        f"{[round(r.send_s, 3) for r in push.reports]} s, {push.reports[0].buckets} buckets); training "
        f"moved {server}'s logprobs by up to {changed:.3g}\n"
    )
    assert changed > CHANGED, f"training did not change what {server} serves (max |Δ| {changed:.3g})"
    assert worst_served <= GRPO_TOLERANCE, f"{server} vs the trained model: max |Δ logprob| {worst_served:.3g}"
    assert worst_rollout <= GRPO_TOLERANCE, f"sampling vs policy logprobs: max |Δ| {worst_rollout:.3g}"
