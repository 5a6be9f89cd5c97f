"""A backend whose completions are scripted text: for tests that need a particular reply (tool calls, reasoning)
from a real pipeline (rendering, sessions, bridging, parsing), where a sampled one would be random."""

from __future__ import annotations

from typing import Any

import numpy as np

from backends_core import GenerateRequest, GenerateResult, hookimpl
from backends_core.multiturn.rendering import encode


class ScriptedBackend:
    """Answers each generate call with the next text of ``replies``, encoded with ``tokenizer`` (a text ending
    in ``<|im_end|>`` finishes with ``stop``, any other with ``length``); records the requests."""

    def __init__(self, tokenizer: Any, replies: list[str]) -> None:
        self.tokenizer = tokenizer
        self.replies = list(replies)
        self.requests: list[GenerateRequest] = []

    @hookimpl
    async def post_generate(self, request: GenerateRequest) -> Any:
        self.requests.append(request)
        return self.replies.pop(0)

    @hookimpl
    def parse_response(self, raw: str, request: GenerateRequest, server_url: str) -> list[GenerateResult]:
        ids = encode(self.tokenizer, raw)
        return [
            GenerateResult(
                prompt_ids=request.prompt_ids,
                completion_ids=tuple(ids),
                logprobs=np.full(len(ids), -0.5, np.float32),
                finish_reason="stop" if raw.endswith("<|im_end|>") else "length",
                server=server_url,
            )
        ]
