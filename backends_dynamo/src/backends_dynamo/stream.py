"""Streamed answers: server-sent events into chunks, and chunks folded into the shape of a non-streamed answer.

Dynamo streams ``data: {chunk}`` events ending with ``data: [DONE]``. Per chunk, ``nvext.completion_token_ids``
holds that chunk's new ids (the final chunk of the mocker carries ``[]``); ``engine_data``, ``timing`` and
``stop_reason`` come on the chunk that carries ``finish_reason``; usage comes last when
``stream_options.include_usage`` is set. :func:`fold` concatenates the deltas (text, OpenAI logprobs, ids) and
keeps the last value of everything else, so :func:`backends_dynamo.wire.parse_sample` reads a folded stream
like any answer, including the check that the concatenated ids equal ``engine_data.completion_token_ids``.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from backends_core.errors import ResponseParseError
from backends_dynamo._json import Node

__all__ = ["fold", "parse_sse"]

_DONE = "[DONE]"


def parse_sse(text: str, url: str | None = None) -> list[Any]:
    """The decoded ``data`` payloads of an event stream, in order, without the closing ``[DONE]``.

    :raises ResponseParseError: an ``error`` event, a payload that is not JSON, or no ``[DONE]`` (truncated).
    """
    chunks: list[Any] = []
    for number, block in enumerate(text.replace("\r\n", "\n").split("\n\n")):
        event, data = "message", []
        for line in block.split("\n"):
            if not line or line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "event":
                event = value
            elif name == "data":
                data.append(value)
        if not data:
            continue
        payload = "\n".join(data)
        if payload == _DONE:
            return chunks
        if event == "error":
            raise ResponseParseError(f"the stream reported an error in event {number}: {payload}", url=url)
        try:
            chunks.append(json.loads(payload))
        except json.JSONDecodeError as exc:
            raise ResponseParseError(f"event {number} is not JSON ({exc.msg}): {payload[:200]!r}", url=url) from exc
    raise ResponseParseError(f"the stream ended without 'data: {_DONE}' after {len(chunks)} event(s)", url=url)


@attrs.define
class _Choice:
    pieces: list[str] = attrs.field(factory=list)
    finish_reason: Any = None
    content: list[Any] | None = None  # chat logprobs entries
    legacy: dict[str, list[Any]] | None = None  # completions logprobs lists


def _add_logprobs(acc: _Choice, block: Node, *, chat: bool) -> None:
    if block.value is None:
        return
    if chat:
        acc.content = (acc.content or []) + [e.value for e in block.get("content").items()]
        return
    acc.legacy = acc.legacy or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        acc.legacy[key].extend(n.value for n in block.get(key).items())


def _choice_body(index: int, acc: _Choice, *, chat: bool) -> dict[str, Any]:
    if chat:
        logprobs = None if acc.content is None else {"content": acc.content, "refusal": None}
        message = {"content": "".join(acc.pieces), "refusal": None, "role": "assistant"}
        return {"index": index, "message": message, "finish_reason": acc.finish_reason, "logprobs": logprobs}
    choice: dict[str, Any] = {"text": "".join(acc.pieces), "index": index, "finish_reason": acc.finish_reason}
    if acc.legacy is not None:
        choice["logprobs"] = acc.legacy
    return choice


def fold(chunks: list[Any], url: str | None = None) -> dict[str, Any]:
    """One answer with the shape of a non-streamed one, built from stream chunks.

    :raises ResponseParseError: no chunks, chunks of another kind, or id deltas for more than one choice.
    """
    if not chunks:
        raise ResponseParseError("the stream carried no chunks", url=url)
    first = Node(chunks[0], "$[0]", url)
    kind = first.get("object").string()
    if kind not in ("chat.completion.chunk", "text_completion"):
        raise first.get("object").fail(f"expected 'chat.completion.chunk' or 'text_completion', got {kind!r}")
    chat = kind == "chat.completion.chunk"
    choices: dict[int, _Choice] = {}
    nvext: dict[str, Any] = {}
    ids: list[int] | None = None
    top: dict[str, Any] = {}
    for i, raw in enumerate(chunks):
        chunk = Node(raw, f"$[{i}]", url)
        for choice in chunk.get("choices").items():
            acc = choices.setdefault(choice.get("index").integer(), _Choice())
            piece = choice.get("delta").get("content", required=False) if chat else choice.get("text", required=False)
            if piece.value is not None:
                acc.pieces.append(piece.string())
            if choice.has("finish_reason"):
                acc.finish_reason = choice.get("finish_reason").value
            _add_logprobs(acc, choice.get("logprobs", required=False), chat=chat)
        for key in ("usage", "prompt_logprobs"):
            if chunk.has(key):
                top[key] = chunk.get(key).value
        if chunk.has("nvext"):
            for key, value in chunk.get("nvext").obj().items():
                if key == "completion_token_ids":
                    ids = (ids or []) + list(value or [])
                elif value is not None:
                    nvext[key] = value
    if ids is not None:
        if len(choices) > 1:
            raise first.fail("completion id deltas cannot be assigned to one of several choices (send n=1)")
        nvext["completion_token_ids"] = ids
    body: dict[str, Any] = {
        "id": first.get("id").value,
        "choices": [_choice_body(index, choices[index], chat=chat) for index in sorted(choices)],
        "created": first.get("created", required=False).value,
        "model": first.get("model", required=False).value,
        "object": "chat.completion" if chat else "text_completion",
        **top,
    }
    if nvext:
        body["nvext"] = nvext
    return body
