"""Open sampling against real Dynamo 1.6.1: structured output (``guided_*``) honoured by Dynamo's vLLM worker
when ``backend_options.structured_output`` says so, accepted but ignored by the mocker (why the backend refuses it
unless told), and stop strings matched by the frontend. The conformance suite's open-sampling section
(``test_dynamo_backend_conformance_live.py``) checks stop strings and the refusals as well."""

from __future__ import annotations

import json
from typing import Any

import pytest

from backends_core import Client, ClientConfig, JsonSchema, SamplingParams, UnsupportedOperationError
from backends_testkit.live import async_probe_client

pytestmark = pytest.mark.live

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
MESSAGES = [{"role": "user", "content": "Give me a JSON object."}]


def config_for(deployment: Any, **options: Any) -> ClientConfig:
    return ClientConfig(
        backend="dynamo",
        base_url=deployment.frontend_url,
        model=deployment.model,
        tokenizer=str(deployment.extra["model_dir"]),
        backend_options={"worker_urls": list(deployment.worker_system_urls), **options},
    )


async def test_vllm_worker_honours_json_schema_when_declared(dynamo_vllm: Any) -> None:
    sampling = SamplingParams(max_tokens=200, temperature=1.0, seed=1, structured=JsonSchema(SCHEMA))
    async with Client(config_for(dynamo_vllm)) as client:
        with pytest.raises(UnsupportedOperationError, match=r"sampling\.structured\.json_schema"):
            await client.generate(messages=MESSAGES, sampling=sampling)
    async with Client(config_for(dynamo_vllm, structured_output=True)) as client:
        result = await client.generate(messages=MESSAGES, sampling=sampling)
        text = client.tokenizer.decode(list(result.completion_ids), skip_special_tokens=True)
    assert result.finish_reason == "stop", text
    value = json.loads(text)
    assert isinstance(value, dict) and type(value["a"]) is int


async def test_vllm_worker_stop_string(dynamo_vllm: Any) -> None:
    async with Client(config_for(dynamo_vllm)) as client:
        greedy = SamplingParams(max_tokens=12, temperature=0.0)
        free = await client.generate(prompt_ids=[1, 2, 3], sampling=greedy)

        def text(k: int) -> str:
            return str(client.tokenizer.decode(list(free.completion_ids[:k]), skip_special_tokens=True))

        assert len(free.completion_ids) >= 3, free
        stop = text(3)[-1]
        k = next(j for j in range(1, 13) if stop in text(j))
        result = await client.generate(
            prompt_ids=[1, 2, 3],
            sampling=SamplingParams(max_tokens=12, temperature=0.0, stop=[stop]),
        )
        with pytest.raises(UnsupportedOperationError, match="ignores stop strings when ignore_eos is set"):
            await client.generate(
                prompt_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=16, stop=[stop], ignore_eos=True)
            )
    assert result.completion_ids == free.completion_ids[:k]
    assert (result.finish_reason, result.stop_reason) == ("stop", stop)


async def test_mocker_accepts_guided_json_and_ignores_it(dynamo_mocker: Any) -> None:
    body = {
        "model": dynamo_mocker.model,
        "messages": MESSAGES,
        "max_tokens": 12,
        "guided_json": SCHEMA,
        "nvext": {"extra_fields": ["completion_token_ids"]},
    }
    async with async_probe_client(120.0) as http:
        response = await http.post(f"{dynamo_mocker.frontend_url}/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    content = response.json()["choices"][0]["message"]["content"] or ""
    try:
        parsed = json.loads(content)
    except ValueError:
        parsed = None
    assert not (isinstance(parsed, dict) and type(parsed.get("a")) is int), content  # random ids, unconstrained
