"""Images through the gateway on real vLLM (the tiny Qwen2.5-VL model), driven by the official SDKs as unmodified
harnesses: an image in the first turn of a chat, later turns reusing the earlier turns' exact ids (the image at the
span vLLM widened it into, never re-rendered), and a trajectory that carries ids, spans and the image, which the
engine's teacher scoring of the whole sequence with that image agrees with."""

from __future__ import annotations

import base64
import io
import itertools
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import numpy as np
import PIL.Image
import pytest
import pytest_asyncio
from gateway_checks import (
    GATEWAY_TURNS,
    TEACHER_ATOL,
    chat,
    check_extends,
    close,
    openai_client,
    reply_of,
    sampled_logprobs,
    trajectory,
)

from backends_core import Client, ClientConfig, ImageSpan
from backends_core.images import Image
from backends_gateway import Gateway, GatewayLimits, SQLiteStore, Trajectories, serve
from backends_testkit.live import async_probe_client
from backends_testkit.tinymodel import default_models_dir
from backends_testkit.tinymodel_vl import IMAGE_PAD_ID, build_tiny_vl_model

MODEL = "tiny-qwen2_5-vl"
FOLLOW_UPS = ("What colours does it have?", "Which one is brightest?")


def png(seed: int, size: tuple[int, int] = (56, 84)) -> bytes:
    buffer = io.BytesIO()
    PIL.Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


@pytest_asyncio.fixture
async def client(vllm_vl_url: str) -> AsyncIterator[Client]:
    config = ClientConfig(
        backend="vllm",
        base_url=vllm_vl_url,
        model=MODEL,
        tokenizer=str(build_tiny_vl_model(default_models_dir())),
        stateless=GATEWAY_TURNS,
    )
    async with Client(config) as c:
        yield c


async def vllm_render(url: str, messages: list[dict[str, Any]]) -> tuple[list[int], list[ImageSpan]]:
    """vLLM's own rendering of ``messages`` with its multimodal processor's expansion of each image."""
    async with async_probe_client(120, base_url=url) as http:
        response = await http.post("/v1/chat/completions/render", json={"model": MODEL, "messages": messages})
    assert response.status_code == 200, f"vLLM's render: {response.status_code} {response.text[:2000]}"
    body = response.json()
    placed = (body.get("features") or {}).get("mm_placeholders") or {}
    return body["token_ids"], [ImageSpan(p["offset"], p["offset"] + p["length"]) for p in placed.get("image", [])]


@pytest.mark.asyncio
async def test_an_openai_sdk_chat_with_an_image_extends_exact_ids_and_the_trajectory_carries_the_image(
    client: Client, vllm_vl_url: str, tmp_path: Path
) -> None:
    picture = png(1)
    url = Image(data=picture).data_url()
    session = f"gw-image-{int(time.time() * 1000)}"
    first = {
        "role": "user",
        "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": url}},
        ],
    }
    # no system message: vLLM's render passes every content as parts, which the tiny model's template does not take
    # for a system message (its oracle answers "can only concatenate str (not "list") to str")
    messages: list[dict[str, Any]] = [first]
    expected_ids, expected_spans = await vllm_render(vllm_vl_url, messages)
    completions = []
    limits = GatewayLimits(max_completion_tokens=64)
    async with Gateway(client, SQLiteStore(tmp_path / "gw.db"), limits=limits) as gateway, serve(gateway) as gw:
        started = time.monotonic()
        async with openai_client(f"{gw}/s/{session}/v1") as oai:
            for index in range(3):
                if completions:
                    messages.append(reply_of(completions[-1]))
                    messages.append({"role": "user", "content": FOLLOW_UPS[index - 1]})
                completions.append(await chat(oai, MODEL, messages, stream=index % 2 == 0))
        seconds = time.monotonic() - started
        body = await trajectory(gw, session)
        await close(gw, session)
    turns = body["turns"]
    # turn 1 ran vLLM's own expansion of the image; every later turn holds it at that very span
    assert turns[0]["prompt_ids"] == expected_ids
    (span,) = expected_spans
    assert span.length > 1 and set(expected_ids[span.start : span.end]) == {IMAGE_PAD_ID}
    assert [t["image_spans"] for t in turns] == [[{"start": span.start, "end": span.end}]] * 3
    assert [t["images"] for t in turns] == [[url]] * 3
    for before, after in itertools.pairwise(turns):
        check_extends(before, after)  # the previous turn's exact ids, all reused: never re-rendered
    assert (body["bridged"], body["branched"], body["rerendered"]) == (2, 0, 0), body
    for turn, completion in zip(turns, completions, strict=True):
        np.testing.assert_allclose(sampled_logprobs(completion), turn["logprobs"], rtol=0, atol=1e-6)
        assert completion.choices[0].message.content == (turn["reply"].get("content") or "")

    (branch,) = body["branches"]
    assert branch["image_spans"] == [{"start": span.start, "end": span.end}] and branch["images"] == [url]
    mask = np.asarray(branch["loss_mask"], dtype=bool)
    assert not mask[span.start : span.end].any()
    assert int(mask.sum()) == sum(len(t["completion_ids"]) for t in turns)
    (sample,) = Trajectories(tmp_path / "gw.db").get(session).samples
    assert sample.images == (Image(data=picture),) and sample.images[0].data == picture
    assert sample.image_spans == (span,) and sample.input_ids.tolist() == branch["input_ids"]

    # the trainer's view is exact: the engine scores the whole sequence with its image as it sampled it
    teacher = await client.teacher_logprobs(
        sample.input_ids.tolist(), images=sample.images, image_spans=sample.image_spans
    )
    scored = np.asarray(teacher.logprobs, dtype=np.float64)
    diff = float(np.max(np.abs(scored[mask] - sample.logprobs[mask].astype(np.float64))))
    sys.stderr.write(
        f"\n[gateway images] openai sdk: 3 turns, image span [{span.start}, {span.end}) ({span.length} ids), "
        f"reused ids {[t['reused_ids'] for t in turns]}, completion ids "
        f"{[len(t['completion_ids']) for t in turns]}, sequence {len(sample.input_ids)} ids, "
        f"max |Δ logprob| vs teacher {diff:.3g}, harness {seconds:.1f}s\n"
    )
    assert diff <= TEACHER_ATOL


@pytest.mark.asyncio
async def test_an_anthropic_sdk_turn_with_an_image_block_runs_vllms_expansion_and_the_next_turn_extends_it(
    client: Client, vllm_vl_url: str, tmp_path: Path
) -> None:
    picture = png(2)
    url = Image(data=picture).data_url()
    session = f"gw-image-anthropic-{int(time.time() * 1000)}"
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(picture).decode()},
    }
    messages: list[dict[str, Any]] = [{"role": "user", "content": [image, {"type": "text", "text": "Describe it."}]}]
    expected_ids, expected_spans = await vllm_render(
        vllm_vl_url,
        [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe it."}],
            }
        ],
    )
    async with Gateway(client, SQLiteStore(tmp_path / "gw.db")) as gateway, serve(gateway) as gw:
        async with anthropic.AsyncAnthropic(
            base_url=f"{gw}/s/{session}", api_key="x", max_retries=0, timeout=300.0
        ) as sdk:
            one = await sdk.messages.create(model=MODEL, max_tokens=8, messages=messages)
            messages += [{"role": "assistant", "content": one.content}, {"role": "user", "content": "Shorter."}]
            two = await sdk.messages.create(model=MODEL, max_tokens=8, messages=messages)
        body = await trajectory(gw, session)
        await close(gw, session)
    first, second = body["turns"]
    (span,) = expected_spans
    assert first["prompt_ids"] == expected_ids and one.usage.input_tokens == len(expected_ids)
    assert first["image_spans"] == second["image_spans"] == [{"start": span.start, "end": span.end}]
    assert first["images"] == second["images"] == [url]
    check_extends(first, second)
    assert two.usage.output_tokens == len(second["completion_ids"]) > 0
    sys.stderr.write(
        f"\n[gateway images] anthropic sdk: image span [{span.start}, {span.end}), prompt {len(expected_ids)} ids, "
        f"turn 2 reused {second['reused_ids']} ids\n"
    )
