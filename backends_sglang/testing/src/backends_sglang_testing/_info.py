"""The read-only routes' answers, shaped like the 0.5.23 captures: ``/model_info``, ``/server_info`` (the
fields a client reads, a subset of SGLang's ~500 server arguments), ``/v1/models`` and ``/v1/loads``."""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path
from typing import Any

import attrs

from backends_testkit.engine import ReferenceEngine

__all__ = ["SGLANG_VERSION", "Identity", "loads", "model_info", "models", "server_info"]

SGLANG_VERSION = "0.5.23"


@attrs.define(kw_only=True)
class Identity:
    """What the server says it serves. ``update_weights_from_disk`` rewrites both paths to the new
    checkpoint, as SGLang does (``served_model_name`` included, unless it was given at launch)."""

    model_path: str
    tokenizer_path: str
    served_model_name: str | None  # given at launch; None = the model path
    context_len: int
    max_total_num_tokens: int
    max_req_input_len: int
    max_running_requests: int
    enable_lora: bool
    enable_return_routed_experts: bool
    api_key_set: bool
    admin_api_key_set: bool
    created: int = attrs.field(factory=lambda: int(time.time()))

    @property
    def served_name(self) -> str:
        return self.served_model_name or self.model_path


def _hf_config(model_dir: Path) -> dict[str, Any]:
    try:
        value = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


_EMBEDDING = {
    "family": "none",
    "task": "none",
    "execution": "none",
    "attention": "none",
    "pooling": "model_defined",
    "normalize": False,
    "postprocessor": "none",
    "tokenizer_special_tokens": "model_default",
    "supports_dimensions": False,
    "supports_token_embeddings": False,
    "supports_multimodal": False,
    "requires_embedding_flag": False,
    "auto_enable_embedding": False,
    "bcg_eligibility": "disabled",
    "safe_disable_kv_cache": False,
    "safe_disable_radix_cache": False,
    "safe_disable_chunked_prefill": False,
    "enabled": False,
    "matryoshka_dimensions": [],
    "bcg": {"prefill_backend": "disabled", "enabled": False, "capture_token_budget": 4096, "capture_batch_sizes": []},
    "cache": {"kv_cache_disabled": False, "radix_cache_disabled": False, "chunked_prefill_disabled": False},
}


def model_info(identity: Identity, engine: ReferenceEngine) -> dict[str, Any]:
    """``GET /model_info`` (and the deprecated ``/get_model_info``)."""
    config = _hf_config(engine.model_dir)
    return {
        "model_path": identity.model_path,
        "served_model_name": identity.served_name,
        "tokenizer_path": identity.tokenizer_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": engine.weight_version,
        "load_format": "auto",
        "reasoning_parser": None,
        "tool_call_parser": None,
        "disaggregation_mode": "null",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": config.get("model_type", "qwen3"),
        "architectures": config.get("architectures", []),
        "embedding": json.loads(json.dumps(_EMBEDDING)),
    }


def server_info(identity: Identity, engine: ReferenceEngine) -> dict[str, Any]:
    """``GET /server_info`` (and ``/get_server_info``): the server arguments a client needs, plus the
    scheduler's derived limits (``max_req_input_len``, ``max_total_num_tokens``)."""
    args = {
        "model_path": identity.model_path,
        "tokenizer_path": identity.tokenizer_path,
        "served_model_name": identity.served_name,
        "skip_tokenizer_init": False,
        "context_length": None,
        "device": "cpu",
        "max_running_requests": identity.max_running_requests,
        "max_total_tokens": identity.max_total_num_tokens,
        "enable_lora": identity.enable_lora or None,
        "enable_return_routed_experts": identity.enable_return_routed_experts,
        "enable_memory_saver": True,
        "api_key": "<redacted>" if identity.api_key_set else None,
        "admin_api_key": "<redacted>" if identity.admin_api_key_set else None,
        "weight_version": engine.weight_version,
    }
    derived = {"max_total_num_tokens": identity.max_total_num_tokens, "max_req_input_len": identity.max_req_input_len}
    return {
        **args,
        "status": "ready",
        "frontend": "python",
        **derived,
        "internal_states": [args],
        "version": SGLANG_VERSION,
    }


def models(identity: Identity, engine: ReferenceEngine) -> dict[str, Any]:
    """``GET /v1/models``: the base model, then each loaded LoRA adapter with its ``parent``."""
    base = {
        "id": identity.served_name,
        "object": "model",
        "created": identity.created,
        "owned_by": "sglang",
        "root": identity.model_path,
        "parent": None,
        "max_model_len": identity.context_len,
    }
    adapters = [
        {
            "id": name,
            "object": "model",
            "created": identity.created,
            "owned_by": "sglang",
            "root": str(path),
            "parent": identity.served_name,
            "max_model_len": None,
        }
        for name, path in engine.loras.items()
    ]
    return {"object": "list", "data": [base, *adapters]}


def loads(identity: Identity, engine: ReferenceEngine) -> dict[str, Any]:
    """``GET /v1/loads``: one data-parallel rank; running and waiting counts from the engine."""
    state = engine.state()
    now = time.time()
    load = {
        "timestamp": now,
        "dp_rank": 0,
        "num_running_reqs": state.in_flight,
        "num_waiting_reqs": state.queued,
        "num_waiting_uncached_tokens": 0,
        "num_used_tokens": 0,
        "num_total_tokens": 0,
        "num_active_tokens": 0,
        "num_prealloc_ready_tokens": 0,
        "max_total_num_tokens": identity.max_total_num_tokens,
        "max_running_requests": identity.max_running_requests,
        "token_usage": 0.0,
        "gen_throughput": 0.0,
        "cache_hit_rate": 0.0,
        "utilization": 0.0,
        "total_prefill_uncached_tokens": 0,
        "total_prefill_busy_us": 0,
        "decode_moments": [],
        "memory": {
            "weight_gb": 0.0,
            "kv_cache_gb": 0.0,
            "graph_gb": 0.0,
            "token_capacity": identity.max_total_num_tokens,
        },
        "disaggregation": {
            "mode": "null",
            "prefill_bootstrap_queue_reqs": 0,
            "prefill_inflight_queue_reqs": 0,
            "decode_prealloc_queue_reqs": 0,
            "decode_transfer_queue_reqs": 0,
            "decode_retracted_queue_reqs": 0,
            "kv_transfer_speed_gb_s": 0.0,
            "kv_transfer_latency_ms": 0.0,
        },
        "queues": {
            "waiting": state.queued,
            "grammar": 0,
            "paused": state.in_flight if state.paused else 0,
            "retracted": 0,
            "prealloc_ready": 0,
        },
    }
    stamp = datetime.datetime.fromtimestamp(now, tz=datetime.UTC).isoformat()
    return {"timestamp": stamp, "version": SGLANG_VERSION, "accelerator": None, "num_accelerators": 1, "loads": [load]}
