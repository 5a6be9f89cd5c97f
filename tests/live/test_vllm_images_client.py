"""Images through the client on real vLLM (tiny Qwen2.5-VL): the prompt ids a result reports are the ones vLLM ran,
multi-turn reuses them exactly, teacher scoring agrees with generation, and a weight update reaches the image.

The oracle for "the engine's own expansion" is vLLM's ``/v1/chat/completions/render``, which renders the same
messages and runs the model's multimodal processor on them."""

from __future__ import annotations

import io
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import pytest
import pytest_asyncio

from backends_core import Client, ClientConfig, ImageSpan, SamplingParams
from backends_core.errors import BridgeError, UnsupportedOperationError
from backends_core.images import Image
from backends_testkit.live import async_probe_client
from backends_testkit.tinymodel import default_models_dir, write_perturbed_weights
from backends_testkit.tinymodel_vl import build_tiny_vl_model

MODEL = "tiny-qwen2_5-vl"
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def picture(seed: int, size: tuple[int, int] = (56, 56)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)


def question(text: str, image: np.ndarray) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": text}, {"type": "image", "image": image}]}


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return build_tiny_vl_model(default_models_dir())


@pytest_asyncio.fixture
async def client(vllm_vl_url: str, model_dir: Path) -> AsyncIterator[Client]:
    config = ClientConfig(backend="vllm", base_url=vllm_vl_url, model=MODEL, tokenizer=str(model_dir))
    async with Client(config) as c:
        yield c


async def render_on_vllm(url: str, messages: list[dict[str, Any]]) -> tuple[list[int], list[ImageSpan]]:
    """vLLM's own rendering and expansion of ``messages`` (images as data URLs, as the client sends them)."""
    wire = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = [
                {"type": "image_url", "image_url": {"url": png_url(p["image"])}} if p["type"] == "image" else p
                for p in content
            ]
        wire.append({**m, "content": content})
    async with async_probe_client(120, base_url=url) as http:
        response = await http.post("/v1/chat/completions/render", json={"model": MODEL, "messages": wire})
    response.raise_for_status()
    body = response.json()
    placed = (body.get("features") or {}).get("mm_placeholders") or {}
    return body["token_ids"], [ImageSpan(p["offset"], p["offset"] + p["length"]) for p in placed.get("image", [])]


def png_url(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    PIL.Image.fromarray(array).save(buffer, format="PNG")
    return Image(data=buffer.getvalue()).data_url()


@pytest.mark.asyncio
async def test_prompt_ids_are_vllms_own_expansion_on_generate_and_stream(client: Client, vllm_vl_url: str) -> None:
    messages = [question("What is in this picture?", picture(1))]
    expected_ids, expected_spans = await render_on_vllm(vllm_vl_url, messages)
    result = await client.generate(messages=messages, sampling=GREEDY)
    assert list(result.prompt_ids) == expected_ids
    assert list(result.image_spans) == expected_spans and expected_spans[0].length == 4  # 56x56: a 2x2 merged grid
    assert result.usage is not None and result.usage.prompt_tokens == len(expected_ids)
    # the message spans cover the widened ids: the user message holds its image's whole span
    user = next(s for s in result.message_spans if s.role == "user")
    assert user.start <= expected_spans[0].start and expected_spans[0].end <= user.end
    async with client.stream(messages=messages, sampling=GREEDY) as stream:
        async for _ in stream:
            pass
    streamed = stream.result
    assert streamed.prompt_ids == result.prompt_ids and streamed.image_spans == result.image_spans
    assert streamed.completion_ids == result.completion_ids
    group = await client.generate_group(messages=messages, n=3, sampling=SamplingParams(max_tokens=4, temperature=1.0))
    assert [(g.prompt_ids, g.image_spans) for g in group] == [(result.prompt_ids, result.image_spans)] * 3


@pytest.mark.asyncio
async def test_two_images_of_different_sizes_are_placed_in_order(client: Client, vllm_vl_url: str) -> None:
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": picture(2, (56, 112))},
                {"type": "text", "text": "and"},
                {"type": "image", "image": picture(3)},
            ],
        }
    ]
    expected_ids, expected_spans = await render_on_vllm(vllm_vl_url, messages)
    result = await client.generate(messages=messages, sampling=GREEDY)
    assert list(result.prompt_ids) == expected_ids and list(result.image_spans) == expected_spans
    assert [s.length for s in result.image_spans] == [8, 4]


@pytest.mark.asyncio
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
            await c.generate(messages=[question("What is it?", picture(1))], sampling=GREEDY)


@pytest.mark.asyncio
async def test_three_turns_reuse_the_first_turns_widened_image_exactly(client: Client, vllm_vl_url: str) -> None:
    conversation = client.conversation()
    first = await conversation.send([question("Describe the picture.", picture(4))], sampling=GREEDY)
    second = await conversation.send([{"role": "user", "content": "And the colours?"}], sampling=GREEDY)
    third = await conversation.send([{"role": "user", "content": "Thanks. One word?"}], sampling=GREEDY)
    assert second.prompt_ids[: len(first.token_ids)] == first.token_ids
    assert third.prompt_ids[: len(second.token_ids)] == second.token_ids
    assert first.image_spans == second.image_spans == third.image_spans and first.image_spans[0].length == 4
    # the last prompt, rendered whole by vLLM from the conversation's messages, is the same text: the bridge added
    # no token the template would not write, and the image is widened where vLLM widens it
    history = [*conversation.messages, client.parse_completion(third)]
    _, expected_spans = await render_on_vllm(vllm_vl_url, history)
    assert list(third.image_spans) == expected_spans


@pytest.mark.asyncio
async def test_teacher_logprobs_over_an_image_sequence_equal_the_generation_logprobs(client: Client) -> None:
    result = await client.generate(messages=[question("Name it.", picture(5))], sampling=GREEDY)
    scored = await client.teacher_logprobs(result.token_ids, images=result.images, image_spans=result.image_spans)
    tail = scored.logprobs[len(result.prompt_ids) :]
    np.testing.assert_allclose(tail, result.logprobs, atol=1e-4)


@pytest.mark.asyncio
async def test_a_weight_update_changes_what_the_image_is_seen_as(
    client: Client, model_dir: Path, tmp_path: Path, vllm_vl_url: str
) -> None:
    messages = [question("What is in this picture?", picture(6))]
    before = await client.generate(messages=messages, sampling=GREEDY)
    scored_before = await score(client, before)
    perturbed = write_perturbed_weights(model_dir, tmp_path / "perturbed", seed=11, scale=0.05)
    try:
        await client.admin.weight_sync(path=str(perturbed), version="images-v2")
        after = await score(client, before)
        # the same sequence under the new weights, its image sent under a name vLLM has never cached
        fresh = await score_with_fresh_identity(vllm_vl_url, before)
    finally:
        await client.admin.weight_sync(path=str(model_dir), version="images-v1")
    image = slice(before.image_spans[0].end, len(before.token_ids))  # every position that sees the image
    assert np.max(np.abs(after.logprobs[image] - scored_before.logprobs[image])) > 1e-2
    np.testing.assert_allclose(after.logprobs[1:], fresh[1:], atol=1e-5)
    restored = await score(client, before)
    np.testing.assert_allclose(restored.logprobs[1:], scored_before.logprobs[1:], atol=1e-5)


async def score(client: Client, result: Any) -> Any:
    return await client.teacher_logprobs(result.token_ids, images=result.images, image_spans=result.image_spans)


async def score_with_fresh_identity(url: str, result: Any) -> np.ndarray:
    from backends_core.images import collapse

    body = {
        "model": MODEL,
        "token_ids": list(collapse(result.token_ids, result.image_spans)),
        "content_parts": [{"type": "image_url", "url": result.images[0].data_url(), "uuid": f"fresh-{uuid.uuid4()}"}],
        "sampling_params": {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0, "detokenize": False},
    }
    async with async_probe_client(120, base_url=url) as http:
        response = await http.post("/inference/v1/generate", json=body)
    response.raise_for_status()
    rows = response.json()["prompt_logprobs"]
    ids = result.token_ids
    return np.array([np.nan] + [rows[i][str(ids[i])]["logprob"] for i in range(1, len(ids))], dtype=np.float32)


@pytest.mark.asyncio
async def test_a_stateless_session_and_the_stateless_extension_reuse_the_widened_image(client: Client) -> None:
    history: list[dict[str, Any]] = [question("Look at this.", picture(7))]
    first = await client.generate(messages=history, sampling=GREEDY, session="images")
    history += [client.parse_completion(first), {"role": "user", "content": "More?"}]
    second = await client.generate(messages=history, sampling=GREEDY, session="images")
    assert second.prompt_ids[: len(first.token_ids)] == first.token_ids and second.reused_ids == len(first.token_ids)
    assert second.image_spans == first.image_spans
    history += [client.parse_completion(second), {"role": "user", "content": "Last one."}]
    third = await client.generate(messages=history, previous=second, sampling=GREEDY)
    assert third.prompt_ids[: len(second.token_ids)] == second.token_ids and third.image_spans == first.image_spans
    # a history whose picture is another one is not the conversation whose ids hold the first picture
    changed = [question("Look at this.", picture(8)), *history[1:3]]
    with pytest.raises(BridgeError, match="image"):
        await client.generate(messages=changed, previous=first, sampling=GREEDY)
