"""Test support for the ``dynamo`` backend: :class:`DynamoEmulator`, Dynamo 1.6.1's frontend and a vLLM
worker's system port over the reference engine."""

from backends_dynamo.testing.emulator import WORKER_ID, WORKER_URL, DynamoEmulator

__all__ = ["WORKER_ID", "WORKER_URL", "DynamoEmulator"]
