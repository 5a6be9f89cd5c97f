"""Images through the client on real vLLM (tiny Qwen2.5-VL): the checks of ``image_checks.py``, with vLLM's
``/v1/chat/completions/render`` (the same messages rendered and run through the model's multimodal processor by
vLLM itself) as the oracle of the engine's widening; and the ``completions`` transport refusing images."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import image_checks
import numpy as np
import pytest
import pytest_asyncio

from backends_core import Client, ClientConfig, GenerateResult, Image, ImageSpan
from backends_core.errors import UnsupportedOperationError
from backends_core.images import collapse
from backends_testkit.live import async_probe_client
from backends_testkit.tinymodel import default_models_dir
from backends_testkit.tinymodel_vl import build_tiny_vl_model

pytestmark = pytest.mark.live

MODEL = "tiny-qwen2_5-vl"


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return build_tiny_vl_model(default_models_dir())


@pytest_asyncio.fixture
async def client(vllm_vl_url: str, model_dir: Path) -> AsyncIterator[Client]:
    config = ClientConfig(backend="vllm", base_url=vllm_vl_url, model=MODEL, tokenizer=str(model_dir))
    async with Client(config) as c:
        yield c


def on_the_wire(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with every image part as the OpenAI ``image_url`` part (a PNG data URL) vLLM's chat routes take."""
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = [
                {"type": "image_url", "image_url": {"url": Image.of(p["image"]).data_url()}}
                if p["type"] == "image"
                else p
                for p in content
            ]
        out.append({**m, "content": content})
    return out


def render_oracle(url: str) -> image_checks.Oracle:
    async def render(messages: list[dict[str, Any]]) -> tuple[list[int], list[ImageSpan]]:
        async with async_probe_client(120, base_url=url) as http:
            response = await http.post(
                "/v1/chat/completions/render", json={"model": MODEL, "messages": on_the_wire(messages)}
            )
        response.raise_for_status()
        body = response.json()
        placed = (body.get("features") or {}).get("mm_placeholders") or {}
        return body["token_ids"], [ImageSpan(p["offset"], p["offset"] + p["length"]) for p in placed.get("image", [])]

    return render


def fresh_score(url: str) -> image_checks.FreshScore:
    """Prompt logprobs of a result's sequence with its image under a ``uuid`` vLLM has never seen."""

    async def fresh(result: GenerateResult) -> np.ndarray:
        body = {
            "model": MODEL,
            "token_ids": list(collapse(result.token_ids, result.image_spans)),
            "content_parts": [
                {"type": "image_url", "url": image.data_url(), "uuid": f"fresh-{uuid.uuid4()}"}
                for image in result.images
            ],
            "sampling_params": {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0, "detokenize": False},
        }
        async with async_probe_client(120, base_url=url) as http:
            response = await http.post("/inference/v1/generate", json=body)
        response.raise_for_status()
        rows, ids = response.json()["prompt_logprobs"], result.token_ids
        return np.array([np.nan] + [rows[i][str(ids[i])]["logprob"] for i in range(1, len(ids))], dtype=np.float32)

    return fresh


async def test_prompt_ids_are_vllms_own_widening(client: Client, vllm_vl_url: str) -> None:
    await image_checks.check_the_engines_widening(client, render_oracle(vllm_vl_url))


async def test_the_completions_transport_refuses_an_image_before_sending(vllm_vl_url: str, model_dir: Path) -> None:
    config = ClientConfig(
        backend="vllm",
        base_url=vllm_vl_url,
        model=MODEL,
        tokenizer=str(model_dir),
        backend_options={"transport": "completions"},
    )
    async with Client(config) as c:
        with pytest.raises(UnsupportedOperationError, match=r"messages\[0\]\.content\[1\].*completions"):
            await c.generate(
                messages=[image_checks.question("What is it?", image_checks.picture(1))], sampling=image_checks.GREEDY
            )


async def test_three_turns_reuse_the_first_turns_widened_image_exactly(client: Client, vllm_vl_url: str) -> None:
    await image_checks.check_three_turns(client, render_oracle(vllm_vl_url))


async def test_a_stateless_session_and_the_stateless_extension_reuse_the_widened_image(client: Client) -> None:
    await image_checks.check_stateless_paths(client)


async def test_teacher_logprobs_over_an_image_sequence_equal_the_generation_logprobs(client: Client) -> None:
    await image_checks.check_teacher_matches_generation(client, atol=1e-4)


async def test_a_weight_update_changes_what_the_image_is_seen_as(
    client: Client, model_dir: Path, tmp_path: Path, vllm_vl_url: str
) -> None:
    await image_checks.check_a_weight_update_reaches_the_image(
        client, model_dir, tmp_path, fresh_score(vllm_vl_url), atol=1e-5
    )
