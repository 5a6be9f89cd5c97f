"""Multi-turn token-in/token-out through the sglang backend against real SGLang, with routed experts replayed
as deltas: turn N's rows from its start equal a full-sequence capture's rows."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from backends_core import Client, ClientConfig, SamplingParams
from backends_testkit.tinymodel import TinyModels

pytestmark = pytest.mark.live


async def test_multi_turn_tito_with_routed_expert_deltas(sglang_moe_url: str, tiny_models: TinyModels) -> None:
    config = ClientConfig(backend="sglang", base_url=sglang_moe_url, model="tiny-qwen3", tokenizer=str(tiny_models.moe))
    async with Client(config) as client:
        conv = client.conversation()
        sampling = SamplingParams(max_tokens=6, temperature=1.0)
        turns = [
            await conv.send([{"role": "user", "content": "route this"}], sampling=sampling, return_routed_experts=True)
        ]
        for text in ("and this", "and once more"):
            previous = turns[-1]
            turns.append(
                await conv.send(
                    [{"role": "user", "content": text}],
                    sampling=sampling,
                    return_routed_experts=True,
                    routed_experts_start=len(previous.token_ids) - 1,
                )
            )
        for before, after in itertools.pairwise(turns):
            assert after.prompt_ids[: len(before.token_ids)] == before.token_ids
        last = turns[-1]
        assert last.routed_experts is not None and last.routed_experts.start == len(turns[1].token_ids) - 1
        full = await client.generate(
            prompt_ids=list(last.token_ids[:-1]), sampling=SamplingParams(max_tokens=1), return_routed_experts=True
        )
        assert full.routed_experts is not None
        start = last.routed_experts.start
        delta = last.routed_experts.experts
        # a full-sequence capture routes the same tokens the same way
        np.testing.assert_array_equal(
            np.sort(full.routed_experts.experts[start : start + len(delta)], axis=-1), np.sort(delta, axis=-1)
        )
        assert client.bridge_stats.successes == 2
