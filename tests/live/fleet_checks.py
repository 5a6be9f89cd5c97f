"""Fleet guarantees checked on real servers: :class:`FleetChecks`, the tests every backend's live fleet module
runs by subclassing it.

Each test takes a :class:`FleetTarget` fixture: two live servers of one backend (serving the tiny dense model as
``tiny-qwen3``) and how to configure a client for them. The checks leave the servers as they found them, also when
they fail (resumed, original weights and version, no salt left behind in the servers' state).
"""

from __future__ import annotations

import asyncio
import socket
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest

from backends_core import (
    AdminError,
    AdminPolicy,
    Client,
    ClientConfig,
    GenerateResult,
    NetworkError,
    RequestTimeout,
    SamplingParams,
)
from backends_testkit.tinymodel import write_perturbed_weights

MODEL = "tiny-qwen3"


def dead_url() -> str:
    """A loopback URL nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@attrs.frozen
class FleetTarget:
    """Two live servers of ``backend`` and what a client needs to drive them.

    :param backend: the backend name.
    :param urls: base URLs of the two live servers.
    :param weights: the checkpoint directory the servers were started with (restored at the end).
    :param options: ``backend_options`` for a fleet over ``urls`` (and any dead address: :meth:`config` adds
        per-server entries through ``per_server``).
    :param per_server: ``backend_options`` entries keyed by a server's base URL (the Dynamo backend's
        ``worker_urls``), merged for the servers of each config.
    :param cached_tokens: the servers report cached prompt tokens, so prefix-cache hits can be observed.
    """

    backend: str
    urls: tuple[str, str]
    weights: Path
    options: Mapping[str, Any] = attrs.field(factory=dict)
    per_server: Mapping[str, Mapping[str, Any]] = attrs.field(factory=dict)
    cached_tokens: bool = False

    def config(self, urls: Sequence[str], **overrides: Any) -> ClientConfig:
        options: dict[str, Any] = dict(self.options)
        for url in urls:
            for key, value in self.per_server.get(url, {}).items():
                options.setdefault(key, {})[url] = value
        fields: dict[str, Any] = {
            "backend": self.backend,
            "base_url": list(urls),
            "model": MODEL,
            "tokenizer": str(self.weights),
            "backend_options": options,
        }
        fields.update(overrides)
        return ClientConfig(**fields)


async def found_version(client: Client) -> str:
    """The weight version the client's servers report now (the first one's), to put back at the end."""
    return (await client.admin.state())[0].weight_version or "base"


def cached(result: GenerateResult) -> int:
    """The prefix-cache hits a server reported for ``result`` (it must report them)."""
    assert result.usage is not None and result.usage.cached_tokens is not None, "no cached-token count"
    return result.usage.cached_tokens


class FleetChecks:
    """The fleet tests every live backend runs: subclass it as ``Test<Backend>Fleet`` with a ``target`` fixture
    returning a :class:`FleetTarget` over two live servers."""

    async def test_balancing_stickiness_and_failover(self, target: FleetTarget) -> None:
        """Concurrent requests spread over both live servers; the dead address is tried, taken out and failed over
        (nothing lost); a session key and a conversation each stay on one server; in-flight counts return to 0."""
        live = list(target.urls)
        async with Client(target.config([*live, dead_url()])) as client:
            sampling = SamplingParams(max_tokens=8, ignore_eos=True, seed=1)
            results = await asyncio.gather(
                *(client.generate(prompt_ids=[1, 2, 3, i], sampling=sampling) for i in range(24))
            )
            per_server = Counter(r.server for r in results)
            assert set(per_server) == set(live), per_server  # all 24 answered, by the live servers only
            assert min(per_server.values()) >= 6, f"least-in-flight balancing left a server idle: {per_server}"
            dead = client.balancer.load[2]
            assert dead.failures >= 1 and dead.completed == 0

            sticky = [
                await client.generate(prompt_ids=[4, 5, 6], sampling=SamplingParams(max_tokens=2), session="s-1")
                for _ in range(4)
            ]
            assert len({r.server for r in sticky}) == 1, "a session key moved between servers"

            conv = client.conversation()
            short = SamplingParams(max_tokens=4)
            turns = [await conv.send([{"role": "user", "content": text}], sampling=short) for text in ("hi", "more")]
            assert len({t.server for t in turns}) == 1, "a conversation moved between servers"
            assert [load.in_flight for load in client.balancer.load] == [0, 0, 0]

    async def test_weight_sync_resumes_on_failure_then_syncs(self, target: FleetTarget, tmp_path: Path) -> None:
        """A failing update resumes every paused server and sets no version; a real update reaches both servers,
        changes their outputs identically, is visible in ``state()`` and salts new requests; the base weights come
        back the same way."""
        ids = [7, 8, 9, 10, 11, 12]
        greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        async with Client(target.config(list(target.urls))) as client:
            found = await found_version(client)
            before = [await client.generate(prompt_ids=ids, sampling=greedy, server=i) for i in (0, 1)]
            try:
                with pytest.raises(AdminError, match="weight_sync: update") as info:
                    await client.admin.weight_sync(path=str(tmp_path / "missing"), version="broken", mode="wait")
                assert [o.ok for o in info.value.phases["resume"]] == [True, True]  # resumed in finally, on both
                assert [s.paused for s in await client.admin.state()] == [False, False]
                assert client.weight_version is None
            finally:  # whatever failed above, the servers are not left paused
                await client.admin.resume()
            new = write_perturbed_weights(target.weights, tmp_path / "v9", seed=9, scale=0.2)
            try:
                report = await client.admin.weight_sync(path=str(new), version="v9", mode="wait")
                assert report.ok and [s.weight_version for s in await client.admin.state()] == ["v9", "v9"]
                after = [await client.generate(prompt_ids=ids, sampling=greedy, server=i) for i in (0, 1)]
                assert after[0].completion_ids == after[1].completion_ids  # both servers run the same new weights
                assert not all(
                    a.completion_ids == b.completion_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
                    for a, b in zip(after, before, strict=True)
                ), "the update did not change the outputs"
                assert all(r.weight_version in ("v9", None) for r in after)
            finally:
                await client.admin.weight_sync(path=str(target.weights), version=found, mode="wait")
            restored = [await client.generate(prompt_ids=ids, sampling=greedy, server=i) for i in (0, 1)]
            assert [r.completion_ids for r in restored] == [r.completion_ids for r in before]

    async def test_salt_isolates_the_prefix_cache_across_a_sync(self, target: FleetTarget) -> None:
        """After a weight sync requests are salted with the new version: at once by the client that synced, and by
        another client (a rollout process) once a state check or an answer showed it the new version. Requests of
        the new version never hit prefix-cache entries made under the old salt, and they share their own."""
        if not target.cached_tokens:
            raise AssertionError(f"{target.backend}: the servers do not report cached tokens")
        ids = list(range(40, 360))  # 320 prompt tokens: two or more cache blocks on every engine here (vLLM CPU: 128)
        sampling = SamplingParams(max_tokens=1)
        config = target.config([target.urls[0]])
        async with Client(config) as synced, Client(config) as rollout, Client(config) as other:
            found = await found_version(synced)
            try:
                await synced.admin.weight_sync(path=str(target.weights), version="salted", mode="wait")
                assert synced.weight_version == "salted"
                # two clients that have not seen the new version yet: the old salt, shared
                await rollout.generate(prompt_ids=ids, sampling=sampling)
                old = await other.generate(prompt_ids=ids, sampling=sampling)
                assert cached(old), "the second identical request was not a prefix-cache hit"
                await rollout.admin.state()  # shows it the new version (if the answer did not already)
                first = await rollout.generate(prompt_ids=ids, sampling=sampling)
                assert cached(first) == 0, "a request of the new version hit a cache entry made under the old salt"
                again = await synced.generate(prompt_ids=ids, sampling=sampling)
                assert cached(again), "requests of the new version do not share their cache entries"
            finally:
                await synced.admin.weight_sync(path=str(target.weights), version=found, mode="wait")

    async def test_partial_failure_reports_every_server(self, target: FleetTarget) -> None:
        """With one server unreachable, a weight sync fails at the pause, says so per server, and resumes the
        server it did pause; nothing is reported as done."""
        missing = dead_url()
        async with Client(target.config([target.urls[0], missing])) as client:
            try:
                with pytest.raises(AdminError, match="weight_sync: pause") as info:
                    await client.admin.weight_sync(path=str(target.weights), version="never", mode="wait")
                pause = info.value.phases["pause"]
                assert pause[0].ok and isinstance(pause[1].error, NetworkError)
                assert [o.ok for o in info.value.phases["resume"]] == [True]  # only the paused one, resumed
                (outcome,) = await client.admin.outcomes([client.servers[0]]).state()
                state = outcome.value
                assert state is not None and state.paused is False and state.weight_version != "never"
                assert client.weight_version is None
            finally:  # whatever failed above, the live server is not left paused
                await client.admin.outcomes([client.servers[0]]).resume()

    async def test_deadlines_fail_per_server(self, target: FleetTarget) -> None:
        """A deadline too short for any server fails every server with a timeout and reports all of them."""
        config = target.config(list(target.urls), admin=AdminPolicy(deadlines={"state": 1e-4}, retries=0))
        async with Client(config) as client:
            with pytest.raises(AdminError) as info:
                await client.admin.state()
        assert len(info.value.results) == 2
        assert all(isinstance(o.error, RequestTimeout) for o in info.value.results)
