"""The scripted engine of a vision-language model, for tests that drive images through the client without a live
engine: it widens each new image placeholder as a vision-language engine does."""

from __future__ import annotations

from typing import Any

import attrs

from backends_core import GenerateRequest, GenerateResult, ImageSpan, hookimpl
from backends_core.images import collapse
from backends_testkit.tinymodel_vl import IMAGE_PAD_ID
from scripted_stream import StreamingScript

#: how many ids the scripted engine widens a new image's placeholder into
WIDTH = 6


class VisionScript(StreamingScript):
    """The scripted engine of a vision-language model: sends images, and answers the prompt it ran with each new
    image's one placeholder widened into :data:`WIDTH` ids (known images keep their spans)."""

    def __init__(self, tokenizer: Any, replies: list[str], *, sends_images: bool = True) -> None:
        super().__init__(tokenizer, replies)
        self.sends_images = sends_images

    @hookimpl
    def image_refusal(self) -> str | None:
        return None if self.sends_images else "this scripted engine takes no images"

    def _result(self, raw: str, request: GenerateRequest, server_url: str) -> GenerateResult:
        result = super()._result(raw, request, server_url)
        if not request.images:
            return result
        known = {s.start: s.length for s in request.image_spans}
        wire = collapse(request.prompt_ids, request.image_spans)
        ran: list[int] = []
        spans = []
        at = 0  # where the next id of ``request.prompt_ids`` is
        for token in wire:
            if token != IMAGE_PAD_ID:
                ran.append(token)
                at += 1
                continue
            length = known.get(at, WIDTH)
            spans.append(ImageSpan(len(ran), len(ran) + length))
            ran.extend([IMAGE_PAD_ID] * length)
            at += known.get(at, 1)
        return attrs.evolve(result, prompt_ids=tuple(ran), images=request.images, image_spans=tuple(spans))
