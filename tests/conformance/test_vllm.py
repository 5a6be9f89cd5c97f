"""The vLLM backend passes the conformance suite on its emulator, over both transports."""

from __future__ import annotations

from typing import Any, ClassVar

from backends_core import SAMPLING_FEATURES
from backends_core.driver import CAPABILITY_HOOKS
from backends_testkit.conformance import BackendConformance

VLLM_CAPABILITIES = CAPABILITY_HOOKS


class TestVllmConformance(BackendConformance):
    backend_name = "vllm"
    expected_capabilities = VLLM_CAPABILITIES
    supports_routed_experts = True
    expected_sampling_features = SAMPLING_FEATURES


class TestVllmCompletionsTransportConformance(TestVllmConformance):
    backend_options: ClassVar[dict[str, Any]] = {"transport": "completions"}
