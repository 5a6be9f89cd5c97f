"""New sessions spread over the fleet whatever the number of turns each sends; sticky sessions keep their server.

The bound: with sessions started one after another, every server gets its fair share of sessions to within one
(``sessions // servers`` or one more); with sessions running concurrently, within 10% of the fair share.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import pytest

from backends_core import Client, ClientConfig, FleetPolicy, SamplingParams
from backends_core.balancer import Balancer
from backends_testkit.emulators import make_emulator
from backends_testkit.engine import ReferenceEngine

SESSIONS = 100


def assert_fair(counts: Counter[int] | Counter[str], servers: int, *, within: int) -> None:
    fair = SESSIONS / servers
    assert len(counts) == servers, f"some server got no session: {dict(counts)}"
    assert all(abs(c - fair) <= within for c in counts.values()), f"not spread (fair share {fair}): {dict(counts)}"


@pytest.mark.parametrize("servers", [2, 4])
@pytest.mark.parametrize("turns", [1, 2, 3, 4])
def test_sessions_started_one_after_another_spread_over_the_servers(servers: int, turns: int) -> None:
    b = Balancer([f"s{i}" for i in range(servers)])
    homes: dict[str, int] = {}
    for k in range(SESSIONS):
        session = f"traj-{k}"
        for _ in range(turns):
            index = b.pick(session=session)
            assert homes.setdefault(session, index) == index  # sticky: every turn on its first server
            b.acquire(index)
            b.release(index, ok=True)
    assert_fair(Counter(homes.values()), servers, within=1)
    assert b.session_counts == [sum(1 for h in homes.values() if h == i) for i in range(servers)]


def test_requests_without_a_session_between_sessions_do_not_skew_them() -> None:
    b = Balancer(["a", "b"])
    homes = Counter()
    for k in range(SESSIONS):
        homes[b.pick(session=f"traj-{k}")] += 1
        b.pick()  # a lone request (teacher scoring, a probe) between two sessions
    assert_fair(homes, 2, within=1)


def test_a_moved_or_forgotten_session_no_longer_counts_for_its_old_server() -> None:
    b = Balancer(["a", "b"], slack=0, max_sessions=2)
    home = b.pick(session="x")
    b.acquire(home)  # one more request than the other server, slack 0: the session moves
    moved = b.pick(session="x")
    assert moved != home
    assert b.session_counts[home] == 0 and b.session_counts[moved] == 1
    b.release(home, ok=True)
    b.pick(session="y")
    b.pick(session="z")  # remembers two: "x" is forgotten
    assert b.session_server("x") is None
    assert sum(b.session_counts) == 2


# -- through a client over emulated vLLM servers ------------------------------------------------------------


def fleet_config(tiny_models, servers: int) -> ClientConfig:
    return ClientConfig(
        backend="vllm",
        base_url=[f"http://v{i}" for i in range(servers)],
        model="tiny-qwen3",
        tokenizer=str(tiny_models.dense),
        fleet=FleetPolicy(sticky_slack=SESSIONS),
    )


@pytest.fixture
async def engines(tiny_models):
    made = [ReferenceEngine(tiny_models.dense, seed=i) for i in range(4)]
    yield made
    for e in made:
        await e.aclose()


def over(engines: list[ReferenceEngine], servers: int) -> httpx.MockTransport:
    emulators = {f"v{i}": make_emulator("vllm", engines[i]) for i in range(servers)}

    async def handle(request: httpx.Request) -> httpx.Response:
        return await emulators[request.url.host].handle(request)

    return httpx.MockTransport(handle)


SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)


async def session(client: Client, k: int, turns: int) -> list[str]:
    """``turns`` turns of one session, each extending the last one's ids; the servers that answered them."""
    ids = [1 + k % 50, 2, 3]
    served = []
    for _ in range(turns):
        result = await client.generate(prompt_ids=ids, sampling=SAMPLING, session=f"traj-{k}")
        served.append(result.server)
        ids = [*result.token_ids, 4]
    return served


@pytest.mark.parametrize("servers", [2, 4])
async def test_a_hundred_sessions_of_three_turns_one_after_another(tiny_models, engines, servers: int) -> None:
    async with Client(fleet_config(tiny_models, servers), transport=over(engines, servers)) as client:
        runs = [await session(client, k, 3) for k in range(SESSIONS)]
    assert all(len(set(run)) == 1 for run in runs), "a session changed server"
    assert_fair(Counter(run[0] for run in runs), servers, within=1)


@pytest.mark.parametrize("servers", [2, 4])
async def test_a_hundred_sessions_of_two_turns_one_after_another(tiny_models, engines, servers: int) -> None:
    async with Client(fleet_config(tiny_models, servers), transport=over(engines, servers)) as client:
        runs = [await session(client, k, 2) for k in range(SESSIONS)]
    assert all(len(set(run)) == 1 for run in runs), "a session changed server"
    assert_fair(Counter(run[0] for run in runs), servers, within=1)


@pytest.mark.parametrize("servers", [2, 4])
async def test_a_hundred_concurrent_sessions_of_three_turns(tiny_models, engines, servers: int) -> None:
    async with Client(fleet_config(tiny_models, servers), transport=over(engines, servers)) as client:
        runs = await asyncio.gather(*(session(client, k, 3) for k in range(SESSIONS)))
        assert [load.in_flight for load in client.balancer.load] == [0] * servers
    assert all(len(set(run)) == 1 for run in runs), "a session changed server"
    assert_fair(Counter(run[0] for run in runs), servers, within=SESSIONS // servers // 10)
