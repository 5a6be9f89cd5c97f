"""The conformance suite's pause and abort tests fail a server that ignores the act, even though they repeat an
attempt whose generation finished before the act landed (a loaded machine can delay either side)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio

from backends_core import Client, ClientConfig, RetryPolicy
from backends_core.driver import CAPABILITY_HOOKS
from backends_core.reference.emulator import ReferenceEmulator
from backends_core.testing import conformance
from backends_core.testing.conformance import BackendConformance
from backends_core.testing.engine import ReferenceEngine
from backends_core.testing.tinymodel import TinyModels


class ReferenceSuite(BackendConformance):
    """The reference backend's suite, not collected (no ``Test`` prefix): its tests are called directly."""

    backend_name = "reference"
    expected_capabilities = CAPABILITY_HOOKS - {
        "admin_init_weight_transfer",
        "admin_update_weights_distributed",
        "admin_destroy_weight_transfer",
    }


def ignoring(emulator: ReferenceEmulator, *, abort: bool = False, pause_mode: str | None = None) -> httpx.MockTransport:
    """The reference emulator, but ``/abort`` answers "none aborted" without aborting, and/or every pause is
    carried out as ``pause_mode`` whatever mode was asked."""

    async def handle(request: httpx.Request) -> httpx.Response:
        if abort and request.url.path == "/abort":
            return httpx.Response(200, json={"aborted": 0})
        if pause_mode is not None and request.url.path == "/pause":
            body = {**json.loads(request.content), "mode": pause_mode}
            request = httpx.Request("POST", request.url, json=body)
        return await emulator.handle(request)

    return httpx.MockTransport(handle)


@pytest_asyncio.fixture
async def emulator(tiny_models: TinyModels) -> AsyncIterator[ReferenceEmulator]:
    engine = ReferenceEngine(tiny_models.dense, seed=0)
    try:
        yield ReferenceEmulator(engine)
    finally:
        await engine.aclose()


def client_over(emulator: ReferenceEmulator, transport: httpx.AsyncBaseTransport) -> Client:
    config = ClientConfig(
        backend="reference",
        base_url="http://emulator.test",
        model=emulator.model_name,
        tokenizer=str(emulator.engine.model_dir),
        retry=RetryPolicy(attempts=1),
    )
    return Client(config, transport=transport)


@pytest.fixture
def fewer_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conformance, "LONG", 200)  # every attempt runs to its end here: keep them short


async def test_an_ignored_abort_fails_after_every_attempt(emulator: ReferenceEmulator, fewer_tokens: None) -> None:
    async with client_over(emulator, ignoring(emulator, abort=True)) as client:
        with pytest.raises(AssertionError):
            await ReferenceSuite().test_abort_by_request_id(client)
    generations = [path for _, path in emulator.requests if path == "/generate"]
    assert len(generations) == conformance.CATCH_ATTEMPTS


async def test_a_pause_that_does_not_abort_fails(emulator: ReferenceEmulator, fewer_tokens: None) -> None:
    async with client_over(emulator, ignoring(emulator, pause_mode="wait")) as client:
        with pytest.raises(AssertionError):
            await ReferenceSuite().test_pause_abort_ends_in_flight_requests(client)


async def test_a_pause_that_does_not_freeze_fails(emulator: ReferenceEmulator, fewer_tokens: None) -> None:
    async with client_over(emulator, ignoring(emulator, pause_mode="wait")) as client:
        with pytest.raises(pytest.fail.Exception, match="finished while the server was paused"):
            await ReferenceSuite().test_pause_keep_freezes_and_resume_continues(client)


async def test_a_working_abort_passes_at_the_first_attempt(emulator: ReferenceEmulator) -> None:
    async with client_over(emulator, emulator.transport()) as client:
        await ReferenceSuite().test_abort_by_request_id(client)
    assert [path for _, path in emulator.requests].count("/generate") == 1
