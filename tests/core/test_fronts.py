"""Router fronts (``ClientConfig.front``): generation through the router with its session header, admin fanned out
to every replica the router lists (never through the router), replicas joining and leaving through the router.

The routers are emulated the way ``tests/live/ROUTERS.md`` records the real ones: ``GET /workers``, registrations
on ``/workers``, and every other route (admin included) proxied to ONE replica."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Awaitable, Callable
from urllib.parse import unquote

import attrs
import httpx
import pytest

from backends_core import (
    AdminError,
    Client,
    ClientConfig,
    ConfigError,
    FleetPolicy,
    FrontConfig,
    FrontError,
    LoraAdapter,
    MembershipError,
    SamplingParams,
    UnsupportedOperationError,
)
from backends_testkit.engine import ReferenceEngine
from backends_testkit.reference.emulator import ReferenceEmulator

Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]
DEADLINE = 30.0
SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)
ROUTER = "http://router"


class Router:
    """An emulated vllm-router or sglang-router in front of emulated replicas (by host), with a request log."""

    def __init__(self, kind: str, emulators: dict[str, ReferenceEmulator], listed: list[str]) -> None:
        self.kind = kind
        self.emulators = emulators
        self.workers: dict[str, dict[str, object]] = {}
        for host in listed:
            self.register(f"http://{host}")
        self.seen: list[httpx.Request] = []
        self.pending: list[Callable[[], None]] = []  # sglang-router applies registrations in the background
        self.turn = itertools.count()
        self.list_fails = False

    def register(self, url: str) -> str:
        worker_id = f"id-{len(self.workers)}-{url.rsplit('/', 1)[-1]}"
        self.workers[url] = {"url": url, "id": worker_id, "is_healthy": True}
        return worker_id

    def replica_hits(self, host: str, path: str) -> int:
        return sum(1 for r in self.seen if r.url.host == host and r.url.path == path)

    def transport(self) -> httpx.MockTransport:
        async def handle(request: httpx.Request) -> httpx.Response:
            self.seen.append(request)
            if request.url.host != "router":
                return await self.emulators[request.url.host].handle(request)
            return await self.route(request)

        return httpx.MockTransport(handle)

    async def route(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/workers" and request.method == "GET":
            for apply in self.pending:
                apply()
            self.pending.clear()
            if self.list_fails:
                return httpx.Response(500, text="router busy")
            workers = [
                {k: v for k, v in w.items() if self.kind == "sglang-router" or k != "id"} for w in self.workers.values()
            ]
            return httpx.Response(200, json={"workers": workers, "total": len(workers)})
        if path == "/workers" and request.method == "POST":
            url = json.loads(request.content)["url"]
            if self.kind == "vllm-router":
                self.register(url)
                return httpx.Response(200, json={"success": True, "message": f"Successfully added worker: {url}"})
            self.pending.append(lambda: self.register(url))
            return httpx.Response(202, json={"status": "accepted", "worker_id": "new", "url": url})
        if path.startswith("/workers/") and request.method == "DELETE":
            name = unquote(path.removeprefix("/workers/"))
            url = next(u for u, w in self.workers.items() if name in (u, w["id"]))
            if self.kind == "vllm-router":
                del self.workers[url]
                return httpx.Response(200, json={"success": True, "message": f"Worker {url} removed successfully"})
            self.pending.append(lambda: self.workers.pop(url))
            return httpx.Response(202, json={"status": "accepted", "worker_id": name})
        return await self.proxy(request)

    async def proxy(self, request: httpx.Request) -> httpx.Response:
        """Like the real routers: any other route, admin included, goes to ONE healthy replica."""
        healthy = [u for u, w in self.workers.items() if w["is_healthy"]]
        key = request.headers.get("x-session-id") if self.kind == "vllm-router" else None
        key = key or (request.headers.get("x-smg-routing-key") if self.kind == "sglang-router" else None)
        index = hash(key) % len(healthy) if key else next(self.turn) % len(healthy)
        host = httpx.URL(healthy[index]).host
        forwarded = httpx.Request(
            request.method, request.url.copy_with(host=host), headers=request.headers, content=request.content
        )
        self.seen.append(forwarded)
        return await self.emulators[host].handle(forwarded)


@pytest.fixture
async def engines(tiny_models):
    made = {h: ReferenceEngine(tiny_models.dense, seed=i) for i, h in enumerate(["r0", "r1", "r2"])}
    yield made
    for e in made.values():
        await e.aclose()


def router(kind: str, engines: dict[str, ReferenceEngine], listed: tuple[str, ...] = ("r0", "r1")) -> Router:
    return Router(kind, {h: ReferenceEmulator(e) for h, e in engines.items()}, list(listed))


def config(tiny_models, kind: str = "vllm-router", **front: object) -> ClientConfig:
    return ClientConfig(
        backend="reference",
        base_url=ROUTER,
        model="tiny-qwen3",
        tokenizer=str(tiny_models.dense),
        front=FrontConfig(kind=kind, **front),  # type: ignore[arg-type]
        fleet=FleetPolicy(refresh_interval=None),
    )


async def within(awaitable: Awaitable[object]) -> object:
    async with asyncio.timeout(DEADLINE):
        return await awaitable


@pytest.mark.parametrize("kind", ["vllm-router", "sglang-router"])
async def test_pause_and_resume_reach_every_replica_directly_never_through_the_router(
    engines, tiny_models, kind
) -> None:
    r = router(kind, engines)
    async with Client(config(tiny_models, kind), transport=r.transport()) as client:
        assert await within(client.admin.pause(mode="keep")) == [True, True]
        assert [engines[h].state().paused for h in ("r0", "r1")] == [True, True]
        assert await client.admin.resume() == [True, True]
        assert [engines[h].state().paused for h in ("r0", "r1")] == [False, False]
    assert not [q for q in r.seen if q.url.host == "router" and q.url.path in ("/pause", "/resume")]


@pytest.mark.parametrize(("kind", "header"), [("vllm-router", "x-session-id"), ("sglang-router", "x-smg-routing-key")])
async def test_generation_goes_through_the_front_with_the_session_header_the_router_honours(
    engines, tiny_models, kind, header
) -> None:
    r = router(kind, engines)
    async with Client(config(tiny_models, kind), transport=r.transport()) as client:
        assert client.base_urls == [ROUTER]
        results = [await client.generate(prompt_ids=[1, 2, 3], sampling=SAMPLING, session="conv-7") for _ in range(4)]
    sent = [q for q in r.seen if q.url.host == "router" and q.url.path == "/generate"]
    assert len(sent) == 4 and all(q.headers.get(header) == "conv-7" for q in sent)
    assert all("x-session-id" not in q.headers for q in sent) or header == "x-session-id"
    replicas = {q.url.host for q in r.seen if q.url.host != "router" and q.url.path == "/generate"}
    assert len(replicas) == 1  # the router kept the session on one replica
    assert all(len(x.completion_ids) == 1 for x in results)


async def test_a_configured_session_header_replaces_the_routers_default(engines, tiny_models) -> None:
    r = router("vllm-router", engines)
    cfg = config(tiny_models, session_header="X-Affinity")
    async with Client(cfg, transport=r.transport()) as client:
        await client.generate(prompt_ids=[1, 2], sampling=SAMPLING, session="s")
    (sent,) = [q for q in r.seen if q.url.host == "router" and q.url.path == "/generate"]
    assert sent.headers["x-affinity"] == "s" and "x-session-id" not in sent.headers


async def test_weight_sync_and_lora_reach_every_replica_with_one_outcome_per_replica(
    engines, tiny_models, tmp_path
) -> None:
    from backends_testkit.tinymodel import write_perturbed_weights

    new = write_perturbed_weights(tiny_models.dense, tmp_path / "w1", seed=3, scale=0.1)
    r = router("vllm-router", engines)
    async with Client(config(tiny_models), transport=r.transport()) as client:
        report = await within(client.admin.weight_sync(path=str(new), version="v1"))
        await client.admin.load_lora(LoraAdapter(name="a", path=str(tiny_models.lora)))
        answered = await client.generate(prompt_ids=[1, 2], sampling=SAMPLING)
    assert [o.server for o in report.phases["update"]] == ["http://r0", "http://r1"]
    assert [engines[h].weight_version for h in ("r0", "r1")] == ["v1", "v1"]
    assert all("a" in engines[h].loras for h in ("r0", "r1"))
    assert answered.weight_version == "v1"


async def test_an_admin_call_through_a_front_that_cannot_list_its_replicas_is_refused_and_nothing_is_sent(
    engines, tiny_models
) -> None:
    r = router("vllm-router", engines)
    r.list_fails = True
    async with Client(config(tiny_models), transport=r.transport()) as client:
        with pytest.raises(FrontError, match=r"vllm-router front http://router: GET /workers failed") as info:
            await within(client.admin.pause())
    assert info.value.kind == "vllm-router" and info.value.front == ROUTER
    assert [engines[h].state().paused for h in ("r0", "r1")] == [False, False]
    assert not [q for q in r.seen if q.url.path == "/pause"]


async def test_a_front_listing_no_replica_it_routes_to_refuses_admin(engines, tiny_models) -> None:
    r = router("vllm-router", engines, listed=())
    async with Client(config(tiny_models), transport=r.transport()) as client:
        with pytest.raises(FrontError, match="lists no replica it routes to"):
            await client.admin.resume()


async def test_a_replica_the_router_starts_listing_is_caught_up_before_the_next_admin_operation_acts(
    engines, tiny_models, tmp_path
) -> None:
    from backends_testkit.tinymodel import write_perturbed_weights

    new = write_perturbed_weights(tiny_models.dense, tmp_path / "w2", seed=4, scale=0.1)
    r = router("vllm-router", engines)
    async with Client(config(tiny_models), transport=r.transport()) as client:
        await within(client.admin.weight_sync(path=str(new), version="v2"))
        r.register("http://r2")  # someone else registered a third replica with the router
        states = await client.admin.state()
        members = [(m.url, m.state) for m in client.fleet.members()]
    assert [s.weight_version for s in states] == ["v2", "v2", "v2"]
    assert engines["r2"].weight_version == "v2"
    assert members == [("http://r0", "serving"), ("http://r1", "serving"), ("http://r2", "serving")]


@pytest.mark.parametrize("kind", ["vllm-router", "sglang-router"])
async def test_fleet_add_catches_the_replica_up_first_and_registers_it_with_the_router_after(
    engines, tiny_models, tmp_path, kind
) -> None:
    from backends_testkit.tinymodel import write_perturbed_weights

    new = write_perturbed_weights(tiny_models.dense, tmp_path / "w3", seed=5, scale=0.1)
    r = router(kind, engines)
    async with Client(config(tiny_models, kind), transport=r.transport()) as client:
        await within(client.admin.weight_sync(path=str(new), version="v3"))
        member = await within(client.fleet.add("http://r2"))
        with pytest.raises(MembershipError, match="already"):
            await client.fleet.add("http://r2")
        assert "http://r2" in r.workers
        await within(client.fleet.remove("http://r0"))
        assert "http://r0" not in r.workers
        assert await client.admin.resume() == [True, True]
        members = [m.url for m in client.fleet.members()]
    assert member.state == "serving" and engines["r2"].weight_version == "v3"
    order = [(q.url.host, q.url.path, q.method) for q in r.seen]
    caught_up = order.index(("r2", "/update_weights", "POST"))
    registered = order.index(("router", "/workers", "POST"))
    assert caught_up < registered
    assert members == ["http://r1", "http://r2"]


async def test_a_static_front_takes_no_registration(engines, tiny_models) -> None:
    r = router("vllm-router", engines)
    cfg = config(tiny_models, "static", replicas=["http://r0", "http://r1"])
    async with Client(cfg, transport=r.transport()) as client:
        assert await client.admin.pause(mode="keep") == [True, True]
        await client.admin.resume()
        with pytest.raises(UnsupportedOperationError, match="register"):
            await client.fleet.add("http://r2")
    assert not [q for q in r.seen if q.url.path == "/workers"]


async def test_a_replica_reported_unhealthy_is_skipped_and_caught_up_when_it_is_back(
    engines, tiny_models, tmp_path
) -> None:
    from backends_testkit.tinymodel import write_perturbed_weights

    new = write_perturbed_weights(tiny_models.dense, tmp_path / "w4", seed=6, scale=0.1)
    r = router("vllm-router", engines)
    async with Client(config(tiny_models), transport=r.transport()) as client:
        await client.admin.resume()
        r.workers["http://r1"]["is_healthy"] = False
        await within(client.admin.weight_sync(path=str(new), version="v4"))
        assert engines["r1"].weight_version != "v4"
        assert [(m.url, m.state) for m in client.fleet.members()][1] == ("http://r1", "joining")
        r.workers["http://r1"]["is_healthy"] = True
        assert [s.weight_version for s in await client.admin.state()] == ["v4", "v4"]
    assert engines["r1"].weight_version == "v4"


async def test_fleet_state_reports_every_replica_and_flags_two_versions_serving_at_once(
    engines, tiny_models, tmp_path
) -> None:
    from backends_testkit.tinymodel import write_perturbed_weights

    new = write_perturbed_weights(tiny_models.dense, tmp_path / "w5", seed=7, scale=0.1)
    r = router("vllm-router", engines)
    async with Client(config(tiny_models), transport=r.transport()) as client:
        agreed = await client.admin.fleet_state()
        engines["r1"].load_weights(new, weight_version="rogue")  # behind the client's back
        split = await client.admin.fleet_state()
    assert [x.server for x in agreed] == ["http://r0", "http://r1"] and agreed.disagreement == []
    before = agreed[0].state.weight_version
    assert split.versions == {before: ["http://r0"], "rogue": ["http://r1"]}
    assert split.disagreement == [f"weight versions {before!r} on http://r0; 'rogue' on http://r1"]


async def test_a_catch_up_failure_fails_the_admin_operation_that_needed_it(engines, tiny_models, tmp_path) -> None:
    from backends_testkit.tinymodel import write_perturbed_weights

    new = write_perturbed_weights(tiny_models.dense, tmp_path / "w6", seed=8, scale=0.1)
    r = router("vllm-router", engines)
    original = r.emulators["r2"].handle

    async def refusing(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/update_weights":
            return httpx.Response(500, json={"error": "disk on fire"})
        return await original(request)

    r.emulators["r2"].handle = refusing  # type: ignore[method-assign]
    async with Client(config(tiny_models), transport=r.transport()) as client:
        await within(client.admin.weight_sync(path=str(new), version="v6"))
        r.register("http://r2")
        with pytest.raises(AdminError, match="disk on fire"):
            await client.admin.pause()
        state = await client.admin.fleet_state()  # reports instead of raising
    assert [(x.server, x.member) for x in state] == [
        ("http://r0", "serving"),
        ("http://r1", "serving"),
        ("http://r2", "joining"),
    ]
    assert [engines[h].state().paused for h in ("r0", "r1")] == [False, False]


def test_an_unknown_front_kind_is_a_config_error_naming_the_installed_ones(tiny_models) -> None:
    cfg = config(tiny_models, "vllm-routr")
    with pytest.raises(ConfigError, match=r"unknown front kind 'vllm-routr'.*did you mean 'vllm-router'.*\$\.front"):
        Client(cfg)


@pytest.mark.parametrize(
    ("front", "base_url", "message"),
    [
        ({"kind": "static"}, "http://r", "needs the replicas' URLs"),
        ({"kind": "vllm-router", "replicas": ["http://a"]}, "http://r", "front.replicas is for kind 'static'"),
        ({"kind": "vllm-router"}, ["http://r", "http://s"], "base_url is the router's one URL"),
        ({"kind": "vllm-router", "workers_url": "nope"}, "http://r", "'nope' is not an http"),
        ({"kind": "vllm-router", "session_header": "a b"}, "http://r", "must be an HTTP header name"),
    ],
)
def test_front_config_errors_name_the_field(front, base_url, message) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        ClientConfig.from_mapping({"backend": "reference", "base_url": base_url, "front": front})
    assert "$" in str(info.value)


async def test_admin_outcomes_before_the_replicas_are_listed_refuse_instead_of_succeeding_on_none(
    engines, tiny_models
) -> None:
    r = router("vllm-router", engines)
    async with Client(config(tiny_models), transport=r.transport()) as client:
        with pytest.raises(MembershipError, match="no server serves"):
            await client.admin.outcomes().pause("keep", clear_cache=False)
        await client.fleet.refresh()
        assert [o.ok for o in await client.admin.outcomes().pause("keep", clear_cache=False)] == [True, True]
        await client.admin.resume()


async def test_fleet_add_right_after_the_client_opens_is_not_undone_by_the_first_refresh(engines, tiny_models) -> None:
    """The refresh the client starts when it opens reads the router's list before the new replica is registered;
    applied after, that stale list must not take out the replica ``add`` is bringing in."""
    r = router("sglang-router", engines)
    refreshing = attrs.evolve(config(tiny_models, "sglang-router"), fleet=FleetPolicy())  # refreshes from the start
    async with Client(refreshing, transport=r.transport()) as client:
        member = await within(client.fleet.add("http://r2"))
        members = {m.url: m.state for m in client.fleet.members()}
    assert member.state == "serving"
    assert sorted(members) == ["http://r0", "http://r1", "http://r2"] and members["http://r2"] == "serving"


def kill(r: Router, host: str) -> None:
    """``host`` stops listening: connections to it are refused (the router still lists it healthy)."""

    async def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    r.emulators[host].handle = refused  # type: ignore[method-assign]


@pytest.mark.parametrize("kind", ["vllm-router", "sglang-router"])
async def test_a_dead_replica_is_deregistered_and_the_admin_operation_runs_over_the_others(
    engines, tiny_models, tmp_path, kind
) -> None:
    from backends_testkit.tinymodel import write_perturbed_weights

    new = write_perturbed_weights(tiny_models.dense, tmp_path / "w7", seed=9, scale=0.1)
    r = router(kind, engines)
    async with Client(config(tiny_models, kind), transport=r.transport()) as client:
        await client.admin.resume()
        kill(r, "r1")
        report = await within(client.admin.weight_sync(path=str(new), version="v7"))
        members = [(m.url, m.state) for m in client.fleet.members()]
    assert [o.server for o in report.phases["update"]] == ["http://r0"] and report.ok
    assert "http://r1" not in r.workers  # the router no longer sends it requests
    assert members == [("http://r0", "serving")]
    assert engines["r0"].weight_version == "v7"


async def test_without_eviction_a_dead_replica_is_skipped_and_caught_up_once_it_answers(
    engines, tiny_models, tmp_path
) -> None:
    from backends_testkit.tinymodel import write_perturbed_weights

    new = write_perturbed_weights(tiny_models.dense, tmp_path / "w8", seed=10, scale=0.1)
    r = router("vllm-router", engines)
    alive = r.emulators["r1"].handle
    async with Client(config(tiny_models, evict_unreachable=False), transport=r.transport()) as client:
        await client.admin.resume()
        kill(r, "r1")
        await within(client.admin.weight_sync(path=str(new), version="v8"))
        assert "http://r1" in r.workers
        assert [(m.url, m.state) for m in client.fleet.members()] == [
            ("http://r0", "serving"),
            ("http://r1", "joining"),
        ]
        r.emulators["r1"].handle = alive  # type: ignore[method-assign]
        assert [s.weight_version for s in await client.admin.state()] == ["v8", "v8"]
    assert engines["r1"].weight_version == "v8"


def test_the_sync_client_behind_a_front_registers_through_the_router(engines, tiny_models) -> None:
    from backends_core import SyncClient

    r = router("sglang-router", engines)
    with SyncClient(config(tiny_models, "sglang-router"), transport=r.transport()) as client:
        assert client.admin.pause(mode="keep") == [True, True]
        client.admin.resume()
        client.fleet.add("http://r2")
        assert [m.url for m in client.fleet.members()] == ["http://r0", "http://r1", "http://r2"]
        assert len(client.admin.fleet_state()) == 3
    assert "http://r2" in r.workers


async def test_a_refresh_while_fleet_add_catches_up_keeps_the_replica_being_added(engines, tiny_models) -> None:
    """A refresh reading the router's list during ``fleet.add``'s catch-up (the replica is registered only after
    it) does not take the replica out: ``add`` returns it serving, and it stays a member."""
    r = router("vllm-router", engines)
    original = r.emulators["r2"].handle
    catching_up, release = asyncio.Event(), asyncio.Event()

    async def held(request: httpx.Request) -> httpx.Response:
        catching_up.set()
        await release.wait()
        return await original(request)

    r.emulators["r2"].handle = held  # type: ignore[method-assign]
    async with Client(config(tiny_models), transport=r.transport()) as client:
        await client.admin.resume()
        adding = asyncio.create_task(client.fleet.add("http://r2"))
        await within(catching_up.wait())
        await within(client.fleet.refresh())  # the router does not list r2 yet
        release.set()
        member = await within(adding)
        members = [(m.url, m.state) for m in client.fleet.members()]
        assert await client.admin.resume() == [True, True, True]
    assert member.state == "serving"
    assert members == [("http://r0", "serving"), ("http://r1", "serving"), ("http://r2", "serving")]


async def test_a_worker_list_read_before_fleet_remove_does_not_bring_the_replica_back(engines, tiny_models) -> None:
    """A refresh whose read of the router's list was answered before ``fleet.remove`` deregistered a replica, and
    is applied after, does not make the removed replica a member again."""
    r = router("vllm-router", engines, listed=("r0", "r1", "r2"))
    route = r.route
    answered, release = asyncio.Event(), asyncio.Event()
    hold = False

    async def held(request: httpx.Request) -> httpx.Response:
        response = await route(request)
        if hold and request.url.path == "/workers" and request.method == "GET":
            answered.set()
            await release.wait()
        return response

    r.route = held  # type: ignore[method-assign]
    async with Client(config(tiny_models), transport=r.transport()) as client:
        await client.admin.resume()
        hold = True
        refreshing = asyncio.create_task(client.fleet.refresh())
        await within(answered.wait())  # the list still has r2
        hold = False
        await within(client.fleet.remove("http://r2"))
        release.set()
        await within(refreshing)
        members = [m.url for m in client.fleet.members()]
        assert await client.admin.resume() == [True, True]
    assert members == ["http://r0", "http://r1"]
