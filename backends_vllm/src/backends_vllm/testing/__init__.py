"""Test kit of the vLLM backend: :class:`VllmEmulator`, vLLM 0.32's HTTP API over the reference engine."""

from __future__ import annotations

from backends_vllm.testing.emulator import VllmEmulator, WeightTransferState

__all__ = ["VllmEmulator", "WeightTransferState"]
