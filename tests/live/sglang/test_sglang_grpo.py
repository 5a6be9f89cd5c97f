"""TRL 1.16's ``GRPOTrainer`` training the tiny model on CPU while real SGLang 0.5.23 (CPU, float32) generates every
batch, through ``backends_trainer.trl.grpo_kwargs``, with the weights pushed over a two-rank gloo group: the test
process is rank 0 (host of the rendezvous), the server joins as rank 1, and after each optimizer step the
trained tensors are broadcast while SGLang receives them. Then SGLang's teacher logprobs on a fixed sequence
equal the trained model's, and the next batch's sampling logprobs equal the policy's own.

The server is shared with the session: the original weights and version go back through the same group in
``finally``, and the group is left (a second leave is refused: it is gone).
"""

from __future__ import annotations

import socket
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
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from backends_core import ClientConfig, SyncClient
from backends_core.errors import AdminError
from backends_core.types import DistributedGroup
from backends_testkit.tinymodel import TOKENIZER_SIZE, TinyModels
from backends_trainer import SyncWeightPusher
from backends_trainer.trl import BackendsRollout, WeightSyncCallback, grpo_kwargs

pytestmark = [
    pytest.mark.live,
    pytest.mark.filterwarnings("ignore:You are using 'rollout_func':UserWarning"),
    pytest.mark.filterwarnings("ignore:`.*gradient_checkpointing.*` is deprecated:FutureWarning"),
]

STEPS = 3
GENERATIONS = 4
TOLERANCE = 1e-4
"""|Δ logprob| accepted between SGLang's float32 CPU kernels and the trainer's float32 torch forward."""
CHANGED = 1e-2
"""The smallest max |Δ logprob| that counts as "training changed what SGLang serves"."""
GROUP_TIMEOUT_S = 180.0
"""The group's rendezvous and collective timeout on the trainer's side (SGLang's default is half an hour)."""
GROUP_NAME = "backends-grpo"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def sequence() -> list[int]:
    return np.random.default_rng(23).integers(0, TOKENIZER_SIZE, size=32).tolist()


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
    """After each step's push (the callback before this one): SGLang's logprobs on the fixed sequence vs the
    model's."""

    def __init__(self, client: SyncClient) -> None:
        self.client = client
        self.deltas: list[float] = []
        self.versions: list[str | None] = []

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        (found,) = self.client.admin.state()
        self.versions.append(found.weight_version)
        self.deltas.append(float(np.max(np.abs(served_logprobs(self.client) - model_logprobs(model, sequence())))))


@pytest.fixture
def client(sglang_dense_url: str, tiny_models: TinyModels) -> Iterator[SyncClient]:
    config = ClientConfig(
        backend="sglang", base_url=sglang_dense_url, model="tiny-qwen3", tokenizer=str(tiny_models.dense)
    )
    with SyncClient(config) as c:
        yield c


def test_grpo_generates_on_sglang_and_every_step_is_broadcast_to_it(
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
    assert start_delta <= TOLERANCE, f"SGLang and the trainer disagree before training: max |Δ| {start_delta:.3g}"

    group = DistributedGroup(
        master_address="127.0.0.1",
        master_port=free_port(),
        world_size=2,
        rank_offset=1,
        backend="gloo",
        group_name=GROUP_NAME,
        bucket_bytes=1 << 20,
    )
    pusher = SyncWeightPusher(client, group=group, reference=model, group_timeout_s=GROUP_TIMEOUT_S)
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
    # joined here rather than by the callback, so the original weights can go back through the same group
    pusher.start()
    try:
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
                f"\n[grpo on SGLang, gloo group] {STEPS} steps in {train_s:.1f}s; served vs trained max |Δ| per step "
                f"{[f'{d:.2g}' for d in check.deltas]}; rollout vs policy max |Δ| per batch {rollout_deltas}; "
                f"generation {[round(b['seconds'], 2) for b in batches]} s; pushes "
                f"{[round(r.duration_s, 2) for r in push.reports]} s (broadcast "
                f"{[round(r.send_s, 3) for r in push.reports]} s, {push.reports[0].buckets} buckets); training "
                f"moved SGLang's logprobs by up to {changed:.3g}\n"
            )
            assert changed > CHANGED, f"training did not change what SGLang serves (max |Δ| {changed:.3g})"
            assert worst_served <= TOLERANCE, f"SGLang vs the trained model: max |Δ logprob| {worst_served:.3g}"
            assert worst_rollout <= TOLERANCE, f"sampling vs policy logprobs: max |Δ| {worst_rollout:.3g}"
        finally:  # the next tests share this server: the original weights and version, through the same group
            pusher.push(load_file(str(Path(tiny_models.dense) / "model.safetensors")), version=original_version)
        (state,) = client.admin.state()
        assert state.weight_version == original_version
        assert float(np.max(np.abs(served_logprobs(client) - before))) == 0.0
    finally:
        pusher.close()
    assert not pusher.pusher.started
    with pytest.raises(AdminError, match="does not exist"):  # the server left the group
        client.admin.destroy_weight_transfer(GROUP_NAME)
