"""Groups on SGLang: its own ``n`` gives every sample the request's one seed, so a seeded group is sent as ``n``
single requests to one server, sample ``i`` with ``sampling_seed = seed + i``; an unseeded group uses ``n``."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from backends_core import Client, ClientConfig, InvalidRequestError, SamplingParams

PROMPT = [5, 9, 14, 3, 27, 8]


def recording_fleet(emulators: list[Any]) -> tuple[httpx.MockTransport, list[tuple[str, dict[str, Any]]]]:
    """One emulator per host ``s0``, ``s1``...; every ``/generate`` body is recorded with its host."""
    sent: list[tuple[str, dict[str, Any]]] = []

    async def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/generate":
            sent.append((request.url.host, json.loads(request.content)))
        response: httpx.Response = await emulators[int(request.url.host[1:])].handle(request)
        return response

    return httpx.MockTransport(handle), sent


async def test_a_seeded_group_is_n_single_requests_to_one_server(make_emulator: Callable[..., Any]) -> None:
    transport, sent = recording_fleet([make_emulator(), make_emulator()])
    config = ClientConfig(backend="sglang", base_url=["http://s0", "http://s1"], model="tiny-qwen3")
    async with Client(config, transport=transport) as client:
        group = await client.generate_group(
            prompt_ids=PROMPT, n=4, sampling=SamplingParams(max_tokens=3, seed=40), request_id="g"
        )
    assert len(group) == 4 and {r.prompt_ids for r in group} == {tuple(PROMPT)}
    assert len({host for host, _ in sent}) == 1
    assert sorted(body["sampling_params"]["sampling_seed"] for _, body in sent) == [40, 41, 42, 43]
    assert {body["sampling_params"]["n"] for _, body in sent} == {1}
    assert sorted(body["rid"] for _, body in sent) == ["g_0", "g_1", "g_2", "g_3"]


async def test_an_unseeded_group_asks_sglang_for_n_samples(make_emulator: Callable[..., Any]) -> None:
    transport, sent = recording_fleet([make_emulator()])
    config = ClientConfig(backend="sglang", base_url="http://s0", model="tiny-qwen3")
    async with Client(config, transport=transport) as client:
        group = await client.generate_group(prompt_ids=PROMPT, n=3, sampling=SamplingParams(max_tokens=3))
    assert len(group) == 3
    ((_, body),) = sent
    assert body["sampling_params"]["n"] == 3 and "sampling_seed" not in body["sampling_params"]


async def test_a_group_whose_last_seed_overflows_is_refused_before_sending(make_emulator: Callable[..., Any]) -> None:
    transport, sent = recording_fleet([make_emulator()])
    config = ClientConfig(backend="sglang", base_url="http://s0", model="tiny-qwen3")
    async with Client(config, transport=transport) as client:
        with pytest.raises(InvalidRequestError, match="does not fit SGLang's 64-bit sampling_seed"):
            await client.generate_group(prompt_ids=PROMPT, n=2, sampling=SamplingParams(max_tokens=16, seed=2**63 - 1))
    assert sent == []
