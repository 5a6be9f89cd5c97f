"""Multi-turn token-in/token-out through the dynamo backend against real Dynamo (frontend + vLLM worker)."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from backends_core import Client, ClientConfig, SamplingParams
from backends_testkit.tinymodel import TinyModels

pytestmark = pytest.mark.live


async def test_multi_turn_tito_with_tool_messages(dynamo_vllm: Any, tiny_models: TinyModels) -> None:
    config = ClientConfig(
        backend="dynamo",
        base_url=str(dynamo_vllm.frontend_url),
        model="tiny-qwen3",
        tokenizer=str(tiny_models.dense),
        backend_options={"worker_urls": list(dynamo_vllm.worker_system_urls)},
    )
    async with Client(config) as client:
        conv = client.conversation()
        sampling = SamplingParams(max_tokens=8, temperature=1.0, seed=5)
        turns = [await conv.send([{"role": "user", "content": "list files"}], sampling=sampling)]
        for step in range(4):
            new = [{"role": "tool", "content": f"f{step}.py"}] if step % 2 == 0 else [{"role": "user", "content": "ok"}]
            turns.append(await conv.send(new, sampling=sampling))
        for before, after in itertools.pairwise(turns):
            assert after.prompt_ids[: len(before.token_ids)] == before.token_ids
        teacher = await client.teacher_logprobs(turns[-1].token_ids)
        np.testing.assert_allclose(teacher.logprobs[len(turns[-1].prompt_ids) :], turns[-1].logprobs, atol=1e-4)
        assert client.bridge_stats.successes == 4 and client.bridge_stats.failed == 0
