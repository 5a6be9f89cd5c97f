"""SGLang's image wire form, against captures of SGLang 0.5.23 serving the tiny Qwen2.5-VL on the CPU: one
placeholder per image and the images with version-salted keys on the wire; the widened ids it ran read back.
(Streams with images: every event carries the widened ids; checked live in ``test_sglang_images_client.py``.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from backends_core import GenerateRequest, Image, ImageSpan, SamplingParams, TeacherRequest
from backends_core.driver import check_prompt
from backends_core.errors import ResponseParseError
from backends_core.jsonnode import Node
from backends_sglang import wire

CAPTURES = Path(__file__).resolve().parents[2] / "fixtures" / "wire" / "sglang"
PAD = 1899


def capture(name: str) -> dict[str, Any]:
    return dict(json.loads((CAPTURES / f"{name}.json").read_text()))


def request_of(name: str, **fields: Any) -> GenerateRequest:
    sent = capture(name)["request"]["json"]
    images = [Image.of(url) for url in sent["image_data"]]
    return GenerateRequest(
        prompt_ids=sent["input_ids"], sampling=SamplingParams(max_tokens=3, temperature=0.0), images=images, **fields
    )


def test_the_body_holds_one_placeholder_per_image_and_keys_salted_with_the_weight_version() -> None:
    request = request_of("images_generate_one_pad", cache_salt="weights:v2")
    body = wire.generate_payload(request)
    sent = capture("images_generate_one_pad")["request"]["json"]
    assert body["input_ids"] == sent["input_ids"] and body["image_data"] == sent["image_data"]
    assert body["return_prompt_token_ids"] is True
    (key,) = body["mm_hashes"]
    assert len(key) == 64 and key != request.images[0].sha256  # salted: another version, another key
    unsalted = wire.generate_payload(request_of("images_generate_one_pad"))
    assert unsalted["mm_hashes"] == [request.images[0].sha256]


def test_the_result_is_the_widened_prompt_sglang_ran() -> None:
    request = request_of("images_generate_one_pad")
    (result,) = wire.parse_generate(
        capture("images_generate_one_pad")["response"], request, "http://s", None, image_token=PAD
    )
    assert result.prompt_ids == (54, 71, 292, 398, 257, 314, 30, 1897, PAD, PAD, PAD, PAD, 1898)
    assert result.image_spans == (ImageSpan(8, 12),) and result.images == request.images
    assert result.usage is not None and result.usage.prompt_tokens == 13
    check_prompt(request, result, where="sample 0", url="http://s")


def test_two_images_are_two_runs() -> None:
    answer = capture("images_generate_two_images")["response"]
    body = Node(answer, "$", "http://s")
    ids, spans = wire.engine_prompt(body, 2, PAD, body.get("meta_info"))
    assert ids == tuple(answer["prompt_token_ids"]) and [s.length for s in spans] == [4, 12]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda r: r.pop("prompt_token_ids"), "prompt_token_ids"),
        (lambda r: r["meta_info"].update(image_tokens=5), "image_tokens is 5"),
        (lambda r: r.update(prompt_token_ids=[1, 2, 3]), "0 runs of the image placeholder"),
    ],
)
def test_an_answer_without_the_widened_prompt_is_refused(edit: Any, message: str) -> None:
    raw = capture("images_generate_one_pad")["response"]
    edit(raw)
    with pytest.raises(ResponseParseError, match=message):
        wire.parse_generate(raw, request_of("images_generate_one_pad"), "http://s", None, image_token=PAD)


def test_teacher_scoring_sends_the_images_collapsed_and_leaves_their_placeholders_unscored() -> None:
    image = Image.of(capture("images_generate_one_pad")["request"]["json"]["image_data"][0])
    ids = [54, 1897, PAD, PAD, 1898, 7]
    request = TeacherRequest(token_ids=ids, images=[image], image_spans=[ImageSpan(2, 4)], cache_salt="weights:v1")
    body = wire.teacher_payload(request)
    assert body["input_ids"] == [54, 1897, PAD, 1898, 7] and len(body["mm_hashes"][0]) == 64
    entries = [
        [None, 54, None],
        [-1.0, 1897, None],
        [-2.0, 0, None],
        [-2.5, 0, None],
        [-3.0, 1898, None],
        [-4.0, 7, None],
    ]
    raw = {"output_ids": [], "meta_info": {"id": "r", "input_token_logprobs": entries}, "prompt_token_ids": ids}
    scored = wire.parse_teacher(raw, request, "http://s", image_token=PAD)
    assert scored.logprobs[1] == -1.0 and scored.logprobs[5] == -4.0
    assert all(x != x for x in scored.logprobs[2:4])  # NaN: SGLang scored its pad values there
