"""Fleet guarantees on two real vLLM processes (and a dead address): the shared checks of ``fleet_checks``."""

from __future__ import annotations

from pathlib import Path

import fleet_checks
import pytest
from fleet_checks import FleetTarget

from backends_core.testing.tinymodel import TinyModels

pytestmark = pytest.mark.live


@pytest.fixture
def target(vllm_dense_url: str, vllm_dense_url_2: str, tiny_models: TinyModels) -> FleetTarget:
    return FleetTarget("vllm", (vllm_dense_url, vllm_dense_url_2), tiny_models.dense, cached_tokens=True)


async def test_balancing_stickiness_and_failover(target: FleetTarget) -> None:
    await fleet_checks.balancing_stickiness_and_failover(target)


async def test_weight_sync_resumes_on_failure_then_syncs(target: FleetTarget, tmp_path: Path) -> None:
    await fleet_checks.weight_sync_resumes_on_failure_then_syncs(target, tmp_path)


async def test_salt_isolates_the_prefix_cache_across_a_sync(target: FleetTarget) -> None:
    await fleet_checks.salt_isolates_the_prefix_cache_across_a_sync(target)


async def test_partial_failure_reports_every_server(target: FleetTarget) -> None:
    await fleet_checks.partial_failure_reports_every_server(target)


async def test_deadlines_fail_per_server(target: FleetTarget) -> None:
    await fleet_checks.deadlines_fail_per_server(target)
