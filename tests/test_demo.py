"""The main job runs end to end (every step of the demo checks what it shows), also when the servers answer admin
calls late, and never waits without a deadline."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from backends_core.cli import main
from backends_testkit import demo
from backends_testkit.emulators import make_emulator
from backends_testkit.engine import ReferenceEngine
from backends_testkit.http_server import serve
from backends_testkit.tinymodel import TinyModels

#: Seconds a demo run here may take (a few unloaded, a minute on a two-core machine under heavy load): the guard
#: that turns a hang into a failure.
GUARD_S = 300.0
#: The vLLM routes the client reads the fleet's state from, and the pause route.
ADMIN_ROUTES = {"/is_paused", "/is_sleeping", "/weight_info", "/metrics", "/v1/models", "/pause"}


@pytest.mark.parametrize("backend", [None, "reference"])
def test_the_demo_runs_and_every_check_holds(tiny_models, capsys, backend) -> None:
    argv = ["demo", "--models-dir", str(tiny_models.root)] + (["--backend", backend] if backend else [])
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "FAILED" not in out
    assert f"backend '{backend or 'vllm'}' over 2 embedded emulators" in out  # the default engine is vLLM's dialect
    assert out.count("  ok  ") == 13
    assert "demo finished" in out


def test_the_demo_with_json_prints_one_object_per_check_then_a_summary(tiny_models, capsys) -> None:
    assert main(["demo", "--json", "--backend", "reference", "--models-dir", str(tiny_models.root)]) == 0
    out, err = capsys.readouterr()
    lines = [json.loads(line) for line in out.splitlines()]
    assert len(lines) == 14 and all(line == {"check": line["check"], "ok": True} for line in lines[:-1])
    assert "every turn starts with the previous turn's exact ids" in {line["check"] for line in lines[:-1]}
    summary = lines[-1]
    assert (summary["demo"], summary["backend"], summary["checks"]) == ("finished", "reference", 13)
    assert err == ""


def test_list_shows_the_reference_backend_and_its_capabilities(capsys) -> None:
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    blocks = {block.split()[0]: block for block in out.split("\n") if block and not block.startswith(" ")}
    assert blocks["reference"].split()[1:] == ["backends-testkit", "0.1.0"]
    assert blocks["vllm"].split()[1:] == ["backends-vllm", "0.1.0"]
    assert "admin_pause" in out and "teacher_logprobs" in out


class BehindItsGenerations:
    """The vLLM emulator, but while one of its first ``lagging`` long generations (the demo's kept requests) runs
    unpaused, its state and pause routes answer only once that generation has ended or was paused: vLLM's API
    server on a loaded machine, behind on a generation's outputs. A state poll then never sees the request in
    flight: it has ended by the time the poll is answered."""

    def __init__(self, engine: ReferenceEngine, lagging: int) -> None:
        self.engine = engine
        self.emulator = make_emulator("vllm", engine)
        self.lagging = lagging
        self.long_generations = 0
        self.running = 0

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/inference/v1/generate" and self.kept(request):
            self.long_generations += 1
            if self.long_generations <= self.lagging:
                self.running += 1
                try:
                    return await self.emulator.handle(request)
                finally:
                    self.running -= 1
        if path in ADMIN_ROUTES:
            async with asyncio.timeout(GUARD_S):
                while self.running and not self.engine.state().paused:  # noqa: ASYNC110 - no event to wait on
                    await asyncio.sleep(0.005)
        response: httpx.Response = await self.emulator.handle(request)
        return response

    @staticmethod
    def kept(request: httpx.Request) -> bool:
        return bool(json.loads(request.content)["sampling_params"].get("max_tokens", 0) >= min(demo.KEPT_TOKENS))


@contextlib.asynccontextmanager
async def fleet(models: TinyModels, lagging: int) -> AsyncIterator[tuple[list[str], BehindItsGenerations]]:
    """Two vLLM emulators on local ports; the second (where the demo keeps its request) answers admin calls late."""
    engines = [ReferenceEngine(models.dense, seed=i) for i in range(2)]
    plain = make_emulator("vllm", engines[0])
    behind = BehindItsGenerations(engines[1], lagging)
    try:
        async with serve(plain.handle) as first, serve(behind.handle) as second:
            yield [first, second], behind
    finally:
        for engine in engines:
            await engine.aclose()


@pytest.fixture
def short_kept_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kept requests of a few hundred tokens: the attempts run to their end here, and the engine is numpy."""
    monkeypatch.setattr(demo, "KEPT_TOKENS", (100, 150, 200))


async def run(models: TinyModels, urls: list[str]) -> None:
    async with asyncio.timeout(GUARD_S):
        await demo.run_demo_async(urls=urls, models_dir=str(models.root))


@pytest.mark.usefixtures("short_kept_requests")
async def test_a_kept_request_that_ends_before_it_is_seen_in_flight_is_tried_again(
    tiny_models: TinyModels, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first kept request ends before any state poll is answered (the demo used to poll for it forever): the
    next one is paused right after it starts, held, and survives the update."""
    async with fleet(tiny_models, lagging=1) as (urls, behind):
        await run(tiny_models, urls)
    out = capsys.readouterr().out
    assert "FAILED" not in out and "demo finished" in out
    assert out.count("  ok  ") == 11  # no MoE server here: step 5 does not run
    assert f"the {demo.KEPT_TOKENS[0]}-token request ended before pause(keep) held it" in out
    assert "the kept request survived the update" in out
    assert behind.long_generations == 2


@pytest.mark.usefixtures("short_kept_requests")
async def test_a_server_always_behind_its_generations_still_shows_the_sync_and_says_why(
    tiny_models: TinyModels, capsys: pytest.CaptureFixture[str]
) -> None:
    """No attempt can hold a running request: after the stated attempts, the request is sent while the fleet is
    paused, waits through the update, and the demo completes saying so (it used to hang)."""
    async with fleet(tiny_models, lagging=99) as (urls, behind):
        await run(tiny_models, urls)
    out = capsys.readouterr().out
    assert "FAILED" not in out and "demo finished" in out
    assert out.count("  ok  ") == 11
    assert out.count("ended before pause(keep) held it") == len(demo.KEPT_TOKENS)
    assert "every request ended before the server answered the pause (a busy machine)" in out
    assert "the kept request survived the update" in out
    assert behind.long_generations == len(demo.KEPT_TOKENS) + 1


async def test_a_failing_step_leaves_the_servers_resumed_on_their_weights_without_the_adapter(
    tiny_models: TinyModels, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A check failing after the update (here: the kept request's length) ends the demo with the failure named,
    and the servers are resumed, back on the original weights and version, without the LoRA adapter."""
    monkeypatch.setattr(demo, "check", failing_at("the kept request survived the update"))
    async with fleet(tiny_models, lagging=0) as (urls, behind):
        with pytest.raises(demo.DemoFailure, match="the kept request survived the update"):
            await run(tiny_models, urls)
        state = behind.engine.state()
    assert not state.paused and state.loras == () and state.weight_version == "default"
    assert "FAILED" not in capsys.readouterr().out


def failing_at(what: str):  # type: ignore[no-untyped-def]
    real = demo.check

    def check(condition: bool, text: str) -> None:
        real(condition and text != what, text)

    return check
