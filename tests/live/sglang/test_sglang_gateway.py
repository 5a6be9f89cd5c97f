"""The gateway (``backends_gateway``) in front of real SGLang 0.5.23 (CPU), driven by the official ``openai`` SDK (and
the ``anthropic`` SDK on the Messages API) as an unmodified harness drives it; the trajectory checked id by id and
against SGLang's teacher scores (see ``tests/live/gateway_checks.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from gateway_checks import GATEWAY_TURNS, check_anthropic_rollout, check_gateway_rollout

from backends_core import Client, ClientConfig
from backends_testkit.tinymodel import TinyModels

pytestmark = pytest.mark.live


async def test_a_harness_session_through_the_gateway_on_real_sglang_is_one_exact_branch(
    sglang_dense_url: str, tiny_models: TinyModels, tmp_path: Path
) -> None:
    config = ClientConfig(
        backend="sglang",
        base_url=sglang_dense_url,
        model="tiny-qwen3",
        tokenizer=str(tiny_models.dense),
        stateless=GATEWAY_TURNS,
    )
    async with Client(config) as client:
        figures = await check_gateway_rollout(client, tmp_path / "gateway.db", name="sglang")
        anthropic_figures = await check_anthropic_rollout(client, tmp_path / "anthropic.db", name="sglang")
    assert figures.turns == anthropic_figures.turns == 3 and all(anthropic_figures.reused_ids[1:])
