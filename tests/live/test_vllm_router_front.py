"""The client in router-front mode behind a real vllm-router 0.1.17 (``--policy consistent_hash``) in front
of two real vLLM 0.32 CPU replicas.

Fixtures of this module: one router for the whole module in front of the two session replicas (``vllm_dense_url``,
``vllm_dense_url_2``), and a spare third replica (same tiny dense model, LoRA enabled) that the membership tests
start, add, remove or kill. Everything the client claims is checked replica by replica, directly (never through the
router): vLLM's ``/is_paused``, ``/weight_info`` (weight version), ``/v1/models`` (adapters), ``/metrics`` (requests
finished) and cached-token counts. Every test puts the replicas back as it found them in ``finally`` (resumed, base
weights and version, adapters unloaded, the router listing the two replicas only).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import numpy as np
import pytest
import router_server
import vllm_server
from live_chaos import sigkill
from router_probe_checks import SETTLE_S, http, vllm_finished

from backends_core import (
    BackendError,
    Client,
    ClientConfig,
    FrontConfig,
    GenerateResult,
    LoraAdapter,
    SamplingParams,
)
from backends_testkit.live import ServerProcess, async_probe_client
from backends_testkit.tinymodel import TinyModels, write_perturbed_weights

pytestmark = pytest.mark.live

MODEL = "tiny-qwen3"
PROMPT = [1878, 426, 198, 54, 441, 355, 220, 17, 10, 17, 30, 1879, 198, 1878, 515, 198]
LONG_PROMPT = list(range(40, 360))  # 320 tokens: two or more 128-token cache blocks of vLLM CPU
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=2, temperature=0.0)
ADAPTER = "front-rl"
T = TypeVar("T")


# -- fixtures --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def replicas(vllm_dense_url: str, vllm_dense_url_2: str) -> list[str]:
    """The two replicas the router starts with."""
    return [vllm_dense_url, vllm_dense_url_2]


@pytest.fixture(scope="module")
def router(
    vllm_router_venv: Path, replicas: list[str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[router_server.RouterProcess]:
    """vllm-router (consistent_hash: ``x-session-id`` pins a session) in front of the two replicas, for the module."""
    log_path = tmp_path_factory.getbasetemp() / "live-logs" / "vllm-router-front.log"
    process = router_server.vllm_router(
        vllm_router_venv, replicas, policy="consistent_hash", log_path=log_path, name="vllm-router-front"
    )
    process.start()
    try:
        process.wait_workers_healthy()
        sys.stderr.write(
            f"\n[live] {process.name} at {process.url}: workers healthy after {process.healthy_after:.2f}s\n"
        )
        yield process
    finally:
        process.stop(timeout=router_server.STOP_TIMEOUT_S)


class Spare:
    """A third replica the tests start on demand (and may kill); stopped at the module's end."""

    def __init__(self, venv: Path, model_dir: Path, log_dir: Path) -> None:
        self._venv = venv
        self._model_dir = model_dir
        self._log_dir = log_dir
        self._starts = 0
        self.process: ServerProcess | None = None

    def ensure(self) -> ServerProcess:
        """The spare, running and healthy (started again, on a new port, if it was killed)."""
        if self.process is not None and self.process.running():
            return self.process
        self._starts += 1
        name = f"vllm-dense-spare-{self._starts}"
        self.process = vllm_server.vllm_server(
            self._venv, self._model_dir, lora=True, log_path=self._log_dir / f"{name}.log", name=name
        )
        self.process.start()
        self.process.wait_ready("/health", timeout=vllm_server.START_TIMEOUT_S)
        sys.stderr.write(f"\n[live] {name} ready at {self.process.url} after {self.process.ready_after:.1f}s\n")
        return self.process

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


@pytest.fixture(scope="module")
def spare(vllm_venv: Path, tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Spare]:
    handle = Spare(vllm_venv, tiny_models.dense, tmp_path_factory.getbasetemp() / "live-logs")
    try:
        yield handle
    finally:
        handle.stop()


def front_config(router_url: str, tiny_models: TinyModels, **overrides: Any) -> ClientConfig:
    """A client whose data plane is the router, admin plane every replica the router lists."""
    fields: dict[str, Any] = {
        "backend": "vllm",
        "base_url": router_url,
        "model": MODEL,
        "tokenizer": str(tiny_models.dense),
        "front": FrontConfig(kind="vllm-router"),
    }
    fields.update(overrides)
    return ClientConfig(**fields)


def direct_config(urls: list[str], tiny_models: TinyModels) -> ClientConfig:
    """A client talking to ``urls`` directly (no router): the reference and the clean-up tool."""
    return ClientConfig(backend="vllm", base_url=urls, model=MODEL, tokenizer=str(tiny_models.dense))


@pytest.fixture
async def front(router: router_server.RouterProcess, tiny_models: TinyModels) -> AsyncIterator[Client]:
    async with Client(front_config(router.url, tiny_models)) as client:
        yield client


# -- direct, per-replica evidence ------------------------------------------------------------------------------------


def listed(client: httpx.Client, router_url: str) -> list[str]:
    """The replicas the router lists now (``GET /list_workers``)."""
    return sorted(u.rstrip("/") for u in client.get(router_url + "/list_workers").json()["urls"])


async def get_json(url: str) -> Any:
    async with async_probe_client(httpx.Timeout(60.0, connect=10.0)) as client:
        response = await client.get(url)
        response.raise_for_status()
        return response.json()


async def is_paused(url: str) -> bool:
    return bool((await get_json(url + "/is_paused"))["is_paused"])


async def weight_version(url: str) -> str | None:
    version = (await get_json(url + "/weight_info")).get("weight_version")
    return None if version is None else str(version)


async def adapters(url: str) -> set[str]:
    """The LoRA adapters a replica serves (``/v1/models`` entries other than the base model)."""
    return {str(m["id"]) for m in (await get_json(url + "/v1/models"))["data"] if m["id"] != MODEL}


async def finished(url: str) -> int:
    """Requests the replica finished (``vllm:request_success_total`` over every finish reason)."""
    with http() as client:
        return await asyncio.to_thread(vllm_finished, client, url)


async def landed_on(urls: list[str], send: Callable[[], Awaitable[T]]) -> tuple[int, T]:
    """Run ``send()`` and return the index of the one replica whose finished count moved (and its result)."""
    before = [await finished(url) for url in urls]
    result = await send()
    deadline = time.monotonic() + SETTLE_S
    while True:
        moved = [i for i, url in enumerate(urls) if await finished(url) != before[i]]
        if moved:
            assert len(moved) == 1, f"more than one replica finished a request for one request: {moved}"
            return moved[0], result
        assert time.monotonic() < deadline, f"no replica's finished count moved within {SETTLE_S:.0f}s"
        await asyncio.sleep(0.05)


async def cached_tokens(url: str) -> int:
    """Prefix-cache hits of ``LONG_PROMPT`` on the replica at ``url`` (the request warms its cache)."""
    async with async_probe_client(httpx.Timeout(120.0, connect=10.0)) as client:
        response = await client.post(
            url + "/inference/v1/generate", json={"token_ids": LONG_PROMPT, "sampling_params": {"max_tokens": 1}}
        )
    assert response.status_code == 200, response.text
    return int((response.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


async def restore(urls: list[str], tiny_models: TinyModels, version: str) -> None:
    """Put the replicas at ``urls`` back: resumed, base weights under ``version``, no adapter of these tests."""
    async with Client(direct_config(urls, tiny_models)) as client:
        await client.admin.resume()
        if [await weight_version(url) for url in urls] != [version] * len(urls):
            await client.admin.weight_sync(path=str(tiny_models.dense), version=version, mode="wait")
        for url in urls:
            if ADAPTER in await adapters(url):
                async with Client(direct_config([url], tiny_models)) as one:
                    await one.admin.unload_lora(ADAPTER)


def deregister(router_url: str, url: str) -> None:
    """Take ``url`` off the router's list if it is on it (clean-up: a test that failed half-way)."""
    with http() as client:
        if url in listed(client, router_url):
            client.post(router_url + "/remove_worker", params={"url": url}).raise_for_status()


@pytest.fixture(scope="module")
def base_version(replicas: list[str]) -> str:
    """The weight version the replicas serve when the module starts (put back by every test)."""
    with http() as client:
        versions = {client.get(url + "/weight_info").json().get("weight_version") for url in replicas}
    assert len(versions) == 1, f"the replicas start on different weight versions: {versions}"
    (version,) = versions
    return version or "base"


# -- tests -----------------------------------------------------------------------------------------------------------


def test_fixtures_router_and_spare_serve(
    router: router_server.RouterProcess, replicas: list[str], spare: Spare
) -> None:
    """The module's fixtures: the router lists both replicas and generates through them; the spare serves and the
    router takes it in and lets it go."""
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2, "temperature": 0.0}}
    with http() as client:
        assert listed(client, router.url) == sorted(replicas)
        answer = client.post(router.url + "/inference/v1/generate", json=body, headers={"x-session-id": "probe"})
        assert answer.status_code == 200, answer.text
        url = spare.ensure().url
        try:
            assert client.post(router.url + "/add_worker", params={"url": url}).status_code == 200
            assert listed(client, router.url) == sorted([*replicas, url])
        finally:
            client.post(router.url + "/remove_worker", params={"url": url})
        assert listed(client, router.url) == sorted(replicas)


async def test_token_in_token_out_through_the_front(
    front: Client, replicas: list[str], tiny_models: TinyModels
) -> None:
    """Generation and teacher scoring through the router give each replica's own ids and logprobs, one per id."""
    through = await front.generate(prompt_ids=PROMPT, sampling=GREEDY, session="tito")
    scored = await front.teacher_logprobs([*PROMPT, *through.completion_ids])
    async with Client(direct_config(replicas, tiny_models)) as direct:
        for index in range(len(replicas)):
            own = await direct.generate(prompt_ids=PROMPT, sampling=GREEDY, server=index)
            assert through.completion_ids == own.completion_ids
            assert len(through.logprobs) == len(through.completion_ids)
            np.testing.assert_allclose(through.logprobs, own.logprobs, atol=1e-4)
            own_scored = await direct.teacher_logprobs([*PROMPT, *through.completion_ids], server=index)
            np.testing.assert_allclose(scored.logprobs[1:], own_scored.logprobs[1:], atol=1e-4)
    np.testing.assert_allclose(scored.logprobs[len(PROMPT) :], through.logprobs, atol=1e-4)


async def test_a_session_stays_on_one_replica(front: Client, replicas: list[str]) -> None:
    """Every request of a session key, and every turn of a conversation, is finished by one replica (counted on
    the replicas themselves)."""
    landed: dict[str, list[int]] = {}
    for key in (f"traj-{i}" for i in range(6)):
        landed[key] = []
        for turn in range(3):

            async def send(key: str = key, turn: int = turn) -> GenerateResult:
                return await front.generate(prompt_ids=[*PROMPT, 100 + turn], sampling=SHORT, session=key)

            index, _ = await landed_on(replicas, send)
            landed[key].append(index)
    assert all(len(set(indices)) == 1 for indices in landed.values()), landed

    conversation = front.conversation()
    turns = []
    for text in ("hello", "more", "again"):

        async def say(text: str = text) -> GenerateResult:
            return await conversation.send([{"role": "user", "content": text}], sampling=SHORT)

        turns.append((await landed_on(replicas, say))[0])
    assert len(set(turns)) == 1, f"a conversation's turns were finished by replicas {turns}"
    sys.stderr.write(f"\n[front] session keys -> replica: {landed}; conversation: {turns}\n")


async def test_pause_resume_flush_and_lora_reach_every_replica(
    front: Client, replicas: list[str], tiny_models: TinyModels, base_version: str
) -> None:
    """Each admin operation through the client answers once per replica, and each replica shows its effect."""
    try:
        assert await front.admin.pause(mode="keep") == [True, True]
        assert [await is_paused(url) for url in replicas] == [True, True]
        state = await front.admin.fleet_state()
        assert sorted(r.server for r in state) == sorted(replicas)
        assert [r.state.paused for r in state if r.state is not None] == [True, True]
        assert await front.admin.resume() == [True, True]
        assert [await is_paused(url) for url in replicas] == [False, False]

        for url in replicas:  # a warm prefix cache on each replica
            await cached_tokens(url)
        assert all([await cached_tokens(url) > 0 for url in replicas])
        assert await front.admin.flush_cache() == [True, True]
        assert [await cached_tokens(url) for url in replicas] == [0, 0], "a replica kept its prefix cache"

        assert await front.admin.load_lora(LoraAdapter(name=ADAPTER, path=str(tiny_models.lora))) == [True, True]
        assert [ADAPTER in await adapters(url) for url in replicas] == [True, True]
        results = await asyncio.gather(
            *(front.generate(prompt_ids=PROMPT, sampling=SHORT, lora=ADAPTER, session=f"lora-{i}") for i in range(6))
        )
        assert all(r.completion_ids for r in results)  # every session, whichever replica it is pinned to
        assert await front.admin.unload_lora(ADAPTER) == [True, True]
        assert [ADAPTER in await adapters(url) for url in replicas] == [False, False]
    finally:
        await restore(replicas, tiny_models, base_version)


async def test_weight_sync_reaches_every_replica(
    front: Client, replicas: list[str], tiny_models: TinyModels, base_version: str, tmp_path: Path
) -> None:
    """A weight sync through the client updates every replica (weights and version, read from each); fleet_state
    reports them agreeing, and flags a replica set to another version behind the client's back."""
    async with Client(direct_config(replicas, tiny_models)) as direct:
        before = [await direct.generate(prompt_ids=PROMPT, sampling=GREEDY, server=i) for i in (0, 1)]
        new = write_perturbed_weights(tiny_models.dense, tmp_path / "front-v1", seed=11, scale=0.3)
        try:
            report = await front.admin.weight_sync(path=str(new), version="front-v1", mode="wait")
            assert report.ok
            assert [await weight_version(url) for url in replicas] == ["front-v1", "front-v1"]
            after = [await direct.generate(prompt_ids=PROMPT, sampling=GREEDY, server=i) for i in (0, 1)]
            assert after[0].completion_ids == after[1].completion_ids
            assert not all(
                a.completion_ids == b.completion_ids and np.allclose(a.logprobs, b.logprobs, atol=1e-4)
                for a, b in zip(after, before, strict=True)
            ), "the new weights did not change the outputs"
            state = await front.admin.fleet_state()
            assert not state.disagreement
            assert {v: sorted(urls) for v, urls in state.versions.items()} == {"front-v1": sorted(replicas)}

            async with async_probe_client() as raw:  # one replica relabelled behind the client's back
                answer = await raw.post(replicas[1] + "/update_weight_version", json={"new_version": "other"})
                answer.raise_for_status()
            state = await front.admin.fleet_state()
            assert state.disagreement
            assert {v: sorted(urls) for v, urls in state.versions.items()} == {
                "front-v1": [replicas[0]],
                "other": [replicas[1]],
            }
        finally:
            await front.admin.weight_sync(path=str(tiny_models.dense), version=base_version, mode="wait")
        assert [await weight_version(url) for url in replicas] == [base_version, base_version]
        restored = [await direct.generate(prompt_ids=PROMPT, sampling=GREEDY, server=i) for i in (0, 1)]
        assert [r.completion_ids for r in restored] == [r.completion_ids for r in before]


Sent = tuple[str, list[int], "GenerateResult | BaseException"]
"""One request of :func:`traffic`: its session key, prompt, and result (or the exception it raised)."""


async def traffic(
    client: Client, stop: asyncio.Event, prefix: str, outcomes: list[Sent], lora: str | None = None
) -> None:
    """Requests through the front, four at a time over new session keys, until ``stop`` is set: each appended to
    ``outcomes`` once it ended. With ``lora``, every other request asks for that adapter."""
    i = 0
    while not stop.is_set():
        sent = [(f"{prefix}-{i + k}", [*PROMPT, 300 + (i + k) % 50]) for k in range(4)]
        ended = await asyncio.gather(
            *(
                client.generate(prompt_ids=ids, sampling=SHORT, session=key, lora=lora if k % 2 else None)
                for k, (key, ids) in enumerate(sent)
            ),
            return_exceptions=True,
        )
        outcomes.extend((key, ids, outcome) for (key, ids), outcome in zip(sent, ended, strict=True))
        i += 4


@contextlib.asynccontextmanager
async def under_traffic(client: Client, prefix: str, lora: str | None = None) -> AsyncIterator[list[Sent]]:
    """Requests run through the front while the body runs (see :func:`traffic`); the list of them is complete
    once the block is left (every request sent has ended)."""
    stop = asyncio.Event()
    outcomes: list[Sent] = []
    running = asyncio.create_task(traffic(client, stop, prefix, outcomes, lora))
    try:
        yield outcomes
    finally:
        stop.set()
        await running


def failures(outcomes: list[Sent]) -> list[Sent]:
    return [sent for sent in outcomes if isinstance(sent[2], BaseException)]


async def wait_for(condition: Callable[[], Awaitable[bool]], what: str, within: float = SETTLE_S) -> None:
    """Poll ``condition`` until it holds; fail after ``within`` seconds."""
    deadline = time.monotonic() + within
    while not await condition():
        assert time.monotonic() < deadline, f"{what}: not within {within:.0f}s"
        await asyncio.sleep(0.05)


async def test_a_replica_added_mid_run_is_caught_up_before_it_serves(
    router: router_server.RouterProcess,
    replicas: list[str],
    spare: Spare,
    tiny_models: TinyModels,
    base_version: str,
    tmp_path: Path,
) -> None:
    """``fleet.add`` brings a new replica to the fleet's weights, version and adapters, and only then registers it
    with the router: requests running through the add (half of them on the fleet's adapter) all succeed and all
    answer with the fleet's version, though the new replica started on another; when the router first lists it,
    it is on the fleet's version and adapters. The next admin operation reaches it. ``fleet.remove`` deregisters
    it while requests run; none fails."""
    url = spare.ensure().url
    new = write_perturbed_weights(tiny_models.dense, tmp_path / "front-add", seed=12, scale=0.3)
    seen: dict[str, Any] = {}

    async def watch() -> None:
        """Record the spare's state the first time the router lists it."""
        with http() as raw:

            async def registered() -> bool:
                return url in await asyncio.to_thread(listed, raw, router.url)

            await wait_for(registered, "the router listing the added replica", within=vllm_server.START_TIMEOUT_S)
        seen.update(version=await weight_version(url), adapters=await adapters(url), paused=await is_paused(url))

    try:
        async with Client(front_config(router.url, tiny_models)) as client:
            assert (await client.admin.weight_sync(path=str(new), version="front-add", mode="wait")).ok
            assert await client.admin.load_lora(LoraAdapter(name=ADAPTER, path=str(tiny_models.lora))) == [True, True]
            assert await finished(url) == 0
            assert await weight_version(url) == base_version

            async with under_traffic(client, "add", lora=ADAPTER) as during_add:
                watcher = asyncio.create_task(watch())
                try:
                    started = time.monotonic()
                    member = await client.fleet.add(url)
                    add_s = time.monotonic() - started
                    await asyncio.wait_for(watcher, timeout=SETTLE_S)
                finally:
                    watcher.cancel()

                async def spare_serves() -> bool:
                    return await finished(url) >= 4

                await wait_for(spare_serves, "the added replica serving its share of new sessions")
            assert member.state == "serving"
            assert seen == {"version": "front-add", "adapters": {ADAPTER}, "paused": False}, seen
            assert sorted(m.url for m in client.fleet.members()) == sorted([*replicas, url])
            assert not failures(during_add), failures(during_add)[:3]
            versions = {r.weight_version for _, _, r in during_add if isinstance(r, GenerateResult)}
            assert versions == {"front-add"}, f"answers during the add came from weight versions {versions}"

            # the next admin operation reaches the new replica too
            assert await client.admin.pause(mode="keep") == [True, True, True]
            assert await is_paused(url)
            assert await client.admin.resume() == [True, True, True]
            assert not await is_paused(url)

            # whichever replica a new session lands on, it serves the fleet's weights
            landed = []
            for key in (f"after-add-{i}" for i in range(8)):

                async def send(key: str = key) -> GenerateResult:
                    return await client.generate(prompt_ids=PROMPT, sampling=GREEDY, session=key)

                landed.append(await landed_on([*replicas, url], send))
            assert len({r.completion_ids for _, r in landed}) == 1, "the replicas serve different weights"

            async with under_traffic(client, "remove") as during_remove:
                started = time.monotonic()
                await client.fleet.remove(url)
                remove_s = time.monotonic() - started
                after_remove = len(during_remove)

                async def traffic_went_on() -> bool:
                    return len(during_remove) >= after_remove + 8

                await wait_for(traffic_went_on, "8 requests after the remove")
            with http() as raw:
                assert listed(raw, router.url) == sorted(replicas)
            assert sorted(m.url for m in client.fleet.members()) == sorted(replicas)
            assert not failures(during_remove), failures(during_remove)[:3]
            sys.stderr.write(
                f"\n[front] add (catch-up + registration) {add_s:.2f}s, remove {remove_s:.2f}s; "
                f"add under traffic: {len(during_add)} requests, 0 failed; 8 new keys after the add -> "
                f"replica {[i for i, _ in landed]}; remove under traffic: {len(during_remove)} requests, 0 failed\n"
            )
            assert await client.admin.pause(mode="keep") == [True, True]
            assert not await is_paused(url), "a removed replica still gets admin operations"
            assert await client.admin.resume() == [True, True]
    finally:
        deregister(router.url, url)
        await restore([*replicas, url], tiny_models, base_version)


async def test_a_replica_killed_while_requests_run(
    router: router_server.RouterProcess,
    replicas: list[str],
    spare: Spare,
    tiny_models: TinyModels,
    base_version: str,
) -> None:
    """A replica killed under traffic: every request is answered or raises a typed error. The router still lists
    the dead replica as healthy (its health checks run every 60 s); the next admin operation finds it
    unreachable, deregisters it from the router (``FrontConfig.evict_unreachable``) and runs over the two live
    replicas. The failed requests succeed when sent again as they were."""
    process = spare.ensure()
    url = process.url
    try:
        async with Client(front_config(router.url, tiny_models)) as client:
            assert (await client.fleet.add(url)).state == "serving"
            assert sorted(m.url for m in client.fleet.members()) == sorted([*replicas, url])
            async with under_traffic(client, "kill") as outcomes:
                served = await finished(url)  # the spare may have served an earlier test

                async def spare_serves() -> bool:
                    return await finished(url) >= served + 2

                await wait_for(spare_serves, "the added replica serving its share")
                await asyncio.to_thread(sigkill, process)
                at_kill = len(outcomes)

                async def traffic_went_on() -> bool:
                    return len(outcomes) >= at_kill + 16

                await wait_for(traffic_went_on, "16 requests after the kill")
            failed = failures(outcomes)
            assert all(isinstance(error, BackendError) for _, _, error in failed), [repr(e) for _, _, e in failed]
            health = router_health(router.url, url)
            sys.stderr.write(
                f"\n[front] kill under traffic: {len(outcomes)} requests ({len(outcomes) - at_kill} ended after the "
                f"kill), {len(failed)} failed: {sorted({f'{type(e).__name__}: {e}'[:200] for _, _, e in failed})}; "
                f"router lists the dead replica is_healthy={health}\n"
            )

            assert health is True  # the router has not noticed
            assert await client.admin.flush_cache() == [True, True]
            with http() as raw:
                assert listed(raw, router.url) == sorted(replicas)
            assert sorted(m.url for m in client.fleet.members()) == sorted(replicas)
            again = [await client.generate(prompt_ids=ids, sampling=SHORT, session=key) for key, ids, _ in failed]
            assert all(r.completion_ids for r in again)  # the failed requests, sent again as they were
    finally:
        deregister(router.url, url)
        spare.stop()
        await restore(replicas, tiny_models, base_version)


def router_health(router_url: str, url: str) -> bool | None:
    """Whether the router's ``GET /workers`` lists ``url`` healthy (``None``: not listed)."""
    with http() as client:
        workers = client.get(router_url + "/workers").json()["workers"]
    return next((bool(w["is_healthy"]) for w in workers if w["url"].rstrip("/") == url), None)
