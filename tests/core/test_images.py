"""Image parts: every input form becomes the same encoded image, and an engine's expansion is proven, not trusted."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import attrs
import numpy as np
import PIL.Image
import pytest

from backends_core import GenerateResult, Image, ImageSpan
from backends_core.errors import InvalidRequestError, ResponseParseError
from backends_core.images import check_expansion, collapse, image_of_part, widen_position
from backends_core.multiturn.messages import images_of, normalize_message
from backends_core.runs import result_row

PIXELS = np.array([[[255, 0, 0], [0, 255, 0]], [[0, 0, 255], [255, 255, 255]]], dtype=np.uint8)
PAD = 9


def png(array: np.ndarray = PIXELS) -> bytes:
    buffer = io.BytesIO()
    PIL.Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def test_every_input_form_of_one_image_is_the_same_image(tmp_path: Path) -> None:
    data = png()
    (tmp_path / "a.png").write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    forms = [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "image_url", "image_url": url},
        {"type": "input_image", "image_url": url},
        {"type": "image_url", "image_url": {"url": (tmp_path / "a.png").as_uri()}},
        {"type": "image", "image": PIL.Image.fromarray(PIXELS)},
        {"type": "image", "image": PIXELS},
        {"type": "image", "image": data},
        {"type": "image", "path": str(tmp_path / "a.png")},
        {"type": "image", "url": url},
    ]
    images = {image_of_part(form, "p") for form in forms}
    assert images == {Image(data=data, media_type="image/png")}
    (image,) = images
    assert image.data_url() == url
    assert image.identity() == image.sha256 and image.identity("weights:v2") == f"{image.sha256}@weights:v2"


def test_a_remote_image_is_its_url_and_the_engine_fetches_it() -> None:
    image = image_of_part({"type": "image_url", "image_url": {"url": "https://example.test/cat.png"}}, "p")
    assert image is not None and image.url == "https://example.test/cat.png" and image.data == b""
    assert image.data_url() == "https://example.test/cat.png"


@pytest.mark.parametrize(
    ("part", "message"),
    [
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}, r"p\.image_url\.url is not an"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,***"}}, "base64 does not decode"),
        ({"type": "image_url", "image_url": {"url": "data:image/png,raw"}}, "data: URL that is not base64"),
        (
            {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(png()).decode()}},
            "says 'image/jpeg' but holds 'image/png'",
        ),
        ({"type": "image_url", "image_url": {"url": "ftp://x/y.png"}}, "not data:, file: or http"),
        ({"type": "image_url", "image_url": {}}, r"p\.image_url\.url needs an image URL"),
        ({"type": "image_url", "image_url": {"url": "file:///no/such/file.png"}}, "cannot read image file"),
        ({"type": "image", "image": np.zeros((2, 2, 3), np.float32)}, "must be uint8"),
        ({"type": "image", "image": 3.5}, "give a PIL image"),
        ({"type": "image"}, "none of 'image', 'url', 'path'"),
    ],
)
def test_a_malformed_image_part_is_refused_naming_it(part: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        image_of_part(part, "p")


def test_histories_compare_by_image_content() -> None:
    data = png()
    as_url = {"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image", "image": data}]}
    as_array = {"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image", "image": PIXELS}]}
    other = {"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image", "image": PIXELS[::-1]}]}
    assert normalize_message(as_url) == normalize_message(as_array) != normalize_message(other)
    assert images_of([as_url, other]) == (Image(data=data), Image(data=png(PIXELS[::-1])))


def test_collapse_and_widen_are_inverse_on_boundaries() -> None:
    engine = (1, 2, PAD, PAD, PAD, 3, 4, PAD, PAD, 5)
    spans = (ImageSpan(2, 5), ImageSpan(7, 9))
    assert collapse(engine, spans) == (1, 2, PAD, 3, 4, PAD, 5)
    # boundaries in the collapsed ids: before the first pad, after it, before and after the second, the end
    assert [widen_position(x, spans) for x in (2, 3, 5, 6, 7)] == [2, 5, 7, 9, 10]


def test_an_expansion_is_accepted_only_when_it_widens_each_placeholder_and_nothing_else() -> None:
    sent = (1, 2, PAD, 3)
    check_expansion(sent, (), (1, 2, PAD, PAD, PAD, 3), (ImageSpan(2, 5),), images=1, where="s", server_url="u")
    failures = {
        "placed 2 images, 1 were sent": ((1, 2, PAD, PAD, 3), (ImageSpan(2, 3), ImageSpan(3, 4))),
        "holds different ids": ((1, 2, PAD, 7, 3), (ImageSpan(2, 4),)),
        "ran a different prompt": ((1, 8, PAD, PAD, 3), (ImageSpan(2, 4),)),
        "outside the": ((1, 2, PAD), (ImageSpan(2, 5),)),
    }
    for message, (answered, spans) in failures.items():
        with pytest.raises(ResponseParseError, match=message):
            check_expansion(sent, (), answered, spans, images=1, where="s", server_url="u")


def test_an_already_widened_image_widened_again_is_caught() -> None:
    # turn 2 holds turn 1's image widened to 3 pads; an engine that widens it again runs 5
    sent = (1, PAD, PAD, PAD, 2, 3)
    known = (ImageSpan(1, 4),)
    check_expansion(sent, known, sent, known, images=1, where="s", server_url="u")
    with pytest.raises(ResponseParseError, match=r"widened to \[1, 6\).*hold it at \[1, 4\)"):
        check_expansion(sent, known, (1, *[PAD] * 5, 2, 3), (ImageSpan(1, 6),), images=1, where="s", server_url="u")


def test_a_rollout_row_says_where_its_images_lie() -> None:
    image = Image(data=png())
    result = GenerateResult(
        prompt_ids=(1, PAD, PAD, 2),
        completion_ids=(3,),
        logprobs=np.zeros(1, np.float32),
        finish_reason="length",
        images=(image,),
        image_spans=(ImageSpan(1, 3),),
    )
    assert result_row(result)["image_spans"] == [[1, 3]]
    assert "image_spans" not in result_row(attrs.evolve(result, images=(), image_spans=()))
