"""``pause("wait")`` returns once this client's requests that were in flight are answered.

A worker confirms a ``wait`` pause once its engine drained the requests it had admitted. A request the frontend
had already sent to the worker but that the engine had not admitted yet is held until ``resume`` (seen live on a
loaded machine: the frontend's in-flight gauge stayed at 1 and the answer never came while paused); the client
lets it in and drains again. An answer still travelling through the frontend is waited for.
"""

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
PAUSED = capture("engine_pause_wait_inflight", "dynamo-vllm")["response"]
RESUMED = capture("engine_resume_after_wait_inflight", "dynamo-vllm")["response"]


def client(deployment: Deployment) -> Client:
    options = {"worker_urls": [W1], "check_prompt_length": False}  # the scripted frontend lists no models
    config = ClientConfig(backend="dynamo", base_url=FRONTEND, model="tiny-qwen3", backend_options=options)
    return Client(config, transport=deployment.transport())


class Worker:
    """A worker whose engine admits the in-flight request only when ``admitted`` (``"before"`` the pause,
    ``"after_resume"``, or ``"never"``), and the frontend that delivers its answer."""

    def __init__(self, deployment: Deployment, admitted: str) -> None:
        self.admitted = admitted
        self.sent = asyncio.Event()
        self.deliver = asyncio.Event()
        self.order: list[str] = []
        deployment.call(FRONTEND, "POST", "/v1/chat/completions", self.generation)  # type: ignore[arg-type]
        deployment.call(W1, "POST", "/engine/pause_generation", self.pause)
        deployment.call(W1, "POST", "/engine/resume_generation", self.resume)

    async def generation(self, request: httpx.Request) -> httpx.Response:
        self.sent.set()
        await self.deliver.wait()
        self.order.append("answer")
        return httpx.Response(200, json=ANSWER)

    def pause(self, request: httpx.Request) -> httpx.Response:
        self.order.append("pause")
        if self.admitted in ("before", "admitted on resume"):  # drained: the frontend delivers it a moment later
            asyncio.get_running_loop().call_later(0.05, self.deliver.set)
        return httpx.Response(200, json=PAUSED)

    def resume(self, request: httpx.Request) -> httpx.Response:
        self.order.append("resume")
        if self.admitted == "after_resume":
            self.admitted = "admitted on resume"  # drained by the next pause
        return httpx.Response(200, json=RESUMED)


async def _pause_during_generation(deployment: Deployment, worker: Worker) -> float:
    async with client(deployment) as c:
        task = asyncio.create_task(c.generate(prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=8)))
        await worker.sent.wait()
        started = time.monotonic()
        await c.admin.pause("wait")
        took = time.monotonic() - started
        worker.order.append("paused")
        done, _ = await asyncio.wait({task}, timeout=0 if worker.admitted == "never" else 5)
        if not done:  # held by the pause: it would only end after a resume
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return took


async def test_an_answer_on_its_way_is_waited_for() -> None:
    deployment = Deployment()
    worker = Worker(deployment, "before")
    await _pause_during_generation(deployment, worker)
    assert worker.order == ["pause", "answer", "paused"]


async def test_a_request_the_worker_held_is_let_in_and_drained() -> None:
    deployment = Deployment()
    worker = Worker(deployment, "after_resume")
    await _pause_during_generation(deployment, worker)
    assert worker.order == ["pause", "resume", "pause", "answer", "paused"]
    bodies = [s.body for s in deployment.to(W1, "/engine/pause_generation")]
    assert bodies == [{"mode": "wait", "clear_cache": False}] * 2


async def test_a_request_never_admitted_leaves_the_workers_paused_after_a_bounded_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(admin, "ANSWER_GRACE_S", 0.1)
    deployment = Deployment()
    worker = Worker(deployment, "never")
    took = await _pause_during_generation(deployment, worker)
    redrains = admin.PAUSE_REDRAINS
    assert worker.order == ["pause", *(["resume", "pause"] * redrains), "paused"]
    assert took < 5.0


async def test_pause_keep_does_not_wait_for_answers() -> None:
    deployment = Deployment()
    worker = Worker(deployment, "never")
    async with client(deployment) as c:
        task = asyncio.create_task(c.generate(prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=8)))
        await worker.sent.wait()
        started = time.monotonic()
        await c.admin.pause("keep")
        assert time.monotonic() - started < 1.0
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert worker.order == ["pause"]
