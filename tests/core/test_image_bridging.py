"""A history whose image is not the one the earlier turn's ids hold is a bridge break like any other: counted in
``bridge_stats``, raised under ``on_break="raise"``, rendered afresh (with the new image widened anew) under
``"rerender"``. With ``previous=`` the break is ``image_changed``; a stateless session compares its turns by image
content, so there no earlier turn is a prefix (``no_prefix``)."""

from __future__ import annotations

import base64
import contextlib
import io
from collections.abc import AsyncIterator
from typing import Any, Literal

import numpy as np
import pytest
from PIL import Image as PILImage

from backends_core import BridgeError, Client, ClientConfig, SamplingParams, StatelessPolicy
from backends_core.multiturn.rendering import load_tokenizer
from backends_testkit.tinymodel import default_models_dir
from backends_testkit.tinymodel_vl import IMAGE_PAD_ID, build_tiny_vl_model
from scripted_vision import WIDTH, VisionScript

RED = "iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAFklEQVR4nGP4z8DA8J+BkYHh////DAAe9gT9Ce00PgAAAABJRU5ErkJggg=="
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def picture(png: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}}


def other_png() -> str:
    """A PNG with other pixels than :data:`RED` (the same 2×2 size, so the same placeholder count)."""
    out = io.BytesIO()
    PILImage.fromarray(np.full((2, 2, 3), 200, dtype=np.uint8)).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


@contextlib.asynccontextmanager
async def vision_client(on_break: Literal["raise", "rerender"]) -> AsyncIterator[tuple[Client, VisionScript]]:
    path = str(build_tiny_vl_model(default_models_dir()))
    script = VisionScript(load_tokenizer(path), ["A red square.<|im_end|>", "Yes.<|im_end|>"])
    config = ClientConfig(
        backend="scripted",
        base_url="http://scripted",
        model="tiny",
        tokenizer=path,
        stateless=StatelessPolicy(on_break=on_break),
    )
    async with Client(config, plugin=script) as client:
        yield client, script


async def changed_image_turn(client: Client, how: str) -> tuple[Any, list[dict[str, Any]], dict[str, Any]]:
    """A first turn with one picture, then the next turn's history with another picture in its place, and how that
    turn extends the first (the same stateless session, or ``previous=`` the first result)."""
    session: dict[str, Any] = {"session": "s"} if how == "session" else {}
    asked = [{"role": "user", "content": [{"type": "text", "text": "What?"}, picture(RED)]}]
    first = await client.generate(messages=asked, sampling=GREEDY, **session)
    changed = [
        {"role": "user", "content": [{"type": "text", "text": "What?"}, picture(other_png())]},
        client.parse_completion(first),
        {"role": "user", "content": "Sure?"},
    ]
    return first, changed, session or {"previous": first}


BREAKS = [("session", "no_prefix"), ("previous", "image_changed")]


@pytest.mark.parametrize(("how", "reason"), BREAKS)
async def test_a_changed_image_is_a_counted_break_under_raise(tiny_models: Any, how: str, reason: str) -> None:
    async with vision_client("raise") as (client, script):
        _, changed, extend = await changed_image_turn(client, how)
        with pytest.raises(BridgeError) as info:
            await client.generate(messages=changed, sampling=GREEDY, **extend)
        assert info.value.reason == reason
        assert client.bridge_stats.failures == {reason: 1} and client.bridge_stats.rerendered == 0
        assert len(script.requests) == 1  # nothing sent for the refused turn


@pytest.mark.parametrize(("how", "reason"), BREAKS)
async def test_a_changed_image_is_rendered_afresh_under_rerender(tiny_models: Any, how: str, reason: str) -> None:
    async with vision_client("rerender") as (client, script):
        first, changed, extend = await changed_image_turn(client, how)
        second = await client.generate(messages=changed, sampling=GREEDY, **extend)
        assert client.bridge_stats.failures == {reason: 1} and client.bridge_stats.rerendered == 1
        assert second.reused_ids == 0
        # the new image went as a new one: one placeholder on the wire, widened by the engine, no known span
        sent = script.requests[-1]
        assert sent.image_spans == () and sent.prompt_ids.count(IMAGE_PAD_ID) == 1
        assert len(second.image_spans) == 1 and second.image_spans[0].length == WIDTH
        assert second.images[0] != first.images[0]
