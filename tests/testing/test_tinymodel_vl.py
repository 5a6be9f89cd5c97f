"""Tests of the tiny Qwen2.5-VL builder: determinism, loading with transformers, image expansion, chat template."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

from backends_testkit.tinymodel import build_tiny_models
from backends_testkit.tinymodel_vl import (
    IMAGE_PAD_ID,
    VIDEO_PAD_ID,
    VISION_END_ID,
    VISION_START_ID,
    VL_DIR,
    build_tiny_vl_model,
)


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vl_model(tmp_path_factory.mktemp("tiny-vl"))


def _hashes(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def test_rebuild_is_byte_identical_and_reused(vl_model: Path, tmp_path: Path) -> None:
    again = build_tiny_vl_model(tmp_path)
    assert again == tmp_path.resolve() / VL_DIR
    assert _hashes(vl_model) == _hashes(again)
    weights = again / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert build_tiny_vl_model(tmp_path) == again
    assert weights.stat().st_mtime_ns == before
    other = load_file(str(build_tiny_vl_model(tmp_path / "seed1", seed=1) / "model.safetensors"))
    assert not np.array_equal(other["lm_head.weight"], load_file(str(weights))["lm_head.weight"])


def test_text_models_are_untouched_beside_it(tmp_path: Path) -> None:
    alone = build_tiny_models(tmp_path / "alone")
    build_tiny_models(tmp_path / "both")
    build_tiny_vl_model(tmp_path / "both")
    both = _hashes(tmp_path / "both")
    assert {k: v for k, v in both.items() if not k.startswith((VL_DIR, ".tiny-vl"))} == _hashes(alone.root)
    assert build_tiny_models(tmp_path / "both").dense.is_dir()  # the text marker still matches


def test_weights_have_hf_names_and_shapes(vl_model: Path) -> None:
    tensors = load_file(str(vl_model / "model.safetensors"))
    assert tensors["model.visual.patch_embed.proj.weight"].shape == (32, 3, 2, 14, 14)
    assert tensors["model.visual.blocks.1.attn.qkv.weight"].shape == (96, 32)
    assert tensors["model.visual.merger.mlp.0.weight"].shape == (128, 128)
    assert tensors["model.visual.merger.mlp.2.weight"].shape == (64, 128)
    assert tensors["model.language_model.embed_tokens.weight"].shape == (1920, 64)
    assert tensors["model.language_model.layers.0.self_attn.k_proj.bias"].shape == (32,)
    assert tensors["lm_head.weight"].shape == (1920, 64)
    assert all(t.dtype == np.float32 for t in tensors.values())


def test_loads_with_transformers(vl_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.from_pretrained(str(vl_model))
    assert type(config).__name__ == "Qwen2_5_VLConfig"
    assert config.text_config.hidden_size == config.vision_config.out_hidden_size == 64
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(vl_model))
    ids = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
    assert ids == [VISION_START_ID, VISION_END_ID, IMAGE_PAD_ID, VIDEO_PAD_ID]
    assert (config.vision_start_token_id, config.image_token_id) == (VISION_START_ID, IMAGE_PAD_ID)


def _image_processor(vl_model: Path) -> Any:
    pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    return pil.Qwen2VLImageProcessorPil.from_pretrained(str(vl_model))


@pytest.mark.parametrize(
    ("width", "height", "pads"),
    [(56, 56, 4), (64, 48, 4), (10, 10, 4), (224, 224, 64), (500, 300, 60), (1000, 1000, 64)],
)
def test_image_expansion_follows_smart_resize(vl_model: Path, width: int, height: int, pads: int) -> None:
    image_module = pytest.importorskip("PIL.Image")
    pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    out = _image_processor(vl_model)(images=[image_module.new("RGB", (width, height))])
    grid = out["image_grid_thw"].tolist()[0]
    assert grid[0] * grid[1] * grid[2] // 4 == pads
    h, w = pil.smart_resize(height, width, factor=28, min_pixels=56 * 56, max_pixels=224 * 224)
    assert [1, h // 14, w // 14] == grid


def test_chat_template_writes_one_pad_per_image(vl_model: Path) -> None:
    pytest.importorskip("jinja2")
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(vl_model))
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare "},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "text", "text": " and "},
                {"type": "image"},
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "Same."}]},
        {"role": "user", "content": "Sure?"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        f"<|im_start|>user\nCompare {placeholder} and {placeholder}<|im_end|>\n"
        "<|im_start|>assistant\nSame.<|im_end|>\n<|im_start|>user\nSure?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert ids.count(IMAGE_PAD_ID) == 2
    assert json.loads((vl_model / "config.json").read_text())["image_token_id"] == IMAGE_PAD_ID
