"""Record what SGLang 0.5.23 does with images on ``/generate``: ``tests/fixtures/wire/sglang/images_*.json``.

Run from the repository root (a few minutes; starts its own server on the tiny Qwen2.5-VL model)::

    uv run --no-sync python tests/live/sglang/capture_sglang_images.py [--out tests/fixtures/wire/sglang]

Each file is one exchange in the style of the other SGLang captures (``{provenance, request: {method, path,
json}, status, content_type, elapsed_s, response}``; a stream's response is its list of ``data:`` lines; a
request that got no answer within the timeout has ``status: null`` and ``error``). Multi-step scenarios hold
``steps``. Findings: ``tests/live/sglang/SGLANG_IMAGES.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # sglang_server, vl_images

import sglang_server  # noqa: E402
import vl_images  # noqa: E402

from backends_testkit.live import probe_client  # noqa: E402
from backends_testkit.tinymodel import default_models_dir, write_perturbed_weights  # noqa: E402
from backends_testkit.tinymodel_vl import build_tiny_vl_model  # noqa: E402

PROVENANCE = (
    "seen running: sglang 0.5.23 launch_server --device cpu (+sgl_kernel CPU shim, vl_runtime shim), tiny Qwen2.5-VL"
)
PAD, VISION_START, VISION_END = vl_images.IMAGE_PAD_ID, 1897, 1898
GREEDY = {"max_new_tokens": 3, "temperature": 0}
TIMEOUT_S = 30.0


def exchange(client: httpx.Client, method: str, path: str, body: Any = None, *, stream: bool = False) -> dict[str, Any]:
    start = time.monotonic()
    record: dict[str, Any] = {"provenance": PROVENANCE, "request": {"method": method, "path": path, "json": body}}
    try:
        request = client.build_request(method, path, json=body)
        response = client.send(request, stream=stream)
        try:
            if stream:
                payload: Any = [line for line in response.iter_lines() if line]
            else:
                response.read()
                try:
                    payload = response.json()
                except ValueError:
                    payload = response.text
        finally:
            response.close()
    except httpx.TimeoutException as exc:
        record.update(status=None, elapsed_s=round(time.monotonic() - start, 4), error=f"{type(exc).__name__}")
        return record
    record.update(
        status=response.status_code,
        content_type=response.headers.get("content-type"),
        elapsed_s=round(time.monotonic() - start, 4),
        response=payload,
    )
    return record


def save(out: Path, name: str, record: dict[str, Any]) -> dict[str, Any]:
    path = out / f"images_{name}.json"
    path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"[capture] {path.name}: {record.get('status', record.get('error'))}", flush=True)
    return record


def image_block(pads: int) -> list[int]:
    return [VISION_START, *([PAD] * pads), VISION_END]


def capture(client: httpx.Client, out: Path, model: Path, tmp: Path) -> None:
    a = vl_images.png_data_url(56, 56, seed=1)
    b = vl_images.png_data_url(112, 84, seed=2)
    text = client.post("/tokenize", json={"prompt": "What is this?"}).json()["tokens"]
    one = [*text, *image_block(1)]

    def generate(name: str, ids: list[int], images: list[Any] | None, **extra: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"input_ids": ids, "sampling_params": GREEDY, "return_prompt_token_ids": True, **extra}
        if images is not None:
            body["image_data"] = images
        return save(out, name, exchange(client, "POST", "/generate", body))

    generate("generate_one_pad", one, [a], return_logprob=True)
    generate("generate_one_pad_mm_hashes", one, [a], mm_hashes=[hashlib.sha256(b"a").hexdigest()])
    generate("generate_one_pad_raw_base64", one, [a.split(",", 1)[1]])
    generate("generate_two_images", [*text, *image_block(1), *image_block(1)], [a, b])
    generate("generate_pad_without_image", one, None)
    generate("generate_image_without_pad", [*text, VISION_START, VISION_END], [a])
    stream_body = {"input_ids": one, "image_data": [a], "sampling_params": GREEDY, "return_prompt_token_ids": True}
    save(out, "generate_stream", exchange(client, "POST", "/generate", {**stream_body, "stream": True}, stream=True))
    capture_weight_update(client, out, model, tmp, one, a)
    # last: a pad count that does not match the images leaves the request unanswered, and then weight updates hang
    generate("generate_expanded_ids", [*text, *image_block(4)], [a])
    generate("generate_two_pads_one_image", [*text, *image_block(2)], [a])
    after = [
        {"label": "health_generate", **exchange(client, "GET", "/health_generate")},
        {"label": "generate one pad", **exchange(client, "POST", "/generate", {"input_ids": one, "image_data": [a]})},
        {"label": "flush_cache", **exchange(client, "POST", "/flush_cache")},
        {
            "label": "update_weights_from_disk (same weights)",
            **exchange(client, "POST", "/update_weights_from_disk", {"model_path": str(model)}),
        },
        {"label": "health_generate after the update", **exchange(client, "GET", "/health_generate")},
    ]
    save(out, "after_unanswered_requests", {"provenance": PROVENANCE, "steps": after})


def capture_weight_update(client: httpx.Client, out: Path, model: Path, tmp: Path, ids: list[int], a: str) -> None:
    """Same image before and after ``/update_weights_from_disk`` (perturbed copy): without ``mm_hashes`` (content
    hash), with the same ``mm_hashes`` as before, and with a fresh one. Then the original weights again."""
    steps: list[dict[str, Any]] = []
    old_hash, new_hash = hashlib.sha256(b"a|v0").hexdigest(), hashlib.sha256(b"a|v1").hexdigest()

    def step(label: str, method: str, path: str, body: Any = None) -> dict[str, Any]:
        record = exchange(client, method, path, body)
        steps.append({"label": label, **record})
        print(f"[capture] weight-update step {label}: {record.get('status', record.get('error'))}", flush=True)
        return record

    def gen(label: str, mm_hash: str | None) -> None:
        body: dict[str, Any] = {
            "input_ids": ids,
            "image_data": [a],
            "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            "return_prompt_token_ids": True,
            "return_logprob": True,
        }
        if mm_hash is not None:
            body["mm_hashes"] = [mm_hash]
        step(label, "POST", "/generate", body)

    gen("before: no mm_hashes", None)
    gen("before: mm_hashes v0", old_hash)
    step("flush_cache", "POST", "/flush_cache")
    gen("after flush: no mm_hashes", None)
    perturbed = write_perturbed_weights(model, tmp / "perturbed", seed=7, scale=0.3)
    step(
        "update perturbed",
        "POST",
        "/update_weights_from_disk",
        {"model_path": str(perturbed), "weight_version": "perturbed"},
    )
    gen("after update: no mm_hashes", None)
    gen("after update: mm_hashes v0", old_hash)
    gen("after update: mm_hashes v1", new_hash)
    step("update original", "POST", "/update_weights_from_disk", {"model_path": str(model), "weight_version": "v0"})
    gen("after restore: no mm_hashes", None)
    gen("after restore: mm_hashes v1", new_hash)
    save(out, "update_weights_same_image", {"provenance": PROVENANCE, "steps": steps})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("tests/fixtures/wire/sglang"))
    parser.add_argument("--url", default=None, help="use a running VL server instead of starting one")
    args = parser.parse_args(argv)
    model = build_tiny_vl_model(default_models_dir())
    with tempfile.TemporaryDirectory(prefix="sglang-images-") as tmp_dir:
        tmp = Path(tmp_dir)
        server = None
        url = args.url
        if url is None:
            venv = sglang_server.ensure_sglang_venv()
            server = sglang_server.sglang_vl_server(venv, model, log_path=tmp / "sglang-vl.log", name="sglang-vl")
            server.start()
        try:
            if server is not None:
                server.wait_ready(sglang_server.READY_PATH, timeout=sglang_server.START_TIMEOUT_S)
                print(f"[capture] server ready after {server.ready_after:.1f}s", flush=True)
                url = server.url
            with probe_client(TIMEOUT_S, base_url=str(url)) as client:
                capture(client, args.out, model, tmp)
        finally:
            if server is not None:
                server.stop(timeout=sglang_server.STOP_TIMEOUT_S)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
