"""The ``dynamo`` backend passes the conformance suite against its emulator (frontend + one vLLM worker's
system port, the worker reached through ``backend_options.worker_urls``)."""

from __future__ import annotations

from typing import Any, ClassVar

from backends_core.driver import CAPABILITY_HOOKS
from backends_dynamo_testing import WORKER_URL
from backends_testkit.conformance import BackendConformance


class TestDynamoConformance(BackendConformance):
    backend_name = "dynamo"
    expected_capabilities = CAPABILITY_HOOKS
    supports_routed_experts = True
    expected_sampling_features = frozenset({"stop", "extra"})
    backend_options: ClassVar[dict[str, Any]] = {"worker_urls": [WORKER_URL]}
