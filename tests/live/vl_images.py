"""Images for the vLLM image tests and captures: deterministic PNGs as ``data:`` URLs, and the request bodies."""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
from PIL import Image

from backends_testkit.tinymodel_vl import IMAGE_PAD_ID

__all__ = ["IMAGE_PAD_ID", "chat_message", "png_data_url"]


def png_data_url(width: int, height: int, *, seed: int = 0) -> str:
    """A ``data:image/png;base64,...`` URL of a ``width`` × ``height`` RGB image of seeded random pixels."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def chat_message(text: str, *urls: str) -> dict[str, Any]:
    """A user message: ``text``, then one OpenAI ``image_url`` part per URL."""
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return {"role": "user", "content": parts}
