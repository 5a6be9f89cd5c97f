"""A real SGLang server SIGKILLed under load: every request of the client ends exactly once, typed, none hangs.

The server is this module's own process (not the session's shared ``sglang_dense_url``), so killing it harms
no other test; it is started lazily by the module fixture and its remains are stopped at the module's end.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import sglang_server
from live_chaos import ChaosSetupError, sigkill, wait_until

from backends_core import (
    AdminPolicy,
    Client,
    ClientConfig,
    GenerateResult,
    NetworkError,
    RequestError,
    RequestTimeout,
    SamplingParams,
    ServerStatusError,
    Timeouts,
)
from backends_testkit.live import ServerProcess
from backends_testkit.tinymodel import TinyModels

pytestmark = pytest.mark.live

MODEL = "tiny-qwen3"
REQUESTS = 200
MAX_TOKENS = 384
"""Long enough that no request is near its end when the kill lands (at most 32 run at once here: the rest
queue), short enough that 32 of them fit the server's 16,384 KV slots."""
READ_TIMEOUT_S = 300.0
"""The client's read timeout: generous for 200 requests on a loaded 2-core machine, but bounded."""
ARRIVAL_TIMEOUT_S = 180.0
"""Seconds for all 200 requests to reach the scheduler (a few seconds idle)."""
AFTER_KILL_DEADLINE_S = 60.0
"""Every call must have ended this long after the kill (they end within milliseconds: reset connections)."""


@pytest.fixture(scope="module")
def requests_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the doomed server logs every request it receives."""
    return tmp_path_factory.mktemp("sglang-chaos-requests")


def received(requests_log: Path) -> int:
    """How many requests the server has logged as received (one JSON event per line)."""
    return sum(f.read_text().count('"request.received"') for f in requests_log.iterdir() if f.is_file())


@pytest.fixture(scope="module")
def doomed_sglang(
    sglang_venv: Path, tiny_models: TinyModels, requests_log: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A live SGLang server on the tiny dense model that only this module uses (and kills)."""
    log_path = tmp_path_factory.getbasetemp() / "live-logs" / "sglang-chaos.log"
    # every request the server receives, logged as a JSON event in ``requests_log`` (level 0: metadata only)
    extra = ["--log-requests", "--log-requests-level", "0", "--log-requests-format", "json"]
    extra += ["--log-requests-target", str(requests_log)]
    server = sglang_server.sglang_server(
        sglang_venv, tiny_models.dense, log_path=log_path, name="sglang-chaos", extra=extra
    )
    server.start()
    try:
        server.wait_ready(sglang_server.READY_PATH, timeout=sglang_server.START_TIMEOUT_S)
        sys.stderr.write(f"\n[live] sglang-chaos ready at {server.url} after {server.ready_after:.1f}s\n")
        yield server
    finally:
        server.stop(timeout=sglang_server.STOP_TIMEOUT_S)


async def test_sigkill_with_200_requests_in_flight(
    doomed_sglang: ServerProcess, requests_log: Path, tiny_models: TinyModels
) -> None:
    """200 concurrent ``generate`` calls of one client, all confirmed in flight on the server (running or
    queued in its scheduler), then SIGKILL of the server's process group.

    Generation is paused while the calls arrive, so none can finish before all are counted however slowly a
    loaded machine lets them in: SGLang holds a request that arrives while paused before its scheduler (which
    then reports nothing in flight), so arrivals are counted in the server's own request log. Generation resumes
    just before the kill, which then lands on running and queued requests.

    Every call ends exactly once, within a deadline, as a ``GenerateResult`` or a typed ``RequestError``
    (never a raw httpx / asyncio exception); every error says the request may have been processed (each one
    had reached the engine); the client's in-flight count is back to 0; and a request after the kill is refused
    with ``NetworkError(maybe_processed=False)``.
    """
    server = doomed_sglang
    config = ClientConfig(
        backend="sglang",
        base_url=server.url,
        model=MODEL,
        tokenizer=str(tiny_models.dense),
        timeouts=Timeouts(read=READ_TIMEOUT_S),
        admin=AdminPolicy(deadlines={"state": 30.0}),
    )
    sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=1.0, seed=3)
    ends: Counter[int] = Counter()
    outcomes: list[GenerateResult | BaseException | None] = [None] * REQUESTS

    async with Client(config) as client:

        async def call(i: int) -> None:
            try:
                outcomes[i] = await client.generate(prompt_ids=[5, 6, 7, 8 + i % 50, 9], sampling=sampling)
            except BaseException as exc:  # recorded, judged below: the test is about what escapes a call
                outcomes[i] = exc
            finally:
                ends[i] += 1

        await client.admin.pause("keep")
        earlier = received(requests_log)  # the server's own warm-up request
        tasks = [asyncio.create_task(call(i)) for i in range(REQUESTS)]
        try:

            async def all_arrived() -> bool:
                return await asyncio.to_thread(received, requests_log) - earlier >= REQUESTS

            waited = await wait_until(
                all_arrived, within=ARRIVAL_TIMEOUT_S, what=f"{REQUESTS} requests received by {server.url}"
            )
            if ends:
                raise ChaosSetupError(f"{len(ends)} calls ended while generation was paused: {outcomes[min(ends)]!r}")
            await client.admin.resume()
            answered_before_kill = len(ends)
            sigkill(server)
            killed_at = time.monotonic()
            _, pending = await asyncio.wait(tasks, timeout=AFTER_KILL_DEADLINE_S)
            ended_after = time.monotonic() - killed_at
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        sys.stderr.write(
            f"\n[chaos] sglang: {received(requests_log) - earlier} requests received while paused after {waited:.1f}s, "
            f"{answered_before_kill} answered before the kill; all ended {ended_after:.2f}s after it\n"
        )
        assert not pending, f"{len(pending)} calls still running {AFTER_KILL_DEADLINE_S} s after the kill"
        assert all(ends[i] == 1 for i in range(REQUESTS)), f"calls ending other than once: {ends}"
        kinds = Counter(type(o).__name__ for o in outcomes)
        untyped = [o for o in outcomes if not isinstance(o, GenerateResult | RequestError)]
        assert not untyped, f"untyped outcomes {kinds}: {untyped[:3]!r}"
        errors = [o for o in outcomes if isinstance(o, RequestError)]
        assert errors, f"the kill failed no request: {kinds}"
        assert all(isinstance(e, NetworkError | RequestTimeout | ServerStatusError) for e in errors), kinds
        assert not any(isinstance(e.__cause__, asyncio.CancelledError) for e in errors)
        reached = [e for e in errors if not e.maybe_processed]
        assert not reached, f"requests that had reached the engine reported as never processed: {reached[:3]!r}"
        results = [o for o in outcomes if isinstance(o, GenerateResult)]
        assert all(len(r.completion_ids) == MAX_TOKENS for r in results)
        assert [load.in_flight for load in client.balancer.load] == [0]
        sys.stderr.write(f"[chaos] sglang outcomes: {dict(kinds)}; first error: {errors[0]!r}\n")

        with pytest.raises(NetworkError) as refused:
            await client.generate(prompt_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=2))
        assert refused.value.maybe_processed is False, refused.value
        assert [load.in_flight for load in client.balancer.load] == [0]
