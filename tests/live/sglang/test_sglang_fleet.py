"""Fleet guarantees on two real SGLang servers (and a dead address): the shared checks of ``fleet_checks``."""

from __future__ import annotations

import pytest
from fleet_checks import FleetChecks, FleetTarget

from backends_testkit.tinymodel import TinyModels

pytestmark = pytest.mark.live


class TestSglangFleet(FleetChecks):
    @pytest.fixture
    def target(self, sglang_dense_url: str, sglang_dense_url_2: str, tiny_models: TinyModels) -> FleetTarget:
        return FleetTarget("sglang", (sglang_dense_url, sglang_dense_url_2), tiny_models.dense, cached_tokens=True)
