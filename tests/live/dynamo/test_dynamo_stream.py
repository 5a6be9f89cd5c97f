"""Streaming to the caller on real Dynamo 1.6.1 (frontend + Dynamo's vLLM worker): a partial rollout streamed from
messages and stopped early, judged by the vLLM engine's own gauges on the worker's system port ``/metrics``.
On this machine the frontend may deliver a stream's chunks together; the verdict reads only server counters."""

from __future__ import annotations

from typing import Any

import pytest
from stream_checks import check_partial_rollout_stream

from backends_core import Client, ClientConfig
from backends_testkit.live import async_probe_client
from backends_testkit.tinymodel import TinyModels

pytestmark = pytest.mark.live


@pytest.mark.parametrize("transport", ["chat", "completions"])
async def test_a_partial_rollout_stream_stopped_early_is_aborted_on_the_engine(
    dynamo_vllm: Any, tiny_models: TinyModels, transport: str
) -> None:
    workers = list(dynamo_vllm.worker_system_urls)
    config = ClientConfig(
        backend="dynamo",
        base_url=dynamo_vllm.frontend_url,
        model="tiny-qwen3",
        tokenizer=str(tiny_models.dense),
        backend_options={"worker_urls": workers, "transport": transport},
    )
    async with Client(config) as client, async_probe_client(60) as raw:

        async def count() -> int:
            total, seen = 0.0, 0
            for worker in workers:
                for line in (await raw.get(worker + "/metrics")).text.splitlines():
                    if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
                        total += float(line.rsplit(" ", 1)[1])
                        seen += 1
            assert seen, "the worker's /metrics has no vllm:num_requests_running gauge"
            return round(total)

        await check_partial_rollout_stream(client, count)
