"""The ``sglang`` backend passes the conformance suite against its emulator (its make_emulator hook) and, with
``--backend-url ... --backend sglang``, against a real SGLang server."""

from __future__ import annotations

from backends_core import SAMPLING_FEATURES
from backends_testkit.conformance import BackendConformance


class TestSglangConformance(BackendConformance):
    backend_name = "sglang"
    expected_capabilities = frozenset(
        {
            "teacher_logprobs",
            "tokenize_messages",
            "admin_health",
            "admin_ready",
            "admin_state",
            "admin_pause",
            "admin_resume",
            "admin_flush_cache",
            "admin_abort",
            "admin_update_weights",
            "admin_init_weight_transfer",
            "admin_destroy_weight_transfer",
            "admin_update_weights_distributed",
            "admin_load_lora",
            "admin_unload_lora",
            "admin_sleep",
            "admin_wake",
            "post_generate_stream",
        }
    )
    supports_routed_experts = True
    expected_sampling_features = SAMPLING_FEATURES
    tokenize_joins_parts_like_vllm = False  # its chat route joins text parts with " ", the client with "\n"
