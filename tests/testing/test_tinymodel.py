"""Tests of the deterministic tiny-model builder (tokenizer, chat template, configs, weights, LoRA)."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from backends_testkit._numpy_qwen3 import Qwen3Model
from backends_testkit.tinymodel import (
    BPE_VOCAB_SIZE,
    MODEL_VOCAB_SIZE,
    SPECIAL_TOKENS,
    TOKENIZER_SIZE,
    TinyModels,
    build_tiny_models,
    default_models_dir,
    write_perturbed_weights,
)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    return build_tiny_models(tmp_path_factory.mktemp("tiny"))


def _hashes(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


# -- determinism and caching --------------------------------------------------------------------


def test_same_seed_gives_identical_bytes(models: TinyModels, tmp_path: Path) -> None:
    again = build_tiny_models(tmp_path / "again")
    assert _hashes(models.root) == _hashes(again.root)
    assert {p.split("/")[0] for p in _hashes(models.root)} >= {"tiny-qwen3", "tiny-qwen3-moe", "tiny-lora"}


def test_other_seed_changes_weights_not_tokenizer(models: TinyModels, tmp_path: Path) -> None:
    other = build_tiny_models(tmp_path / "seed1", seed=1)
    for name in ("tiny-qwen3/tokenizer.json", "tiny-qwen3/config.json", "tiny-lora/adapter_config.json"):
        assert (models.root / name).read_bytes() == (other.root / name).read_bytes()
    for name in ("tiny-qwen3/model.safetensors", "tiny-qwen3-moe/model.safetensors"):
        a, b = load_file(str(models.root / name)), load_file(str(other.root / name))
        assert not np.array_equal(a["lm_head.weight"], b["lm_head.weight"])


def test_rebuild_reuses_complete_build_and_repairs_a_damaged_one(tmp_path: Path) -> None:
    built = build_tiny_models(tmp_path)
    weights = built.dense / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert build_tiny_models(tmp_path) == built
    assert weights.stat().st_mtime_ns == before
    good = weights.read_bytes()
    weights.write_bytes(b"garbage")
    build_tiny_models(tmp_path)
    assert weights.read_bytes() == good
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".build-")]


def test_default_models_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BACKENDS_TINY_MODELS", str(tmp_path / "x"))
    assert default_models_dir() == tmp_path / "x"
    monkeypatch.delenv("BACKENDS_TINY_MODELS")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_models_dir(seed=3).parent == tmp_path / "backends" / "tiny-models"
    assert default_models_dir(seed=3).name.endswith("-seed3")


# -- tokenizer ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def raw_tokenizer(models: TinyModels) -> Tokenizer:
    return Tokenizer.from_file(str(models.dense / "tokenizer.json"))


def test_auto_tokenizer_loads_offline(models: TinyModels, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(models.dense))
    assert len(tokenizer) == TOKENIZER_SIZE
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None
    text = "Hello, world! 123 <think>x</think>"
    assert tokenizer.encode(text) == _raw_ids(models, text)


def _raw_ids(models: TinyModels, text: str) -> list[int]:
    ids: list[int] = Tokenizer.from_file(str(models.dense / "tokenizer.json")).encode(text).ids
    return ids


def _random_text(rng: random.Random) -> str:
    ranges = [(0x00, 0x7F), (0x80, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x4E00, 0x4FFF), (0x1F600, 0x1F64F)]
    chars = []
    for _ in range(rng.randint(0, 40)):
        lo, hi = rng.choice(ranges)
        chars.append(chr(rng.randint(lo, hi)))
    return "".join(chars)


def test_every_string_round_trips(raw_tokenizer: Tokenizer) -> None:
    rng = random.Random(0)
    samples = [_random_text(rng) for _ in range(300)]
    samples += ["".join(chr(b) for b in range(256)), "e\u0301 cafe\u0301 \t\r\n  \x00", " leading and trailing  "]
    for text in samples:
        ids = raw_tokenizer.encode(text).ids
        assert raw_tokenizer.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_are_single_ids(raw_tokenizer: Tokenizer) -> None:
    for index, (content, special) in enumerate(SPECIAL_TOKENS):
        assert raw_tokenizer.encode(f"a{content}b").ids[1:-1] == [BPE_VOCAB_SIZE + index]
        kept = raw_tokenizer.decode([BPE_VOCAB_SIZE + index], skip_special_tokens=True)
        assert kept == ("" if special else content)
    assert raw_tokenizer.get_vocab_size() == TOKENIZER_SIZE


# -- chat template ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_tokenizer(models: TinyModels) -> Any:
    pytest.importorskip("jinja2", reason="transformers' apply_chat_template needs jinja2")
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(models.dense))


_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
_TOOLS_BLOCK = (
    "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query."
    "\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", '
    '"properties": {"city": {"type": "string"}}}}}\n</tools>\n\nFor each function call, return a json object '
    "with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)


def test_chat_template_multi_turn_drops_old_reasoning(hf_tokenizer: Any) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
        {"role": "user", "content": "Bye"},
    ]
    rendered = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    with_thinking = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert with_thinking.endswith("<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n")


def test_chat_template_tools_calls_and_responses(hf_tokenizer: Any) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Lyon?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "two lookups",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}},
            ],
        },
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "rainy"},
        {"role": "assistant", "content": "<think>\ncompare\n</think>\n\nParis is sunny."},
    ]
    rendered = hf_tokenizer.apply_chat_template(messages, tools=_TOOLS, tokenize=False)
    assert rendered == _TOOLS_BLOCK + (
        "<|im_start|>user\nWeather in Paris and Lyon?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\ntwo lookups\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrainy\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n<think>\ncompare\n</think>\n\nParis is sunny.<|im_end|>\n"
    )


def test_apply_chat_template_tokenize_returns_batch_encoding(hf_tokenizer: Any, raw_tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    encoded = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    # transformers 5 returns a BatchEncoding (dict-like) by default, not a bare list of ids
    ids = encoded["input_ids"]
    text = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert ids == raw_tokenizer.encode(text).ids
    assert ids[0] == BPE_VOCAB_SIZE + 1  # <|im_start|>


# -- configs and weights ------------------------------------------------------------------------


def test_configs(models: TinyModels) -> None:
    dense = _read_json(models.dense / "config.json")
    assert dense["architectures"] == ["Qwen3ForCausalLM"]
    assert dense["vocab_size"] == MODEL_VOCAB_SIZE >= TOKENIZER_SIZE
    assert MODEL_VOCAB_SIZE % 64 == 0
    expected = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    assert dense.items() >= (expected | {"head_dim": 32, "rope_theta": 1e6, "rope_scaling": None}).items()
    assert dense["tie_word_embeddings"] is False
    moe = _read_json(models.moe / "config.json")
    assert moe["architectures"] == ["Qwen3MoeForCausalLM"]
    assert moe.items() >= {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64}.items()
    generation = _read_json(models.dense / "generation_config.json")
    assert generation["eos_token_id"] == [BPE_VOCAB_SIZE + 2, BPE_VOCAB_SIZE]
    assert (generation["temperature"], generation["top_k"], generation["top_p"]) == (0.6, 20, 0.95)
    tokenizer_config = _read_json(models.dense / "tokenizer_config.json")
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    assert tokenizer_config["bos_token"] is None


def test_weights_have_hf_names_and_shapes(models: TinyModels) -> None:
    dense = load_file(str(models.dense / "model.safetensors"))
    assert dense["model.layers.1.self_attn.q_proj.weight"].shape == (128, 64)
    assert dense["model.layers.1.self_attn.k_norm.weight"].shape == (32,)
    assert dense["model.layers.0.mlp.down_proj.weight"].shape == (64, 128)
    assert len(dense) == 3 + 2 * 11
    assert all(t.dtype == np.float32 for t in dense.values())
    moe = load_file(str(models.moe / "model.safetensors"))
    assert moe["model.layers.0.mlp.gate.weight"].shape == (8, 64)
    assert moe["model.layers.1.mlp.experts.7.down_proj.weight"].shape == (64, 64)
    assert len(moe) == 3 + 2 * (8 + 1 + 8 * 3)
    Qwen3Model.load(models.dense)
    Qwen3Model.load(models.moe)


def test_lora_adapter(models: TinyModels) -> None:
    config = _read_json(models.lora / "adapter_config.json")
    assert config["peft_type"] == "LORA"
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (8, 16, 0.0)
    assert sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    tensors = load_file(str(models.lora / "adapter_model.safetensors"))
    assert len(tensors) == 2 * 7 * 2
    prefix = "base_model.model.model.layers.0."
    assert tensors[prefix + "self_attn.q_proj.lora_A.weight"].shape == (8, 64)
    assert tensors[prefix + "self_attn.q_proj.lora_B.weight"].shape == (128, 8)
    assert tensors[prefix + "mlp.down_proj.lora_A.weight"].shape == (8, 128)
    assert all(np.abs(t).max() > 0 for name, t in tensors.items() if "lora_B" in name)


def test_moe_router_uses_most_experts(models: TinyModels) -> None:
    model = Qwen3Model.load(models.moe)
    prompt = np.random.default_rng(0).integers(0, TOKENIZER_SIZE, size=64)
    routed = model.forward(prompt, model.new_cache()).routed_experts
    assert routed is not None and routed.shape == (64, 2, 2)
    for layer in range(2):
        assert len(np.unique(routed[:, layer])) >= 6


def test_write_perturbed_weights(models: TinyModels, tmp_path: Path) -> None:
    out = write_perturbed_weights(models.dense, tmp_path / "perturbed", seed=1, scale=0.01)
    assert (out / "config.json").read_bytes() == (models.dense / "config.json").read_bytes()
    assert (out / "tokenizer.json").is_file()
    base, noisy = load_file(str(models.dense / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert base.keys() == noisy.keys()
    delta = noisy["lm_head.weight"] - base["lm_head.weight"]
    assert 0.005 < float(delta.std()) < 0.02
