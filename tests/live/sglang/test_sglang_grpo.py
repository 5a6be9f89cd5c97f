"""TRL 1.16's ``GRPOTrainer`` training the tiny model on CPU while real SGLang 0.5.23 (CPU, float32) generates every
batch, through ``backends_trainer.trl.grpo_kwargs``, with the weights pushed over a two-rank gloo group: the test
process is rank 0 (host of the rendezvous), the server joins as rank 1, and after each optimizer step the
trained tensors are broadcast while SGLang receives them. Then SGLang's teacher logprobs on a fixed sequence
equal the trained model's, and the next batch's sampling logprobs equal the policy's own
(``weight_push_checks.train_and_check_every_step``).

The server is shared with the session: the original weights and version go back through the same group in
``finally``, and the group is left (a second leave is refused: it is gone).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from weight_push_checks import (
    fixed_sequence,
    grpo_run,
    loopback_gloo_group,
    policy_as_served,
    served_logprobs,
    tensors,
    train_and_check_every_step,
)

from backends_core import ClientConfig, SyncClient
from backends_core.errors import AdminError
from backends_testkit.tinymodel import TinyModels
from backends_trainer import SyncWeightPusher

pytestmark = [
    pytest.mark.live,
    pytest.mark.filterwarnings("ignore:You are using 'rollout_func':UserWarning"),
    pytest.mark.filterwarnings("ignore:`.*gradient_checkpointing.*` is deprecated:FutureWarning"),
]

GROUP_TIMEOUT_S = 180.0
"""The group's rendezvous and collective timeout on the trainer's side (SGLang's default is half an hour)."""
GROUP_NAME = "backends-grpo"


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
    policy = policy_as_served(client, tiny_models.dense, fixed_sequence(23), server="SGLang")
    group = loopback_gloo_group(group_name=GROUP_NAME, bucket_bytes=1 << 20)
    pusher = SyncWeightPusher(client, group=group, reference=policy.model, group_timeout_s=GROUP_TIMEOUT_S)
    run = grpo_run(client, pusher, policy, tmp_path / "out")
    # joined here rather than by the callback, so the original weights can go back through the same group
    pusher.start()
    try:
        try:
            label = "grpo on SGLang, gloo group"
            train_and_check_every_step(
                client, run, policy, server="SGLang", label=label, record_property=record_property
            )
        finally:  # the next tests share this server: the original weights and version, through the same group
            pusher.push(tensors(tiny_models.dense), version=policy.version)
        (state,) = client.admin.state()
        assert state.weight_version == policy.version
        assert float(np.max(np.abs(served_logprobs(client, policy.ids) - policy.served))) == 0.0
    finally:
        pusher.close()
    assert not pusher.pusher.started
    with pytest.raises(AdminError, match="does not exist"):  # the server left the group
        client.admin.destroy_weight_transfer(GROUP_NAME)
