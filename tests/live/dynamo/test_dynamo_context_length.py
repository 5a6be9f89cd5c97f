"""Overlong prompts on real Dynamo 1.6.1: where the frontend exposes the limit, what it refuses, and the dynamo
backend refusing the same before sending.

Probed: ``GET /v1/models`` lists each model's ``context_window`` (2048 with the vLLM worker on tiny-qwen3, 0 with
the mocker, which enforces nothing); the frontend answers 400 ``{"details": {"type": "context_length", "limit",
"actual"}}`` when prompt + max_tokens exceeds it (or the prompt alone fills it), on both routes, after the request
travelled. The backend reads the window once per frontend and model and refuses first.
"""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import pytest

from backends_core import Client, ClientConfig, InvalidRequestError, ResponseParseError, SamplingParams
from backends_testkit.live import async_probe_client
from backends_testkit.tinymodel import TOKENIZER_SIZE

pytestmark = pytest.mark.live


def ids(n: int) -> list[int]:
    return np.random.default_rng(3).integers(0, TOKENIZER_SIZE, size=n).tolist()


class Recorder:
    """Every request the client sends, by path."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    async def __call__(self, request: httpx.Request) -> None:
        self.paths.append(request.url.path)


def client(deployment: Any, transport: str) -> Client:
    config = ClientConfig(
        backend="dynamo",
        base_url=deployment.frontend_url,
        model=deployment.model,
        backend_options={"worker_urls": list(deployment.worker_system_urls), "transport": transport},
    )
    return Client(config)


@pytest.mark.parametrize("transport", ["chat", "completions"])
async def test_overlong_prompts_are_refused_before_sending_on_the_vllm_worker(dynamo_vllm: Any, transport: str) -> None:
    url = dynamo_vllm.frontend_url
    async with async_probe_client(120.0) as http:
        (card,) = (await http.get(f"{url}/v1/models")).json()["data"]
        assert card["context_window"] == 2048
        raw = await http.post(
            f"{url}/v1/completions", json={"model": dynamo_vllm.model, "prompt": ids(2044), "max_tokens": 5}
        )
        assert raw.status_code == 400
        assert raw.json()["details"] == {"type": "context_length", "limit": 2048, "actual": 2049}
    recorder = Recorder()
    async with client(dynamo_vllm, transport) as c:
        c._data.event_hooks["request"].append(recorder)
        with pytest.raises(InvalidRequestError, match=r"= 2049 exceeds the context_window 2048 of 'tiny-qwen3'"):
            await c.generate(prompt_ids=ids(2044), sampling=SamplingParams(max_tokens=5))
        with pytest.raises(InvalidRequestError, match=r"= 2049 exceeds the context_window 2048"):
            await c.generate(prompt_ids=ids(2048), sampling=SamplingParams(max_tokens=1))
        fits = await c.generate(prompt_ids=ids(2044), sampling=SamplingParams(max_tokens=4, temperature=0.0))
    assert len(fits.completion_ids) <= 4
    sent = [p for p in recorder.paths if p in ("/v1/chat/completions", "/v1/completions")]
    assert len(sent) == 1 and recorder.paths.count("/v1/models") == 1  # only the one that fits travelled


async def test_the_mockers_unknown_window_checks_nothing(dynamo_mocker: Any) -> None:
    async with async_probe_client(60.0) as http:
        (card,) = (await http.get(f"{dynamo_mocker.frontend_url}/v1/models")).json()["data"]
    assert card["context_window"] == 0
    recorder = Recorder()
    async with client(dynamo_mocker, "chat") as c:
        c._data.event_hooks["request"].append(recorder)
        with pytest.raises(ResponseParseError):  # the mocker answers without engine data: it took the request
            await c.generate(prompt_ids=ids(2044), sampling=SamplingParams(max_tokens=5, ignore_eos=True))
    assert recorder.paths == ["/v1/models", "/v1/chat/completions"]
