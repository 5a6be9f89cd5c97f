"""Test support for the ``dynamo`` backend: :class:`DynamoEmulator`, Dynamo 1.6.1's frontend and a vLLM
worker's system port over the reference engine."""

from backends_dynamo_testing.emulator import WORKER_ID, WORKER_URL, DynamoEmulator
from backends_testkit.engine import ReferenceEngine

__all__ = ["WORKER_ID", "WORKER_URL", "DynamoEmulator", "make_emulator"]


def make_emulator(engine: ReferenceEngine, *, routed_experts: bool = False) -> DynamoEmulator:
    """The test kit's emulator factory for this backend (entry point ``backends_testkit.emulators``)."""
    return DynamoEmulator(engine, routed_experts=routed_experts)
