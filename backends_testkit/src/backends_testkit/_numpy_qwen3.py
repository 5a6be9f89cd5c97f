"""Pure-numpy forward pass of HF Qwen3 / Qwen3-MoE causal LMs, with PEFT LoRA and an incremental KV cache.

The maths follows ``transformers``' Qwen3 modelling exactly (RMSNorm, per-head q/k norms before a
NeoX-style rotary embedding, grouped-query causal attention, SwiGLU MLP or a top-k softmax router
over SwiGLU experts). Weights are stored as float32 on disk and computed in ``float64`` by default,
which makes every code path (full prefill, chunked prefill, one-token decode) agree to ~1e-12 and
keeps the results deterministic.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
from safetensors.numpy import load_file

__all__ = ["ForwardResult", "KVCache", "LoraAdapter", "Qwen3Config", "Qwen3Model"]

FloatArray = npt.NDArray[np.floating[Any]]
IntArray = npt.NDArray[np.int32]

_ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
_FUSED_GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}


def _module_path(module: str) -> str:
    """``"q_proj"`` → ``"self_attn.q_proj"``, ``"gate_proj"`` → ``"mlp.gate_proj"``."""
    return f"self_attn.{module}" if module in _ATTN_MODULES else f"mlp.{module}"


@attrs.frozen(kw_only=True)
class Qwen3Config:
    """The subset of an HF ``config.json`` the forward pass needs."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Qwen3Config:
        """Read an HF Qwen3 or Qwen3-MoE config dict.

        :param raw: the parsed ``config.json``.
        :raises ValueError: for an unsupported architecture or rope scaling.
        """
        if raw.get("model_type") not in ("qwen3", "qwen3_moe"):
            raise ValueError(f"unsupported model_type {raw.get('model_type')!r} (want qwen3 or qwen3_moe)")
        rope = raw.get("rope_parameters") or {}
        scaling = raw.get("rope_scaling")
        if (scaling and scaling.get("rope_type", scaling.get("type")) != "default") or rope.get(
            "rope_type", "default"
        ) != "default":
            raise ValueError("only the default rotary embedding is supported")
        heads = int(raw["num_attention_heads"])
        moe = raw.get("model_type") == "qwen3_moe"
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
            intermediate_size=int(raw["intermediate_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", rope.get("rope_theta", 10000.0))),
            num_experts=int(raw["num_experts"]) if moe else 0,
            num_experts_per_tok=int(raw["num_experts_per_tok"]) if moe else 0,
            moe_intermediate_size=int(raw.get("moe_intermediate_size", 0)) if moe else 0,
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            decoder_sparse_step=int(raw.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
        )

    @property
    def is_moe(self) -> bool:
        """Whether any layer has a sparse MoE block."""
        return self.num_experts > 0

    def layer_is_moe(self, layer: int) -> bool:
        """Whether ``layer`` uses the MoE block (HF's ``decoder_sparse_step`` / ``mlp_only_layers`` rule)."""
        return (
            self.num_experts > 0 and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        )


@attrs.frozen(kw_only=True)
class LoraAdapter:
    """A PEFT LoRA adapter: ``y += (x @ A.T @ B.T) * scaling`` on each targeted linear.

    :ivar weights: ``(layer, module) -> (A [r, in], B [out, r])``, module being e.g. ``"q_proj"``.
    """

    rank: int
    scaling: float
    weights: Mapping[tuple[int, str], tuple[FloatArray, FloatArray]]

    @classmethod
    def load(cls, path: Path | str, config: Qwen3Config, *, dtype: type[np.floating[Any]] = np.float64) -> LoraAdapter:
        """Load a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``).

        :param path: the adapter directory.
        :param config: the base model's config, to check shapes against.
        :param dtype: compute dtype.
        :raises ValueError: for a malformed or incompatible adapter.
        :raises OSError: when the files cannot be read.
        """
        path = Path(path)
        raw = json.loads((path / "adapter_config.json").read_text(encoding="utf-8"))
        if raw.get("peft_type") != "LORA":
            raise ValueError(f"not a LoRA adapter: peft_type={raw.get('peft_type')!r}")
        if raw.get("rank_pattern") or raw.get("alpha_pattern") or raw.get("use_dora"):
            raise ValueError("rank_pattern, alpha_pattern and DoRA are not supported")
        rank, alpha = int(raw["r"]), float(raw["lora_alpha"])
        scaling = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
        tensors = load_file(str(path / "adapter_model.safetensors"))
        pairs: dict[tuple[int, str], dict[str, FloatArray]] = {}
        for name, tensor in tensors.items():
            key, which = _parse_lora_name(name, config)
            pairs.setdefault(key, {})[which] = tensor.astype(dtype)
        weights: dict[tuple[int, str], tuple[FloatArray, FloatArray]] = {}
        for (layer, module), pair in sorted(pairs.items()):
            if set(pair) != {"A", "B"}:
                raise ValueError(f"layer {layer} {module}: need both lora_A and lora_B")
            out, inp = _linear_shape(config, module)
            if pair["A"].shape != (rank, inp) or pair["B"].shape != (out, rank):
                raise ValueError(f"layer {layer} {module}: bad LoRA shapes {pair['A'].shape} / {pair['B'].shape}")
            weights[(layer, module)] = (pair["A"], pair["B"])
        return cls(rank=rank, scaling=scaling, weights=weights)


def _parse_lora_name(name: str, config: Qwen3Config) -> tuple[tuple[int, str], str]:
    parts = name.split(".")
    # base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight
    if (
        len(parts) == 9
        and parts[:4] == ["base_model", "model", "model", "layers"]
        and parts[4].isdigit()
        and parts[7] in ("lora_A", "lora_B")
        and parts[8] == "weight"
        and (parts[5], parts[6]) in {("self_attn", m) for m in _ATTN_MODULES} | {("mlp", m) for m in _MLP_MODULES}
    ):
        layer = int(parts[4])
        if layer < config.num_layers and not (parts[5] == "mlp" and config.layer_is_moe(layer)):
            return (layer, parts[6]), parts[7][-1]
    raise ValueError(f"unsupported LoRA tensor {name!r}")


def _linear_shape(config: Qwen3Config, module: str) -> tuple[int, int]:
    hidden, q_out = config.hidden_size, config.num_heads * config.head_dim
    kv_out = config.num_kv_heads * config.head_dim
    return {
        "q_proj": (q_out, hidden),
        "k_proj": (kv_out, hidden),
        "v_proj": (kv_out, hidden),
        "o_proj": (hidden, q_out),
        "gate_proj": (config.intermediate_size, hidden),
        "up_proj": (config.intermediate_size, hidden),
        "down_proj": (hidden, config.intermediate_size),
    }[module]


class KVCache:
    """Rotated keys and values of the tokens seen so far, one ``[kv_heads, capacity, head_dim]`` pair per layer."""

    def __init__(self, config: Qwen3Config, *, dtype: type[np.floating[Any]] = np.float64, capacity: int = 64) -> None:
        self._config = config
        self._dtype = dtype
        shape = (config.num_kv_heads, max(capacity, 1), config.head_dim)
        self.keys = [np.zeros(shape, dtype) for _ in range(config.num_layers)]
        self.values = [np.zeros(shape, dtype) for _ in range(config.num_layers)]
        self.length = 0

    def reserve(self, extra: int) -> None:
        """Grow the buffers (doubling) so ``extra`` more positions fit."""
        need = self.length + extra
        capacity = self.keys[0].shape[1]
        if need <= capacity:
            return
        while capacity < need:
            capacity *= 2
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                grown = np.zeros((old.shape[0], capacity, old.shape[2]), self._dtype)
                grown[:, : self.length] = old[:, : self.length]
                store[i] = grown

    def prefix(self, length: int) -> KVCache:
        """Return an independent cache holding the first ``length`` positions of this one."""
        if not 0 <= length <= self.length:
            raise ValueError(f"prefix length {length} outside [0, {self.length}]")
        copy = KVCache(self._config, dtype=self._dtype, capacity=max(length * 2, 64))
        for src, dst in ((self.keys, copy.keys), (self.values, copy.values)):
            for layer, array in enumerate(src):
                dst[layer][:, :length] = array[:, :length]
        copy.length = length
        return copy


@attrs.frozen(kw_only=True)
class ForwardResult:
    """Output of :meth:`Qwen3Model.forward`.

    :ivar logits: ``[m, vocab]`` logits (``m`` = number of new tokens, or 1 with ``all_logits=False``).
    :ivar routed_experts: MoE only: ``int32 [n, layers, top_k]`` expert ids per new token and layer,
        in descending router weight (``-1`` for dense layers); ``None`` for dense models.
    """

    logits: FloatArray
    routed_experts: IntArray | None


class Qwen3Model:
    """A Qwen3 / Qwen3-MoE causal LM held in numpy arrays."""

    def __init__(
        self,
        config: Qwen3Config,
        tensors: Mapping[str, npt.NDArray[Any]],
        *,
        dtype: type[np.floating[Any]] = np.float64,
    ) -> None:
        """Build from HF-named tensors.

        :param config: the model config.
        :param tensors: every tensor of the checkpoint, by HF name.
        :param dtype: compute dtype (``float64`` by default; ``float32`` mimics HF more closely).
        :raises ValueError: when a tensor is missing or has the wrong shape.
        """
        self.config = config
        self.dtype = dtype
        self._tensors = {name: np.ascontiguousarray(t, dtype=dtype) for name, t in tensors.items()}
        self._check_shapes()
        self._rope_cache: tuple[FloatArray, FloatArray] = self._rope_tables(256)
        # fused, pre-transposed projections: one matmul for q/k/v and one for gate/up
        self._fused: dict[tuple[int, str], FloatArray] = {}
        for layer in range(config.num_layers):
            for group, modules in _FUSED_GROUPS.items():
                if group == "gate_up" and config.layer_is_moe(layer):
                    continue
                weights = [self._tensors[f"model.layers.{layer}.{_module_path(m)}.weight"] for m in modules]
                self._fused[(layer, group)] = np.ascontiguousarray(np.concatenate(weights).T)

    @classmethod
    def load(cls, model_dir: Path | str, *, dtype: type[np.floating[Any]] = np.float64) -> Qwen3Model:
        """Load ``config.json`` and ``model.safetensors`` from an HF model directory.

        :raises ValueError: for an unsupported config or bad tensors.
        :raises OSError: when files cannot be read.
        """
        model_dir = Path(model_dir)
        config = Qwen3Config.from_dict(json.loads((model_dir / "config.json").read_text(encoding="utf-8")))
        return cls(config, load_file(str(model_dir / "model.safetensors")), dtype=dtype)

    def tensor(self, name: str) -> FloatArray:
        """Return one weight by HF name (compute dtype)."""
        return self._tensors[name]

    def with_tensors(self, updates: Mapping[str, npt.NDArray[Any]]) -> Qwen3Model:
        """A model with ``updates`` in place of the weights of the same names, the others shared with this one.

        :raises ValueError: a name this model has no weight for, or a shape its weight does not have.
        """
        unknown = sorted(name for name in updates if name not in self._tensors)
        if unknown:
            raise ValueError(f"the model has no tensor(s) {', '.join(unknown)}")
        tensors = dict(self._tensors)
        if (
            tensors.get("lm_head.weight") is tensors.get("model.embed_tokens.weight")
            and "lm_head.weight" not in updates
        ):
            del tensors["lm_head.weight"]  # tied: follows the embedding it is
        tensors.update(updates)
        return Qwen3Model(self.config, tensors, dtype=self.dtype)

    def new_cache(self) -> KVCache:
        """Return an empty KV cache for this model."""
        return KVCache(self.config, dtype=self.dtype)

    # -- forward -------------------------------------------------------------------------------

    def forward(
        self,
        token_ids: npt.ArrayLike,
        cache: KVCache,
        *,
        lora: LoraAdapter | None = None,
        all_logits: bool = False,
    ) -> ForwardResult:
        """Run new tokens through the model, appending their keys/values to ``cache``.

        :param token_ids: ``[n]`` ids of the tokens at positions ``cache.length ...``.
        :param cache: the sequence's KV cache (mutated).
        :param lora: an optional LoRA adapter applied to its target linears.
        :param all_logits: logits for every new token instead of only the last one.
        :returns: logits and, for MoE models, routed expert ids.
        """
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError("forward needs at least one token")
        cfg = self.config
        start = cache.length
        cache.reserve(ids.size)
        cos, sin = self._rope(start, ids.size)
        hidden = self._tensors["model.embed_tokens.weight"][ids]
        routed = np.full((ids.size, cfg.num_layers, max(cfg.num_experts_per_tok, 1)), -1, np.int32)
        for layer in range(cfg.num_layers):
            prefix = f"model.layers.{layer}."
            normed = self._rms_norm(hidden, prefix + "input_layernorm.weight")
            hidden = hidden + self._attention(layer, normed, cache, start, cos, sin, lora)
            normed = self._rms_norm(hidden, prefix + "post_attention_layernorm.weight")
            if cfg.layer_is_moe(layer):
                out, routed[:, layer] = self._moe(layer, normed)
            else:
                out = self._mlp(layer, normed, lora)
            hidden = hidden + out
        cache.length = start + ids.size
        if not all_logits:
            hidden = hidden[-1:]
        hidden = self._rms_norm(hidden, "model.norm.weight")
        logits = hidden @ self._tensors["lm_head.weight"].T
        return ForwardResult(logits=logits, routed_experts=routed if cfg.is_moe else None)

    def _linear(self, x: FloatArray, layer: int, module: str, lora: LoraAdapter | None) -> FloatArray:
        y: FloatArray = x @ self._tensors[f"model.layers.{layer}.{_module_path(module)}.weight"].T
        return self._add_lora(x, y, layer, (module,), lora)

    def _fused_linear(self, x: FloatArray, layer: int, group: str, lora: LoraAdapter | None) -> FloatArray:
        y: FloatArray = x @ self._fused[(layer, group)]
        return self._add_lora(x, y, layer, _FUSED_GROUPS[group], lora)

    def _add_lora(
        self, x: FloatArray, y: FloatArray, layer: int, modules: tuple[str, ...], lora: LoraAdapter | None
    ) -> FloatArray:
        if lora is None:
            return y
        offset = 0
        for module in modules:
            width = _linear_shape(self.config, module)[0]
            pair = lora.weights.get((layer, module))
            if pair is not None:
                y[:, offset : offset + width] += ((x @ pair[0].T) @ pair[1].T) * lora.scaling
            offset += width
        return y

    def _rms_norm(self, x: FloatArray, weight: str) -> FloatArray:
        variance = np.square(x).sum(axis=-1, keepdims=True) / x.shape[-1]
        normed: FloatArray = x / np.sqrt(variance + self.config.rms_norm_eps) * self._tensors[weight]
        return normed

    def _attention(
        self,
        layer: int,
        x: FloatArray,
        cache: KVCache,
        start: int,
        cos: FloatArray,
        sin: FloatArray,
        lora: LoraAdapter | None,
    ) -> FloatArray:
        cfg = self.config
        n, d, heads, kv_heads = x.shape[0], cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        prefix = f"model.layers.{layer}.self_attn."
        qkv = self._fused_linear(x, layer, "qkv", lora)
        q = qkv[:, : heads * d].reshape(n, heads, d)
        k = qkv[:, heads * d : (heads + kv_heads) * d].reshape(n, kv_heads, d)
        v = qkv[:, (heads + kv_heads) * d :].reshape(n, kv_heads, d)
        q = _rotate(self._rms_norm(q, prefix + "q_norm.weight"), cos, sin)
        k = _rotate(self._rms_norm(k, prefix + "k_norm.weight"), cos, sin)
        end = start + n
        keys, values = cache.keys[layer], cache.values[layer]
        keys[:, start:end] = k.transpose(1, 0, 2)
        values[:, start:end] = v.transpose(1, 0, 2)
        group = heads // kv_heads
        # [kv_heads, group * n, d]: query head h = kv * group + g uses key/value head kv
        q_grouped = q.transpose(1, 0, 2).reshape(kv_heads, group * n, d)
        scores = q_grouped @ keys[:, :end].transpose(0, 2, 1) / math.sqrt(d)
        if n > 1:
            query_pos = start + np.tile(np.arange(n), group)
            scores = np.where(np.arange(end)[None, :] > query_pos[:, None], -np.inf, scores)
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = scores / scores.sum(axis=-1, keepdims=True)
        out = (probs @ values[:, :end]).reshape(heads, n, d).transpose(1, 0, 2).reshape(n, heads * d)
        return self._linear(out, layer, "o_proj", lora)

    def _mlp(self, layer: int, x: FloatArray, lora: LoraAdapter | None) -> FloatArray:
        gate_up = self._fused_linear(x, layer, "gate_up", lora)
        half = gate_up.shape[-1] // 2
        return self._linear(_silu(gate_up[:, :half]) * gate_up[:, half:], layer, "down_proj", lora)

    def _moe(self, layer: int, x: FloatArray) -> tuple[FloatArray, IntArray]:
        cfg = self.config
        prefix = f"model.layers.{layer}.mlp."
        router_logits = x @ self._tensors[prefix + "gate.weight"].T
        router = np.exp(router_logits - router_logits.max(axis=-1, keepdims=True))
        router /= router.sum(axis=-1, keepdims=True)
        top = np.argsort(-router, axis=-1, kind="stable")[:, : cfg.num_experts_per_tok]
        weights = np.take_along_axis(router, top, axis=-1)
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        out = np.zeros_like(x)
        for expert in np.unique(top):
            rows, slot = np.nonzero(top == expert)
            name = f"{prefix}experts.{expert}."
            xe = x[rows]
            gate, up = xe @ self._tensors[name + "gate_proj.weight"].T, xe @ self._tensors[name + "up_proj.weight"].T
            out[rows] += (_silu(gate) * up @ self._tensors[name + "down_proj.weight"].T) * weights[rows, slot][:, None]
        return out, top.astype(np.int32)

    # -- rotary tables -------------------------------------------------------------------------

    def _rope_tables(self, length: int) -> tuple[FloatArray, FloatArray]:
        head_dim = self.config.head_dim
        inv_freq = 1.0 / (self.config.rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
        angles = np.arange(length, dtype=np.float64)[:, None] * inv_freq[None, :]
        emb = np.concatenate([angles, angles], axis=-1)
        return np.cos(emb).astype(self.dtype), np.sin(emb).astype(self.dtype)

    def _rope(self, start: int, n: int) -> tuple[FloatArray, FloatArray]:
        if start + n > self._rope_cache[0].shape[0]:
            self._rope_cache = self._rope_tables(max(2 * (start + n), 256))
        cos, sin = self._rope_cache
        # [n, 1, d]: broadcast over heads
        return cos[start : start + n, None, :], sin[start : start + n, None, :]

    def _check_shapes(self) -> None:
        cfg = self.config
        expected: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size),
            "model.norm.weight": (cfg.hidden_size,),
            "lm_head.weight": (cfg.vocab_size, cfg.hidden_size),
        }
        for layer in range(cfg.num_layers):
            prefix = f"model.layers.{layer}."
            expected[prefix + "input_layernorm.weight"] = (cfg.hidden_size,)
            expected[prefix + "post_attention_layernorm.weight"] = (cfg.hidden_size,)
            expected[prefix + "self_attn.q_norm.weight"] = (cfg.head_dim,)
            expected[prefix + "self_attn.k_norm.weight"] = (cfg.head_dim,)
            for module in _ATTN_MODULES:
                expected[f"{prefix}self_attn.{module}.weight"] = _linear_shape(cfg, module)
            if cfg.layer_is_moe(layer):
                hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size
                expected[prefix + "mlp.gate.weight"] = (cfg.num_experts, hidden)
                for e in range(cfg.num_experts):
                    expected[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = (inter, hidden)
                    expected[f"{prefix}mlp.experts.{e}.up_proj.weight"] = (inter, hidden)
                    expected[f"{prefix}mlp.experts.{e}.down_proj.weight"] = (hidden, inter)
            else:
                for module in _MLP_MODULES:
                    expected[f"{prefix}mlp.{module}.weight"] = _linear_shape(cfg, module)
        if "lm_head.weight" not in self._tensors and "model.embed_tokens.weight" in self._tensors:
            self._tensors["lm_head.weight"] = self._tensors["model.embed_tokens.weight"]  # tied embeddings
        for name, shape in expected.items():
            tensor = self._tensors.get(name)
            if tensor is None:
                raise ValueError(f"missing tensor {name}")
            if tensor.shape != shape:
                raise ValueError(f"tensor {name} has shape {tensor.shape}, expected {shape}")


def _rotate(x: FloatArray, cos: FloatArray, sin: FloatArray) -> FloatArray:
    """Apply the NeoX-style rotary embedding (``x * cos + rotate_half(x) * sin``) to ``[n, heads, d]``."""
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out: FloatArray = x * cos + rotated * sin
    return out


def _silu(x: FloatArray) -> FloatArray:
    """``x * sigmoid(x)``, with the sigmoid written via tanh so it cannot overflow."""
    out: FloatArray = 0.5 * x * (1.0 + np.tanh(0.5 * x))
    return out
