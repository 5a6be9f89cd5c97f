"""Fleet guarantees on two real vLLM processes (and a dead address): the shared checks of ``fleet_checks``."""

from __future__ import annotations

import pytest
from fleet_checks import FleetChecks, FleetTarget

from backends_testkit.tinymodel import TinyModels

pytestmark = pytest.mark.live


class TestVllmFleet(FleetChecks):
    @pytest.fixture
    def target(self, vllm_dense_url: str, vllm_dense_url_2: str, tiny_models: TinyModels) -> FleetTarget:
        return FleetTarget("vllm", (vllm_dense_url, vllm_dense_url_2), tiny_models.dense, cached_tokens=True)
