"""The built-in ``reference`` backend passes the conformance suite against its emulator (its make_emulator hook)."""

from __future__ import annotations

from backends_core.driver import CAPABILITY_HOOKS
from backends_testkit.conformance import BackendConformance


class TestReferenceConformance(BackendConformance):
    backend_name = "reference"
    expected_capabilities = CAPABILITY_HOOKS - {
        "admin_init_weight_transfer",
        "admin_update_weights_distributed",
        "admin_destroy_weight_transfer",
    }
    supports_routed_experts = True
    expected_sampling_features = frozenset({"stop", "logit_bias"})
