"""``Client.stream`` on the vLLM backend over a streamed ``/inference/v1/generate`` (the usual chunks, which take
the plain way through ``StreamFold`` and the SSE reader): the deltas make up ``s.result``, which is what
``generate`` returns for the same sample answered whole; a stream cut mid-way is a ``NetworkError`` after the
deltas that arrived; an event that is not JSON and a chunk with a bad logprob are typed parse errors."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncGenerator
from typing import Any

import httpx
import numpy as np
import pytest

from backends_core import Client, ClientConfig, NetworkError, ResponseParseError, RetryPolicy, SamplingParams
from backends_testkit.emulator import StreamedBody

from .test_stream_fold_plain import COMPLETION, PROMPT, chunks

SAMPLING = SamplingParams(max_tokens=4)
MODELS = {"object": "list", "data": [{"id": "tiny-qwen3", "object": "model", "max_model_len": 4096}]}


def whole(raws: list[Any]) -> dict[str, Any]:
    """The answer of the non-streamed route for the sample ``raws`` streams."""
    last = raws[-2]["choices"][0]
    choice = {
        **last,
        "token_ids": COMPLETION,
        "logprobs": {"content": [e for raw in raws[:-1] for e in raw["choices"][0]["logprobs"]["content"]]},
    }
    return {"request_id": raws[0]["request_id"], "usage": raws[-1]["usage"], "choices": [choice]}


def client(events: list[bytes | Exception], raws: list[Any]) -> Client:
    async def body() -> AsyncGenerator[bytes, None]:
        for event in events:
            if isinstance(event, Exception):
                raise event
            yield event

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=MODELS)
        if json.loads(request.content).get("stream"):
            headers = {"content-type": "text/event-stream; charset=utf-8"}
            return httpx.Response(200, headers=headers, stream=StreamedBody(body()))
        return httpx.Response(200, json=whole(raws))

    config = ClientConfig(
        backend="vllm", base_url="http://vllm.test", model="tiny-qwen3", retry=RetryPolicy(attempts=1)
    )
    return Client(config, transport=httpx.MockTransport(handler))


async def read_deltas(c: Client, got: list[tuple[int, ...]]) -> None:
    async with c.stream(prompt_ids=PROMPT, sampling=SAMPLING) as s:
        async for delta in s:
            got.append(delta.completion_ids)


def sse(raws: list[Any]) -> list[bytes]:
    return [b"data: " + json.dumps(raw, separators=(",", ":")).encode() + b"\n\n" for raw in raws] + [
        b"data: [DONE]\n\n"
    ]


@pytest.mark.parametrize("per_chunk", [1, 3])
async def test_the_deltas_make_up_the_result_generate_returns(per_chunk: int) -> None:
    raws = chunks(per_chunk=per_chunk)
    async with client(sse(raws), raws) as c:
        deltas = []
        async with c.stream(prompt_ids=PROMPT, sampling=SAMPLING) as s:
            async for delta in s:
                deltas.append(delta)
        plain = await c.generate(prompt_ids=PROMPT, sampling=SAMPLING)
    assert s.result == plain
    assert tuple(i for d in deltas for i in d.completion_ids) == plain.completion_ids == tuple(COMPLETION)
    assert np.array_equal(np.concatenate([d.logprobs for d in deltas]), plain.logprobs)


async def test_a_stream_cut_mid_way_is_a_network_error_after_the_deltas_that_arrived() -> None:
    raws = chunks()
    events: list[bytes | Exception] = [*sse(raws)[:2], httpx.ReadError("connection reset")]
    async with client(events, raws) as c:
        got: list[tuple[int, ...]] = []
        with pytest.raises(NetworkError) as info:
            await read_deltas(c, got)
    assert got == [(7,), (8,)]
    assert info.value.maybe_processed


@pytest.mark.parametrize(
    ("event", "message"),
    [
        (b"data: {not json\n\n", "stream event is not JSON"),
        (None, "not a finite log-probability"),
    ],
)
async def test_a_bad_event_is_a_typed_parse_error(event: bytes | None, message: str) -> None:
    raws = chunks()
    if event is None:  # a chunk whose logprob is NaN (json.dumps writes NaN)
        raws[1]["choices"][0]["logprobs"]["content"][0]["logprob"] = math.nan
        events: list[bytes | Exception] = list(sse(raws))
    else:
        events = [*sse(raws)[:1], event, *sse(raws)[1:]]
    async with client(events, raws) as c:
        got: list[tuple[int, ...]] = []
        with pytest.raises(ResponseParseError, match=message):
            await read_deltas(c, got)
    assert got == [(7,)]
