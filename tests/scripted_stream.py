"""The scripted backend (a chosen reply per call) with streaming, a gate to hold generations, and failures to
inject: for the gateway's tests, which drive it through HTTP as a harness would."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from backends_core import GenerateRequest, GenerateResult, StreamDelta, hookimpl
from backends_core.multiturn.rendering import encode
from scripted_backend import ScriptedBackend


class StreamingScript(ScriptedBackend):
    """:class:`ScriptedBackend` (where a reply may also stop on ``<|endoftext|>``) that also streams (one delta
    per token, logprob ``-0.5 - i/100``), can hold every generation until :attr:`gate` is set, and raises
    :attr:`fail` (once) instead of answering when it is set."""

    def __init__(self, tokenizer: Any, replies: list[str]) -> None:
        super().__init__(tokenizer, replies)
        self.gate = asyncio.Event()
        self.gate.set()
        self.started = 0
        self.entered = asyncio.Event()  # set once a generation has reached the engine
        self.fail: BaseException | None = None

    def _result(self, raw: str, request: GenerateRequest, server_url: str) -> GenerateResult:
        ids = encode(self.tokenizer, raw)
        # a reply ending in <|endoftext|> stopped on it as an engine stops on a model's second end token, saying so
        second_end = raw.endswith("<|endoftext|>")
        return GenerateResult(
            prompt_ids=request.prompt_ids,
            completion_ids=tuple(ids),
            logprobs=-0.5 - np.arange(len(ids), dtype=np.float32) / 100,
            finish_reason="stop" if raw.endswith("<|im_end|>") or second_end else "length",
            stop_reason=ids[-1] if second_end else None,
            server=server_url,
        )

    async def _next(self, request: GenerateRequest) -> str:
        self.requests.append(request)
        self.started += 1
        self.entered.set()
        await self.gate.wait()
        if self.fail is not None:
            exc, self.fail = self.fail, None
            raise exc
        return self.replies.pop(0)

    @hookimpl
    async def post_generate(self, request: GenerateRequest) -> Any:
        return await self._next(request)

    @hookimpl
    def parse_response(self, raw: str, request: GenerateRequest, server_url: str) -> list[GenerateResult]:
        return [self._result(raw, request, server_url)]

    @hookimpl
    def post_generate_stream(
        self, server: Any, request: GenerateRequest
    ) -> AsyncIterator[StreamDelta | GenerateResult]:
        async def deltas() -> AsyncIterator[StreamDelta | GenerateResult]:
            result = self._result(await self._next(request), request, server.base_url)
            for i, token in enumerate(result.completion_ids):
                yield StreamDelta(completion_ids=(token,), logprobs=result.logprobs[i : i + 1])
            yield result

        return deltas()
