"""``weight_sync`` over a transfer group with the trainer's half (``sender``) and its ``plan``: the sender runs
while every server receives; whichever side fails abandons the other at once, every server's outcome says why,
and every paused server is resumed. Two vLLM emulators (they follow the protocol and move no tensors here)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from backends_core import AdminError, Client, ClientConfig, DistributedGroup, InvalidRequestError, TensorSpec
from backends_core.errors import ServerStatusError, TransferError
from backends_testkit.engine import ReferenceEngine
from backends_vllm_testing import VllmEmulator

HOSTS = ("s0", "s1")
TENSORS = [TensorSpec(name="model.norm.weight", dtype="float32", shape=(64,))]
GROUP = DistributedGroup(master_address="127.0.0.1", master_port=29500, world_size=3, rank_offset=1)
DEADLINE_S = 30.0
"""A hang guard: every wait below ends well before it."""

Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]


class Fleet:
    """Two emulators behind one transport; ``override[(host, path)]`` answers a request instead."""

    def __init__(self, emulators: dict[str, VllmEmulator]) -> None:
        self.emulators = emulators
        self.override: dict[tuple[str, str], Handler] = {}
        self.sent: list[httpx.Request] = []

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(request)
        override = self.override.get((request.url.host, request.url.path))
        if override is not None:
            return await override(request)
        return await self.emulators[request.url.host].handle(request)

    def paused(self) -> list[bool]:
        return [e.engine.state().paused for e in self.emulators.values()]


@pytest.fixture
async def fleet(tiny_models) -> AsyncIterator[Fleet]:
    engines = [ReferenceEngine(tiny_models.dense, seed=i) for i in range(len(HOSTS))]
    try:
        yield Fleet({host: VllmEmulator(e) for host, e in zip(HOSTS, engines, strict=True)})
    finally:
        for e in engines:
            await e.aclose()


@pytest.fixture
async def client(fleet: Fleet) -> AsyncIterator[Client]:
    config = ClientConfig(backend="vllm", base_url=[f"http://{h}" for h in HOSTS], model="tiny-qwen3")
    async with Client(config, transport=httpx.MockTransport(fleet.handle)) as c:
        assert await c.admin.init_weight_transfer(GROUP) == [True, True]
        fleet.sent.clear()
        yield c


def blocked(entered: asyncio.Event, count: list[int], expected: int) -> Handler:
    """A receive that never completes (a server waiting on a broadcast): marks that it was reached."""

    async def handle(request: httpx.Request) -> httpx.Response:
        count.append(1)
        if len(count) == expected:
            entered.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    return handle


async def test_the_sender_runs_once_every_server_paused_and_the_version_is_set(client: Client, fleet: Fleet) -> None:
    seen: list[list[bool]] = []

    async def sender() -> None:
        seen.append(fleet.paused())

    plan = client.admin.transfer_plan(TENSORS)
    async with asyncio.timeout(DEADLINE_S):
        report = await client.admin.weight_sync(
            version="v1", group_name=GROUP.group_name, tensors=plan.tensors, plan=plan, sender=sender
        )
    assert seen == [[True, True]]
    assert list(report.phases) == ["pause", "update", "flush", "resume", "verify"]
    assert [e.weight_transfer.finished for e in fleet.emulators.values()] == [["v1"], ["v1"]]
    assert fleet.paused() == [False, False]


async def test_a_failed_sender_fails_every_server_naming_the_broadcast_and_resumes_them(
    client: Client, fleet: Fleet
) -> None:
    entered, count = asyncio.Event(), []
    for host in HOSTS:
        fleet.override[(host, "/update_weights")] = blocked(entered, count, len(HOSTS))

    async def sender() -> None:
        await entered.wait()  # both servers are receiving
        raise RuntimeError("gloo: connection closed by peer")

    async with asyncio.timeout(DEADLINE_S):
        with pytest.raises(AdminError) as caught:
            await client.admin.weight_sync(version="v2", group_name=GROUP.group_name, tensors=TENSORS, sender=sender)
    error = caught.value
    assert "weight_sync: update" in str(error)
    update = error.phases["update"]
    assert [o.server for o in update] == ["http://s0", "http://s1"]
    for outcome in update:
        assert isinstance(outcome.error, TransferError)
        assert "the trainer's broadcast failed (RuntimeError: gloo: connection closed by peer)" in str(outcome.error)
    assert all(o.ok for o in error.phases["resume"]) and len(error.phases["resume"]) == 2
    assert fleet.paused() == [False, False]
    assert [e.weight_transfer.finished for e in fleet.emulators.values()] == [[], []]  # no version was set


async def test_a_failed_receive_abandons_the_sender_and_the_other_servers_receive_at_once(
    client: Client, fleet: Fleet
) -> None:
    entered, count = asyncio.Event(), []
    fleet.override[("s1", "/update_weights")] = blocked(entered, count, 1)
    fleet.override[("s0", "/update_weights")] = lambda r: _refuse_after(entered)
    sender_cancelled = asyncio.Event()

    async def sender() -> None:
        try:
            await asyncio.Event().wait()  # a broadcast blocked on a rank that left
        except asyncio.CancelledError:
            sender_cancelled.set()
            raise

    async with asyncio.timeout(DEADLINE_S):
        with pytest.raises(AdminError) as caught:
            await client.admin.weight_sync(version="v3", group_name=GROUP.group_name, tensors=TENSORS, sender=sender)
    assert sender_cancelled.is_set()
    s0, s1 = caught.value.phases["update"]
    assert isinstance(s0.error, ServerStatusError) and s0.error.status_code == 500
    assert "cannot receive: out of memory" in str(s0.error)
    assert isinstance(s1.error, TransferError)
    assert "abandoned: http://s0 failed to receive" in str(s1.error)
    assert all(o.ok for o in caught.value.phases["resume"])
    assert fleet.paused() == [False, False]


async def _refuse_after(other_receiving: asyncio.Event) -> httpx.Response:
    await other_receiving.wait()
    return httpx.Response(
        500,
        json={
            "error": {
                "message": "Call to collective_rpc method failed: Worker failed with error 'cannot receive: out of "
                "memory', please check the stack trace above for the root cause",
                "type": "InternalServerError",
                "param": None,
                "code": 500,
            }
        },
    )


async def test_sender_and_plan_go_with_a_group_not_with_a_path(client: Client, fleet: Fleet, tiny_models) -> None:
    async def sender() -> None:
        raise AssertionError("never started")

    plan = client.admin.transfer_plan(TENSORS)
    with pytest.raises(InvalidRequestError, match="plan= and sender= go with group_name=, not with path="):
        await client.admin.weight_sync(version="v4", path=str(tiny_models.dense), sender=sender)
    with pytest.raises(InvalidRequestError, match="plan= and sender= go with group_name=, not with path="):
        await client.admin.weight_sync(version="v4", path=str(tiny_models.dense), plan=plan)
    other = [TensorSpec(name="lm_head.weight", dtype="float32", shape=(1920, 64))]
    with pytest.raises(InvalidRequestError, match="plan must hold the tensors announced"):
        await client.admin.weight_sync(version="v4", group_name=GROUP.group_name, tensors=other, plan=plan)
    assert fleet.sent == []
