"""Fleet guarantees on two real vLLM processes (and one dead address)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from backends_core import AdminError, AdminPolicy, Client, ClientConfig, RequestTimeout, SamplingParams
from backends_core.testing.tinymodel import TinyModels, write_perturbed_weights

pytestmark = pytest.mark.live


def dead_url() -> str:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


async def test_balancing_stickiness_and_failover(vllm_dense_url, vllm_dense_url_2, tiny_models: TinyModels) -> None:
    urls = [vllm_dense_url, vllm_dense_url_2, dead_url()]
    config = ClientConfig(backend="vllm", base_url=urls, model="tiny-qwen3", tokenizer=str(tiny_models.dense))
    async with Client(config) as client:
        sampling = SamplingParams(max_tokens=8, ignore_eos=True, seed=1)
        results = await asyncio.gather(
            *(client.generate(prompt_ids=[1, 2, 3, i], sampling=sampling) for i in range(24))
        )
        used = {r.server for r in results}
        assert used == {vllm_dense_url, vllm_dense_url_2}  # spread over the live ones; the dead one failed over
        dead = client.balancer.load[2]
        assert dead.failures >= 1 and dead.completed == 0  # taken out (for the cooldown) each time it was tried
        conv = client.conversation()
        turns = [await conv.send([{"role": "user", "content": "hi"}], sampling=SamplingParams(max_tokens=4, seed=2))]
        for text in ("more", "again"):
            turns.append(await conv.send([{"role": "user", "content": text}], sampling=SamplingParams(max_tokens=4)))
        assert len({t.server for t in turns}) == 1  # a conversation sticks to one server
        assert [load.in_flight for load in client.balancer.load] == [0, 0, 0]


async def test_weight_sync_over_two_servers_with_resume_on_failure_and_salting(
    vllm_dense_url, vllm_dense_url_2, tiny_models: TinyModels, tmp_path
) -> None:
    config = ClientConfig(backend="vllm", base_url=[vllm_dense_url, vllm_dense_url_2], model="tiny-qwen3")
    async with Client(config) as client:
        with pytest.raises(AdminError, match="weight_sync: update"):
            await client.admin.weight_sync(path=str(tmp_path / "missing"), version="broken", mode="wait")
        assert [s.paused for s in await client.admin.state()] == [False, False]  # resumed in finally
        assert client.weight_version is None
        new = write_perturbed_weights(tiny_models.dense, tmp_path / "v9", seed=9, scale=0.2)
        report = await client.admin.weight_sync(path=str(new), version="v9", mode="wait")
        assert report.ok and [s.weight_version for s in await client.admin.state()] == ["v9", "v9"]
        salted = await client.generate(prompt_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=2))
        assert salted.weight_version == "v9"  # requests now carry cache_salt "weights:v9"
        await client.admin.weight_sync(path=str(tiny_models.dense), version="base", mode="wait")


async def test_a_too_short_deadline_fails_per_server_and_reports_all(vllm_dense_url, vllm_dense_url_2) -> None:
    config = ClientConfig(
        backend="vllm",
        base_url=[vllm_dense_url, vllm_dense_url_2],
        model="tiny-qwen3",
        admin=AdminPolicy(deadlines={"state": 1e-4}, retries=0),
    )
    async with Client(config) as client:
        with pytest.raises(AdminError) as info:
            await client.admin.state()
    assert len(info.value.results) == 2
    assert all(isinstance(o.error, RequestTimeout) for o in info.value.results)
