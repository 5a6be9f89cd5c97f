"""Test kit of the vLLM backend: :class:`VllmEmulator`, vLLM 0.32's HTTP API over the reference engine."""

from __future__ import annotations

from backends_testkit.engine import ReferenceEngine
from backends_vllm_testing.emulator import VllmEmulator, WeightTransferState

__all__ = ["VllmEmulator", "WeightTransferState", "make_emulator"]


def make_emulator(engine: ReferenceEngine, *, routed_experts: bool = False) -> VllmEmulator:
    """The test kit's emulator factory for this backend (entry point ``backends_testkit.emulators``)."""
    return VllmEmulator(engine, enable_lora=not engine.is_moe, enable_return_routed_experts=routed_experts)
