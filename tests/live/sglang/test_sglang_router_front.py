"""sglang-router 0.3.2 (SGLang Model Gateway) as the client's front, before two real SGLang 0.5.23 replicas.

The router runs ``--policy manual --assignment-mode min_group``: a request's ``X-SMG-Routing-Key`` pins it to one
replica, and a new key should go to "the worker with fewest routing keys" (``--help``). Seen, it does not balance
them: eight new keys split 4/4 and 3/5 in different runs, and in one run the six new keys that followed all went to
the replica that then held 9 keys to the other's 5. Where a new key lands is the router's business: only the pinning
is asserted, the split is printed. Evidence of where a request ran is read from
each replica directly (``/v1/loads`` ``total_prefill_uncached_tokens``), never through the router.

One router serves the whole module (it is stopped at the module's end); the routed-experts test puts a second one
before the MoE server. Every test leaves the replicas as it found them (resumed, original weights and version, no
adapter loaded) and the router listing exactly the two replicas.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import router_server
import sglang_server
from router_probe_checks import SETTLE_S, http, sglang_prefilled, which_replica

from backends_core import (
    BackendError,
    Client,
    ClientConfig,
    LoraAdapter,
    RequestError,
    ResponseParseError,
    SamplingParams,
)
from backends_core.config import FrontConfig
from backends_core.errors import FrontError
from backends_testkit.live import ServerProcess
from backends_testkit.tinymodel import TinyModels, write_perturbed_weights

pytestmark = pytest.mark.live

PROMPT = [1878, 426, 198, 54, 441, 355, 220, 17, 10, 17, 30, 1879, 198, 1878, 515, 198]
GREEDY = {"max_new_tokens": 4, "temperature": 0.0}
ASSIGNMENT = ["--assignment-mode", "min_group"]
VOCAB = 1920
"""The tiny models' vocabulary: a larger id crashes an SGLang replica's scheduler (``IndexError`` in the embedding,
the whole server exits), so every id sent stays below it."""
_FRESH = itertools.count(200)
MEMBERSHIP_S = 60.0
"""Seconds a ``POST /workers`` / ``DELETE /workers/{id}`` (202, applied in the background) may take to show."""


def fresh() -> int:
    """A first token no earlier request of the module used: its prompt is never a prefix-cache hit."""
    token = next(_FRESH)
    assert token < VOCAB, "the module ran out of fresh first tokens"
    return token


def start_front(
    venv: Path, worker_urls: list[str], *, log_path: Path, name: str, policy: str = "manual"
) -> router_server.RouterProcess:
    """A started sglang-router (manual policy, min_group assignment) listing every replica healthy."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    router = router_server.RouterProcess(
        [
            *router_server.sglang_router_command(venv, worker_urls, policy=policy),
            *ASSIGNMENT,
        ],
        worker_urls=worker_urls,
        venv=venv,
        name=name,
        log_path=log_path,
        cwd=log_path.parent,
    )
    router.start()
    try:
        router.wait_workers_healthy()
    except BaseException:
        router.stop(timeout=router_server.STOP_TIMEOUT_S)
        raise
    sys.stderr.write(f"\n[live] {name} at {router.url}: workers healthy after {router.healthy_after:.2f}s\n")
    return router


@pytest.fixture(scope="module")
def replicas(sglang_dense_url: str, sglang_dense_url_2: str) -> list[str]:
    return [sglang_dense_url, sglang_dense_url_2]


@pytest.fixture(scope="module")
def front(
    sglang_router_venv: Path, replicas: list[str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[router_server.RouterProcess]:
    """The module's router before the two dense replicas."""
    log = tmp_path_factory.getbasetemp() / "live-logs" / "sglang-front.log"
    router = start_front(sglang_router_venv, replicas, log_path=log, name="sglang-front")
    try:
        yield router
    finally:
        router.stop(timeout=router_server.STOP_TIMEOUT_S)


class Spare:
    """A third dense replica (LoRA enabled) owned by this module: started on the first :meth:`url`, stopped at the
    module's end (or killed by a test)."""

    def __init__(self, process: ServerProcess) -> None:
        self.process = process
        self.started = False

    def url(self) -> str:
        if not self.started:
            self.started = True
            self.process.start()
            self.process.wait_ready(sglang_server.READY_PATH, timeout=sglang_server.START_TIMEOUT_S)
            sys.stderr.write(
                f"\n[live] sglang-spare ready at {self.process.url} after {self.process.ready_after:.1f}s\n"
            )
        return self.process.url


@pytest.fixture(scope="module")
def spare(sglang_venv: Path, tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Spare]:
    log = tmp_path_factory.getbasetemp() / "live-logs" / "sglang-spare.log"
    process = sglang_server.sglang_server(sglang_venv, tiny_models.dense, log_path=log, name="sglang-spare", lora=True)
    try:
        yield Spare(process)
    finally:
        process.stop(timeout=sglang_server.STOP_TIMEOUT_S)


def workers(client: httpx.Client, router_url: str) -> list[dict]:
    answer = client.get(router_url + "/workers")
    assert answer.status_code == 200, answer.text
    return answer.json()["workers"]


def test_min_group_pins_each_key_to_one_replica(front, replicas) -> None:
    """Under ``manual`` + ``min_group`` each routing key stays on one replica. How new keys split is printed, not
    asserted: ``min_group`` did not balance them (see the module's doc)."""
    keys = [f"spread-{i}" for i in range(8)]
    landed: dict[str, list[int]] = {key: [] for key in keys}
    with http() as client:
        for _ in range(2):
            for key in keys:

                def send(key: str = key) -> None:
                    answer = client.post(
                        front.url + "/generate",
                        json={"input_ids": [fresh(), *PROMPT], "sampling_params": GREEDY},
                        headers={"X-SMG-Routing-Key": key},
                    )
                    assert answer.status_code == 200, answer.text

                landed[key].append(which_replica(client, replicas, sglang_prefilled, send))
    sys.stderr.write(f"\n[router-front] min_group key -> replicas: {landed}\n")
    assert all(len(set(rs)) == 1 for rs in landed.values()), f"a key moved between replicas: {landed}"


async def test_router_drops_routed_experts(sglang_router_venv, sglang_moe_url, tiny_models, tmp_path_factory) -> None:
    """The MoE replica answers ``meta_info.routed_experts`` directly; the same request through sglang-router comes
    back without it, and the client in front mode says the ROUTER dropped them (not a server flag)."""
    log = tmp_path_factory.getbasetemp() / "live-logs" / "sglang-front-moe.log"
    router = start_front(sglang_router_venv, [sglang_moe_url], log_path=log, name="sglang-front-moe")
    body = {"input_ids": PROMPT, "sampling_params": GREEDY, "return_routed_experts": True}
    try:
        with http() as raw:
            direct = raw.post(sglang_moe_url + "/generate", json=body)
            routed = raw.post(router.url + "/generate", json=body)
        assert direct.status_code == 200 and routed.status_code == 200, (direct.text, routed.text)
        assert direct.json()["meta_info"].get("routed_experts"), "the replica itself returned no routed experts"
        assert routed.json()["output_ids"] == direct.json()["output_ids"]
        assert "routed_experts" not in routed.json()["meta_info"], sorted(routed.json()["meta_info"])

        greedy = SamplingParams(max_tokens=4, temperature=0.0)
        async with Client(direct_config([sglang_moe_url], tiny_models.moe)) as client:
            answer = await client.generate(prompt_ids=PROMPT, sampling=greedy, return_routed_experts=True)
            assert answer.routed_experts is not None
        async with Client(front_config(router.url, tiny_models.moe)) as client:
            with pytest.raises(ResponseParseError, match="router") as info:
                await client.generate(prompt_ids=PROMPT, sampling=greedy, return_routed_experts=True)
            assert "--enable-return-routed-experts" not in str(info.value)
            sys.stderr.write(f"\n[router-front] routed experts through the router: {info.value}\n")
    finally:
        router.stop(timeout=router_server.STOP_TIMEOUT_S)


# -- the client in front mode ----------------------------------------------------------------------------------

MODEL = "tiny-qwen3"
LONG = list(range(40, 360))
"""320 prompt tokens: several prefix-cache pages, so a repeat shows cached tokens."""


def front_config(router_url: str, weights: Path, **overrides: Any) -> ClientConfig:
    fields: dict[str, Any] = {
        "backend": "sglang",
        "base_url": router_url,
        "model": MODEL,
        "tokenizer": str(weights),
        "front": FrontConfig(kind="sglang-router"),
    }
    fields.update(overrides)
    return ClientConfig(**fields)


def direct_config(urls: list[str], weights: Path) -> ClientConfig:
    return ClientConfig(backend="sglang", base_url=urls, model=MODEL, tokenizer=str(weights))


class Replica:
    """One replica read directly (never through the router)."""

    def __init__(self, client: httpx.Client, url: str) -> None:
        self.client = client
        self.url = url

    def ready(self) -> bool:
        """SGLang's ``/ready``: 503 while paused (``TokenizerManager.is_ready``)."""
        status = self.client.get(self.url + "/ready").status_code
        assert status in (200, 503), status
        return status == 200

    def version(self) -> str:
        return str(self.client.get(self.url + "/model_info").json()["weight_version"])

    def loras(self) -> set[str]:
        data = self.client.get(self.url + "/v1/models").json()["data"]
        return {str(e["id"]) for e in data if e.get("parent") is not None}

    def cached(self, ids: list[int]) -> int:
        answer = self.client.post(
            self.url + "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}
        )
        assert answer.status_code == 200, answer.text
        return int(answer.json()["meta_info"]["cached_tokens"])


async def test_token_in_token_out_through_the_front(front, replicas, tiny_models) -> None:
    """Generation and teacher scoring through the router: the same ids and logprobs, one to one, as the replica
    answers directly; the client's balancer holds the front only."""
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    async with (
        Client(front_config(front.url, tiny_models.dense)) as client,
        Client(direct_config([replicas[0]], tiny_models.dense)) as direct,
    ):
        assert client.base_urls == [front.url]
        routed = await client.generate(prompt_ids=PROMPT, sampling=greedy, session="tokens-1")
        expected = await direct.generate(prompt_ids=PROMPT, sampling=greedy)
        assert routed.completion_ids == expected.completion_ids
        assert len(routed.logprobs) == len(routed.completion_ids) == 8
        assert routed.logprobs == pytest.approx(expected.logprobs, abs=1e-4)
        scored = await client.teacher_logprobs(LONG[:32])
        reference = await direct.teacher_logprobs(LONG[:32])
        assert len(scored.logprobs) == 32
        assert scored.logprobs[1:] == pytest.approx(reference.logprobs[1:], abs=1e-4)


async def test_a_session_stays_on_one_replica(front, replicas, tiny_models) -> None:
    """``session=`` keys and a conversation's turns reach the router as ``X-SMG-Routing-Key``: each stays on one
    replica (counted on the replicas)."""
    keys = [f"session-{i}" for i in range(6)]
    landed: dict[str, list[int]] = {key: [] for key in keys}
    sampling = SamplingParams(max_tokens=2, temperature=0.0)
    async with Client(front_config(front.url, tiny_models.dense)) as client:
        with http() as raw:
            for _ in range(3):
                for key in keys:
                    before = [sglang_prefilled(raw, url) for url in replicas]
                    await client.generate(prompt_ids=[fresh(), *PROMPT], sampling=sampling, session=key)
                    landed[key].append(await moved(raw, replicas, before))
            conversation = client.conversation()
            turns = []
            for text in ("hello", "and more", "once again"):
                before = [sglang_prefilled(raw, url) for url in replicas]
                await conversation.send([{"role": "user", "content": text}], sampling=SamplingParams(max_tokens=4))
                turns.append(await moved(raw, replicas, before))
    sys.stderr.write(f"\n[router-front] session -> replicas: {landed}; conversation turns: {turns}\n")
    assert all(len(set(rs)) == 1 for rs in landed.values()), f"a session moved between replicas: {landed}"
    assert len(set(turns)) == 1, f"a conversation moved between replicas: {turns}"


async def moved(raw: httpx.Client, urls: list[str], before: list[int]) -> int:
    """Index of the one replica whose prefill counter moved since ``before`` (it is updated after the answer)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        changed = [i for i, url in enumerate(urls) if sglang_prefilled(raw, url) != before[i]]
        if changed:
            assert len(changed) == 1, f"more than one replica ran one request: {changed}"
            return changed[0]
        assert time.monotonic() < deadline, f"no replica's counter moved within {SETTLE_S:.0f}s"
        await asyncio.sleep(0.05)


async def test_admin_reaches_every_replica(front, replicas, tiny_models, tmp_path) -> None:
    """pause / resume / flush_cache / LoRA load and unload / weight_sync through ``client.admin`` reach both
    replicas, each checked directly."""
    adapter = LoraAdapter(name="front-lora", path=str(tiny_models.lora))
    async with Client(front_config(front.url, tiny_models.dense)) as client:
        with http() as raw:
            direct = [Replica(raw, url) for url in replicas]
            found = direct[0].version()
            assert [r.version() for r in direct] == [found, found]
            try:
                assert await client.admin.pause() == [True, True]
                assert [r.ready() for r in direct] == [False, False]
                assert await client.admin.resume() == [True, True]
                assert [r.ready() for r in direct] == [True, True]

                for replica in direct:  # warm the prefix cache on each replica
                    replica.cached(LONG)
                    assert replica.cached(LONG) > 0
                assert await client.admin.flush_cache() == [True, True]
                assert [r.cached(LONG) for r in direct] == [0, 0]

                assert await client.admin.load_lora(adapter) == [True, True]
                assert [adapter.name in r.loras() for r in direct] == [True, True]
                adapted = [
                    await client.generate(
                        prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=2), lora=adapter.name, session=f"lora-{i}"
                    )
                    for i in range(4)
                ]
                assert all(len(r.completion_ids) == 2 for r in adapted)
                assert await client.admin.unload_lora(adapter.name) == [True, True]
                assert [adapter.name in r.loras() for r in direct] == [False, False]

                new = write_perturbed_weights(tiny_models.dense, tmp_path / "v-front", seed=7, scale=0.2)
                report = await client.admin.weight_sync(path=str(new), version="v-front", mode="wait")
                assert report.ok
                assert [r.version() for r in direct] == ["v-front", "v-front"]
                state = await client.admin.fleet_state()
                assert sorted(r.server for r in state) == sorted(replicas)
                assert not state.disagreement and set(state.versions) == {"v-front"}
                answer = await client.generate(prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=2))
                assert answer.weight_version == "v-front"
            finally:
                await client.admin.resume()
                if adapter.name in set().union(*(r.loras() for r in direct)):
                    await client.admin.unload_lora(adapter.name)
                if {r.version() for r in direct} != {found}:
                    await client.admin.weight_sync(path=str(tiny_models.dense), version=found, mode="wait")
            assert [r.version() for r in direct] == [found, found]


async def test_a_front_that_cannot_list_its_replicas_is_refused(replicas, tiny_models) -> None:
    """Pointed at a replica instead of a router (no ``GET /workers`` there), admin is refused with FrontError and
    nothing reaches the replica."""
    async with Client(front_config(replicas[0], tiny_models.dense)) as client:
        with pytest.raises(FrontError, match="/workers"):
            await client.admin.pause()
    with http() as raw:
        assert Replica(raw, replicas[0]).ready()


class FirstListing(threading.Thread):
    """Watches the router's ``GET /workers`` for ``url`` and, the moment it is listed, reads that replica's weight
    version and adapters directly: what the replica would serve with from its first routed request."""

    def __init__(self, router_url: str, url: str) -> None:
        super().__init__(daemon=True)
        self.router_url = router_url
        self.url = url
        self.seen: tuple[str, set[str]] | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        with http() as raw:
            while not self.stop.is_set():
                if any(w["url"].rstrip("/") == self.url for w in workers(raw, self.router_url)):
                    replica = Replica(raw, self.url)
                    self.seen = (replica.version(), replica.loras())
                    return
                self.stop.wait(0.02)


def listed(router_url: str) -> list[str]:
    with http() as raw:
        return sorted(w["url"].rstrip("/") for w in workers(raw, router_url) if w["is_healthy"])


async def test_an_added_replica_is_caught_up_before_it_serves(front, replicas, spare, tiny_models, tmp_path) -> None:
    """``fleet.add`` brings a third replica to the fleet's weights and adapters, then registers it with the router:
    when the router first lists it, it already has them; new sessions then reach it and run the new weights."""
    adapter = LoraAdapter(name="join-lora", path=str(tiny_models.lora))
    third = spare.url()
    async with Client(front_config(front.url, tiny_models.dense)) as client:
        with http() as raw:
            found = Replica(raw, replicas[0]).version()
            assert Replica(raw, third).version() == found
        new = write_perturbed_weights(tiny_models.dense, tmp_path / "v-join", seed=11, scale=0.2)
        watcher = FirstListing(front.url, third)
        try:
            await client.admin.weight_sync(path=str(new), version="v-join", mode="wait")
            await client.admin.load_lora(adapter)
            watcher.start()
            started = time.monotonic()
            member = await client.fleet.add(third)
            sys.stderr.write(
                f"\n[router-front] fleet.add (catch-up + registration): {time.monotonic() - started:.2f}s\n"
            )
            assert member.state == "serving"
            assert listed(front.url) == sorted([*replicas, third])
            watcher.join(timeout=MEMBERSHIP_S)
            assert watcher.seen == ("v-join", {adapter.name}), "the router listed the replica before its catch-up"
            # min_group sends new keys to the replica holding the fewest: soon the new one
            everyone = [*replicas, third]
            reached = []
            with http() as raw:
                for i in range(24):
                    before = [sglang_prefilled(raw, url) for url in everyone]
                    answer = await client.generate(
                        prompt_ids=[fresh(), *PROMPT], sampling=SamplingParams(max_tokens=2), session=f"joined-{i}"
                    )
                    assert answer.weight_version == "v-join"
                    reached.append(everyone[await moved(raw, everyone, before)])
                    if reached[-1] == third:
                        break
            sys.stderr.write(f"\n[router-front] new sessions after the add went to: {reached}\n")
            assert reached[-1] == third, f"no new session reached the added replica: {reached}"
        finally:
            watcher.stop.set()
            await client.admin.resume()
            members = [m.url for m in client.fleet.members()]
            with http() as raw:
                if any(adapter.name in Replica(raw, url).loras() for url in members):
                    await client.admin.unload_lora(adapter.name)
            await client.admin.weight_sync(path=str(tiny_models.dense), version=found, mode="wait")
            if third in members:
                await client.fleet.remove(third)
    assert listed(front.url) == sorted(replicas)
    with http() as raw:
        assert [Replica(raw, url).version() for url in [*replicas, third]] == [found] * 3


class Load:
    """Requests kept running through the front, one loop per session key, while the fleet changes: every request
    ends answered or with a typed error, recorded with its arguments (a key's loop ends at its first failure)."""

    def __init__(self, client: Client, tag: str, keys: int = 12) -> None:
        self.client = client
        self.tag = tag
        self.keys = keys
        self.answered = 0
        self.failed: list[tuple[str, int, BaseException]] = []
        self.stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def _loop(self, key: str) -> None:
        token = 100
        while not self.stop.is_set():
            token = token % (VOCAB - 1) + 1
            try:
                await self.client.generate(
                    prompt_ids=[token, *PROMPT], sampling=SamplingParams(max_tokens=4), session=key
                )
                self.answered += 1
            except BackendError as exc:  # the trainer's view: this trajectory failed; resubmitted later
                self.failed.append((key, token, exc))
                return

    def __enter__(self) -> Load:
        self._tasks = [asyncio.create_task(self._loop(f"{self.tag}-{i}")) for i in range(self.keys)]
        return self

    async def settle(self, answered: int) -> None:
        """Wait until ``answered`` more requests were answered."""
        target = self.answered + answered
        deadline = time.monotonic() + MEMBERSHIP_S
        while self.answered < target:
            assert time.monotonic() < deadline, f"{answered} answers not within {MEMBERSHIP_S:.0f}s"
            await asyncio.sleep(0.05)

    async def finish(self) -> None:
        self.stop.set()
        await asyncio.gather(*self._tasks)

    def __exit__(self, *exc: object) -> None:
        self.stop.set()

    async def resubmit(self) -> None:
        """Send every failed request again: each must be answered now."""
        for key, token, _ in self.failed:
            await self.client.generate(prompt_ids=[token, *PROMPT], sampling=SamplingParams(max_tokens=4), session=key)


async def test_a_removed_replica_loses_no_request(front, replicas, spare, tiny_models) -> None:
    """``fleet.remove`` while requests run: the router stops sending to it, every request ends answered or with a
    typed error, resubmitting the failed ones succeeds, and the next admin operation covers the two left."""
    third = spare.url()
    async with Client(front_config(front.url, tiny_models.dense)) as client:
        assert (await client.fleet.add(third)).state == "serving"
        try:
            with Load(client, "remove") as load:
                await load.settle(12)
                started = time.monotonic()
                await client.fleet.remove(third)
                sys.stderr.write(f"\n[router-front] fleet.remove under load: {time.monotonic() - started:.2f}s\n")
                assert listed(front.url) == sorted(replicas)
                await load.settle(12)
                await load.finish()
            sys.stderr.write(
                f"\n[router-front] remove under load: {load.answered} answered, {len(load.failed)} failed: "
                f"{[type(e).__name__ for _, _, e in load.failed]}\n"
            )
            await load.resubmit()
            assert await client.admin.flush_cache() == [True, True]
            assert sorted(m.url for m in client.fleet.members()) == sorted(replicas)
        finally:
            if third in [m.url for m in client.fleet.members()]:
                await client.fleet.remove(third)
    assert listed(front.url) == sorted(replicas)


async def test_a_killed_replica_loses_no_request(front, replicas, spare, tiny_models) -> None:
    """A registered replica killed while requests run: every request ends answered or with a typed error; the next
    admin operation finds it unreachable, deregisters it from the router (``front.evict_unreachable``, the
    default) and runs over the two left; resubmitting the failed requests succeeds. Runs last: the spare replica is
    gone afterwards."""
    third = spare.url()
    process = spare.process
    async with Client(front_config(front.url, tiny_models.dense)) as client:
        assert (await client.fleet.add(third)).state == "serving"
        try:
            with Load(client, "kill") as load:
                await load.settle(12)
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=MEMBERSHIP_S)
                await load.settle(12)
                await load.finish()
            with http() as raw:
                still = {w["url"].rstrip("/"): w["is_healthy"] for w in workers(raw, front.url)}
            sys.stderr.write(
                f"\n[router-front] kill under load: {load.answered} answered, {len(load.failed)} failed: "
                f"{sorted({f'{type(e).__name__}: {e}'[:200] for _, _, e in load.failed})}; the router then listed "
                f"the dead replica: {third in still} (healthy: {still.get(third)})\n"
            )
            assert all(isinstance(e, RequestError) for _, _, e in load.failed), load.failed
            assert await client.admin.flush_cache() == [True, True]
            assert listed(front.url) == sorted(replicas), "the dead replica is still registered with the router"
            assert sorted(m.url for m in client.fleet.members()) == sorted(replicas)
            await load.resubmit()
        finally:
            if third in [m.url for m in client.fleet.members()]:
                await client.fleet.remove(third)
    assert listed(front.url) == sorted(replicas)
