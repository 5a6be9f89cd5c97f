"""The sglang backend's conformance suite against real SGLang 0.5.23 on the CPU: dense server (LoRA) and the
MoE server with routed experts, whose rows the suite checks end to end."""

from __future__ import annotations

import pytest

from backends_core import SAMPLING_FEATURES
from backends_core.driver import CAPABILITY_HOOKS
from backends_testkit.conformance import BackendConformance

pytestmark = pytest.mark.live


@pytest.mark.uses_live_servers("sglang_dense_url", "sglang_moe_url")
class TestSglangLiveConformance(BackendConformance):
    backend_name = "sglang"
    expected_capabilities = CAPABILITY_HOOKS
    supports_routed_experts = True
    live_moe = True
    expected_sampling_features = SAMPLING_FEATURES
    deterministic_seeds = False  # sampling_seed does not reproduce on CPU SGLang without deterministic inference
    tokenize_joins_parts_like_vllm = False  # its chat route joins text parts with " ", the client with "\n"

    @pytest.fixture
    def live_url(self, model_kind: str, request: pytest.FixtureRequest) -> str:
        return str(request.getfixturevalue("sglang_moe_url" if model_kind == "moe" else "sglang_dense_url"))
