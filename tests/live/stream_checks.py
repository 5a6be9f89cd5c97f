"""Streaming checked on a real server by its own counters: a multi-turn partial rollout streamed from messages,
stopped early, leaves nothing running on the engine. Each live suite passes the server's raw in-flight counter
(vLLM's ``/metrics``, SGLang's ``/v1/loads``, the Dynamo worker's ``/metrics``), read without the backend's code."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import numpy as np

from backends_core import Client, SamplingParams
from backends_testkit.conformance import left_stream_is_aborted

#: Seconds to wait for the server's counter to settle (a hang guard on a loaded two-core machine).
SETTLE_S = 300.0

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
    """A streamed turn from messages (on a session) whose deltas are the turn's exact ids; then a stream left after
    its first delta is aborted on the engine, proven by the server's own counter with the conformance suite's clock
    generations (``left_stream_is_aborted``)."""
    messages = [{"role": "user", "content": "Tell me a long story."}]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    async with client.stream(messages=messages, sampling=greedy, session="rollout-whole") as stream:
        deltas = [delta async for delta in stream]
    whole = await client.generate(messages=messages, sampling=greedy)
    assert sum((d.completion_ids for d in deltas), ()) == stream.result.completion_ids == whole.completion_ids
    np.testing.assert_allclose(stream.result.logprobs, whole.logprobs, atol=1e-4)

    async def idle() -> None:
        await until(count, lambda n: n == 0, "a stream left early never ended on the engine")

    await left_stream_is_aborted(client, count, idle=idle)
