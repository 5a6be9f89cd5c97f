"""Chat messages as plain data: normalisation for rendering and for comparing histories.

Agent frameworks hand over dicts, Pydantic models, attrs or dataclass objects, sometimes with ``None``-valued
keys, missing vs empty content, and tool-call arguments as JSON strings with arbitrary spacing. Two histories
that differ only in such ways are the same conversation; :func:`normalize_message` maps each to one canonical
plain dict so comparison is exact and benign differences never break token reuse.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from backends_core.errors import InvalidRequestError

__all__ = ["as_plain", "normal_forms", "normalize_message", "normalize_messages"]


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
    if type(value) in _SCALARS:
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
