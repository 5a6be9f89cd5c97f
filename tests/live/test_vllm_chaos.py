"""A real vLLM server SIGKILLed in the middle of a fleet weight sync, and what happens when it comes back stale.

Two vLLM processes of this module's own (not the session's shared servers), one client over both. The kill is
made to land at one exact point of ``admin.weight_sync``: an ``observe`` plugin SIGKILLs the victim's whole
process group as soon as both servers have confirmed the pause, i.e. after the ``pause`` phase and before the
``update`` phase sends anything. So the update reaches the survivor only, the victim's update and resume fail,
and the survivor is left on the new weights (the sync cannot be rolled back).

The other tests then start a new process on the victim's port with the ORIGINAL weights (stale: the fleet moved
to v1) and check that, once ``fleet.cooldown`` is over, the client never lets it answer with those weights,
after a failed sync and after a successful one, for requests one at a time or all at once, and after a state
check.

Every test gets both servers up on the original weights and version from the ``fleet`` fixture, and puts them
back that way in its teardown (pytest's ``finally``): a killed server is restarted on its port, both reload the
original weights and version. So a test that fails, even in the middle of a restart, leaves the next one a
clean fleet.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import vllm_server
from live_chaos import require, sigkill, wait_until

from backends_core import (
    AdminError,
    AdminPolicy,
    BackendError,
    Client,
    ClientConfig,
    Event,
    FleetPolicy,
    GenerateResult,
    NetworkError,
    RequestError,
    SamplingParams,
    StaleServerError,
    Timeouts,
    hookimpl,
)
from backends_testkit.engine import ReferenceEngine
from backends_testkit.live import ServerProcess, ServerStartError, probe_client
from backends_testkit.tinymodel import TinyModels, write_perturbed_weights

pytestmark = pytest.mark.live

MODEL = vllm_server.SERVED_MODEL_NAME
SURVIVOR, VICTIM = 0, 1
PROMPT = [7, 8, 9, 10, 11, 12]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SCORED = [int(t) for t in np.random.default_rng(5).integers(3, 200, size=48)]
"""A sequence scored by teacher logprobs on the server and on the reference engine (48 ids: under vLLM's
128-token cache block, so no prefix-cache entry can be reused across weights)."""
SAME = 1e-4
"""|Δ logprob| within which two runs are the same weights (vLLM vs the reference engine: 2.6e-6)."""
DIFFERENT = 1e-2
"""|Δ logprob| beyond which the weights are different (the perturbation moves logprobs by ~0.1-1)."""
COOLDOWN_S = 8.0
"""``fleet.cooldown`` of the test clients: a refused server stays out this long."""
SYNC_DEADLINE_S = 300.0
"""The whole weight sync (pause, update, resume on a busy machine: seconds) must end within this."""
START_TIMEOUT_S = 900.0
"""Seconds for a (re)started server to answer ``/health``: 22-112 s seen, but 6 min and more with the default
thread binding on a machine where other vLLM servers run (see ``vllm_server.CPU_THREADS_ENV``)."""


def vllm_process(venv: Path, model_dir: Path, *, name: str, log_path: Path, port: int | None = None) -> ServerProcess:
    """A not-yet-started vLLM server as ``vllm_server.vllm_server`` makes it, on a chosen port (a restart must
    come back where the client knows the server)."""
    env = dict(vllm_server.SERVER_ENV)
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    argv = vllm_server.server_command(venv, model_dir, lora=False)
    return ServerProcess(argv, name=name, log_path=log_path, env=env, port=port)


class Pair:
    """This module's two vLLM servers on the original weights; :meth:`restart` brings a killed one back."""

    def __init__(self, venv: Path, weights: Path, logs: Path) -> None:
        self.venv, self.weights, self.logs = venv, weights, logs
        self.servers = [
            vllm_process(venv, weights, name=f"vllm-chaos-{i}", log_path=logs / f"vllm-chaos-{i}.log") for i in (0, 1)
        ]
        self.restarts = 0
        #: The version the servers report on the original weights (read before any test changes it).
        self.base_version: str | None = None

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def start(self) -> None:
        for server in self.servers:
            server.start()
        for server in self.servers:  # both start at once: one wait covers the slower
            server.wait_ready("/health", timeout=START_TIMEOUT_S)
            sys.stderr.write(f"\n[live] {server.name} ready at {server.url} after {server.ready_after:.1f}s\n")

    def restart(self, index: int) -> ServerProcess:
        """Start a fresh process on server ``index``'s port with the original weights; wait until it is ready.

        :raises ServerStartError: it did not become ready (the process is stopped: the next :meth:`ensure_up`
            tries again).
        """
        old = self.servers[index]
        old.stop(timeout=10.0)  # reaps what is left of a killed one
        self.restarts += 1
        new = vllm_process(
            self.venv,
            self.weights,
            name=f"{old.name.split('-r')[0]}-r{self.restarts}",
            log_path=self.logs / f"{old.name.split('-r')[0]}-r{self.restarts}.log",
            port=old.port,
        )
        self.servers[index] = new
        new.start()
        try:
            new.wait_ready("/health", timeout=START_TIMEOUT_S)
        except ServerStartError:
            new.stop(timeout=10.0)
            raise
        sys.stderr.write(f"\n[live] {new.name} back at {new.url} after {new.ready_after:.1f}s\n")
        return new

    def ensure_up(self) -> None:
        """Restart every server that is not running or does not answer ``/health``."""
        for index, server in enumerate(self.servers):
            if not (server.running() and healthy(server.url)):
                self.restart(index)

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


def healthy(url: str) -> bool:
    try:
        with probe_client(10.0) as http:
            return http.get(url + "/health").status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def pair(vllm_venv: Path, tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    servers = Pair(vllm_venv, tiny_models.dense, tmp_path_factory.getbasetemp() / "live-logs")
    try:
        servers.start()
        yield servers
    finally:
        servers.stop()


@pytest.fixture
async def fleet(pair: Pair) -> AsyncIterator[Pair]:
    """The module's two servers, both up on the original weights and version before the test (whatever an
    earlier test left behind) and after it (the test's own mess is cleaned up here, in the teardown)."""
    await restore(pair)
    yield pair
    await restore(pair)


class KillAfterPause:
    """``observe`` plugin: SIGKILLs ``victim`` the moment every one of ``servers`` has confirmed the pause of a
    weight sync — after the pause phase, before the update phase — and records every admin call it sees."""

    def __init__(self, victim: ServerProcess, servers: Sequence[str]) -> None:
        self.victim = victim
        self.servers = set(servers)
        self.paused: set[str] = set()
        self.calls: list[tuple[str, str | None, bool]] = []
        self.killed_after: list[tuple[str, str | None, bool]] | None = None

    @hookimpl
    def observe(self, event: Event) -> None:
        if event.kind != "admin":
            return
        self.calls.append((event.operation, event.server, event.ok))
        if event.operation == "admin_pause" and event.ok and self.killed_after is None:
            self.paused.add(event.server or "")
            if self.paused == self.servers:
                sigkill(self.victim)  # blocks the loop for the few milliseconds the kill takes: nothing runs between
                self.killed_after = list(self.calls)


def config(urls: Sequence[str], weights: Path) -> ClientConfig:
    return ClientConfig(
        backend="vllm",
        base_url=list(urls),
        model=MODEL,
        tokenizer=str(weights),
        timeouts=Timeouts(read=120.0),
        fleet=FleetPolicy(cooldown=COOLDOWN_S),
        admin=AdminPolicy(deadlines={"pause": 120.0, "update_weights": 240.0, "resume": 60.0, "state": 30.0}),
    )


async def reference_scores(model_dir: Path) -> np.ndarray[Any, Any]:
    """Teacher logprobs of :data:`SCORED` by the numpy reference engine on ``model_dir``'s weights."""
    async with ReferenceEngine(model_dir) as engine:
        out = await engine.score(SCORED, top_k=0)
    assert out.prompt_logprobs is not None
    return out.prompt_logprobs.astype(np.float64)


async def server_scores(client: Client, server: int) -> np.ndarray[Any, Any]:
    return (await client.teacher_logprobs(SCORED, server=server)).logprobs.astype(np.float64)


def delta(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> float:
    return float(np.max(np.abs(a[1:] - b[1:])))


def same_greedy(a: GenerateResult, b: GenerateResult) -> bool:
    return a.completion_ids == b.completion_ids and bool(np.allclose(a.logprobs, b.logprobs, atol=SAME, rtol=0))


async def kill_victim_mid_sync(client: Client, new: Path, killer: KillAfterPause) -> AdminError | None:
    """Run the weight sync to ``new`` as version ``v1`` with ``killer`` armed; return its ``AdminError`` (``None``
    if it raised none). A sync that fails before the kill landed is a broken set-up."""
    try:
        async with asyncio.timeout(SYNC_DEADLINE_S):
            await client.admin.weight_sync(path=str(new), version="v1", mode="wait")
    except AdminError as exc:
        require(killer.killed_after is not None, f"the sync failed before the kill: {exc}")
        return exc
    require(killer.killed_after is not None, "the sync ended without the kill")
    return None


async def restore(pair: Pair) -> None:
    """Both servers as the module fixture made them: any server down restarted on its port, then every server
    reloaded with the original weights and version."""
    await asyncio.to_thread(pair.ensure_up)
    async with Client(config(pair.urls, pair.weights)) as fixer:
        if pair.base_version is None:
            pair.base_version = (await fixer.admin.state())[SURVIVOR].weight_version or "base"
        await fixer.admin.weight_sync(path=str(pair.weights), version=pair.base_version, mode="wait")


async def test_sigkill_mid_weight_sync_resumes_the_survivor(fleet: Pair, tmp_path: Path) -> None:
    """SIGKILL of one server between the pause and update phases of ``weight_sync``.

    ``AdminError`` names the update phase; ``.phases`` holds pause (both ok), update (survivor ok, victim a
    ``NetworkError``) and resume (survivor ok, victim a ``RequestError``), and no flush. The survivor is resumed
    (not paused) and serves requests, including those the balancer first sent to the dead server (refused:
    failed over, the dead one taken out). The survivor serves the POST-sync weights: its greedy logprobs differ
    from its own before the sync, and its teacher logprobs equal the reference engine's on the new checkpoint
    (and not on the original one); it reports version ``v1``. The client records no version.
    """
    pair = fleet
    new = write_perturbed_weights(pair.weights, tmp_path / "v1", seed=21, scale=0.2)
    killer = KillAfterPause(pair.servers[VICTIM], pair.urls)
    async with Client(config(pair.urls, pair.weights), plugins=[killer]) as client:
        initial = await client.admin.state()
        assert [s.paused for s in initial] == [False, False]
        before = await client.generate(prompt_ids=PROMPT, sampling=GREEDY, server=SURVIVOR)

        error = await kill_victim_mid_sync(client, new, killer)
        assert error is not None, "weight_sync succeeded although a server was SIGKILLed during it"
        sys.stderr.write(f"\n[chaos] vllm: killed after {killer.killed_after}; then {killer.calls}\n{error}\n")

        assert error.operation == "weight_sync: update", error
        assert list(error.phases) == ["pause", "update", "resume"], error.phases
        pause, update, resume = (error.phases[p] for p in ("pause", "update", "resume"))
        assert [o.ok for o in pause] == [True, True]
        assert update[SURVIVOR].ok and isinstance(update[VICTIM].error, NetworkError), update
        assert resume[SURVIVOR].ok and isinstance(resume[VICTIM].error, RequestError), resume
        assert [o.server for o in resume] == pair.urls  # resume ran on every paused server, the dead one too
        assert client.weight_version is None
        assert (error.failed, error.succeeded) == ([pair.urls[VICTIM]], [pair.urls[SURVIVOR]]), error
        assert error.state is not None and f"mixed weights: {pair.urls[SURVIVOR]} switched" in error.state, error

        (outcome,) = await client.admin.outcomes([client.servers[SURVIVOR]]).state()
        state = outcome.value
        assert state is not None and state.paused is False, outcome
        assert state.weight_version == "v1", state

        answers = await asyncio.gather(*(client.generate(prompt_ids=PROMPT, sampling=GREEDY) for _ in range(4)))
        assert {a.server for a in answers} == {pair.urls[SURVIVOR]}
        dead = client.balancer.load[VICTIM]
        assert dead.failures >= 1 and dead.down_until > 0 and dead.completed == 0, dead
        assert [load.in_flight for load in client.balancer.load] == [0, 0]

        after = answers[0]
        assert not same_greedy(after, before), "the survivor's outputs did not change: update not applied?"
        scores = await server_scores(client, SURVIVOR)
        to_new, to_old = (
            delta(scores, await reference_scores(new)),
            delta(scores, await reference_scores(pair.weights)),
        )
        sys.stderr.write(f"[chaos] survivor teacher logprobs: |Δ| {to_new:.2e} to v1, {to_old:.2e} to the original\n")
        assert to_new < SAME and to_old > DIFFERENT, (to_new, to_old)


async def one_at_a_time(client: Client, count: int) -> list[GenerateResult | BaseException]:
    """``count`` greedy requests through the balancer, each sent after the previous one ended."""
    outcomes: list[GenerateResult | BaseException] = []
    for _ in range(count):
        try:
            outcomes.append(await client.generate(prompt_ids=PROMPT, sampling=GREEDY))
        except BackendError as exc:
            outcomes.append(exc)
    return outcomes


def assert_never_stale(
    outcomes: Sequence[GenerateResult | BaseException], fresh: GenerateResult, stale: GenerateResult, what: str
) -> None:
    """Every outcome is an answer with v1 weights (``fresh``) or a typed error; at least one is an answer."""
    summary = _summary(outcomes, fresh, stale)
    sys.stderr.write(f"\n[chaos] {what}: {summary}\n")
    assert all(isinstance(o, GenerateResult | BackendError) for o in outcomes), summary
    served = [o for o in outcomes if isinstance(o, GenerateResult)]
    silently_stale = sorted({str(o.server) for o in served if same_greedy(o, stale)})
    assert served, f"no request was served: {summary}"
    assert not silently_stale, f"answered with the pre-sync weights by {silently_stale}: {summary}"
    assert all(same_greedy(o, fresh) for o in served), summary


async def test_stale_server_back_after_a_failed_sync_is_kept_out(fleet: Pair, tmp_path: Path) -> None:
    """After the failed sync of the test above (the survivor on v1, the victim dead and taken out by the client,
    which recorded no version), a new vLLM process starts on the victim's port with the ORIGINAL weights.

    Once ``fleet.cooldown`` is over, requests through the same client (one at a time) are never answered by those
    stale weights: the restarted server is asked for its version, which differs from the one every other server
    serves, and is taken out again; every request is answered by the survivor with v1 weights. A request pinned
    to it raises ``StaleServerError`` (expected ``v1``, reported its start-up version).
    """
    pair = fleet
    new = write_perturbed_weights(pair.weights, tmp_path / "v1", seed=21, scale=0.2)
    killer = KillAfterPause(pair.servers[VICTIM], pair.urls)
    async with Client(config(pair.urls, pair.weights), plugins=[killer]) as client:
        stale = await client.generate(prompt_ids=PROMPT, sampling=GREEDY, server=SURVIVOR)

        require(await kill_victim_mid_sync(client, new, killer) is not None, "the sync raised no AdminError")
        require(client.weight_version is None, "the failed sync recorded a version")
        fresh = await client.generate(prompt_ids=PROMPT, sampling=GREEDY, server=SURVIVOR)
        require(not same_greedy(fresh, stale), "the survivor did not take the new weights")
        answers = await asyncio.gather(*(client.generate(prompt_ids=PROMPT, sampling=GREEDY) for _ in range(4)))
        require({a.server for a in answers} == {pair.urls[SURVIVOR]}, "a request reached the dead server")
        require(client.balancer.load[VICTIM].down_until > 0, "the client never took the dead server out")
        await asyncio.to_thread(pair.restart, VICTIM)
        await wait_until(_healthy(client, VICTIM), within=COOLDOWN_S + 30.0, what="the restarted server's cooldown")

        out_until = client.balancer.load[VICTIM].down_until
        outcomes = await one_at_a_time(client, 6)
        assert_never_stale(outcomes, fresh, stale, "failed sync, 6 requests one at a time after the cooldown")
        assert {o.server for o in outcomes if isinstance(o, GenerateResult)} == {pair.urls[SURVIVOR]}
        assert client.balancer.load[VICTIM].down_until > out_until, "the stale server was not looked at"

        await wait_until(_healthy(client, VICTIM), within=COOLDOWN_S + 30.0, what="the cooldown to end")
        with pytest.raises(StaleServerError) as refused:
            await client.generate(prompt_ids=PROMPT, sampling=GREEDY, server=VICTIM)
        assert (refused.value.expected, refused.value.reported) == ("v1", pair.base_version), refused.value


async def sync_then_restart_stale(client: Client, pair: Pair, new: Path) -> tuple[GenerateResult, GenerateResult]:
    """Sync the fleet to ``new`` as ``v1`` (recorded by ``client``), SIGKILL the victim, let the client find it
    down, restart it on its port with the ORIGINAL weights and wait for the end of its cooldown.

    :returns: the survivor's greedy answer before the sync (original weights) and after it (v1).
    """
    stale = await client.generate(prompt_ids=PROMPT, sampling=GREEDY, server=SURVIVOR)
    await client.admin.weight_sync(path=str(new), version="v1", mode="wait")
    require(client.weight_version == "v1", "the sync recorded no version")
    fresh = await client.generate(prompt_ids=PROMPT, sampling=GREEDY, server=SURVIVOR)
    require(not same_greedy(fresh, stale), "the sync did not change the outputs")
    sigkill(pair.servers[VICTIM])
    answers = await asyncio.gather(*(client.generate(prompt_ids=PROMPT, sampling=GREEDY) for _ in range(4)))
    require({a.server for a in answers} == {pair.urls[SURVIVOR]}, "a request reached the dead server")
    require(client.balancer.load[VICTIM].down_until > 0, "the client never took the dead server out")
    await asyncio.to_thread(pair.restart, VICTIM)
    await wait_until(_healthy(client, VICTIM), within=COOLDOWN_S + 30.0, what="the restarted server's cooldown")
    return stale, fresh


async def test_stale_server_back_after_a_synced_fleet_is_kept_out(fleet: Pair, tmp_path: Path) -> None:
    """The fleet was synced to v1 (the client recorded the version), then one server is SIGKILLed and a new
    process comes up on its port with the ORIGINAL weights.

    Once ``fleet.cooldown`` is over, requests sent one at a time through the client are all answered by the
    survivor with v1 weights (the restarted server is asked for its version, reports another one and is taken
    out again); a request pinned to it raises ``StaleServerError`` naming both versions. After a weight sync
    brings it to v1 and the cooldown passes, it serves again, with v1 weights.
    """
    pair = fleet
    new = write_perturbed_weights(pair.weights, tmp_path / "v1", seed=21, scale=0.2)
    async with Client(config(pair.urls, pair.weights)) as client:
        stale, fresh = await sync_then_restart_stale(client, pair, new)

        out_until = client.balancer.load[VICTIM].down_until
        outcomes = await one_at_a_time(client, 6)
        assert_never_stale(outcomes, fresh, stale, "synced fleet, 6 requests one at a time after the cooldown")
        assert {o.server for o in outcomes if isinstance(o, GenerateResult)} == {pair.urls[SURVIVOR]}
        assert client.balancer.load[VICTIM].down_until > out_until, "the stale server was not looked at"

        await wait_until(_healthy(client, VICTIM), within=COOLDOWN_S + 30.0, what="the cooldown to end")
        with pytest.raises(StaleServerError) as refused:
            await client.generate(prompt_ids=PROMPT, sampling=GREEDY, server=VICTIM)
        assert (refused.value.expected, refused.value.reported) == ("v1", pair.base_version), refused.value

        await client.admin.weight_sync(path=str(new), version="v1", mode="wait")  # catches it up
        await wait_until(_healthy(client, VICTIM), within=COOLDOWN_S + 30.0, what="the cooldown to end")
        caught_up = await client.generate(prompt_ids=PROMPT, sampling=GREEDY, server=VICTIM)
        assert same_greedy(caught_up, fresh), "the caught-up server does not serve v1"
        spread = await asyncio.gather(*(client.generate(prompt_ids=PROMPT, sampling=GREEDY) for _ in range(4)))
        assert {a.server for a in spread} == set(pair.urls), "the caught-up server gets no requests"
        assert all(same_greedy(a, fresh) for a in spread)


async def test_stale_server_back_after_a_synced_fleet_gets_no_concurrent_request(fleet: Pair, tmp_path: Path) -> None:
    """As above, but the first requests after the cooldown arrive together (8 concurrent ``generate`` calls):
    none may be answered by the restarted server's original weights (each is answered with v1 weights or fails
    with a typed error): every request waiting on the one version lookup judges the version it read.
    """
    pair = fleet
    new = write_perturbed_weights(pair.weights, tmp_path / "v1", seed=21, scale=0.2)
    async with Client(config(pair.urls, pair.weights)) as client:
        stale, fresh = await sync_then_restart_stale(client, pair, new)
        outcomes = await asyncio.gather(
            *(client.generate(prompt_ids=PROMPT, sampling=GREEDY) for _ in range(8)), return_exceptions=True
        )
        assert_never_stale(outcomes, fresh, stale, "synced fleet, 8 concurrent requests after the cooldown")


async def test_state_check_does_not_readmit_a_stale_server(fleet: Pair, tmp_path: Path) -> None:
    """As above, but after the cooldown the trainer first looks at the fleet (``admin.state()``, as a monitoring
    loop would), which reports the restarted server's start-up version next to the survivor's v1. Requests sent
    one at a time afterwards must still never be answered by the original weights: a state check records the
    version but never vouches for a server in doubt.
    """
    pair = fleet
    new = write_perturbed_weights(pair.weights, tmp_path / "v1", seed=21, scale=0.2)
    async with Client(config(pair.urls, pair.weights)) as client:
        stale, fresh = await sync_then_restart_stale(client, pair, new)
        states = await client.admin.state()
        require(
            [s.weight_version for s in states] == ["v1", pair.base_version],
            f"unexpected versions {[s.weight_version for s in states]}",
        )
        outcomes = await one_at_a_time(client, 6)
        assert_never_stale(outcomes, fresh, stale, "synced fleet, state check, then 6 requests one at a time")


def _summary(
    outcomes: Sequence[GenerateResult | BaseException], fresh: GenerateResult, stale: GenerateResult
) -> list[Any]:
    """Per outcome: (server, which weights answered) or the error's type."""
    return [
        (o.server, "v1" if same_greedy(o, fresh) else "original" if same_greedy(o, stale) else "?")
        if isinstance(o, GenerateResult)
        else type(o).__name__
        for o in outcomes
    ]


def _healthy(client: Client, index: int) -> Any:
    async def check() -> bool:
        return client.balancer.healthy()[index]

    return check
