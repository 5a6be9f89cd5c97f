"""The numpy reference engine agrees with real SGLang 0.5.23 (CPU, float32) on the same weights and tokens.

Raw httpx only, no backend code: these tests pin down the ground truth the SGLang backend is checked against.
Everything goes through ``POST /generate`` with ``input_ids``:

* teacher logprobs: ``max_new_tokens: 0, return_logprob, logprob_start_len: 0`` → ``input_token_logprobs``,
  ``[logprob, id, null]`` per position, entry 0 ``null``; with ``logprob_start_len: k`` the list starts at
  position ``k`` and entry ``k`` is ``null`` too (the trap of the notes);
* greedy generation: ``temperature: 0`` → ``output_ids`` and ``output_token_logprobs``;
* routed experts (MoE server): ``return_routed_experts`` → base64 little-endian int32, shape
  ``[prompt + completion - 1 - start_len, layers, top_k]``; row ``i`` routes the token at position
  ``start_len + i``; ``routed_experts_start_len`` above the prompt length is a 400;
* LoRA (dense server): ``/load_lora_adapter`` then ``lora_path: <adapter name>``.

Observed on this machine (2 cores x86_64, float32, 2026-11, four runs): max |Δ logprob| 1.9e-6 for dense,
dense + LoRA and MoE teacher logprobs, ≤ 1.4e-6 for greedy output logprobs; greedy tokens identical; all
282 routed-experts rows×layers identical to the engine's, in the same order. ``TOLERANCE`` (10× that) leaves
headroom for other CPUs' kernels.
"""

from __future__ import annotations

import base64
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

TOLERANCE = 2e-5
"""Largest accepted |Δ logprob| between the engine and SGLang (observed: see the module docstring)."""
GREEDY_TOKENS = 16
LORA_NAME = "parity-lora"


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


def _values(entries: Sequence[Sequence[Any]], ids: Sequence[int]) -> npt.NDArray[np.float64]:
    """``[logprob|null, id, text|null]`` triples → float array (null → NaN), checking the ids."""
    assert [entry[1] for entry in entries] == list(ids), "logprob entries name other token ids"
    return np.array([np.nan if entry[0] is None else entry[0] for entry in entries], dtype=np.float64)


async def _sglang_prompt_logprobs(
    http: httpx.AsyncClient, base_url: str, ids: Sequence[int], *, start: int = 0, lora: str | None = None
) -> npt.NDArray[np.float64]:
    body: dict[str, Any] = {
        "input_ids": list(ids),
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": start,
    }
    if lora is not None:
        body["lora_path"] = lora
    raw = await _post(http, f"{base_url}/generate", body)
    assert raw["output_ids"] == [] and raw["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    entries = raw["meta_info"]["input_token_logprobs"]
    assert len(entries) == len(ids) - start and entries[0][0] is None
    return _values(entries, ids[start:])


async def _engine_prompt_logprobs(
    engine: ReferenceEngine, ids: Sequence[int], *, lora: str | None = None
) -> npt.NDArray[np.float64]:
    out = await engine.score(list(ids), top_k=0, lora=lora)
    assert out.prompt_logprobs is not None
    return out.prompt_logprobs.astype(np.float64)


def _max_delta(a: npt.NDArray[np.float64], b: npt.NDArray[np.float64]) -> float:
    assert a.shape == b.shape and np.isnan(a[0]) and np.isnan(b[0])
    assert np.all(np.isfinite(a[1:])) and np.all(np.isfinite(b[1:]))
    return float(np.max(np.abs(a[1:] - b[1:])))


def _decode_routed(encoded: str, *, layers: int, top_k: int) -> npt.NDArray[np.int32]:
    flat = np.frombuffer(base64.b64decode(encoded), dtype="<i4")
    assert flat.size % (layers * top_k) == 0, f"{flat.size} routed-expert ids are not rows of {layers}x{top_k}"
    return flat.reshape(-1, layers, top_k).astype(np.int32)


def _expert_sets_match(a: npt.NDArray[np.int32], b: npt.NDArray[np.int32]) -> tuple[int, int]:
    """(rows×layers whose top-k expert sets agree, of which in the same order)."""
    assert a.shape == b.shape, f"routed experts {a.shape} vs {b.shape}"
    same_set = np.all(np.sort(a, axis=-1) == np.sort(b, axis=-1), axis=-1)
    same_order = np.all(a == b, axis=-1)
    return int(same_set.sum()), int(same_order.sum())


async def _check_teacher_parity(
    http: httpx.AsyncClient, base_url: str, model_dir: Path, seed: int, record_property: Any
) -> None:
    worst = 0.0
    async with ReferenceEngine(model_dir) as engine:
        for ids in _sequences(seed):
            full = await _sglang_prompt_logprobs(http, base_url, ids)
            worst = max(worst, _max_delta(full, await _engine_prompt_logprobs(engine, ids)))
            # logprob_start_len = k: the list starts at k and entry k is null although it has a value at start 0
            k = len(ids) // 2
            tail = await _sglang_prompt_logprobs(http, base_url, ids, start=k)
            assert np.isnan(tail[0]) and np.isfinite(full[k])
            assert np.max(np.abs(tail[1:] - full[k + 1 :])) <= TOLERANCE
    record_property("max_abs_delta", worst)
    print(f"\n[parity] sglang {model_dir.name} teacher logprobs: max |Δ| = {worst:.3g}")
    assert worst <= TOLERANCE, f"{model_dir.name}: engine vs SGLang max |Δ logprob| = {worst:.3g} > {TOLERANCE}"


async def _check_greedy_parity(
    http: httpx.AsyncClient, base_url: str, model_dir: Path, seed: int, record_property: Any
) -> None:
    worst = 0.0
    async with ReferenceEngine(model_dir) as engine:
        for ids in _sequences(seed):
            body = {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": GREEDY_TOKENS, "temperature": 0, "ignore_eos": True},
                "return_logprob": True,
            }
            raw = await _post(http, f"{base_url}/generate", body)
            sglang_ids = list(raw["output_ids"])
            assert raw["meta_info"]["finish_reason"] == {"type": "length", "length": GREEDY_TOKENS}
            sglang_logprobs = _values(raw["meta_info"]["output_token_logprobs"], sglang_ids)
            ours = await engine.generate(
                EngineRequest(prompt_ids=ids, max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
            )
            assert sglang_ids == list(ours.completion_ids), f"greedy tokens differ for a {len(ids)}-token prompt"
            assert ours.logprobs is not None
            worst = max(worst, float(np.max(np.abs(sglang_logprobs - ours.logprobs.astype(np.float64)))))
    record_property("max_abs_delta", worst)
    print(f"\n[parity] sglang {model_dir.name} greedy {GREEDY_TOKENS} tokens identical; logprobs max |Δ| = {worst:.3g}")
    assert worst <= TOLERANCE


async def test_dense_teacher_logprobs_match_sglang(
    http: httpx.AsyncClient, sglang_dense_url: str, tiny_models: TinyModels, record_property: Any
) -> None:
    await _check_teacher_parity(http, sglang_dense_url, tiny_models.dense, 11, record_property)


async def test_dense_greedy_generation_matches_sglang(
    http: httpx.AsyncClient, sglang_dense_url: str, tiny_models: TinyModels, record_property: Any
) -> None:
    await _check_greedy_parity(http, sglang_dense_url, tiny_models.dense, 12, record_property)


async def test_lora_loads_and_matches_sglang(
    http: httpx.AsyncClient, sglang_dense_url: str, tiny_models: TinyModels, record_property: Any
) -> None:
    loaded = await _post(
        http, f"{sglang_dense_url}/load_lora_adapter", {"lora_name": LORA_NAME, "lora_path": str(tiny_models.lora)}
    )
    assert loaded["success"] is True and LORA_NAME in loaded["loaded_adapters"], loaded
    try:
        worst = 0.0
        async with ReferenceEngine(tiny_models.dense) as engine:
            engine.load_lora(LORA_NAME, tiny_models.lora)
            for ids in _sequences(13):
                base = await _sglang_prompt_logprobs(http, sglang_dense_url, ids)
                adapted = await _sglang_prompt_logprobs(http, sglang_dense_url, ids, lora=LORA_NAME)
                assert _max_delta(base, adapted) > 100 * TOLERANCE, "the LoRA adapter did not change the logprobs"
                worst = max(worst, _max_delta(adapted, await _engine_prompt_logprobs(engine, ids, lora=LORA_NAME)))
    finally:
        unloaded = await _post(http, f"{sglang_dense_url}/unload_lora_adapter", {"lora_name": LORA_NAME})
        assert unloaded["success"] is True and LORA_NAME not in unloaded["loaded_adapters"], unloaded
    record_property("max_abs_delta", worst)
    print(f"\n[parity] sglang tiny-qwen3 + LoRA teacher logprobs: max |Δ| = {worst:.3g}")
    assert worst <= TOLERANCE, f"LoRA: engine vs SGLang max |Δ logprob| = {worst:.3g} > {TOLERANCE}"


async def test_moe_teacher_logprobs_match_sglang(
    http: httpx.AsyncClient, sglang_moe_url: str, tiny_models: TinyModels, record_property: Any
) -> None:
    await _check_teacher_parity(http, sglang_moe_url, tiny_models.moe, 21, record_property)


async def test_moe_greedy_generation_matches_sglang(
    http: httpx.AsyncClient, sglang_moe_url: str, tiny_models: TinyModels, record_property: Any
) -> None:
    await _check_greedy_parity(http, sglang_moe_url, tiny_models.moe, 22, record_property)


async def test_moe_routed_experts_match_engine(
    http: httpx.AsyncClient, sglang_moe_url: str, tiny_models: TinyModels, record_property: Any
) -> None:
    completion = 8
    compared = same_order = 0
    async with ReferenceEngine(tiny_models.moe) as engine:
        layers, top_k = engine.num_layers, engine.top_k

        async def sglang_routed(ids: list[int], *, start: int) -> tuple[list[int], npt.NDArray[np.int32]]:
            body = {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": completion, "temperature": 0, "ignore_eos": True},
                "return_routed_experts": True,
                "routed_experts_start_len": start,
            }
            raw = await _post(http, f"{sglang_moe_url}/generate", body)
            meta = raw["meta_info"]
            seqlen = meta["prompt_tokens"] + meta["completion_tokens"]
            rows = _decode_routed(meta["routed_experts"], layers=layers, top_k=top_k)
            assert rows.shape == (seqlen - 1 - start, layers, top_k), f"routed experts {rows.shape}, start {start}"
            assert rows.min() >= 0 and rows.max() < 8
            return list(raw["output_ids"]), rows

        for ids in _sequences(23):
            out_ids, full = await sglang_routed(ids, start=0)
            assert full.shape[0] == len(ids) + completion - 1
            ours = await engine.generate(
                EngineRequest(
                    prompt_ids=ids, max_tokens=completion, temperature=0.0, ignore_eos=True, return_routed_experts=True
                )
            )
            assert out_ids == list(ours.completion_ids)
            assert ours.routed_experts is not None
            sets, order = _expert_sets_match(full, ours.routed_experts)
            compared += full.shape[0] * layers
            same_order += order
            assert sets == full.shape[0] * layers, f"{sets}/{full.shape[0] * layers} expert sets agree"
            # with routed_experts_start_len k (what a multi-turn delta asks for) the rows are the full capture's
            # rows from k, also when the prompt's prefix comes from the radix cache (this request repeats one)
            for k in (1, len(ids) - 1, len(ids)):
                delta_ids, delta = await sglang_routed(ids, start=k)
                assert delta_ids == out_ids
                np.testing.assert_array_equal(delta, full[k:])
            # a start past the prompt is refused (SGLang checks it against the input ids only)
            body = {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": 1},
                "return_routed_experts": True,
                "routed_experts_start_len": len(ids) + 1,
            }
            refused = await http.post(f"{sglang_moe_url}/generate", json=body)
            assert refused.status_code == 400 and "routed_experts_start_len" in refused.text, refused.text
            # teacher scoring routes the same: max_new_tokens 0 returns the routing of positions 0 .. n-2
            scored = await _post(
                http,
                f"{sglang_moe_url}/generate",
                {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_routed_experts": True},
            )
            rows = _decode_routed(scored["meta_info"]["routed_experts"], layers=layers, top_k=top_k)
            np.testing.assert_array_equal(rows, full[: len(ids) - 1])
    record_property("expert_rows_compared", compared)
    record_property("expert_rows_same_order", same_order)
    print(
        f"\n[parity] sglang routed experts: {compared}/{compared} token×layer expert sets equal, {same_order} in order"
    )
