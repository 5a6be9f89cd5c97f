"""TRL 1.16's ``GRPOTrainer`` training the tiny model on CPU, generating through vLLM's emulator (in-process) with
``grpo_kwargs``: after every optimizer step the trained weights go to the server through a checkpoint directory,
the next batch is generated from them, and the server's logprobs are the trained model's own."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from backends_core import Client, ClientConfig, SyncClient
from backends_testkit.engine import DEFAULT_WEIGHT_VERSION, ReferenceEngine
from backends_testkit.tinymodel import TOKENIZER_SIZE
from backends_trainer import CheckpointDir, SyncWeightPusher
from backends_trainer.trl import BackendsRollout, WeightSyncCallback, grpo_kwargs
from backends_vllm_testing import VllmEmulator

pytestmark = pytest.mark.slow

STEPS = 2
GENERATIONS = 4
TOLERANCE = 1e-4
"""|Δ logprob| accepted between the engine (float64 from float32 weights) and the trainer's float32 forward."""
CHANGED = 1e-2
"""The smallest max |Δ logprob| that counts as "a step changed the weights"."""


def sequence() -> list[int]:
    return np.random.default_rng(3).integers(0, TOKENIZER_SIZE, size=24).tolist()


def model_logprobs(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    """The model's logprob of every token of ``ids`` after the first, at temperature 1."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
    picked = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return picked.numpy()


def completion_logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> np.ndarray:
    return model_logprobs(model, prompt + completion)[len(prompt) - 1 :]


class Served:
    def __init__(self, models: Any) -> None:
        self.emulator = VllmEmulator(ReferenceEngine(models.dense, seed=0))
        config = ClientConfig(
            backend="vllm", base_url="http://vllm.test", model="tiny-qwen3", tokenizer=str(models.dense)
        )
        self.client = SyncClient(config, transport=httpx.MockTransport(self.emulator.handle))

    def served_logprobs(self) -> np.ndarray:
        return self.client.teacher_logprobs(sequence()).logprobs[1:].astype(np.float64)

    def close(self) -> None:
        async def stop(_client: Client) -> None:
            await self.emulator.aclose()

        try:
            self.client.run(stop)
        finally:
            self.client.close()


@pytest.fixture
def served(tiny_models: Any) -> Iterator[Served]:
    s = Served(tiny_models)
    try:
        yield s
    finally:
        s.close()


def dataset() -> Dataset:
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Count to {i}."}] for i in range(8)]})


def config(tmp_path: Path, **changes: Any) -> GRPOConfig:
    fields: dict[str, Any] = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": GENERATIONS * 2,
        "num_generations": GENERATIONS,
        "max_completion_length": 8,
        "max_steps": STEPS,
        "learning_rate": 1e-2,
        "logging_steps": 1,
        "report_to": "none",
        "use_cpu": True,
        "save_strategy": "no",
        "seed": 0,
        # TRL's default, bf16 autocast, computes the policy's logprobs in bfloat16 (0.02 from the float32 weights
        # the server holds): float32 throughout makes the comparisons exact
        "bf16": False,
    }
    fields.update(changes)
    return GRPOConfig(**fields)


def id_reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """Any reward that differs within a group (so the advantages, and the step, are not zero)."""
    return [float(sum(ids) % 7) for ids in completion_ids]


def test_grpo_trains_on_the_emulator_and_every_step_is_served(
    served: Served, tiny_models: Any, tmp_path: Path, record_property: Any
) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(tiny_models.dense))
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_models.dense))
    before = served.served_logprobs()
    assert np.max(np.abs(before - model_logprobs(model, sequence()))) <= TOLERANCE  # same weights to begin with

    pusher = SyncWeightPusher(
        served.client,
        checkpoint=CheckpointDir(path=tmp_path / "ckpt", config_from=tiny_models.dense, keep=1),
        reference=model,
    )
    kwargs = grpo_kwargs(served.client, pusher, seed=0)
    rollout: BackendsRollout = kwargs["rollout_func"]
    (callback,) = kwargs["callbacks"]
    assert isinstance(callback, WeightSyncCallback)

    # each batch as generated, with the policy's own logprobs of it at that moment
    batches: list[dict[str, Any]] = []

    def recording(prompts: list[Any], trainer: Any) -> dict[str, Any]:
        out = rollout(prompts, trainer)
        policy = trainer.model
        deltas = [
            float(np.max(np.abs(completion_logprobs(policy, p, c) - np.asarray(lp))))
            for p, c, lp in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"], strict=True)
        ]
        batches.append(
            {"step": trainer.state.global_step, "versions": set(out["weight_version"]), "delta": max(deltas)}
        )
        return out

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=id_reward,
        args=config(tmp_path),
        train_dataset=dataset(),
        processing_class=tokenizer,
        rollout_func=recording,
        callbacks=kwargs["callbacks"],
    )
    trainer.train()

    assert trainer.state.global_step == STEPS
    assert [r.version for r in callback.reports] == [f"step-{s}" for s in range(1, STEPS + 1)]
    # batch k is generated after step k's push, from exactly the weights the trainer then holds
    assert [b["step"] for b in batches] == list(range(STEPS))
    assert [b["versions"] for b in batches] == [{DEFAULT_WEIGHT_VERSION}, *({f"step-{s}"} for s in range(1, STEPS))]
    worst_rollout = max(b["delta"] for b in batches)
    assert worst_rollout <= TOLERANCE, f"rollout logprobs vs the policy's: max |Δ| {worst_rollout:.3g}"

    (state,) = served.client.admin.state()
    assert state.weight_version == f"step-{STEPS}"
    after = served.served_logprobs()
    assert np.max(np.abs(after - before)) > CHANGED, "training did not change what the server serves"
    worst = float(np.max(np.abs(after - model_logprobs(trainer.model, sequence()))))
    record_property("max_abs_delta_rollout_vs_policy", worst_rollout)
    record_property("max_abs_delta_served_vs_trained", worst)
    sys.stderr.write(
        f"\n[grpo on the emulator] {STEPS} steps; rollout vs policy max |Δ| {worst_rollout:.3g}; served vs trained "
        f"max |Δ| {worst:.3g}; pushes {[round(r.duration_s, 3) for r in callback.reports]} s\n"
    )
    assert worst <= TOLERANCE, f"served vs trained logprobs: max |Δ| {worst:.3g}"
    assert [p.name for p in (tmp_path / "ckpt").iterdir() if p.is_dir()] == [f"step-{STEPS}"]  # keep=1


def test_push_at_start_and_every_other_step_with_the_off_policy_mask(
    served: Served, tiny_models: Any, tmp_path: Path
) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(tiny_models.dense))
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_models.dense))
    pusher = SyncWeightPusher(
        served.client, checkpoint=CheckpointDir(path=tmp_path / "ckpt", config_from=tiny_models.dense)
    )
    kwargs = grpo_kwargs(served.client, pusher, every=2, push_at_start=True)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=id_reward,
        # the off-policy sequence mask is what TRL does with the sampling logprobs under use_vllm=False
        args=config(tmp_path, max_steps=3, off_policy_mask_threshold=0.5),
        train_dataset=dataset(),
        processing_class=tokenizer,
        **kwargs,
    )
    trainer.train()
    (callback,) = kwargs["callbacks"]
    # step-0 at the start, step 2, and the last step whatever `every` says
    assert [r.version for r in callback.reports] == ["step-0", "step-2", "step-3"]
    worst = float(np.max(np.abs(served.served_logprobs() - model_logprobs(trainer.model, sequence()))))
    assert worst <= TOLERANCE
