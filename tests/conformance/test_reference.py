"""The built-in ``reference`` backend passes the conformance suite against its emulator."""

from __future__ import annotations

import httpx

from backends_core.driver import CAPABILITY_HOOKS
from backends_core.reference.emulator import ReferenceEmulator
from backends_core.testing.conformance import BackendConformance
from backends_core.testing.engine import ReferenceEngine


class TestReferenceConformance(BackendConformance):
    backend_name = "reference"
    expected_capabilities = CAPABILITY_HOOKS - {"admin_init_weight_transfer", "admin_update_weights_distributed"}
    supports_routed_experts = True

    def emulator_transport(self, engine: ReferenceEngine) -> httpx.AsyncBaseTransport:
        return ReferenceEmulator(engine).transport()
