"""Elastic membership without a router (``client.fleet``): joiners are caught up before they serve, leavers are
drained, discovery adds and removes servers. In-process emulated servers behind one dispatching transport."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from backends_core import (
    AdminError,
    Client,
    ClientConfig,
    ConfigError,
    Event,
    FleetPolicy,
    InvalidRequestError,
    LoraAdapter,
    MembershipError,
    NetworkError,
    SamplingParams,
    SyncClient,
    hookimpl,
)
from backends_core.membership import discover
from backends_testkit.engine import ReferenceEngine
from backends_testkit.reference.emulator import ReferenceEmulator

Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]
HOSTS = ["s0", "s1", "s2"]
DEADLINE = 30.0
SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)


class Servers:
    """Emulated servers by host behind one transport; a host's handler can be swapped, requests are logged."""

    def __init__(self, emulators: dict[str, ReferenceEmulator]) -> None:
        self.emulators = emulators
        self.handlers: dict[str, Handler] = {h: e.handle for h, e in emulators.items()}
        self.seen: list[httpx.Request] = []

    def transport(self) -> httpx.MockTransport:
        async def handle(request: httpx.Request) -> httpx.Response:
            self.seen.append(request)
            return await self.handlers[request.url.host](request)

        return httpx.MockTransport(handle)

    def hits(self, host: str, path: str) -> int:
        return sum(1 for r in self.seen if r.url.host == host and r.url.path == path)

    def gate(self, host: str, path: str) -> tuple[asyncio.Event, asyncio.Event]:
        """Hold ``host``'s ``path`` requests until the second event is set; the first is set when one arrives."""
        arrived, release = asyncio.Event(), asyncio.Event()
        inner = self.emulators[host].handle

        async def gated(request: httpx.Request) -> httpx.Response:
            if request.url.path == path:
                arrived.set()
                await release.wait()
            return await inner(request)

        self.handlers[host] = gated
        return arrived, release


@pytest.fixture
async def servers(tiny_models):
    engines = [ReferenceEngine(tiny_models.dense, seed=i) for i in range(len(HOSTS))]
    yield Servers({h: ReferenceEmulator(e) for h, e in zip(HOSTS, engines, strict=True)})
    for e in engines:
        await e.aclose()


def config(tiny_models, hosts: list[str] = HOSTS[:2], **fleet: object) -> ClientConfig:
    return ClientConfig(
        backend="reference",
        base_url=[f"http://{h}" for h in hosts],
        model="tiny-qwen3",
        tokenizer=str(tiny_models.dense),
        fleet=FleetPolicy(**fleet),  # type: ignore[arg-type]
    )


class Observer:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self.joined = asyncio.Event()

    @hookimpl
    def observe(self, event: Event) -> None:
        if event.kind == "fleet":
            self.events.append(event)
            if event.operation == "join":
                self.joined.set()


async def within(awaitable: Awaitable[object]) -> None:
    async with asyncio.timeout(DEADLINE):
        await awaitable


async def some_generations(client: Client, count: int = 12) -> set[str | None]:
    results = await asyncio.gather(*(client.generate(prompt_ids=[1, 2, k], sampling=SAMPLING) for k in range(count)))
    return {r.server for r in results}


async def test_a_joining_server_gets_no_generation_until_it_is_on_the_fleets_weights_and_adapters(
    servers, tiny_models, tmp_path
) -> None:
    from backends_testkit.tinymodel import write_perturbed_weights

    new = write_perturbed_weights(tiny_models.dense, tmp_path / "w1", seed=3, scale=0.1)
    async with Client(config(tiny_models), transport=servers.transport()) as client:
        await client.admin.weight_sync(path=str(new), version="v1")
        await client.admin.load_lora(LoraAdapter(name="a", path=str(tiny_models.lora)))
        arrived, release = servers.gate("s2", "/update_weights")
        joining = asyncio.ensure_future(client.fleet.add("http://s2"))
        await within(arrived.wait())
        assert [(m.url, m.state) for m in client.fleet.members()][-1] == ("http://s2", "joining")
        assert await some_generations(client) == {"http://s0", "http://s1"}
        with pytest.raises(InvalidRequestError, match="joining"):
            await client.generate(prompt_ids=[1, 2], server="http://s2", sampling=SamplingParams(max_tokens=16))
        assert "http://s2" not in client.base_urls
        release.set()
        member = await joining
        assert member.state == "serving" and member.error is None
        pinned = await client.generate(
            prompt_ids=[1, 2], server="http://s2", lora="a", sampling=SamplingParams(max_tokens=16)
        )
        assert "http://s2" in await some_generations(client)
    engine = servers.emulators["s2"].engine
    assert engine.weight_version == "v1" and "a" in engine.loras
    assert pinned.weight_version == "v1"
    assert servers.hits("s2", "/generate") > 0


async def test_a_server_joining_during_a_weight_sync_is_caught_up_to_the_version_the_sync_sets(
    servers, tiny_models, tmp_path
) -> None:
    from backends_testkit.tinymodel import write_perturbed_weights

    new = write_perturbed_weights(tiny_models.dense, tmp_path / "w2", seed=4, scale=0.1)
    async with Client(config(tiny_models), transport=servers.transport()) as client:
        arrived, release = servers.gate("s0", "/update_weights")
        sync = asyncio.ensure_future(client.admin.weight_sync(path=str(new), version="v2"))
        await within(arrived.wait())
        joining = asyncio.ensure_future(client.fleet.add("http://s2"))
        release.set()
        report = await sync
        member = await joining
        states = await client.admin.state()
    assert [o.server for o in report.phases["update"]] == ["http://s0", "http://s1"]
    assert member.state == "serving"
    assert [s.weight_version for s in states] == ["v2", "v2", "v2"]
    assert servers.hits("s2", "/update_weights") == 1


async def test_a_failed_catch_up_keeps_the_server_out_counted_reported_and_retried_at_the_next_refresh(
    servers, tiny_models, tmp_path
) -> None:
    from backends_testkit.tinymodel import write_perturbed_weights

    new = write_perturbed_weights(tiny_models.dense, tmp_path / "w3", seed=5, scale=0.1)
    broken = {"on": True}

    async def refusing_update(request: httpx.Request) -> httpx.Response:
        if broken["on"] and request.url.path == "/update_weights":
            return httpx.Response(500, json={"error": "disk on fire"})
        return await servers.emulators["s2"].handle(request)

    servers.handlers["s2"] = refusing_update
    observer = Observer()
    cfg = config(tiny_models, refresh_interval=None)
    async with Client(cfg, transport=servers.transport(), plugins=[observer]) as client:
        await client.admin.update_weights(str(new), version="v3")
        with pytest.raises(AdminError, match="disk on fire") as info:
            await client.fleet.add("http://s2")
        assert "stays out of the fleet" in str(info.value)
        (member,) = [m for m in client.fleet.members() if m.url == "http://s2"]
        assert member.state == "joining" and member.error is info.value
        assert client.fleet.catch_up_failures == 1
        assert await some_generations(client) == {"http://s0", "http://s1"}
        await client.fleet.refresh()  # still refused: counted again
        assert client.fleet.catch_up_failures == 2
        broken["on"] = False
        await client.fleet.refresh()
        assert [m.state for m in client.fleet.members()] == ["serving"] * 3
        caught_up = await client.generate(prompt_ids=[1, 2], server="http://s2", sampling=SamplingParams(max_tokens=16))
    assert caught_up.weight_version == "v3"
    catch_ups = [e for e in observer.events if e.operation == "catch_up"]
    assert [e.ok for e in catch_ups] == [False, False, True]
    assert catch_ups[1].detail["failures"] == 2 and catch_ups[0].server == "http://s2"
    assert [e.server for e in observer.events if e.operation == "join"] == ["http://s2"]


async def test_a_leaving_server_is_drained_and_its_request_in_flight_is_answered_once(servers, tiny_models) -> None:
    async with Client(config(tiny_models), transport=servers.transport()) as client:
        arrived, release = servers.gate("s1", "/generate")
        in_flight = asyncio.ensure_future(client.generate(prompt_ids=[1, 2], sampling=SAMPLING, server="http://s1"))
        await within(arrived.wait())
        leaving = asyncio.ensure_future(client.fleet.remove("http://s1"))
        assert await some_generations(client) == {"http://s0"}
        assert not leaving.done()  # its request is still running
        assert [m.url for m in client.fleet.members()] == ["http://s0"]
        release.set()
        result = await in_flight
        await within(leaving)
        assert [load.in_flight for load in client.balancer.load] == [0, 0]
    assert result.server == "http://s1"
    assert servers.hits("s1", "/generate") == 1


async def test_a_request_in_flight_on_a_leaving_server_that_fails_raises_its_error_once(servers, tiny_models) -> None:
    arrived, release = asyncio.Event(), asyncio.Event()

    async def dies(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/generate":
            arrived.set()
            await release.wait()
            raise httpx.ReadError("connection reset by peer", request=request)
        return await servers.emulators["s1"].handle(request)

    servers.handlers["s1"] = dies
    async with Client(config(tiny_models), transport=servers.transport()) as client:
        in_flight = asyncio.ensure_future(client.generate(prompt_ids=[1, 2], sampling=SAMPLING, session="t-1"))
        client.balancer.load[0].in_flight += 100  # the session's request goes to s1
        await within(arrived.wait())
        client.balancer.load[0].in_flight -= 100
        leaving = asyncio.ensure_future(client.fleet.remove("http://s1"))
        release.set()
        with pytest.raises(NetworkError) as info:
            await in_flight
        await within(leaving)
        after = await client.generate(prompt_ids=[1, 2], sampling=SAMPLING, session="t-1")
    assert info.value.maybe_processed
    assert servers.hits("s1", "/generate") == 1  # never re-sent
    assert after.server == "http://s0"  # the session moved with its server gone


async def test_a_server_removed_while_it_is_caught_up_never_serves(servers, tiny_models, tmp_path) -> None:
    from backends_testkit.tinymodel import write_perturbed_weights

    new = write_perturbed_weights(tiny_models.dense, tmp_path / "w4", seed=6, scale=0.1)
    async with Client(config(tiny_models), transport=servers.transport()) as client:
        await client.admin.update_weights(str(new), version="v4")
        arrived, release = servers.gate("s2", "/update_weights")
        joining = asyncio.ensure_future(client.fleet.add("http://s2"))
        await within(arrived.wait())
        await within(client.fleet.remove("http://s2"))
        release.set()
        member = await joining
        assert member.state == "gone"
        assert await some_generations(client) == {"http://s0", "http://s1"}
        assert [m.url for m in client.fleet.members()] == ["http://s0", "http://s1"]
    assert servers.hits("s2", "/generate") == 0


async def test_members_join_and_leave_while_hundreds_of_requests_run_and_each_ends_exactly_once(
    servers, tiny_models, tmp_path
) -> None:
    from backends_testkit.tinymodel import write_perturbed_weights

    new = write_perturbed_weights(tiny_models.dense, tmp_path / "w5", seed=7, scale=0.1)
    async with Client(config(tiny_models), transport=servers.transport()) as client:
        await client.admin.update_weights(str(new), version="v5")

        async def churn() -> None:
            await client.fleet.add("http://s2")
            await client.fleet.remove("http://s0")
            await client.fleet.add("http://s0")
            await client.fleet.remove("http://s1")

        requests = [
            client.generate(prompt_ids=[1, 2, k % 50], sampling=SAMPLING, session=f"t-{k % 40}") for k in range(200)
        ]
        *results, _ = await within_all(*requests, churn())
        assert [load.in_flight for load in client.balancer.load] == [0] * len(client.servers)
        assert client.base_urls == ["http://s2", "http://s0"]
        states = await client.admin.state()
    assert len(results) == 200 and all(r.weight_version == "v5" for r in results)
    assert sum(servers.hits(h, "/generate") for h in HOSTS) == 200  # none lost, none sent twice
    assert [s.weight_version for s in states] == ["v5", "v5"]


async def within_all(*awaitables: Awaitable[object]) -> list[object]:
    async with asyncio.timeout(DEADLINE):
        return list(await asyncio.gather(*awaitables))


async def test_membership_errors_are_clear(servers, tiny_models) -> None:
    async with Client(config(tiny_models), transport=servers.transport()) as client:
        with pytest.raises(MembershipError, match="is a member of the fleet already"):
            await client.fleet.add("http://s0/")
        with pytest.raises(MembershipError, match="not a member"):
            await client.fleet.remove("http://s9")
        with pytest.raises(ConfigError):
            await client.fleet.add("s9:8000")
        await client.fleet.remove("http://s1")
        with pytest.raises(MembershipError, match="last server serving"):
            await client.fleet.remove("http://s0")
        with pytest.raises(InvalidRequestError, match="left the fleet"):
            await client.generate(prompt_ids=[1, 2], server="http://s1", sampling=SamplingParams(max_tokens=16))
        await client.fleet.add("http://s1")  # back, as a new member
        assert client.base_urls == ["http://s0", "http://s1"]
        assert await some_generations(client) == {"http://s0", "http://s1"}


async def test_discovery_adds_listed_servers_and_removes_the_others(servers, tiny_models, tmp_path) -> None:
    listed = ["http://s0", "http://s1"]
    observer = Observer()
    cfg = config(tiny_models, discovery=lambda: list(listed), refresh_interval=None)
    async with Client(cfg, transport=servers.transport(), plugins=[observer]) as client:
        await client.admin.load_lora(LoraAdapter(name="a", path=str(tiny_models.lora)))
        listed[:] = ["http://s0", "http://s2"]
        await client.fleet.refresh()
        assert client.base_urls == ["http://s0", "http://s2"]
        assert await some_generations(client) == {"http://s0", "http://s2"}
        listed[:] = []  # nothing listed: all leave but the last server serving
        await client.fleet.refresh()
        assert client.base_urls == ["http://s2"]
    assert "a" in servers.emulators["s2"].engine.loras
    assert [(e.operation, e.server) for e in observer.events if e.operation in ("join", "leave")] == [
        ("leave", "http://s1"),
        ("join", "http://s2"),
        ("leave", "http://s0"),
    ]


async def test_a_failing_discovery_is_reported_and_changes_nothing(servers, tiny_models) -> None:
    def broken() -> list[str]:
        raise OSError("registry unreachable")

    observer = Observer()
    cfg = config(tiny_models, discovery=broken, refresh_interval=None)
    async with Client(cfg, transport=servers.transport(), plugins=[observer]) as client:
        await client.fleet.refresh()
        assert client.base_urls == ["http://s0", "http://s1"]
    (event,) = observer.events
    assert event.operation == "discover" and isinstance(event.error, OSError)


async def test_the_membership_is_refreshed_on_the_interval_while_the_client_is_open(servers, tiny_models) -> None:
    async def listed() -> list[str]:
        return ["http://s0", "http://s1", "http://s2"]

    observer = Observer()
    cfg = config(tiny_models, discovery=listed, refresh_interval=0.01)
    async with Client(cfg, transport=servers.transport(), plugins=[observer]) as client:
        await within(observer.joined.wait())
        assert client.base_urls == ["http://s0", "http://s1", "http://s2"]


async def test_a_failed_catch_up_is_retried_on_the_interval_without_discovery(servers, tiny_models, tmp_path) -> None:
    from backends_testkit.tinymodel import write_perturbed_weights

    new = write_perturbed_weights(tiny_models.dense, tmp_path / "w6", seed=8, scale=0.1)
    broken = {"on": True}

    async def refusing_update(request: httpx.Request) -> httpx.Response:
        if broken["on"] and request.url.path == "/update_weights":
            return httpx.Response(500, json={"error": "not yet"})
        return await servers.emulators["s2"].handle(request)

    servers.handlers["s2"] = refusing_update
    observer = Observer()
    async with Client(
        config(tiny_models, refresh_interval=0.01), transport=servers.transport(), plugins=[observer]
    ) as client:
        await client.admin.update_weights(str(new), version="v6")
        with pytest.raises(AdminError, match="not yet"):
            await client.fleet.add("http://s2")
        broken["on"] = False
        await within(observer.joined.wait())
        assert client.base_urls == ["http://s0", "http://s1", "http://s2"]
    assert servers.emulators["s2"].engine.weight_version == "v6"


async def test_discovery_reads_a_file_and_dns_a_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    listing = tmp_path / "servers.txt"
    listing.write_text("# the rollout pool\nhttp://10.0.0.1:8000/\n\n  http://10.0.0.2:8000\nhttp://10.0.0.1:8000\n")
    assert await discover(f"file:{listing}") == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]

    def resolve(host: str, port: int, family: int = 0, *args: object, **kwargs: object) -> list[tuple]:
        assert (host, port, family) == ("workers.internal", 8000, socket.AF_INET)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in ("10.0.0.7", "10.0.0.8", "10.0.0.7")]

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    assert await discover("dns:workers.internal:8000") == ["http://10.0.0.7:8000", "http://10.0.0.8:8000"]


@pytest.mark.parametrize(
    ("fleet", "message"),
    [
        (
            {"discovery": "consul://x"},
            "discovery must be 'file:PATH', 'dns:HOST:PORT' or a callable returning server URLs, got 'consul://x' "
            "@ $.fleet.discovery",
        ),
        ({"discovery": "dns:host"}, "@ $.fleet.discovery"),
        ({"discovery": ["http://a"]}, "@ $.fleet.discovery"),
        (
            {"refresh_interval": 0},
            "refresh_interval must be a positive number of seconds or null, got 0 @ $.fleet.refresh_interval",
        ),
    ],
)
def test_bad_discovery_settings_name_their_path(fleet: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        ClientConfig.from_mapping({"backend": "reference", "base_url": "http://a", "fleet": fleet})
    assert any(message in m for m in info.value.messages), info.value.messages


def test_a_sync_client_adds_and_removes_servers_blocking(tiny_models) -> None:
    engines = [ReferenceEngine(tiny_models.dense, seed=i) for i in range(len(HOSTS))]
    servers = Servers({h: ReferenceEmulator(e) for h, e in zip(HOSTS, engines, strict=True)})
    with SyncClient(config(tiny_models), transport=servers.transport()) as client:
        member = client.fleet.add("http://s2")
        client.fleet.remove("http://s0")
        served = {client.generate(prompt_ids=[1, 2, k], sampling=SAMPLING).server for k in range(6)}
        assert [(m.url, m.state) for m in client.fleet.members()] == [
            ("http://s1", "serving"),
            ("http://s2", "serving"),
        ]
        assert client.fleet.catch_up_failures == 0
    for e in engines:
        asyncio.run(e.aclose())
    assert member.state == "serving"
    assert served == {"http://s1", "http://s2"}
