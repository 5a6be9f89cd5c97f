"""Test support for the SGLang backend: :class:`SglangEmulator`, an SGLang-dialect server over the numpy
reference engine (needs ``backends-sglang[testing]``)."""

from __future__ import annotations

from backends_sglang_testing.emulator import SglangEmulator
from backends_testkit.engine import ReferenceEngine

__all__ = ["SglangEmulator", "make_emulator"]


def make_emulator(engine: ReferenceEngine, *, routed_experts: bool = False) -> SglangEmulator:
    """The test kit's emulator factory for this backend (entry point ``backends_testkit.emulators``)."""
    return SglangEmulator(engine, enable_return_routed_experts=routed_experts)
