"""10,000 requests through a fleet with 1% injected faults: each ends as exactly one result or one error,
nothing is lost or sent twice, and in-flight counts return to zero."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter

import httpx
import numpy as np
import pytest

from backends_core import (
    Client,
    ClientConfig,
    GenerateResult,
    RequestError,
    ResponseParseError,
    RetryPolicy,
    SamplingParams,
    hookimpl,
)
from backends_testkit.faults import Fault, FaultyTransport

N_REQUESTS = 10_000
SERVERS = [f"http://s{i}" for i in range(4)]


class Echo:
    """A minimal backend: the server echoes the request id as the single completion id."""

    @hookimpl
    async def post_generate(self, server, request):
        return await server.request("POST", "/gen", json_body={"rid": request.request_id})

    @hookimpl
    def parse_response(self, raw, request, server_url):
        ids = raw["ids"]
        return [
            GenerateResult(
                prompt_ids=request.prompt_ids,
                completion_ids=tuple(ids),
                logprobs=np.full(len(ids), -1.0, np.float32),
                finish_reason="length",
                request_id=raw["rid"],
                server=server_url,
            )
        ]


@pytest.mark.slow
async def test_ten_thousand_requests_with_one_percent_faults() -> None:
    rng = random.Random(1234)
    kinds = ["refuse", "reset_before_send", "reset_after_send", "read_timeout", "status", "truncated_json", "mutate"]
    received: Counter[str] = Counter()

    async def server(request: httpx.Request) -> httpx.Response:
        rid = json.loads(request.content)["rid"]
        received[rid] += 1
        await asyncio.sleep(0)
        return httpx.Response(200, json={"rid": rid, "ids": [int(rid.split("-")[1]) % 1000]})

    def plan(request: httpx.Request, n: int) -> Fault | None:
        if rng.random() >= 0.01:
            return None
        kind = rng.choice(kinds)
        if kind == "mutate":
            return Fault(kind="mutate", mutate=lambda body: {**body, "ids": "not a list"})
        return Fault(kind=kind, status=503 if rng.random() < 0.5 else 500)  # type: ignore[arg-type]

    faulty = FaultyTransport(server, plan)
    config = ClientConfig(backend="echo", base_url=SERVERS, retry=RetryPolicy(attempts=2, backoff=0))
    outcomes: dict[str, str] = {}
    async with Client(config, transport=faulty, plugin=Echo()) as client:
        limit = asyncio.Semaphore(512)

        async def one(i: int) -> None:
            rid = f"req-{i}"
            async with limit:
                try:
                    result = await client.generate(
                        prompt_ids=[1, 2], request_id=rid, sampling=SamplingParams(max_tokens=16)
                    )
                except (RequestError, ResponseParseError) as exc:
                    outcomes[rid] = type(exc).__name__
                    return
            assert result.request_id == rid and result.completion_ids == (i % 1000,)
            outcomes[rid] = "ok"

        await asyncio.gather(*(one(i) for i in range(N_REQUESTS)))
        loads = client.balancer.load
    assert len(outcomes) == N_REQUESTS  # every request ended exactly once
    tally = Counter(outcomes.values())
    assert tally["ok"] >= N_REQUESTS * 0.98
    assert sum(tally.values()) == N_REQUESTS
    assert [load.in_flight for load in loads] == [0, 0, 0, 0]
    # no request reached the engine twice: only failures that never arrived were sent again (elsewhere)
    assert max(received.values()) == 1
    assert all(received[rid] == 1 for rid, outcome in outcomes.items() if outcome == "ok")
    assert set(tally) <= {"ok", "NetworkError", "RequestTimeout", "ServerStatusError", "ResponseParseError"}
