"""Streaming to the caller on real SGLang 0.5.23 (CPU): a partial rollout streamed from messages and stopped early,
judged by SGLang's own ``/v1/loads`` counters; routed experts of a stream on the MoE server."""

from __future__ import annotations

import numpy as np
import pytest
from stream_checks import check_partial_rollout_stream

from backends_core import Client, ClientConfig, SamplingParams
from backends_testkit.live import async_probe_client
from backends_testkit.tinymodel import TinyModels

pytestmark = pytest.mark.live


async def test_a_partial_rollout_stream_stopped_early_is_aborted_on_the_engine(
    sglang_dense_url: str, tiny_models: TinyModels
) -> None:
    config = ClientConfig(
        backend="sglang", base_url=sglang_dense_url, model="tiny-qwen3", tokenizer=str(tiny_models.dense)
    )
    async with Client(config) as client, async_probe_client(60, base_url=sglang_dense_url) as raw:

        async def count() -> int:
            loads = (await raw.get("/v1/loads")).json()["loads"]
            return sum(load["num_running_reqs"] + load["num_waiting_reqs"] for load in loads)

        await check_partial_rollout_stream(client, count)


async def test_a_streamed_moe_turn_brings_its_routed_experts_with_the_result(
    sglang_moe_url: str, tiny_models: TinyModels
) -> None:
    config = ClientConfig(backend="sglang", base_url=sglang_moe_url, model="tiny-qwen3", tokenizer=str(tiny_models.moe))
    sampling = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    async with Client(config) as client:
        async with client.stream(prompt_ids=[1, 2, 3, 4, 5], sampling=sampling, return_routed_experts=True) as s:
            deltas = [delta async for delta in s]
        whole = await client.generate(prompt_ids=[1, 2, 3, 4, 5], sampling=sampling, return_routed_experts=True)
    assert sum((d.completion_ids for d in deltas), ()) == s.result.completion_ids == whole.completion_ids
    assert s.result.routed_experts is not None and whole.routed_experts is not None
    np.testing.assert_array_equal(s.result.routed_experts.experts, whole.routed_experts.experts)
