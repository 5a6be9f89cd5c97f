"""Streaming checked on a real server by its own counters: a multi-turn partial rollout streamed from messages,
stopped early, leaves nothing running on the engine. Each live suite passes the server's raw in-flight counter
(vLLM's ``/metrics``, SGLang's ``/v1/loads``, the Dynamo worker's ``/metrics``), read without the backend's code."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import numpy as np

from backends_core import Client, SamplingParams
from backends_testkit.conformance import LONG, LONGEST, Attempts

#: Seconds to wait for the server's counter to settle (a hang guard on a loaded two-core machine).
SETTLE_S = 300.0
#: Attempts before the verdict (see Attempts: an attempt whose counter lagged says nothing).
ATTEMPTS = 3

Count = Callable[[], Awaitable[int]]


async def until(count: Count, wanted: Callable[[int], bool], what: str) -> int:
    """The counter's first value that is ``wanted``; an AssertionError naming ``what`` after SETTLE_S."""
    value = -1
    try:
        async with asyncio.timeout(SETTLE_S):
            while True:
                value = await count()
                if wanted(value):
                    return value
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"{what}: the server counter still read {value} after {SETTLE_S:.0f} s") from None


async def check_partial_rollout_stream(client: Client, count: Count) -> None:
    """A streamed turn from messages stopped after a few tokens, then a second turn on the same session: the
    deltas are the turn's exact ids; the left stream is aborted on the engine, proven by the counter reading 0
    right after a shorter generation sent after it ended (had it run on, it would still have about LONGEST - LONG
    tokens to go)."""
    messages = [{"role": "user", "content": "Tell me a long story."}]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    async with client.stream(messages=messages, sampling=greedy, session="rollout-1") as stream:
        deltas = [delta async for delta in stream]
    whole = await client.generate(messages=messages, sampling=greedy)
    assert sum((d.completion_ids for d in deltas), ()) == stream.result.completion_ids == whole.completion_ids
    np.testing.assert_allclose(stream.result.logprobs, whole.logprobs, atol=1e-4)

    attempts = Attempts("leaving a stream early")
    long = SamplingParams(max_tokens=LONGEST, ignore_eos=True, temperature=1.0)
    for attempt in range(1, ATTEMPTS + 1):
        await until(count, lambda n: n == 0, "before the attempt")
        seen = 0
        async with client.stream(messages=messages, sampling=long, session="rollout-1") as stream:
            async for delta in stream:
                seen += len(delta.completion_ids)
                if seen >= 3:  # the early stop of a partial rollout
                    break
        assert 3 <= seen < LONGEST
        clock = await client.generate(
            prompt_ids=[1, 2, 3, 4], sampling=SamplingParams(max_tokens=LONG, ignore_eos=True)
        )
        assert len(clock.completion_ids) == LONG
        left = await count()
        if left == 0:
            return
        await until(count, lambda n: n == 0, "the stream left early never ended on the engine")
        attempts.inconclusive(f"attempt {attempt}: the counter read {left} when the clock generation ended")
    attempts.verdict("a stream left early was still running when a shorter generation sent after it ended")
