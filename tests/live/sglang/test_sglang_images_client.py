"""Images through the client on real SGLang 0.5.23 (CPU, tiny Qwen2.5-VL): the checks of ``image_checks.py``, with
a raw ``/generate`` of the rendered ids (one placeholder per image) as the oracle of SGLang's widening."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import image_checks
import numpy as np
import pytest
import pytest_asyncio

from backends_core import Client, ClientConfig, GenerateResult, ImageSpan
from backends_core.images import collapse
from backends_core.multiturn.messages import images_of
from backends_testkit.live import async_probe_client
from backends_testkit.tinymodel import default_models_dir
from backends_testkit.tinymodel_vl import IMAGE_PAD_ID, build_tiny_vl_model

pytestmark = [pytest.mark.live, pytest.mark.slow]

MODEL = "tiny-qwen2_5-vl"


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return build_tiny_vl_model(default_models_dir())


@pytest_asyncio.fixture
async def client(sglang_vl_url: str, model_dir: Path) -> AsyncIterator[Client]:
    config = ClientConfig(backend="sglang", base_url=sglang_vl_url, model=MODEL, tokenizer=str(model_dir))
    async with Client(config) as c:
        yield c


async def _generate(url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with async_probe_client(120, base_url=url) as http:
        response = await http.post("/generate", json=body)
    response.raise_for_status()
    answer: dict[str, Any] = response.json()
    return answer


def widening_oracle(url: str, client: Client) -> image_checks.Oracle:
    """SGLang's own widening of the messages as the template renders them (the client renders: SGLang's chat route
    is not token-in), each image under a fresh key."""

    async def widen(messages: list[dict[str, Any]]) -> tuple[list[int], list[ImageSpan]]:
        images = images_of(messages)
        body = {
            "input_ids": client.render(messages),
            "image_data": [image.data_url() for image in images],
            "mm_hashes": [hashlib.sha256(uuid.uuid4().bytes).hexdigest() for _ in images],
            "return_prompt_token_ids": True,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        }
        ids = (await _generate(url, body))["prompt_token_ids"]
        spans: list[ImageSpan] = []
        for i, token in enumerate(ids):
            if token == IMAGE_PAD_ID:
                if spans and spans[-1].end == i:
                    spans[-1] = ImageSpan(spans[-1].start, i + 1)
                else:
                    spans.append(ImageSpan(i, i + 1))
        return ids, spans

    return widen


def fresh_score(url: str) -> image_checks.FreshScore:
    """Input logprobs of a result's sequence with its image under an ``mm_hashes`` key SGLang has never seen."""

    async def fresh(result: GenerateResult) -> np.ndarray:
        body = {
            "input_ids": list(collapse(result.token_ids, result.image_spans)),
            "image_data": [image.data_url() for image in result.images],
            "mm_hashes": [hashlib.sha256(uuid.uuid4().bytes).hexdigest() for _ in result.images],
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        entries = (await _generate(url, body))["meta_info"]["input_token_logprobs"]
        return np.array([np.nan if e[0] is None else e[0] for e in entries], dtype=np.float32)

    return fresh


async def test_prompt_ids_are_sglangs_own_widening(client: Client, sglang_vl_url: str) -> None:
    await image_checks.check_the_engines_widening(client, widening_oracle(sglang_vl_url, client))


async def test_three_turns_reuse_the_first_turns_widened_image_exactly(client: Client, sglang_vl_url: str) -> None:
    await image_checks.check_three_turns(client, widening_oracle(sglang_vl_url, client))


async def test_a_stateless_session_and_the_stateless_extension_reuse_the_widened_image(client: Client) -> None:
    await image_checks.check_stateless_paths(client)


async def test_teacher_logprobs_over_an_image_sequence_equal_the_generation_logprobs(client: Client) -> None:
    await image_checks.check_teacher_matches_generation(client, atol=1e-4)


async def test_a_weight_update_reaches_the_image_although_sglang_keeps_old_features(
    client: Client, model_dir: Path, tmp_path: Path, sglang_vl_url: str
) -> None:
    """SGLang never drops an image's cached features (``SGLANG_IMAGES.md``): only the client's key, salted with the
    weight version, makes the image seen by the new weights."""
    await image_checks.check_a_weight_update_reaches_the_image(
        client, model_dir, tmp_path, fresh_score(sglang_vl_url), atol=1e-4
    )
