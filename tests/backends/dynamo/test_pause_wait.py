"""``pause("wait")`` returns once this client's in-flight answers have arrived, not only once the workers'
engines finished them: a worker confirms the pause while the last answer still travels through the frontend,
whose in-flight gauge (``state().in_flight``) counts it until then."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from backends_core import Client, ClientConfig, SamplingParams
from backends_dynamo import admin

from ._captures import capture
from ._fake import FRONTEND, WORKERS, Deployment
from .test_client import ANSWER, PROMPT

W1 = WORKERS[0]


def client(deployment: Deployment) -> Client:
    options = {"worker_urls": [W1]}
    config = ClientConfig(backend="dynamo", base_url=FRONTEND, model="tiny-qwen3", backend_options=options)
    return Client(config, transport=deployment.transport())


def scripted(deployment: Deployment, delivered: asyncio.Event | None) -> tuple[asyncio.Event, list[str]]:
    """The worker confirms the pause at once; the generation's answer arrives ``delivered`` (never: ``None``)."""
    sent = asyncio.Event()
    order: list[str] = []

    async def generation(request: httpx.Request) -> httpx.Response:
        sent.set()
        if delivered is None:
            await asyncio.Event().wait()  # held by the pause until resume (cancelled at the end)
        else:
            await delivered.wait()
        order.append("answer")
        return httpx.Response(200, json=ANSWER)

    def pause(request: httpx.Request) -> httpx.Response:
        if delivered is not None:
            asyncio.get_running_loop().call_later(0.2, delivered.set)  # the frontend delivers it a bit later
        return httpx.Response(200, json=capture("engine_pause_wait_inflight", "dynamo-vllm")["response"])

    deployment.call(FRONTEND, "POST", "/v1/chat/completions", generation)  # type: ignore[arg-type]
    deployment.call(W1, "POST", "/engine/pause_generation", pause)
    return sent, order


async def test_pause_wait_returns_after_the_in_flight_answer_arrived() -> None:
    deployment = Deployment()
    sent, order = scripted(deployment, asyncio.Event())
    async with client(deployment) as c:
        task = asyncio.create_task(c.generate(prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=8)))
        await sent.wait()
        await c.admin.pause("wait")
        order.append("paused")
        result = await task
    assert order == ["answer", "paused"]
    assert list(result.completion_ids) == ANSWER["nvext"]["engine_data"]["completion_token_ids"]


async def test_pause_wait_does_not_wait_for_a_request_the_pause_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admin, "PAUSE_SETTLE_S", 0.3)
    deployment = Deployment()
    sent, order = scripted(deployment, None)
    async with client(deployment) as c:
        task = asyncio.create_task(c.generate(prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=8)))
        await sent.wait()
        started = time.monotonic()
        await c.admin.pause("wait")
        assert 0.25 < time.monotonic() - started < 3.0
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert order == []


async def test_pause_keep_does_not_wait_for_answers() -> None:
    deployment = Deployment()
    sent, _ = scripted(deployment, None)
    async with client(deployment) as c:
        task = asyncio.create_task(c.generate(prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=8)))
        await sent.wait()
        started = time.monotonic()
        await c.admin.pause("keep")
        assert time.monotonic() - started < 1.0
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
