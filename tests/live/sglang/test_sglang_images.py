"""SGLang 0.5.23 serving the tiny Qwen2.5-VL model on the CPU: ``/generate`` with ``input_ids`` (one
``<|image_pad|>`` per image) + ``image_data`` widens each pad, answers the ids it ran in ``prompt_token_ids``, and
keeps image features across weight updates (keyed by ``mm_hashes`` or the content hash).

Findings and captures: ``tests/live/sglang/SGLANG_IMAGES.md``, ``tests/fixtures/wire/sglang/images_*.json``. Not
tested here because it wedges the shared server: a pad count that does not match the images leaves the request
unanswered, and the next weight update hangs (``images_after_unanswered_requests.json``).
"""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import vl_images

from backends_testkit.live import probe_client
from backends_testkit.tinymodel import default_models_dir, write_perturbed_weights
from backends_testkit.tinymodel_vl import build_tiny_vl_model

pytestmark = [pytest.mark.live, pytest.mark.slow]

PAD, VISION_START, VISION_END = vl_images.IMAGE_PAD_ID, 1897, 1898
TEXT = [54, 71, 292, 398, 257, 314, 30]  # "What is this?"
ONE_IMAGE = [*TEXT, VISION_START, PAD, VISION_END]
GREEDY = {"max_new_tokens": 3, "temperature": 0}


def _generate(url: str, ids: list[int], images: list[str], **extra: Any) -> dict[str, Any]:
    body = {"input_ids": ids, "image_data": images, "sampling_params": GREEDY, "return_prompt_token_ids": True}
    with probe_client(base_url=url) as client:
        response = client.post("/generate", json={**body, **extra})
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def _widened(ids: list[int], *pads: int) -> list[int]:
    out: list[int] = []
    counts = iter(pads)
    for token in ids:
        out += [PAD] * next(counts) if token == PAD else [token]
    return out


def test_one_pad_per_image_is_widened_in_prompt_token_ids(sglang_vl_url: str) -> None:
    a = vl_images.png_data_url(56, 56, seed=1)
    answer = _generate(sglang_vl_url, ONE_IMAGE, [a])
    assert answer["prompt_token_ids"] == _widened(ONE_IMAGE, 4)  # 56×56 → 2×2 merged patches
    assert answer["meta_info"]["image_tokens"] == 4
    assert answer["meta_info"]["prompt_tokens"] == len(answer["prompt_token_ids"])
    hashed = _generate(sglang_vl_url, ONE_IMAGE, [a], mm_hashes=[hashlib.sha256(b"test-a").hexdigest()])
    assert hashed["prompt_token_ids"] == answer["prompt_token_ids"]
    raw = _generate(sglang_vl_url, ONE_IMAGE, [a.split(",", 1)[1]])  # bare base64 is accepted too
    assert raw["output_ids"] == answer["output_ids"]


def test_two_images_widen_each_pad(sglang_vl_url: str) -> None:
    a, b = vl_images.png_data_url(56, 56, seed=1), vl_images.png_data_url(112, 84, seed=2)
    ids = [*TEXT, VISION_START, PAD, VISION_END, VISION_START, PAD, VISION_END]
    answer = _generate(sglang_vl_url, ids, [a, b])
    assert answer["prompt_token_ids"] == _widened(ids, 4, 12)
    assert answer["meta_info"]["image_tokens"] == 16


def test_every_stream_chunk_carries_the_widened_ids(sglang_vl_url: str) -> None:
    body = {
        "input_ids": ONE_IMAGE,
        "image_data": [vl_images.png_data_url(56, 56, seed=1)],
        "sampling_params": GREEDY,
        "return_prompt_token_ids": True,
        "stream": True,
    }
    with probe_client(base_url=sglang_vl_url) as client, client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[len("data: ") :]) for line in r.iter_lines() if line.startswith("data: {")]
    # each chunk holds every id so far; a loaded server may send two new tokens in one chunk
    outputs = [chunk["output_ids"] for chunk in chunks]
    assert len(outputs[-1]) == GREEDY["max_new_tokens"]
    assert all(later[: len(earlier)] == earlier for earlier, later in itertools.pairwise(outputs))
    assert all(chunk["prompt_token_ids"] == _widened(ONE_IMAGE, 4) for chunk in chunks)


def test_image_features_survive_a_weight_update(sglang_vl_url: str, tmp_path: Path) -> None:
    """After ``/update_weights_from_disk`` the same image with an ``mm_hashes`` seen before runs the *old* features
    (stale); a fresh ``mm_hashes`` runs new ones. The original weights are restored at the end."""
    model = build_tiny_vl_model(default_models_dir())
    a = vl_images.png_data_url(56, 56, seed=3)
    old, new = hashlib.sha256(b"seed3|old").hexdigest(), hashlib.sha256(b"seed3|new").hexdigest()
    before = _generate(sglang_vl_url, ONE_IMAGE, [a], mm_hashes=[old], return_logprob=True)
    perturbed = write_perturbed_weights(model, tmp_path / "perturbed", seed=7, scale=0.3)
    with probe_client(base_url=sglang_vl_url) as client:
        update = client.post("/update_weights_from_disk", json={"model_path": str(perturbed)})
        assert update.status_code == 200 and update.json()["success"], update.text
        try:
            stale = _generate(sglang_vl_url, ONE_IMAGE, [a], mm_hashes=[old], return_logprob=True)
            fresh = _generate(sglang_vl_url, ONE_IMAGE, [a], mm_hashes=[new], return_logprob=True)
        finally:
            restore = client.post(
                "/update_weights_from_disk", json={"model_path": str(model), "weight_version": "default"}
            )
            assert restore.status_code == 200 and restore.json()["success"], restore.text

    def logprobs(answer: dict[str, Any]) -> list[float]:
        return [entry[0] for entry in answer["meta_info"]["output_token_logprobs"]]

    assert logprobs(stale) != logprobs(before)  # the text stack did change
    assert logprobs(stale) != logprobs(fresh)  # ... but the image features under the old key did not
    assert stale["prompt_token_ids"] == fresh["prompt_token_ids"] == _widened(ONE_IMAGE, 4)
