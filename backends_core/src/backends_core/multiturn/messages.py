"""Chat messages as plain data: normalisation for rendering and for comparing histories.

Agent frameworks hand over dicts, Pydantic models, attrs or dataclass objects, sometimes with ``None``-valued
keys, missing vs empty content, and tool-call arguments as JSON strings with arbitrary spacing. Two histories
that differ only in such ways are the same conversation; :func:`normalize_message` maps each to one canonical
plain dict so comparison is exact and benign differences never break token reuse.

Content given as OpenAI content parts (``[{"type": "text", "text": ...}, ...]``) is read the way vLLM's chat
route reads it: the text part types (``text``, ``input_text``, ``output_text``, ``refusal``, ``thinking``) give
their text, a text or refusal part without one is skipped, plain strings in the list are text; the normal form is
the list of ``{"type": "text", "text": ...}`` parts. What the chat template then sees is decided per template in
:func:`~backends_core.multiturn.rendering.render_text`: the texts joined with ``"\n"`` for templates that read
content as a string (Qwen-style templates replace anything else with ``''``), the text parts themselves for
templates that iterate over content. Image parts (:mod:`backends_core.images`) become
``{"type": "image", "image": Image}`` in the normal form, so histories compare by image content, and reach the
template as ``{"type": "image"}``; whether the backend, transport and model take them is the client's check.
Audio, video, file and other parts are refused (:class:`~backends_core.errors.InvalidRequestError` naming the
message and the part). Nothing becomes a silently empty turn.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from backends_core.errors import InvalidRequestError
from backends_core.images import IMAGE_PART_TYPES, Image, image_of_part

__all__ = [
    "TEXT_PART_KEYS",
    "as_plain",
    "check_content_parts",
    "content_items",
    "images_of",
    "normal_forms",
    "normalize_message",
    "normalize_messages",
    "part_texts",
]

#: Content-part types whose text reaches the chat template, and the key holding the text (vLLM's text part types).
TEXT_PART_KEYS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
#: Text part types vLLM skips when their text is missing.
_SKIPPED_WHEN_EMPTY = frozenset({"text", "refusal"})


def content_items(content: Sequence[Any], where: str) -> list[str | Image]:
    """The texts and images of a content-part list, in order (plain strings in the list are text).

    :param content: the message's ``content`` list.
    :param where: how errors name the content (``messages[2].content``).
    :raises InvalidRequestError: a part that is neither text nor an image (audio, video, file...), a malformed
        part, or an image that cannot be read.
    """
    items: list[str | Image] = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            items.append(part)
            continue
        if not isinstance(part, Mapping):
            raise InvalidRequestError(f"{where}[{j}] must be a content part object, got {type(part).__name__}")
        kind = part.get("type")
        if not isinstance(kind, str):
            raise InvalidRequestError(f"{where}[{j}] has no string 'type' (a content part needs one): {part!r}")
        image = image_of_part(part, f"{where}[{j}]")
        if image is not None:
            items.append(image)
            continue
        key = TEXT_PART_KEYS.get(kind)
        if key is None:
            raise InvalidRequestError(
                f"{where}[{j}] is a part of type {kind!r}: only text parts ({', '.join(sorted(TEXT_PART_KEYS))}) "
                f"and image parts ({', '.join(sorted(IMAGE_PART_TYPES))}) can be sent: token-in generation "
                "carries prompt ids, and the engines' processors used here take no audio, video or files"
            )
        text = part.get(key)
        if text is None and kind in _SKIPPED_WHEN_EMPTY:
            continue
        if not isinstance(text, str):
            raise InvalidRequestError(
                f"{where}[{j}] is a part of type {kind!r} whose {key!r} is not a string: {text!r}"
            )
        items.append(text)
    return items


def part_texts(content: Sequence[Any], where: str) -> list[str]:
    """The texts of a content-part list, in order, for a destination that takes text only.

    :raises InvalidRequestError: a part that is not text (naming it), or a malformed part.
    """
    texts = []
    for j, item in enumerate(content_items(content, where)):
        if isinstance(item, Image):
            raise InvalidRequestError(f"{where} holds an image (item {j}): this destination takes text only")
        texts.append(item)
    return texts


def images_of(messages: Sequence[Mapping[str, Any]], *, where: str = "messages") -> tuple[Image, ...]:
    """Every image of ``messages``, in prompt order, each part checked (see :func:`content_items`)."""
    images: list[Image] = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list | tuple):
            images.extend(x for x in content_items(content, f"{where}[{i}].content") if isinstance(x, Image))
    return tuple(images)


def check_content_parts(messages: Sequence[Mapping[str, Any]]) -> tuple[Image, ...]:
    """Refuse, before anything is rendered or sent, any content part that is neither text nor a readable image,
    naming the message index and the part; returns the images in prompt order (:func:`images_of`)."""
    return images_of(messages)


def as_plain(message: Any) -> dict[str, Any]:
    """A message object as a plain dict (Mapping, Pydantic v2/v1 model, attrs or dataclass instance)."""
    if isinstance(message, Mapping):
        return dict(message)
    dump = getattr(message, "model_dump", None)
    if callable(dump):
        return dict(dump())
    if attrs.has(type(message)):
        return attrs.asdict(message)
    if dataclasses.is_dataclass(message) and not isinstance(message, type):
        return dataclasses.asdict(message)
    legacy = getattr(message, "dict", None)
    if callable(legacy):
        return dict(legacy())
    raise InvalidRequestError(f"a message must be a mapping or a model object, got {type(message).__name__}")


_SCALARS = frozenset({str, int, float, bool, type(None)})


def _canonical(value: Any) -> Any:
    if type(value) in _SCALARS or isinstance(value, Image):
        return value
    if isinstance(value, Mapping):
        return {k: _canonical(v) for k, v in sorted(value.items()) if v is not None}
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    if (
        attrs.has(type(value))
        or hasattr(value, "model_dump")
        or (dataclasses.is_dataclass(value) and not isinstance(value, type))
    ):
        return _canonical(as_plain(value))
    return value


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return _canonical(json.loads(value))
        except json.JSONDecodeError:
            return value
    return _canonical(value)


# Normal forms of flat string dicts by ``id``: an agent loop re-sends the same dicts every turn. A hit is used only
# when the dict still equals the snapshot taken then (a mutated or recycled dict is normalised afresh), and only
# flat dicts of ``str``/``None`` values are remembered, for which equality means identical contents.
_MEMO: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}
_MEMO_MAX = 1 << 15


def _flat_strings(message: dict[Any, Any]) -> bool:
    return "tool_calls" not in message and all(type(v) is str or v is None for v in message.values())


def normalize_message(message: Any) -> dict[str, Any]:
    """The canonical form of one message: plain types, no ``None`` values, missing content as ``""``,
    tool-call arguments parsed from JSON."""
    if type(message) is dict:
        hit = _MEMO.get(id(message))
        if hit is not None and hit[0] == message:
            return dict(hit[1])
        if _flat_strings(message):
            # the common case: what the general path below returns for it, without the recursion
            flat = {k: v for k, v in sorted(message.items()) if v is not None}
            if not isinstance(flat.get("role"), str):
                raise InvalidRequestError(f"a message needs a string 'role', got {message!r}")
            flat.setdefault("content", "")
            if len(_MEMO) >= _MEMO_MAX:
                _MEMO.clear()
            _MEMO[id(message)] = (dict(message), flat)
            return dict(flat)
    plain: dict[str, Any] = _canonical(as_plain(message))
    if not isinstance(plain.get("role"), str):
        raise InvalidRequestError(f"a message needs a string 'role', got {message!r}")
    plain.setdefault("content", "")
    if isinstance(plain["content"], list):
        plain["content"] = [
            {"type": "image", "image": x} if isinstance(x, Image) else {"type": "text", "text": x}
            for x in content_items(plain["content"], "content")
        ]
    calls = plain.get("tool_calls")
    if calls:
        normalized = []
        for call in calls:
            call = dict(call)
            fn = dict(call.get("function", call))
            if "arguments" in fn:
                fn["arguments"] = _arguments(fn["arguments"])
            if "function" in call:
                call["function"] = fn
            else:
                call = fn
            call.pop("id", None)  # tool-call ids are client bookkeeping, not part of the rendered prompt
            normalized.append(call)
        plain["tool_calls"] = normalized
    elif "tool_calls" in plain:
        del plain["tool_calls"]
    return plain


def normalize_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """:func:`normalize_message` of each message (remembered flat dicts cost one comparison each)."""
    return [dict(m) for m in normal_forms(messages)]


def normal_forms(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Like :func:`normalize_messages`, but remembered normal forms are returned themselves, not copies: for
    callers that only read them (comparing histories, rendering)."""
    out = []
    get = _MEMO.get
    for m in messages:
        if type(m) is dict:
            hit = get(id(m))
            if hit is not None and hit[0] == m:
                out.append(hit[1])
                continue
        out.append(normalize_message(m))
    return out
