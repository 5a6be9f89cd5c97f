"""Tests of the asyncio ReferenceEngine over the numpy tiny models."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

from backends_testkit.engine import (
    EngineOutput,
    EngineRequest,
    EngineRequestError,
    ReferenceEngine,
    WeightSpan,
)
from backends_testkit.tinymodel import (
    ENDOFTEXT_ID,
    IM_END_ID,
    TinyModels,
    build_tiny_models,
    write_perturbed_weights,
)

PROMPT = tuple(int(t) for t in np.random.default_rng(7).integers(0, 1800, size=24))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    return build_tiny_models(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
async def engine(models: TinyModels) -> AsyncIterator[ReferenceEngine]:
    async with ReferenceEngine(models.dense, seed=0) as eng:
        yield eng


@pytest.fixture
async def moe_engine(models: TinyModels) -> AsyncIterator[ReferenceEngine]:
    async with ReferenceEngine(models.moe, seed=0) as eng:
        yield eng


def _request(**overrides: Any) -> EngineRequest:
    fields: dict[str, Any] = {"prompt_ids": PROMPT, "max_tokens": 12, "ignore_eos": True, "seed": 123}
    return EngineRequest(**(fields | overrides))


async def _ticks(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


# -- basics -------------------------------------------------------------------------------------


async def test_properties(engine: ReferenceEngine, moe_engine: ReferenceEngine) -> None:
    assert engine.model_name == "tiny-qwen3"
    assert engine.eos_token_ids == tuple(sorted((IM_END_ID, ENDOFTEXT_ID)))
    assert engine.vocab_size == 1920
    assert (engine.is_moe, engine.top_k, engine.num_layers) == (False, 0, 2)
    assert (moe_engine.is_moe, moe_engine.top_k) == (True, 2)


async def test_same_seed_same_output(models: TinyModels) -> None:
    outputs: list[EngineOutput] = []
    for _ in range(2):
        async with ReferenceEngine(models.dense) as eng:
            outputs.append(await eng.generate(_request(logprobs=0, temperature=0.8, top_p=0.9)))
    assert outputs[0].completion_ids == outputs[1].completion_ids
    assert outputs[0].logprobs is not None and outputs[1].logprobs is not None
    np.testing.assert_array_equal(outputs[0].logprobs, outputs[1].logprobs)
    async with ReferenceEngine(models.dense) as eng:
        other = await eng.generate(_request(seed=124))
    assert other.completion_ids != outputs[0].completion_ids


async def test_unseeded_requests_follow_the_engine_seed(models: TinyModels) -> None:
    runs = []
    for _ in range(2):
        async with ReferenceEngine(models.dense, seed=5) as eng:
            runs.append([(await eng.generate(_request(seed=None))).completion_ids for _ in range(2)])
    assert runs[0] == runs[1]
    assert runs[0][0] != runs[0][1]


@pytest.mark.parametrize(
    "params",
    [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 20, "top_p": 0.95}, {"temperature": 1.3, "min_p": 0.05}],
)
async def test_score_matches_generation_logprobs(engine: ReferenceEngine, params: dict[str, Any]) -> None:
    out = await engine.generate(_request(max_tokens=16, logprobs=0, **params))
    assert out.logprobs is not None and out.logprobs.dtype == np.float32 and len(out.logprobs) == 16
    assert np.all(np.isfinite(out.logprobs)) and np.all(out.logprobs <= 0)
    scored = await engine.score(out.prompt_ids + out.completion_ids)
    assert scored.prompt_logprobs is not None
    assert np.isnan(scored.prompt_logprobs[0]) and np.all(np.isfinite(scored.prompt_logprobs[1:]))
    np.testing.assert_allclose(scored.prompt_logprobs[len(PROMPT) :], out.logprobs, atol=1e-5, rtol=0)
    assert scored.completion_ids == () and scored.finish_reason == "length"


async def test_score_matches_generation_with_lora_and_moe(
    engine: ReferenceEngine, moe_engine: ReferenceEngine, models: TinyModels
) -> None:
    engine.load_lora("adapter", models.lora)
    for eng, lora in ((engine, "adapter"), (moe_engine, None)):
        out = await eng.generate(_request(logprobs=0, lora=lora))
        scored = await eng.score(out.prompt_ids + out.completion_ids, lora=lora)
        assert out.logprobs is not None and scored.prompt_logprobs is not None
        np.testing.assert_allclose(scored.prompt_logprobs[len(PROMPT) :], out.logprobs, atol=1e-5, rtol=0)


async def test_greedy_is_argmax_and_top_logprobs_are_sorted(engine: ReferenceEngine) -> None:
    out = await engine.generate(_request(temperature=0.0, logprobs=5, seed=None))
    assert out.logprobs is not None and out.top_logprobs is not None
    assert len(out.top_logprobs) == len(out.completion_ids)
    for token, logprob, top in zip(out.completion_ids, out.logprobs, out.top_logprobs, strict=True):
        assert len(top) == 5
        values = [lp for _, lp in top]
        assert values == sorted(values, reverse=True)
        assert top[0][0] == token
        assert top[0][1] == pytest.approx(float(logprob), abs=1e-6)
    again = await engine.generate(_request(temperature=0.0, seed=None))
    assert again.completion_ids == out.completion_ids
    assert again.logprobs is None and again.top_logprobs is None


async def test_prompt_logprobs_with_top_k(engine: ReferenceEngine) -> None:
    out = await engine.generate(_request(max_tokens=1, prompt_logprobs=3))
    assert out.prompt_logprobs is not None and out.prompt_top_logprobs is not None
    assert out.prompt_logprobs.shape == (len(PROMPT),)
    assert out.prompt_top_logprobs[0] == []
    assert all(len(top) == 3 for top in out.prompt_top_logprobs[1:])
    for logprob, top in zip(out.prompt_logprobs[1:], out.prompt_top_logprobs[1:], strict=True):
        assert float(logprob) <= top[0][1] + 1e-6


# -- MoE routing --------------------------------------------------------------------------------


async def test_routed_experts_shape_and_start(moe_engine: ReferenceEngine) -> None:
    full = await moe_engine.generate(_request(max_tokens=5, return_routed_experts=True))
    assert full.routed_experts is not None and full.routed_experts.dtype == np.int32
    assert full.routed_experts.shape == (len(PROMPT) + 5 - 1, 2, 2)
    assert full.routed_experts.min() >= 0 and full.routed_experts.max() < 8
    assert np.all(full.routed_experts[..., 0] != full.routed_experts[..., 1])
    trimmed = await moe_engine.generate(_request(max_tokens=5, return_routed_experts=True, routed_experts_start=10))
    assert trimmed.completion_ids == full.completion_ids
    np.testing.assert_array_equal(trimmed.routed_experts, full.routed_experts[10:])
    scored = await moe_engine.score(full.prompt_ids + full.completion_ids, return_routed_experts=True)
    np.testing.assert_array_equal(scored.routed_experts, full.routed_experts)
    plain = await moe_engine.generate(_request(max_tokens=5))
    assert plain.routed_experts is None


# -- prefix cache -------------------------------------------------------------------------------


async def test_prefix_cache_reuse_and_flush(engine: ReferenceEngine) -> None:
    first = await engine.generate(_request(logprobs=0))
    assert first.num_cached_tokens == 0
    second = await engine.generate(_request(logprobs=0))
    assert second.num_cached_tokens == len(PROMPT) - 1
    assert second.completion_ids == first.completion_ids
    assert first.logprobs is not None and second.logprobs is not None
    np.testing.assert_allclose(second.logprobs, first.logprobs, atol=1e-9)
    assert engine.flush_cache() is True
    assert (await engine.generate(_request())).num_cached_tokens == 0


# -- pause / resume / abort / sleep -------------------------------------------------------------


async def test_pause_abort_finishes_in_flight_and_queues_new(engine: ReferenceEngine) -> None:
    long = asyncio.create_task(engine.generate(_request(max_tokens=500)))
    await _ticks(10)
    await engine.pause("abort")
    out = await long
    assert out.finish_reason == "abort" and 0 < len(out.completion_ids) < 500
    assert engine.state().paused and engine.state().pause_mode == "abort"
    queued = asyncio.create_task(engine.generate(_request(max_tokens=3)))
    await _ticks(10)
    assert not queued.done() and engine.state().queued == 1
    await engine.resume()
    assert (await queued).finish_reason == "length"
    assert not engine.state().paused


async def test_pause_wait_lets_in_flight_finish(engine: ReferenceEngine) -> None:
    running = asyncio.create_task(engine.generate(_request(max_tokens=30)))
    await _ticks(5)
    await engine.pause("wait")
    assert running.done()
    out = running.result()
    assert out.finish_reason == "length" and len(out.completion_ids) == 30
    queued = asyncio.create_task(engine.generate(_request(max_tokens=3)))
    await _ticks(10)
    assert not queued.done()
    await engine.resume()
    assert len((await queued).completion_ids) == 3


async def test_pause_keep_freezes_and_continues(engine: ReferenceEngine) -> None:
    reference = await engine.generate(_request(max_tokens=40))
    engine.flush_cache()
    running = asyncio.create_task(engine.generate(_request(max_tokens=40)))
    await _ticks(10)
    await engine.pause("keep")
    assert engine.state().in_flight == 1
    await _ticks(20)
    assert not running.done()
    engine.update_weight_version("v2")
    await engine.resume()
    out = await running
    assert out.finish_reason == "length"
    assert out.completion_ids == reference.completion_ids
    assert out.weight_version == "v2"
    (before, after) = out.weight_versions
    assert before == WeightSpan(version="default", start=0, end=before.end)
    assert after == WeightSpan(version="v2", start=before.end, end=40)
    assert 0 < before.end < 40


async def test_sleep_queues_until_wake(engine: ReferenceEngine) -> None:
    await engine.sleep(1)
    assert engine.state().sleeping and engine.state().sleep_level == 1
    queued = asyncio.create_task(engine.generate(_request(max_tokens=2)))
    await _ticks(10)
    assert not queued.done()
    await engine.wake()
    assert len((await queued).completion_ids) == 2
    assert not engine.state().sleeping


async def test_abort_by_id_and_cancellation(engine: ReferenceEngine) -> None:
    task = asyncio.create_task(engine.generate(_request(max_tokens=500, request_id="r1")))
    await _ticks(3)
    assert engine.abort("nope") == 0
    assert engine.abort("r1") == 1
    assert (await task).finish_reason == "abort"
    cancelled = asyncio.create_task(engine.generate(_request(max_tokens=500)))
    await _ticks(3)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert engine.state().in_flight == 0
    assert engine.flush_cache() is True


# -- weights and LoRA ---------------------------------------------------------------------------


async def test_weight_reload_changes_logprobs_and_version(
    engine: ReferenceEngine, models: TinyModels, tmp_path: Path
) -> None:
    sequence = (*PROMPT, 5, 6, 7)
    before = await engine.score(sequence)
    perturbed = write_perturbed_weights(models.dense, tmp_path / "w2", seed=3, scale=0.02)
    await engine.pause("wait")
    engine.load_weights(perturbed, weight_version="step-1")
    await engine.resume()
    after = await engine.score(sequence)
    assert after.weight_version == "step-1" and engine.state().weight_version == "step-1"
    assert before.prompt_logprobs is not None and after.prompt_logprobs is not None
    assert np.nanmax(np.abs(after.prompt_logprobs - before.prompt_logprobs)) > 1e-3
    engine.load_weights(models.dense, weight_version="default")
    restored = await engine.score(sequence)
    np.testing.assert_array_equal(restored.prompt_logprobs, before.prompt_logprobs)
    with pytest.raises(EngineRequestError):
        engine.load_weights(models.moe)


async def test_lora_load_changes_logprobs_and_unload_restores(engine: ReferenceEngine, models: TinyModels) -> None:
    base = await engine.score(PROMPT)
    engine.load_lora("a", models.lora)
    assert engine.loras == {"a": models.lora}
    adapted = await engine.score(PROMPT, lora="a")
    assert base.prompt_logprobs is not None and adapted.prompt_logprobs is not None
    assert np.nanmax(np.abs(adapted.prompt_logprobs - base.prompt_logprobs)) > 1e-2
    with pytest.raises(EngineRequestError):
        engine.load_lora("a", models.lora)
    engine.load_lora("a", models.lora, replace=True)
    engine.unload_lora("a")
    with pytest.raises(EngineRequestError):
        await engine.score(PROMPT, lora="a")
    with pytest.raises(EngineRequestError):
        engine.unload_lora("a")
    np.testing.assert_array_equal((await engine.score(PROMPT)).prompt_logprobs, base.prompt_logprobs)


# -- stopping -----------------------------------------------------------------------------------


async def test_stop_token_ids_and_min_tokens(engine: ReferenceEngine) -> None:
    greedy = await engine.generate(_request(temperature=0.0, max_tokens=8))
    stop = greedy.completion_ids[3]
    position = greedy.completion_ids.index(stop)
    out = await engine.generate(_request(temperature=0.0, max_tokens=8, stop_token_ids=(stop,)))
    assert out.completion_ids == greedy.completion_ids[: position + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    held = await engine.generate(_request(temperature=0.0, max_tokens=8, stop_token_ids=(stop,), min_tokens=8))
    assert stop not in held.completion_ids and held.finish_reason == "length"


async def test_eos_from_generation_config(models: TinyModels, tmp_path: Path) -> None:
    async with ReferenceEngine(models.dense) as eng:
        greedy = await eng.generate(_request(temperature=0.0, max_tokens=6))
    model_dir = tmp_path / "eos-model"
    shutil.copytree(models.dense, model_dir)
    config_path = model_dir / "generation_config.json"
    config = json.loads(config_path.read_text())
    eos = greedy.completion_ids[2]
    config["eos_token_id"] = [eos]
    config_path.write_text(json.dumps(config))
    async with ReferenceEngine(model_dir) as eng:
        assert eos in eng.eos_token_ids
        out = await eng.generate(_request(temperature=0.0, max_tokens=6, ignore_eos=False))
        assert out.completion_ids[-1] == eos and (out.finish_reason, out.stop_reason) == ("stop", eos)
        ignored = await eng.generate(_request(temperature=0.0, max_tokens=6, ignore_eos=True))
        assert ignored.completion_ids == greedy.completion_ids


async def test_max_model_len(models: TinyModels) -> None:
    async with ReferenceEngine(models.dense, max_model_len=30) as eng:
        out = await eng.generate(_request(max_tokens=100))
        assert len(out.completion_ids) == 30 - len(PROMPT) and out.finish_reason == "length"
        full = PROMPT + PROMPT[:6]
        with pytest.raises(EngineRequestError, match="max_model_len"):
            await eng.generate(_request(prompt_ids=full, max_tokens=1))
        assert (await eng.score(full)).prompt_logprobs is not None


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"prompt_ids": ()}, "empty"),
        ({"prompt_ids": (1, 5000)}, "outside the vocabulary"),
        ({"prompt_ids": (-1,)}, "outside the vocabulary"),
        ({"stop_token_ids": (99999,)}, "outside the vocabulary"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"min_tokens": 50}, "min_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"min_p": 2.0}, "min_p"),
        ({"logprobs": -1}, "logprobs"),
        ({"lora": "missing"}, "not loaded"),
        ({"return_routed_experts": True}, "not a MoE"),
        ({"prompt_ids": (1,) * 3000}, "max_model_len"),
    ],
)
async def test_bad_requests_raise(engine: ReferenceEngine, overrides: dict[str, Any], match: str) -> None:
    with pytest.raises(EngineRequestError, match=match):
        await engine.generate(_request(**overrides))
    assert engine.state().queued == 0


async def test_duplicate_request_id_and_bad_admin_calls(engine: ReferenceEngine, tmp_path: Path) -> None:
    task = asyncio.create_task(engine.generate(_request(max_tokens=200, request_id="dup")))
    await _ticks(2)
    with pytest.raises(EngineRequestError, match="already in flight"):
        await engine.generate(_request(request_id="dup"))
    engine.abort()
    await task
    with pytest.raises(EngineRequestError):
        await engine.pause("later")  # type: ignore[arg-type]
    with pytest.raises(EngineRequestError):
        engine.load_lora("x", tmp_path)
    assert attrs.evolve(_request(), prompt_ids=[1, 2]).prompt_ids == (1, 2)
