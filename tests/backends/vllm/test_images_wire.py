"""vLLM's image wire form: one placeholder per image on the wire, the engine's widened prompt read back."""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import pytest

from backends_core import GenerateRequest, Image, ImageSpan, SamplingParams, TeacherRequest
from backends_core.driver import check_prompt
from backends_core.errors import InvalidRequestError, ResponseParseError
from backends_vllm import wire

PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAFklEQVR4nGP4z8DA8J+BkYHh////DAAe9gT9Ce00PgAAAABJRU5ErkJggg=="
)
CAT, DOG = Image(data=PNG), Image(url="https://example.test/dog.png")
PAD = 1899


def answer(prompt: list[int], spans: list[tuple[int, int]], **extra: Any) -> dict[str, Any]:
    return {
        "request_id": "r",
        "choices": [
            {
                "index": 0,
                "token_ids": [5],
                "logprobs": {"content": [{"token_id": 5, "logprob": -0.5}]},
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": 1},
        "prompt_token_ids": prompt,
        "mm_placeholders": {"image": [{"offset": o, "length": n} for o, n in spans]},
        **extra,
    }


def test_a_new_image_goes_as_one_placeholder_and_a_content_part_keyed_by_its_salted_digest() -> None:
    request = GenerateRequest(
        prompt_ids=[1, PAD, 2], sampling=SamplingParams(max_tokens=1), images=[CAT], cache_salt="weights:v3"
    )
    body = wire.generate_payload(request, "m")
    assert body["token_ids"] == (1, PAD, 2)
    assert body["content_parts"] == [{"type": "image_url", "url": CAT.data_url(), "uuid": f"{CAT.sha256}@weights:v3"}]
    assert body["return_token_ids"] is True and body["cache_salt"] == "weights:v3"


def test_an_image_of_an_earlier_turn_goes_collapsed_and_a_remote_one_as_its_url() -> None:
    request = GenerateRequest(
        prompt_ids=[1, PAD, PAD, PAD, 2, PAD, 3],
        sampling=SamplingParams(max_tokens=1),
        images=[CAT, DOG],
        image_spans=[ImageSpan(1, 4)],
    )
    body = wire.generate_payload(request, "m")
    assert body["token_ids"] == (1, PAD, 2, PAD, 3)
    assert [p["url"] for p in body["content_parts"]] == [CAT.data_url(), "https://example.test/dog.png"]
    assert "cache_salt" not in body and body["content_parts"][0]["uuid"] == CAT.sha256


def test_the_result_holds_the_ids_the_engine_ran_and_each_image_span() -> None:
    request = GenerateRequest(prompt_ids=[1, PAD, 2], sampling=SamplingParams(max_tokens=1), images=[CAT])
    (result,) = wire.parse_generate(answer([1, PAD, PAD, PAD, PAD, 2], [(1, 4)]), request, "http://v")
    assert result.prompt_ids == (1, PAD, PAD, PAD, PAD, 2)
    assert result.image_spans == (ImageSpan(1, 5),) and result.images == (CAT,)
    assert result.usage is not None and result.usage.prompt_tokens == 6
    check_prompt(request, result, where="sample 0", url="http://v")


def test_a_prompt_widened_twice_is_refused() -> None:
    # the ids of an earlier turn sent already widened: vLLM widens the first placeholder again
    request = GenerateRequest(
        prompt_ids=[1, PAD, PAD, 2], sampling=SamplingParams(max_tokens=1), images=[CAT], image_spans=[ImageSpan(1, 3)]
    )
    (result,) = wire.parse_generate(answer([1, PAD, PAD, PAD, 2], [(1, 3)]), request, "http://v")
    with pytest.raises(ResponseParseError, match=r"image 0 was widened to \[1, 4\)"):
        check_prompt(request, result, where="sample 0", url="http://v")


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda a: a.pop("prompt_token_ids"), r"prompt_token_ids"),
        (lambda a: a.update(mm_placeholders={"video": []}), "placeholders of images only"),
        (lambda a: a.update(mm_placeholders={"image": []}), "0 placeholder ranges for 1 images"),
        (lambda a: a["mm_placeholders"]["image"][0].update(length=0), "do not make a span"),
    ],
)
def test_an_answer_without_the_engines_prompt_is_refused(mutate: Any, message: str) -> None:
    request = GenerateRequest(prompt_ids=[1, PAD, 2], sampling=SamplingParams(max_tokens=1), images=[CAT])
    raw = answer([1, PAD, PAD, 2], [(1, 2)])
    mutate(raw)
    with pytest.raises(ResponseParseError, match=message):
        wire.parse_generate(raw, request, "http://v")


def test_the_streamed_prompt_comes_in_the_first_chunk() -> None:
    request = GenerateRequest(prompt_ids=[1, PAD, 2], sampling=SamplingParams(max_tokens=2), images=[CAT])
    fold = wire.StreamFold(request, "http://v", transport="generate")
    first = {
        "request_id": "r",
        "prompt_token_ids": [1, PAD, PAD, 2],
        "mm_placeholders": {"image": [{"offset": 1, "length": 2}]},
        "choices": [{"index": 0, "token_ids": [5], "logprobs": {"content": [{"token_id": 5, "logprob": -0.1}]}}],
    }
    last = {
        "request_id": "r",
        "choices": [
            {
                "index": 0,
                "token_ids": [6],
                "logprobs": {"content": [{"token_id": 6, "logprob": -0.2}]},
                "finish_reason": "length",
            }
        ],
    }
    assert fold.chunk(first) is not None and fold.chunk(last) is not None
    result = fold.result()
    assert result.prompt_ids == (1, PAD, PAD, 2) and result.image_spans == (ImageSpan(1, 3),)
    assert result.completion_ids == (5, 6)


def test_teacher_scoring_sends_the_images_collapsed_and_checks_the_engines_prompt() -> None:
    request = TeacherRequest(token_ids=[1, PAD, PAD, 2, 5], images=[CAT], image_spans=[ImageSpan(1, 3)])
    path, body = wire.teacher_payload(request, "m", transport="generate")
    assert path == "/inference/v1/generate" and body["token_ids"] == (1, PAD, 2, 5)
    assert body["content_parts"][0]["uuid"] == CAT.sha256 and body["return_token_ids"] is True
    rows = [None, *({str(t): {"logprob": -1.0}} for t in (PAD, PAD, 2, 5))]
    good = {
        "prompt_logprobs": rows,
        "prompt_token_ids": [1, PAD, PAD, 2, 5],
        "mm_placeholders": {"image": [{"offset": 1, "length": 2}]},
    }
    scored = wire.parse_prompt_logprobs(good, request, "http://v", transport="generate")
    assert scored.logprobs.shape == (5,)
    widened = {
        **good,
        "prompt_token_ids": [1, PAD, PAD, PAD, 2, 5],
        "mm_placeholders": {"image": [{"offset": 1, "length": 3}]},
    }
    with pytest.raises(ResponseParseError, match="image 0 was widened"):
        wire.parse_prompt_logprobs(widened, request, "http://v", transport="generate")
    with pytest.raises(InvalidRequestError, match="completions takes no images"):
        wire.teacher_payload(request, "m", transport="completions")


def test_routed_experts_are_aligned_to_the_widened_prompt() -> None:
    request = GenerateRequest(
        prompt_ids=[1, PAD, 2], sampling=SamplingParams(max_tokens=1), images=[CAT], return_routed_experts=True
    )
    widened = [1, PAD, PAD, PAD, PAD, 2]
    rows = np.arange(len(widened) * 2 * 2, dtype=np.uint8).reshape(-1, 2, 2) % 8  # every token fed: prompt + 0
    raw = answer(widened, [(1, 4)])
    raw["choices"][0]["routed_experts"] = base64.b64encode(_npy(rows)).decode()
    (result,) = wire.parse_generate(raw, request, "http://v")
    assert result.routed_experts is not None and result.routed_experts.experts.shape[0] == len(widened)
    # rows counted against the ids sent (three) would not fit: the engine routed the widened prompt
    raw["choices"][0]["routed_experts"] = base64.b64encode(_npy(rows[:3])).decode()
    with pytest.raises(ResponseParseError, match="routed"):
        wire.parse_generate(raw, request, "http://v")


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()
