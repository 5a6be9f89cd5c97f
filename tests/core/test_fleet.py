"""Fleet guarantees: balancing, stickiness, failover, salting, deadlines, weight sync with resume in finally."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import httpx
import pytest

from backends_core import (
    AdminError,
    AdminPolicy,
    Client,
    ClientConfig,
    DistributedGroup,
    InvalidRequestError,
    LoraAdapter,
    NetworkError,
    RequestTimeout,
    SamplingParams,
    ServerStatusError,
    StaleServerError,
    TensorSpec,
    WeightVersionMismatch,
)
from backends_core.balancer import Balancer
from backends_testkit.engine import ReferenceEngine
from backends_testkit.reference.emulator import ReferenceEmulator

Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]
HOSTS = ["s0", "s1", "s2"]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# -- the balancer on its own ----------------------------------------------------------------------------


def test_requests_go_to_the_least_loaded_server() -> None:
    b = Balancer(["a", "b", "c"])
    b.acquire(0)
    b.acquire(0)
    b.acquire(2)
    assert b.pick() == 1


def test_a_session_sticks_until_its_server_is_overloaded_then_moves_once() -> None:
    b = Balancer(["a", "b"], slack=2)
    home = b.pick(session="conv-1")
    for _ in range(2):
        b.acquire(home)
        assert b.pick(session="conv-1") == home  # within slack: stays for its prefix cache
    b.acquire(home)
    moved = b.pick(session="conv-1")
    assert moved != home
    assert b.session_server("conv-1") == moved


def test_an_unreachable_server_is_taken_out_and_probed_after_the_cooldown() -> None:
    clock = Clock()
    b = Balancer(["a", "b"], cooldown=5.0, clock=clock)
    b.acquire(0)
    b.release(0, ok=False, reachable=False)
    assert b.healthy() == [False, True]
    assert {b.pick() for _ in range(4)} == {1}
    clock.now += 5.0
    assert b.healthy() == [True, True]
    b.acquire(0)
    b.release(0, ok=True)
    assert b.load[0].failures == 0 and b.load[0].in_flight == 0


def test_when_every_server_is_down_the_one_back_soonest_is_probed() -> None:
    clock = Clock()
    b = Balancer(["a", "b"], cooldown=5.0, clock=clock)
    b.acquire(1)
    b.release(1, ok=False, reachable=False)
    clock.now += 1
    b.acquire(0)
    b.release(0, ok=False, reachable=False)
    assert b.pick() == 1


# -- a client over a fleet of emulated servers ------------------------------------------------------------


@pytest.fixture
async def fleet(tiny_models):
    engines = [ReferenceEngine(tiny_models.dense, seed=i) for i in range(len(HOSTS))]
    emulators = {host: ReferenceEmulator(e) for host, e in zip(HOSTS, engines, strict=True)}
    yield emulators
    for e in engines:
        await e.aclose()


def routed(handlers: dict[str, Handler], seen: list[httpx.Request] | None = None) -> httpx.MockTransport:
    async def handle(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(request)
        return await handlers[request.url.host](request)

    return httpx.MockTransport(handle)


def config(tiny_models, **kw) -> ClientConfig:
    return ClientConfig(
        backend="reference",
        base_url=[f"http://{h}" for h in HOSTS],
        model="tiny-qwen3",
        tokenizer=str(tiny_models.dense),
        **kw,
    )


async def test_a_refused_connection_fails_over_and_the_server_is_taken_out(fleet, tiny_models) -> None:
    calls: list[str] = []

    async def refuse(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.host)
        raise httpx.ConnectError("connection refused", request=request)

    handlers = {h: e.handle for h, e in fleet.items()} | {"s0": refuse}
    async with Client(config(tiny_models), transport=routed(handlers)) as client:
        results = [await client.generate(prompt_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=2)) for _ in range(4)]
    assert all(r.server in ("http://s1", "http://s2") for r in results)
    assert len(calls) == 1  # out for the cooldown after the first refusal
    assert client.balancer.healthy() == [False, True, True]
    assert [load.in_flight for load in client.balancer.load] == [0, 0, 0]


async def test_a_request_that_may_have_reached_the_engine_is_reported_not_resent(fleet, tiny_models) -> None:
    calls: list[str] = []

    async def reset_mid_request(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.host)
        raise httpx.ReadError("connection reset by peer", request=request)

    handlers = {h: reset_mid_request for h in HOSTS}
    async with Client(config(tiny_models), transport=routed(handlers)) as client:
        with pytest.raises(NetworkError) as info:
            await client.generate(prompt_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=16))
    assert info.value.maybe_processed
    assert len(calls) == 1


async def test_sessions_stick_and_carry_the_session_header(fleet, tiny_models) -> None:
    seen: list[httpx.Request] = []
    async with Client(config(tiny_models), transport=routed({h: e.handle for h, e in fleet.items()}, seen)) as client:
        conv = client.conversation()
        sampling = SamplingParams(max_tokens=3, seed=1)
        turns = [await conv.send([{"role": "user", "content": "hi"}], sampling=sampling)]
        for text in ("again", "more"):
            turns.append(await conv.send([{"role": "user", "content": text}], sampling=sampling))
        lone = await client.generate(prompt_ids=[5, 6], session="trajectory-7", sampling=SamplingParams(max_tokens=16))
    assert len({t.server for t in turns}) == 1
    generate_calls = [r for r in seen if r.url.path == "/generate"]
    assert {r.headers["x-session-id"] for r in generate_calls[:3]} == {conv.session}
    assert generate_calls[3].headers["x-session-id"] == "trajectory-7"
    assert lone.server is not None


def salts(seen: list[httpx.Request]) -> list[str | None]:
    return [json.loads(r.content)["cache_salt"] for r in seen if r.url.path == "/generate"]


async def test_cache_salt_follows_the_weight_version_this_client_set(fleet, tiny_models, tmp_path) -> None:
    from backends_testkit.tinymodel import write_perturbed_weights

    seen: list[httpx.Request] = []
    async with Client(config(tiny_models), transport=routed({h: e.handle for h, e in fleet.items()}, seen)) as client:
        await client.generate(prompt_ids=[1, 2], server=0, sampling=SamplingParams(max_tokens=16))
        new = write_perturbed_weights(tiny_models.dense, tmp_path / "w1", seed=3, scale=0.1)
        await client.admin.update_weights(str(new), version="step-9")
        await client.generate(prompt_ids=[1, 2], server=0, sampling=SamplingParams(max_tokens=16))
        await client.generate(prompt_ids=[1, 2], cache_salt="mine", sampling=SamplingParams(max_tokens=16))
    assert salts(seen) == [None, "weights:step-9", "mine"]


async def test_a_separate_rollout_client_salts_with_the_version_the_server_reports(
    fleet, tiny_models, tmp_path
) -> None:
    """Trainer and rollout run in separate processes: the rollout client never ran the update itself."""
    from backends_testkit.tinymodel import write_perturbed_weights

    transport = routed({h: e.handle for h, e in fleet.items()})
    seen: list[httpx.Request] = []
    new = write_perturbed_weights(tiny_models.dense, tmp_path / "w1", seed=3, scale=0.1)
    async with (
        Client(config(tiny_models), transport=transport) as trainer,
        Client(config(tiny_models), transport=routed({h: e.handle for h, e in fleet.items()}, seen)) as rollout,
    ):
        await rollout.generate(
            prompt_ids=[1, 2], server=0, sampling=SamplingParams(max_tokens=16)
        )  # its answer reports the start-up version
        await rollout.generate(prompt_ids=[1, 2], server=0, sampling=SamplingParams(max_tokens=16))
        await trainer.admin.weight_sync(path=str(new), version="v1", mode="keep")
        await rollout.generate(
            prompt_ids=[1, 2], server=0, sampling=SamplingParams(max_tokens=16)
        )  # answered on v1: a version-mismatch answer
        await rollout.generate(prompt_ids=[1, 2], server=0, sampling=SamplingParams(max_tokens=16))
        await rollout.admin.state()  # a state check refreshes every server
        await rollout.generate(prompt_ids=[1, 2], server=1, sampling=SamplingParams(max_tokens=16))
    start = salts(seen)[1]
    assert start is not None and start.startswith("weights:") and start != "weights:v1"
    assert salts(seen) == [None, start, start, "weights:v1", "weights:v1"]
    assert rollout.weight_version is None  # it set nothing itself


async def test_a_hot_swapped_adapter_never_reuses_prefix_blocks_of_the_old_one(fleet, tiny_models, tmp_path) -> None:
    """vLLM #42125: engines key prefix-cache blocks by adapter name, which a hot swap keeps."""
    seen: list[httpx.Request] = []
    async with Client(config(tiny_models), transport=routed({h: e.handle for h, e in fleet.items()}, seen)) as client:
        await client.admin.load_lora(LoraAdapter(name="a", path=str(tiny_models.lora)))
        await client.generate(prompt_ids=[1, 2], lora="a", server=0, sampling=SamplingParams(max_tokens=16))
        await client.admin.load_lora(LoraAdapter(name="a", path=str(tiny_models.lora), replace=True))
        await client.generate(prompt_ids=[1, 2], lora="a", server=0, sampling=SamplingParams(max_tokens=16))
        await client.generate(prompt_ids=[1, 2], server=0, sampling=SamplingParams(max_tokens=16))
        await client.admin.unload_lora("a")
    paths = [r.url.path for r in seen]
    swap = paths.index("/lora/load", paths.index("/lora/load") + len(HOSTS))
    assert sorted(r.url.host for r in seen[swap:] if r.url.path == "/flush_cache") == HOSTS
    start = fleet["s0"].engine.weight_version  # reported by the first answer
    assert salts(seen) == [None, f"weights:{start}|lora:a#1", f"weights:{start}"]


async def test_a_server_back_with_other_weights_gets_no_requests_until_it_is_caught_up(
    fleet, tiny_models, tmp_path
) -> None:
    """A server that went down mid-run comes back on its start-up weights: it must not serve them silently."""
    from backends_testkit.tinymodel import write_perturbed_weights

    down = {"s1": False}

    async def flaky(request: httpx.Request) -> httpx.Response:
        if down["s1"]:
            raise httpx.ConnectError("connection refused", request=request)
        return await fleet["s1"].handle(request)

    handlers = {h: e.handle for h, e in fleet.items()} | {"s1": flaky}
    seen: list[httpx.Request] = []
    clock = Clock()
    new = write_perturbed_weights(tiny_models.dense, tmp_path / "w6", seed=8, scale=0.1)
    async with Client(config(tiny_models), transport=routed(handlers, seen)) as client:
        client.balancer._clock = clock
        await client.admin.update_weights(str(new), version="v6")
        down["s1"] = True
        await client.generate(
            prompt_ids=[1, 2], server=None, session=None, sampling=SamplingParams(max_tokens=16)
        )  # s1 refuses if picked
        with pytest.raises(NetworkError):
            await client.generate(prompt_ids=[1, 2], server=1, sampling=SamplingParams(max_tokens=16))
        fleet["s1"].engine.load_weights(str(tiny_models.dense), weight_version="default")  # restarted
        down["s1"] = False
        clock.now += 10  # the cooldown is over
        with pytest.raises(StaleServerError, match="'default' but the fleet is on 'v6'"):
            await client.generate(prompt_ids=[1, 2], server=1, sampling=SamplingParams(max_tokens=16))
        seen.clear()
        results = [await client.generate(prompt_ids=[1, 2], sampling=SamplingParams(max_tokens=16)) for _ in range(6)]
        await client.admin.state()  # a state check reads its version but does not vouch for it
        clock.now += 10  # out of the cooldown again: many requests at once, one version check
        results += await asyncio.gather(
            *(client.generate(prompt_ids=[1, 2], sampling=SamplingParams(max_tokens=16)) for _ in range(6))
        )
        assert {r.server for r in results} == {"http://s0", "http://s2"}
        assert not [r for r in seen if r.url.host == "s1" and r.url.path == "/generate"]
        assert client.balancer.healthy() == [True, False, True]
        await client.admin.outcomes([client.servers[1]]).update_weights(str(new), version="v6")
        clock.now += 10
        caught_up = await client.generate(prompt_ids=[1, 2], server=1, sampling=SamplingParams(max_tokens=16))
    assert caught_up.server == "http://s1" and caught_up.weight_version == "v6"


async def test_weight_sync_pauses_updates_flushes_resumes_and_verifies(fleet, tiny_models, tmp_path) -> None:
    from backends_testkit.tinymodel import write_perturbed_weights

    new = write_perturbed_weights(tiny_models.dense, tmp_path / "w2", seed=4, scale=0.1)
    async with Client(config(tiny_models), transport=routed({h: e.handle for h, e in fleet.items()})) as client:
        report = await client.admin.weight_sync(path=str(new), version="v2", mode="wait")
        states = await client.admin.state()
    assert report.ok and list(report.phases) == ["pause", "update", "flush", "resume", "verify"]
    assert all(s.weight_version == "v2" and s.paused is False for s in states)
    assert client.weight_version == "v2"


async def test_weight_sync_resumes_every_paused_server_when_an_update_fails(fleet, tiny_models, tmp_path) -> None:
    from backends_testkit.tinymodel import write_perturbed_weights

    new = write_perturbed_weights(tiny_models.dense, tmp_path / "w3", seed=5, scale=0.1)

    async def broken_update(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/update_weights":
            return httpx.Response(500, json={"error": "disk on fire"})
        return await fleet["s1"].handle(request)

    handlers = {h: e.handle for h, e in fleet.items()} | {"s1": broken_update}
    async with Client(config(tiny_models), transport=routed(handlers)) as client:
        with pytest.raises(AdminError, match="disk on fire") as info:
            await client.admin.weight_sync(path=str(new), version="v3")
        states = await client.admin.state()
    assert "weight_sync: update" in str(info.value)
    assert all(s.paused is False for s in states)  # resumed in finally, everywhere
    assert client.weight_version is None  # a failed sync never re-salts


async def test_a_silent_server_hits_its_deadline_and_the_others_still_report(fleet, tiny_models) -> None:
    async def silent(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/state":
            await asyncio.sleep(30)
        return await fleet["s2"].handle(request)

    handlers = {h: e.handle for h, e in fleet.items()} | {"s2": silent}
    cfg = config(tiny_models, admin=AdminPolicy(deadlines={"state": 0.2}, retries=0))
    async with Client(cfg, transport=routed(handlers)) as client:
        with pytest.raises(AdminError) as info:
            await client.admin.state()
        reports = await client.admin.fleet_state()
    outcomes = info.value.results
    assert [o.ok for o in outcomes] == [True, True, False]
    assert isinstance(outcomes[2].error, RequestTimeout) and "0.2 s deadline" in str(outcomes[2].error)
    assert outcomes[2].duration_s < 5
    assert [r.reachable for r in reports] == [True, True, True]
    assert reports[2].error is not None and reports[0].state is not None


async def test_fleet_state_reports_an_unreachable_server(fleet, tiny_models) -> None:
    async def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    handlers = {h: e.handle for h, e in fleet.items()} | {"s1": down}
    cfg = config(tiny_models, admin=AdminPolicy(retries=1, backoff=0))
    async with Client(cfg, transport=routed(handlers)) as client:
        reports = await client.admin.fleet_state()
    assert [r.reachable for r in reports] == [True, False, True]
    assert isinstance(reports[1].error, NetworkError)
    assert reports[0].ready is True and reports[0].state is not None


async def test_a_generation_a_gateway_answered_502_or_504_reaches_the_engine_once(fleet, tiny_models) -> None:
    """The gateway's upstream may have run it: sampling it again would put two samples where one was asked."""
    calls: list[str] = []

    async def gateway(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        await fleet["s0"].handle(request)  # the engine behind the gateway runs it
        return httpx.Response(504, json={"error": "upstream timed out"})

    handlers = dict.fromkeys(HOSTS, gateway)
    async with Client(config(tiny_models), transport=routed(handlers)) as client:
        with pytest.raises(ServerStatusError) as info:
            await client.generate(prompt_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=2))
    assert info.value.status_code == 504 and info.value.maybe_processed
    assert calls == ["/generate"]


# -- bad admin arguments never leave the client -----------------------------------------------------------

BLANK = ["", "   ", "\t\n"]


@pytest.mark.parametrize("blank", BLANK)
async def test_blank_admin_arguments_are_refused_before_anything_is_sent(fleet, tiny_models, blank) -> None:
    seen: list[httpx.Request] = []
    async with Client(config(tiny_models), transport=routed({h: e.handle for h, e in fleet.items()}, seen)) as client:
        calls: list[Callable[[], Awaitable[object]]] = [
            lambda: client.admin.update_weights(blank),
            lambda: client.admin.update_weights(str(tiny_models.dense), version=blank),
            lambda: client.admin.weight_sync(path=blank, version="v1"),
            lambda: client.admin.weight_sync(path=str(tiny_models.dense), version=blank),
            lambda: client.admin.weight_sync(
                group_name=blank, tensors=[TensorSpec(name="w", dtype="f", shape=[1])], version="v1"
            ),
            lambda: client.admin.unload_lora(blank),
            lambda: client.admin.abort([blank]),
        ]
        for call in calls:
            with pytest.raises(InvalidRequestError):
                await call()
        for make in (
            lambda: LoraAdapter(name=blank, path=str(tiny_models.lora)),
            lambda: LoraAdapter(name="a", path=blank),
            lambda: DistributedGroup(master_address="h", master_port=1, world_size=2, rank_offset=1, group_name=blank),
            lambda: TensorSpec(name=blank, dtype="f", shape=[1]),
        ):
            with pytest.raises(InvalidRequestError):
                make()
    assert seen == []
    assert client.weight_version is None


# -- every AdminError names the servers concerned ---------------------------------------------------------


async def test_a_pause_that_fails_somewhere_names_the_servers_it_left_paused(fleet, tiny_models) -> None:
    async def refuses_pause(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/pause":
            return httpx.Response(400, json={"error": "cannot pause now"})
        return await fleet["s1"].handle(request)

    handlers = {h: e.handle for h, e in fleet.items()} | {"s1": refuses_pause}
    async with Client(config(tiny_models), transport=routed(handlers)) as client:
        try:
            with pytest.raises(AdminError) as info:
                await client.admin.pause("wait")
            states = await client.admin.state()
        finally:
            await client.admin.outcomes().resume()
    err = info.value
    assert [s.paused for s in states] == [True, False, True]
    assert err.failed == ["http://s1"] and err.succeeded == ["http://s0", "http://s2"]
    assert "left paused: http://s0, http://s2" in str(err)


def test_the_cli_names_the_servers_a_failed_pause_left_paused(capsys) -> None:
    from backends_core.cli import EXIT_FAILED, main
    from backends_core.fleet import ServerOutcome

    error = AdminError(
        "admin_pause",
        [
            ServerOutcome(server="http://a", value=True),
            ServerOutcome(server="http://b", error=NetworkError("refused", method="POST", url="http://b/pause")),
        ],
        state="left paused: http://a (resume them with admin.resume())",
    )

    class Broken:
        def __call__(self, args: object) -> int:
            raise error

    import argparse
    from unittest import mock

    with mock.patch("backends_core.cli.build_parser") as parser:
        parser.return_value.parse_args.return_value = argparse.Namespace(func=Broken())
        assert main(["pause"]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert "left paused: http://a" in err
    assert "http://a: ok" in err and "http://b: FAILED: NetworkError" in err


async def test_a_weight_sync_whose_version_is_not_visible_names_the_server_and_keeps_its_phases(
    fleet, tiny_models, tmp_path
) -> None:
    from backends_testkit.tinymodel import write_perturbed_weights

    new = write_perturbed_weights(tiny_models.dense, tmp_path / "w4", seed=6, scale=0.1)

    async def stale_state(request: httpx.Request) -> httpx.Response:
        response = await fleet["s2"].handle(request)
        if request.url.path == "/state":
            body = json.loads(response.content) | {"weight_version": "old"}
            return httpx.Response(200, json=body)
        return response

    handlers = {h: e.handle for h, e in fleet.items()} | {"s2": stale_state}
    async with Client(config(tiny_models), transport=routed(handlers)) as client:
        with pytest.raises(AdminError) as info:
            await client.admin.weight_sync(path=str(new), version="v4")
    err = info.value
    assert err.failed == ["http://s2"]
    assert "http://s2" in str(err) and "'old'" in str(err) and "failed on 1 of 3" in str(err)
    assert isinstance(err.results[2].error, WeightVersionMismatch)
    assert list(err.phases) == ["pause", "update", "flush", "resume", "verify"]
    assert all(o.ok for o in err.phases["resume"])


async def test_a_weight_sync_whose_update_fails_somewhere_states_the_mixed_fleet(fleet, tiny_models, tmp_path) -> None:
    from backends_testkit.tinymodel import write_perturbed_weights

    new = write_perturbed_weights(tiny_models.dense, tmp_path / "w5", seed=7, scale=0.1)

    async def broken_update(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/update_weights":
            return httpx.Response(500, json={"error": "disk on fire"})
        return await fleet["s1"].handle(request)

    handlers = {h: e.handle for h, e in fleet.items()} | {"s1": broken_update}
    async with Client(config(tiny_models), transport=routed(handlers)) as client:
        with pytest.raises(AdminError) as info:
            await client.admin.weight_sync(path=str(new), version="v5")
    err = info.value
    assert err.failed == ["http://s1"] and err.succeeded == ["http://s0", "http://s2"]
    assert "mixed weights: http://s0, http://s2 switched to" in str(err) and "no version was recorded" in str(err)
    assert list(err.phases) == ["pause", "update", "resume"]
    assert client.weight_version is None


async def test_after_an_update_that_failed_on_one_server_that_server_is_kept_out_until_it_matches(
    fleet, tiny_models, tmp_path
) -> None:
    """No fleet version was recorded (the update failed somewhere), but the others agree on the new one."""
    from backends_testkit.tinymodel import write_perturbed_weights

    new = write_perturbed_weights(tiny_models.dense, tmp_path / "w7", seed=9, scale=0.1)

    disk_full = [True]

    async def refuses_update(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/update_weights" and disk_full[0]:
            return httpx.Response(507, json={"error": "disk full"})
        return await fleet["s1"].handle(request)

    handlers = {h: e.handle for h, e in fleet.items()} | {"s1": refuses_update}
    async with Client(config(tiny_models), transport=routed(handlers)) as client:
        with pytest.raises(AdminError, match="mixed weights"):
            await client.admin.update_weights(str(new), version="v7")
        assert client.weight_version is None
        with pytest.raises(StaleServerError, match=r"http://s1 serves weight version .* but the fleet is on 'v7'"):
            await client.generate(prompt_ids=[1, 2], server=1, sampling=SamplingParams(max_tokens=16))
        results = [await client.generate(prompt_ids=[1, 2], sampling=SamplingParams(max_tokens=16)) for _ in range(4)]
        assert {r.server for r in results} == {"http://s0", "http://s2"}
        disk_full[0] = False
        await client.admin.update_weights(str(new), version="v7")  # retried: now everywhere
        assert (
            await client.generate(prompt_ids=[1, 2], server=1, sampling=SamplingParams(max_tokens=16))
        ).weight_version == "v7"


async def test_weight_sync_updates_every_server_before_any_flushes_and_each_resumes_after_its_own_flush(
    fleet, tiny_models, tmp_path
) -> None:
    from backends_testkit.tinymodel import write_perturbed_weights

    new = write_perturbed_weights(tiny_models.dense, tmp_path / "w7", seed=9, scale=0.1)
    seen: list[httpx.Request] = []
    async with Client(config(tiny_models), transport=routed({h: e.handle for h, e in fleet.items()}, seen)) as client:
        report = await client.admin.weight_sync(path=str(new), version="v7")
    steps = [(r.url.host, r.url.path) for r in seen]
    order = {step: i for i, step in enumerate(steps)}
    last_update = max(order[h, "/update_weights"] for h in HOSTS)
    last_pause = max(order[h, "/pause"] for h in HOSTS)
    for h in HOSTS:
        assert last_pause < order[h, "/update_weights"]  # nothing is updated before every server paused
        assert last_update < order[h, "/flush_cache"] < order[h, "/resume"] < order[h, "/state"]
        assert [p for host, p in steps if host == h] == [
            "/pause",
            "/update_weights",
            "/flush_cache",
            "/resume",
            "/state",
        ]
    assert list(report.phases) == ["pause", "update", "flush", "resume", "verify"]
    assert [o.server for o in report.phases["verify"]] == [f"http://{h}" for h in HOSTS]
    assert all(o.value.weight_version == "v7" and o.value.paused is False for o in report.phases["verify"])


async def test_a_weight_sync_whose_flush_fails_somewhere_resumes_every_server_and_checks_nothing(
    fleet, tiny_models, tmp_path
) -> None:
    from backends_testkit.tinymodel import write_perturbed_weights

    new = write_perturbed_weights(tiny_models.dense, tmp_path / "w8", seed=10, scale=0.1)

    async def broken_flush(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/flush_cache":
            return httpx.Response(400, json={"error": "cache locked"})
        return await fleet["s1"].handle(request)

    handlers = {h: e.handle for h, e in fleet.items()} | {"s1": broken_flush}
    async with Client(config(tiny_models), transport=routed(handlers)) as client:
        with pytest.raises(AdminError, match="cache locked") as info:
            await client.admin.weight_sync(path=str(new), version="v8")
        states = await client.admin.state()
    err = info.value
    assert "weight_sync: flush_cache" in str(err) and err.failed == ["http://s1"]
    assert list(err.phases) == ["pause", "update", "flush", "resume"]
    assert all(o.ok for o in err.phases["resume"]) and all(s.paused is False for s in states)
    assert all(s.weight_version == "v8" for s in states) and client.weight_version == "v8"


async def test_a_weight_sync_cancelled_after_the_update_still_resumes_every_server(
    fleet, tiny_models, tmp_path
) -> None:
    from backends_testkit.tinymodel import write_perturbed_weights

    new = write_perturbed_weights(tiny_models.dense, tmp_path / "w9", seed=11, scale=0.1)
    flushing = asyncio.Event()
    resumed: list[str] = []

    def handler(host: str) -> Handler:
        async def handle(request: httpx.Request) -> httpx.Response:
            if request.url.path == "/flush_cache" and host == "s2":
                flushing.set()
                await asyncio.sleep(30)  # cancelled while this server flushes; the others may be resumed already
            if request.url.path == "/resume":
                resumed.append(host)
            return await fleet[host].handle(request)

        return handle

    async with Client(config(tiny_models), transport=routed({h: handler(h) for h in HOSTS})) as client:
        task = asyncio.ensure_future(client.admin.weight_sync(path=str(new), version="v9"))
        await flushing.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        states = await client.admin.state()
    assert sorted(resumed) == HOSTS  # each server resumed once: by its own sequence or by the finally
    assert all(s.paused is False for s in states)
