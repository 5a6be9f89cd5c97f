"""Deterministic builder of the tiny test models: ``tiny-qwen3``, ``tiny-qwen3-moe`` and ``tiny-lora``.

Everything is made locally from numpy, ``safetensors`` and ``tokenizers`` (no torch, no hub): a
byte-level BPE tokenizer trained on a built-in corpus, a Qwen3 chat template, HF-layout configs and
random float32 weights with the exact HF Qwen3 / Qwen3-MoE tensor names, and a PEFT LoRA adapter.
The same seed always gives byte-identical files.

Tokenizer notes: ``tokenizer_config.json`` names ``PreTrainedTokenizerFast`` on purpose. transformers 5's
``Qwen2Tokenizer`` rebuilds the pipeline in code (NFC normaliser, its own split regex) and ignores the
pre-tokenizer stored in ``tokenizer.json``, so it would tokenise differently from ``tokenizers`` itself;
with ``PreTrainedTokenizerFast``, ``AutoTokenizer`` (hence vLLM / SGLang) and ``tokenizers.Tokenizer``
agree exactly. In transformers 5, ``apply_chat_template(..., tokenize=True)`` returns a ``BatchEncoding``
(``input_ids`` + ``attention_mask``), not a bare list; it needs ``jinja2``.
"""

from __future__ import annotations

import contextlib
import fcntl
import filecmp
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
from safetensors.numpy import load_file, save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from backends_testkit._chat_template import CHAT_TEMPLATE
from backends_testkit._tiny_corpus import corpus_lines

__all__ = [
    "BUILDER_VERSION",
    "SPECIAL_TOKENS",
    "TinyModels",
    "build_tiny_models",
    "default_models_dir",
    "write_eos_variant",
    "write_long_context_variant",
    "write_perturbed_weights",
    "write_short_reply_variant",
]

BUILDER_VERSION = 1
"""Bumped whenever the builder's output changes; part of the cache marker and default directory."""

BPE_VOCAB_SIZE = 1888
"""Size of the trained byte-level BPE vocabulary (256 byte symbols + merges)."""

SPECIAL_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<think>", False),
    ("</think>", False),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
)
"""Added tokens ``(content, special)`` with ids ``BPE_VOCAB_SIZE + index``, in this order."""

_TOKEN_ID = {content: BPE_VOCAB_SIZE + i for i, (content, _) in enumerate(SPECIAL_TOKENS)}
_ID_TOKEN = {i: t for t, i in _TOKEN_ID.items()}
ENDOFTEXT_ID = _TOKEN_ID["<|endoftext|>"]
IM_END_ID = _TOKEN_ID["<|im_end|>"]
TOKENIZER_SIZE = BPE_VOCAB_SIZE + len(SPECIAL_TOKENS)
MODEL_VOCAB_SIZE = -(-TOKENIZER_SIZE // 64) * 64
"""Embedding rows: the tokenizer size rounded up to a multiple of 64 (extra rows are random)."""

DENSE_DIR, MOE_DIR, LORA_DIR = "tiny-qwen3", "tiny-qwen3-moe", "tiny-lora"
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_MARKER = ".tiny-models.json"
_WEIGHTS = "model.safetensors"
_SAFETENSORS_META = {"format": "pt"}

Tensors = dict[str, npt.NDArray[np.float32]]


@attrs.frozen(kw_only=True)
class TinyModels:
    """Paths of one complete build.

    :ivar root: the directory holding the three model directories.
    :ivar dense: ``root/tiny-qwen3``, the dense Qwen3 model.
    :ivar moe: ``root/tiny-qwen3-moe``, the Qwen3-MoE model (8 experts, top-2).
    :ivar lora: ``root/tiny-lora``, a rank-8 PEFT LoRA adapter for the dense model.
    """

    root: Path
    dense: Path
    moe: Path
    lora: Path


def default_models_dir(*, seed: int = 0) -> Path:
    """Return where tiny models are cached by default.

    :param seed: the build seed, part of the directory name.
    :returns: ``$BACKENDS_TINY_MODELS`` if set, else
        ``$XDG_CACHE_HOME/backends/tiny-models/v<BUILDER_VERSION>-seed<seed>`` (``~/.cache`` by default).
    """
    override = os.environ.get("BACKENDS_TINY_MODELS")
    if override:
        return Path(override).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    return cache / "backends" / "tiny-models" / f"v{BUILDER_VERSION}-seed{seed}"


def build_tiny_models(root: Path | str, *, seed: int = 0) -> TinyModels:
    """Build the three tiny models under ``root``, or reuse an identical complete build.

    A marker file records the seed, the builder version and the hash of every file; when it
    matches the files on disk nothing is rewritten. Building happens in a temporary directory that
    is moved into place under an exclusive file lock, so concurrent callers (pytest workers) and
    crashes never expose a half-written model.

    :param root: the directory to build into (created if missing).
    :param seed: seed of all random weights; the tokenizer does not depend on it.
    :returns: the paths of the build.
    """
    root = Path(root).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    models_ = TinyModels(root=root, dense=root / DENSE_DIR, moe=root / MOE_DIR, lora=root / LORA_DIR)
    with _exclusive_lock(root / ".lock"):
        if _marker_matches(root, seed):
            return models_
        (root / _MARKER).unlink(missing_ok=True)
        for stale in root.glob(".build-*"):  # left by a crashed build; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        with tempfile.TemporaryDirectory(prefix=".build-", dir=root) as tmp:
            staging = Path(tmp)
            _write_all(staging, seed)
            for name in (DENSE_DIR, MOE_DIR, LORA_DIR):
                target = root / name
                if target.exists():
                    shutil.rmtree(target)
                (staging / name).rename(target)
        marker = {"builder_version": BUILDER_VERSION, "seed": seed, "files": _hash_files(root)}
        _atomic_write_text(root / _MARKER, json.dumps(marker, indent=2, sort_keys=True) + "\n")
    return models_


def write_perturbed_weights(src: Path, dst: Path, *, seed: int, scale: float) -> Path:
    """Write a copy of the model in ``src`` whose weights carry added Gaussian noise.

    Every non-weight file (config, tokenizer, ...) is copied unchanged; every tensor of
    ``model.safetensors`` gets ``N(0, scale²)`` noise added. Used to test weight reloading.

    :param src: a model directory.
    :param dst: the directory to write (created; existing files are overwritten).
    :param seed: seed of the noise.
    :param scale: standard deviation of the noise.
    :returns: ``dst``.
    """
    dst.mkdir(parents=True, exist_ok=True)
    for item in sorted(src.iterdir()):
        if item.is_file() and item.name != _WEIGHTS:
            shutil.copyfile(item, dst / item.name)
    rng = np.random.Generator(np.random.PCG64(seed))
    tensors = load_file(str(src / _WEIGHTS))
    noisy = {name: (t + scale * rng.standard_normal(t.shape)).astype(np.float32) for name, t in sorted(tensors.items())}
    save_file(noisy, str(dst / _WEIGHTS), metadata=_SAFETENSORS_META)
    return dst


def write_long_context_variant(src: Path, dst: Path, *, max_position_embeddings: int = 131072) -> Path:
    """Write a copy of the model in ``src`` whose context is ``max_position_embeddings`` (``config.json``; the
    tokenizer's ``model_max_length`` too): the weights are the same (rotary positions need none), so real agent
    harnesses, whose prompts run to tens of thousands of ids with this tokenizer, fit.

    Idempotent: a complete copy with that context is reused; one is written in a temporary directory and moved
    into place under a lock, so concurrent callers never see half of it.

    :returns: ``dst``.
    """
    dst.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(dst.parent / f".{dst.name}.lock"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            same = all(filecmp.cmp(src / name, dst / name, shallow=False) for name in (_WEIGHTS, "tokenizer.json"))
            if (
                same
                and json.loads((dst / "config.json").read_text())["max_position_embeddings"] == max_position_embeddings
            ):
                return dst
        with tempfile.TemporaryDirectory(prefix=f".{dst.name}-", dir=dst.parent) as tmp:
            staging = Path(tmp) / dst.name
            shutil.copytree(src, staging)
            config = json.loads((staging / "config.json").read_text())
            config["max_position_embeddings"] = max_position_embeddings
            _atomic_write_text(staging / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
            tokenizer_config = staging / "tokenizer_config.json"
            if tokenizer_config.exists():
                settings = json.loads(tokenizer_config.read_text())
                settings["model_max_length"] = max_position_embeddings
                _atomic_write_text(tokenizer_config, json.dumps(settings, indent=2, sort_keys=True) + "\n")
            if dst.exists():
                shutil.rmtree(dst)
            staging.rename(dst)
    return dst


def write_eos_variant(src: Path, dst: Path, *, eos_token_ids: list[int]) -> Path:
    """Write a copy of the model in ``src`` whose EOS (``config.json``, ``generation_config.json`` and the
    tokenizer's ``eos_token``) is ``eos_token_ids``, while its chat template still ends turns with
    ``<|im_end|>``: a model whose EOS differs from its template's end-of-turn token, as some releases ship.

    :param src: a model directory.
    :param dst: the directory to write (created; existing files are overwritten).
    :param eos_token_ids: the new EOS ids.
    :returns: ``dst``.
    """
    dst.mkdir(parents=True, exist_ok=True)
    for item in sorted(src.iterdir()):
        if item.is_file():
            shutil.copyfile(item, dst / item.name)
    for name in ("config.json", "generation_config.json"):
        path = dst / name
        if path.is_file():
            data = json.loads(path.read_text(encoding="utf-8"))
            data["eos_token_id"] = eos_token_ids[0] if name == "config.json" else list(eos_token_ids)
            _write_json(path, data)
    # the tokenizer's EOS too (servers take it as an EOS as well), as the token of the first id
    token = _ID_TOKEN.get(eos_token_ids[0])
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = dst / name
        if token is not None and path.is_file():
            data = json.loads(path.read_text(encoding="utf-8"))
            data["eos_token"] = token
            _write_json(path, data)
    return dst


SHORT_REPLY_VERSION = 1
"""Bumped whenever :func:`write_short_reply_variant`'s weights change; part of its marker."""
_SHORT_REPLY_MARKER = ".short-reply.json"

#: Residual-stream dimensions the short-reply variant keeps for itself (no layer writes to them, so each holds its
#: embedding value up to the final norm: features of the current token that ``lm_head`` reads as a bigram table).
_BIAS_DIM, _END_GATE_DIM, _BRACE_DIM = -1, -2, -3
_FEATURE = 2.0
"""The feature dimensions' value in the embedding: about the size of the other dimensions after the layers, so the
final RMSNorm leaves it at 1-2."""
_END_LOGIT = 40.0
"""``<|im_end|>``'s weight on the end gate (and minus half of it on the bias unit): + this after a gated token,
- this otherwise, against random logits of a few units."""
_CLOSE_LOGIT = 20.0
_SUPPRESS_LOGIT = 30.0
_MILD_SUPPRESS_LOGIT = 8.0
_CALL_MARKUP_LOGIT = 6.0


def write_short_reply_variant(src: Path, dst: Path) -> Path:
    """Write a copy of the model in ``src`` (config, tokenizer and context as they are: typically a
    :func:`write_long_context_variant` copy) whose weights end every reply after about one visible token, so real
    agent harnesses, which ask tens of thousands of completion ids, get a short text answer from a real engine on a
    CPU. Random weights otherwise, unchanged but for three residual dimensions and ``lm_head``:

    * a bias unit (the same value in every token's embedding): markup (``<|im_start|>``, ``<|endoftext|>``, thinking
      and tool-response tags, BPE pieces holding ``<``), ids beyond the tokenizer, ``{"`` and `` {"`` are unlikely,
      and whitespace, control characters and pieces of UTF-8 sequences less likely; ``<tool_call>`` and
      ``</tool_call>`` mildly so (a tool-call grammar still writes each as its one added id, not spelled out);
    * an end gate, set in every token of visible text and in ``</tool_call>`` (not in whitespace, which ends a
      generation prompt): after such a token ``<|im_end|>`` is all but certain, otherwise all but impossible. So a
      free reply is one visible token (after a rare whitespace one) and the end of turn, at any temperature;
    * an open-brace feature in ``{`` and `` {``: ``}`` follows. Under a tool-call grammar (``tool_choice``
      "required") the arguments close at once, ``{}``, and the call ends the reply.

    No layer writes to those dimensions (their rows of ``o_proj`` and ``down_proj`` are zero), so each holds its
    embedding value up to the final norm: the last token's features reach ``lm_head`` as a bigram table.

    Idempotent: a copy made from the same source by this version, its files intact, is reused (a marker holds both
    sides' hashes); one is written in a temporary directory and moved into place under a lock.

    :returns: ``dst``.
    """
    dst.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(dst.parent / f".{dst.name}.lock"):
        source = {"version": SHORT_REPLY_VERSION, "source": _file_digests(src)}
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            marker = json.loads((dst / _SHORT_REPLY_MARKER).read_text(encoding="utf-8"))
            if {k: marker[k] for k in source} == source and marker["files"] == _file_digests(dst):
                return dst
        with tempfile.TemporaryDirectory(prefix=f".{dst.name}-", dir=dst.parent) as tmp:
            staging = Path(tmp) / dst.name
            shutil.copytree(src, staging)
            tokenizer = Tokenizer.from_file(str(staging / "tokenizer.json"))
            config = json.loads((staging / "config.json").read_text(encoding="utf-8"))
            tensors = load_file(str(staging / _WEIGHTS))
            save_file(
                _short_reply_weights(tensors, config, tokenizer), str(staging / _WEIGHTS), metadata=_SAFETENSORS_META
            )
            (staging / _WEIGHTS).chmod(0o644)
            marker = {**source, "files": _file_digests(staging)}
            _atomic_write_text(staging / _SHORT_REPLY_MARKER, json.dumps(marker, indent=2, sort_keys=True) + "\n")
            if dst.exists():
                shutil.rmtree(dst)
            staging.rename(dst)
    return dst


def _file_digests(directory: Path) -> dict[str, str]:
    """The SHA-256 of each file of a model directory (not the short-reply marker)."""
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.iterdir())
        if path.is_file() and path.name != _SHORT_REPLY_MARKER
    }


def _short_reply_weights(tensors: Tensors, config: Mapping[str, Any], tokenizer: Tokenizer) -> Tensors:
    out = {name: np.array(t, dtype=np.float32, copy=True) for name, t in tensors.items()}
    embed, head = out["model.embed_tokens.weight"], out["lm_head.weight"]
    vocab = embed.shape[0]
    texts = [tokenizer.decode([i], skip_special_tokens=False) for i in range(min(vocab, TOKENIZER_SIZE))]
    dims = [_BIAS_DIM, _END_GATE_DIM, _BRACE_DIM]
    for layer in range(config["num_hidden_layers"]):
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            out[f"model.layers.{layer}.{name}.weight"][dims, :] = 0.0
    out["model.norm.weight"][dims] = 1.0
    embed[:, dims] = 0.0
    embed[:, _BIAS_DIM] = _FEATURE
    head[:, dims] = 0.0
    markup = {t for t, _ in SPECIAL_TOKENS} - {"<|im_end|>", "<tool_call>", "</tool_call>"}
    for token_id, text in enumerate(texts):
        if text in markup or (token_id < BPE_VOCAB_SIZE and ("<" in text or text in ('{"', ' {"'))):
            head[token_id, _BIAS_DIM] = -_SUPPRESS_LOGIT / _FEATURE
        elif text in ("<tool_call>", "</tool_call>"):
            head[token_id, _BIAS_DIM] = -_CALL_MARKUP_LOGIT / _FEATURE
        elif not _visible(text):
            head[token_id, _BIAS_DIM] = -_MILD_SUPPRESS_LOGIT / _FEATURE
        if (_visible(text) and token_id < BPE_VOCAB_SIZE) or text == "</tool_call>":
            embed[token_id, _END_GATE_DIM] = _FEATURE
        if text in ("{", " {"):
            embed[token_id, _BRACE_DIM] = _FEATURE
    head[len(texts) :, _BIAS_DIM] = -_SUPPRESS_LOGIT / _FEATURE  # rows beyond the tokenizer
    head[IM_END_ID, :] = 0.0
    head[IM_END_ID, _END_GATE_DIM] = 2 * _END_LOGIT / _FEATURE
    head[IM_END_ID, _BIAS_DIM] = -_END_LOGIT / _FEATURE
    head[texts.index("}"), _BRACE_DIM] = _CLOSE_LOGIT / _FEATURE
    return out


def _visible(text: str) -> bool:
    """Text a reply may show: not only whitespace, no control characters, no piece of a UTF-8 sequence."""
    return bool(text.strip()) and text.isprintable() and "\ufffd" not in text


# -- building ----------------------------------------------------------------------------------


def _write_all(staging: Path, seed: int) -> None:
    tokenizer = _train_tokenizer()
    dense, moe, lora = staging / DENSE_DIR, staging / MOE_DIR, staging / LORA_DIR
    dense_config, moe_config = _dense_config(), _moe_config()
    for directory, config in ((dense, dense_config), (moe, moe_config)):
        directory.mkdir()
        _write_tokenizer(directory, tokenizer)
        _write_json(directory / "config.json", config)
        _write_json(directory / "generation_config.json", _generation_config())
    seeds = np.random.SeedSequence(seed).spawn(3)
    save_file(_model_weights(dense_config, _rng(seeds[0])), str(dense / _WEIGHTS), metadata=_SAFETENSORS_META)
    save_file(_model_weights(moe_config, _rng(seeds[1])), str(moe / _WEIGHTS), metadata=_SAFETENSORS_META)
    lora.mkdir()
    _write_json(lora / "adapter_config.json", _adapter_config())
    save_file(
        _lora_weights(dense_config, _rng(seeds[2])),
        str(lora / "adapter_model.safetensors"),
        metadata=_SAFETENSORS_META,
    )
    for path in staging.rglob("*.safetensors"):  # safetensors creates files owner-only
        path.chmod(0o644)


def _rng(seed: np.random.SeedSequence) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(seed))


def _train_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus_lines(), trainer)
    if tokenizer.get_vocab_size() != BPE_VOCAB_SIZE:
        raise RuntimeError(f"BPE training gave {tokenizer.get_vocab_size()} tokens, expected {BPE_VOCAB_SIZE}")
    for content, special in SPECIAL_TOKENS:
        token = AddedToken(content, special=special, normalized=False, single_word=False)
        (tokenizer.add_special_tokens if special else tokenizer.add_tokens)([token])
    for content, token_id in _TOKEN_ID.items():
        if tokenizer.token_to_id(content) != token_id:
            raise RuntimeError(f"added token {content!r} did not get id {token_id}")
    return tokenizer


def _write_tokenizer(directory: Path, tokenizer: Tokenizer) -> None:
    (directory / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    added = {
        str(_TOKEN_ID[content]): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for content, special in SPECIAL_TOKENS
    }
    _write_json(
        directory / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "added_tokens_decoder": added,
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
            "clean_up_tokenization_spaces": False,
            "errors": "replace",
            "model_max_length": 2048,
            "split_special_tokens": False,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(
        directory / "special_tokens_map.json",
        {
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
        },
    )


def _dense_config() -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": MODEL_VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-06,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 2,
        "initializer_range": 0.02,
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": IM_END_ID,
        "pad_token_id": ENDOFTEXT_ID,
        "torch_dtype": "float32",
    }


def _moe_config() -> dict[str, Any]:
    config = _dense_config()
    config.update(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        output_router_logits=False,
        router_aux_loss_coef=0.001,
    )
    return config


def _generation_config() -> dict[str, Any]:
    return {
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
        "pad_token_id": ENDOFTEXT_ID,
        "do_sample": True,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
    }


def _adapter_config() -> dict[str, Any]:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": DENSE_DIR,
        "r": 8,
        "lora_alpha": 16,
        "lora_dropout": 0.0,
        "target_modules": sorted(LORA_TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "use_rslora": False,
        "use_dora": False,
        "revision": None,
    }


def _linear_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """Map each per-layer linear (relative name) to its ``[out, in]`` shape; MoE experts excluded."""
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    q_out, kv_out = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {
        "self_attn.q_proj": (q_out, hidden),
        "self_attn.k_proj": (kv_out, hidden),
        "self_attn.v_proj": (kv_out, hidden),
        "self_attn.o_proj": (hidden, q_out),
    }
    if "num_experts" not in config:
        inter = config["intermediate_size"]
        shapes |= {"mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden), "mlp.down_proj": (hidden, inter)}
    return shapes


def _normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> npt.NDArray[np.float32]:
    return (rng.standard_normal(shape) * std).astype(np.float32)


def _norm_weight(rng: np.random.Generator, size: int) -> npt.NDArray[np.float32]:
    return (1.0 + rng.standard_normal(size) * 0.05).astype(np.float32)


def _model_weights(config: Mapping[str, Any], rng: np.random.Generator) -> Tensors:
    """Random weights; std ≈ 0.7/sqrt(fan_in) keeps activations O(1) and next-token distributions broad."""
    hidden, head_dim, vocab = config["hidden_size"], config["head_dim"], config["vocab_size"]
    tensors: Tensors = {"model.embed_tokens.weight": _normal(rng, (vocab, hidden), 1.0)}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        tensors[prefix + "input_layernorm.weight"] = _norm_weight(rng, hidden)
        tensors[prefix + "post_attention_layernorm.weight"] = _norm_weight(rng, hidden)
        tensors[prefix + "self_attn.q_norm.weight"] = _norm_weight(rng, head_dim)
        tensors[prefix + "self_attn.k_norm.weight"] = _norm_weight(rng, head_dim)
        for name, (out, inp) in _linear_shapes(config).items():
            tensors[prefix + name + ".weight"] = _normal(rng, (out, inp), 0.7 / np.sqrt(inp))
        if "num_experts" in config:
            experts, inter = config["num_experts"], config["moe_intermediate_size"]
            tensors[prefix + "mlp.gate.weight"] = _normal(rng, (experts, hidden), 1.0 / np.sqrt(hidden))
            for e in range(experts):
                expert = f"{prefix}mlp.experts.{e}."
                tensors[expert + "gate_proj.weight"] = _normal(rng, (inter, hidden), 0.7 / np.sqrt(hidden))
                tensors[expert + "up_proj.weight"] = _normal(rng, (inter, hidden), 0.7 / np.sqrt(hidden))
                tensors[expert + "down_proj.weight"] = _normal(rng, (hidden, inter), 0.7 / np.sqrt(inter))
    tensors["model.norm.weight"] = _norm_weight(rng, hidden)
    tensors["lm_head.weight"] = _normal(rng, (vocab, hidden), 2.0 / np.sqrt(hidden))
    return tensors


def _lora_weights(config: Mapping[str, Any], rng: np.random.Generator) -> Tensors:
    """PEFT LoRA tensors (``lora_A`` ``[r, in]``, ``lora_B`` ``[out, r]``); B is non-zero on purpose."""
    rank = _adapter_config()["r"]
    tensors: Tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name, (out, inp) in _linear_shapes(config).items():
            prefix = f"base_model.model.model.layers.{layer}.{name}."
            tensors[prefix + "lora_A.weight"] = _normal(rng, (rank, inp), 1.0 / np.sqrt(inp))
            tensors[prefix + "lora_B.weight"] = _normal(rng, (out, rank), 0.1 / np.sqrt(rank))
    return tensors


# -- files -------------------------------------------------------------------------------------


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _hash_files(root: Path, names: tuple[str, ...] = (DENSE_DIR, MOE_DIR, LORA_DIR)) -> dict[str, str]:
    return {
        path.relative_to(root).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for name in names
        for path in sorted((root / name).rglob("*"))
        if path.is_file()
    }


def _marker_matches(
    root: Path,
    seed: int,
    *,
    marker_name: str = _MARKER,
    names: tuple[str, ...] = (DENSE_DIR, MOE_DIR, LORA_DIR),
    version: int = BUILDER_VERSION,
) -> bool:
    try:
        marker = json.loads((root / marker_name).read_text(encoding="utf-8"))
        return bool(
            marker["builder_version"] == version
            and marker["seed"] == seed
            and marker["files"] == _hash_files(root, names)
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
