"""What every engine that takes images must show through the client, live (tiny Qwen2.5-VL): the prompt ids a
result reports are the engine's own widening, a group and a stream report the same, multi-turn paths reuse the
widened image exactly, teacher scoring agrees with generation, and a weight update reaches the image.

Each engine's test module gives the engine's own oracle (vLLM: ``/v1/chat/completions/render``; SGLang: a raw
``/generate`` of the collapsed ids) and the way to score a sequence under a name the engine never cached."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from backends_core import Client, GenerateResult, ImageSpan, SamplingParams
from backends_core.errors import BridgeError
from backends_testkit.tinymodel import write_perturbed_weights

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)

#: ``messages`` -> the ids the engine runs for them and each image's span there, asked of the engine directly.
Oracle = Callable[[list[dict[str, Any]]], Awaitable[tuple[list[int], list[ImageSpan]]]]
#: a result -> its sequence's teacher logprobs with its images under keys the engine has never seen.
FreshScore = Callable[[GenerateResult], Awaitable[np.ndarray]]


def picture(seed: int, size: tuple[int, int] = (56, 56)) -> np.ndarray:
    """Seeded random RGB pixels, ``size`` = (height, width)."""
    return np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)


def question(text: str, image: np.ndarray) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": text}, {"type": "image", "image": image}]}


async def check_the_engines_widening(client: Client, oracle: Oracle) -> None:
    """One image (generate, stream, group) and two images of different sizes: prompt ids and spans are the engine's."""
    messages = [question("What is in this picture?", picture(1))]
    expected_ids, expected_spans = await oracle(messages)
    result = await client.generate(messages=messages, sampling=GREEDY)
    assert list(result.prompt_ids) == expected_ids
    assert list(result.image_spans) == expected_spans and expected_spans[0].length == 4  # 56x56: a 2x2 merged grid
    assert result.usage is not None and result.usage.prompt_tokens == len(expected_ids)
    user = next(s for s in result.message_spans if s.role == "user")  # message spans cover the widened ids
    assert user.start <= expected_spans[0].start and expected_spans[0].end <= user.end
    async with client.stream(messages=messages, sampling=GREEDY) as stream:
        async for _ in stream:
            pass
    streamed = stream.result
    assert (streamed.prompt_ids, streamed.image_spans) == (result.prompt_ids, result.image_spans)
    assert streamed.completion_ids == result.completion_ids
    group = await client.generate_group(
        messages=messages, n=3, sampling=SamplingParams(max_tokens=4, temperature=1.0, seed=5)
    )
    assert [(g.prompt_ids, g.image_spans) for g in group] == [(result.prompt_ids, result.image_spans)] * 3

    two = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": picture(2, (56, 112))},
                {"type": "text", "text": "and"},
                {"type": "image", "image": picture(3)},
            ],
        }
    ]
    expected_ids, expected_spans = await oracle(two)
    result = await client.generate(messages=two, sampling=GREEDY)
    assert list(result.prompt_ids) == expected_ids and list(result.image_spans) == expected_spans
    assert [s.length for s in result.image_spans] == [8, 4]


async def check_three_turns(client: Client, oracle: Oracle) -> None:
    """A conversation with an image in turn 1: turns 2 and 3 start with the previous turn's exact ids."""
    conversation = client.conversation()
    first = await conversation.send([question("Describe the picture.", picture(4))], sampling=GREEDY)
    second = await conversation.send([{"role": "user", "content": "And the colours?"}], sampling=GREEDY)
    third = await conversation.send([{"role": "user", "content": "Thanks. One word?"}], sampling=GREEDY)
    assert second.prompt_ids[: len(first.token_ids)] == first.token_ids
    assert third.prompt_ids[: len(second.token_ids)] == second.token_ids
    assert first.image_spans == second.image_spans == third.image_spans and first.image_spans[0].length == 4
    # the engine widens the image of the whole conversation, rendered afresh, at the same place
    _, expected_spans = await oracle([*conversation.messages, client.parse_completion(third)])
    assert list(third.image_spans) == expected_spans


async def check_stateless_paths(client: Client) -> None:
    """A stateless session, then the stateless extension (``previous=``), reuse the widened image; a history whose
    picture is another one does not extend the ids that hold the first."""
    history: list[dict[str, Any]] = [question("Look at this.", picture(7))]
    first = await client.generate(messages=history, sampling=GREEDY, session="images")
    history += [client.parse_completion(first), {"role": "user", "content": "More?"}]
    second = await client.generate(messages=history, sampling=GREEDY, session="images")
    assert second.prompt_ids[: len(first.token_ids)] == first.token_ids and second.reused_ids == len(first.token_ids)
    assert second.image_spans == first.image_spans
    history += [client.parse_completion(second), {"role": "user", "content": "Last one."}]
    third = await client.generate(messages=history, previous=second, sampling=GREEDY)
    assert third.prompt_ids[: len(second.token_ids)] == second.token_ids and third.image_spans == first.image_spans
    changed = [question("Look at this.", picture(8)), *history[1:3]]
    with pytest.raises(BridgeError) as info:
        await client.generate(messages=changed, previous=first, sampling=GREEDY)
    assert info.value.reason == "image_changed"


async def score(client: Client, result: GenerateResult) -> Any:
    return await client.teacher_logprobs(result.token_ids, images=result.images, image_spans=result.image_spans)


async def check_teacher_matches_generation(client: Client, *, atol: float) -> None:
    result = await client.generate(messages=[question("Name it.", picture(5))], sampling=GREEDY)
    scored = await score(client, result)
    assert scored.logprobs.shape == (len(result.token_ids),)
    np.testing.assert_allclose(scored.logprobs[len(result.prompt_ids) :], result.logprobs, atol=atol)


async def check_a_weight_update_reaches_the_image(
    client: Client, model_dir: Path, tmp_path: Path, fresh: FreshScore, *, atol: float
) -> None:
    """After ``weight_sync`` to perturbed weights the image is seen anew: the image-conditioned logprobs move, and
    equal a scoring under an image key the engine never cached; restoring gives the first scores back."""
    before = await client.generate(messages=[question("What is in this picture?", picture(6))], sampling=GREEDY)
    scored_before = await score(client, before)
    perturbed = write_perturbed_weights(model_dir, tmp_path / "perturbed", seed=11, scale=0.05)
    try:
        await client.admin.weight_sync(path=str(perturbed), version="images-v2")
        after = await score(client, before)
        fresh_after = await fresh(before)
    finally:
        await client.admin.weight_sync(path=str(model_dir), version="images-v1")
    seeing = slice(before.image_spans[0].end, len(before.token_ids))  # every position after the image
    assert np.max(np.abs(after.logprobs[seeing] - scored_before.logprobs[seeing])) > 1e-2
    text = outside_images(before)
    np.testing.assert_allclose(after.logprobs[text], fresh_after[text], atol=atol)
    restored = await score(client, before)
    np.testing.assert_allclose(restored.logprobs[text], scored_before.logprobs[text], atol=atol)


def outside_images(result: GenerateResult) -> np.ndarray:
    """Positions 1.. of ``result.token_ids`` that are no image placeholder (the ones every engine scores as
    tokens)."""
    mask = np.ones(len(result.token_ids), dtype=bool)
    mask[0] = False
    for span in result.image_spans:
        mask[span.start : span.end] = False
    return mask
