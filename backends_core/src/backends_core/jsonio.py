"""JSON bodies: orjson both ways, the stdlib for what orjson refuses.

orjson is 2-3x faster than the stdlib on these bodies; whatever it refuses (NaN literals, integers beyond 64 bits,
non-UTF-8 encodings, non-string keys) takes the stdlib path, so what is accepted and how failures read is the
stdlib's. :func:`loads_lifting` cuts big string values (base64 routed experts: megabytes) out of the raw body
before parsing and hands them back as ``memoryview`` objects into it, so they are neither scanned by
the JSON parser nor copied into a ``str``.
"""

from __future__ import annotations

import json
import re
import secrets as _secrets
from collections.abc import Callable, Sequence
from typing import Any

import orjson

__all__ = ["dumps", "loads", "loads_lifting"]

#: Types the stdlib serialises differently or refuses go to the stdlib (orjson would serialise them natively).
_DUMPS_OPTIONS = orjson.OPT_PASSTHROUGH_SUBCLASS | orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME


def dumps(value: Any) -> bytes:
    """Compact JSON bytes of ``value`` (orjson; the stdlib for what orjson refuses, e.g. int keys or big ints)."""
    try:
        return orjson.dumps(value, option=_DUMPS_OPTIONS)
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        return json.dumps(value, separators=(",", ":")).encode()


def loads(content: bytes) -> Any:
    """Parse a JSON body: orjson, or the stdlib for what orjson refuses (NaN literals, big ints, UTF-16...).

    :raises json.JSONDecodeError | UnicodeDecodeError: it is not JSON.
    """
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError:
        return json.loads(content)


#: Strings shorter than this are parsed as usual: lifting them out would cost more than it saves.
_LIFT_MIN = 4096
_NONCE = _secrets.token_hex(8)


def loads_lifting(
    content: bytes, keys: Sequence[str], *, sized: Callable[[memoryview], int | None] | None = None
) -> Any:
    """:func:`loads`, with the string values of ``keys`` (at least 4 KiB long) returned as ``memoryview`` objects
    of ``content``: the parser never sees them and they are never copied. A lifted value is the raw text between
    its quotes, JSON escapes included: its consumer must refuse what its format does not allow and unescape what
    JSON allows (:func:`~backends_core.routed_experts.decode_routed_experts` does both for base64).

    Each value is replaced in a copy of the rest of the body by a placeholder no server can forge (a per-process
    nonce), the rest is parsed, and the views are put back where the placeholders landed; if any is not found
    (a match inside a string, an unusual layout), the whole body is parsed as usual instead. A value whose first
    quote is preceded by a backslash (maybe escaped: its end is not known without reading every escape) is parsed
    as usual.

    :param sized: for values whose length their own first bytes tell (a base64 ``.npy`` payload's header): given
        the body from the value's first byte, its length in bytes, or ``None`` to find its end by scanning; a
        sized value is lifted without scanning when a closing quote stands right after it.
    """
    spans: list[tuple[int, int]] = []
    view = memoryview(content)
    # one scan for every key, going on after each value found: the values themselves (megabytes) are never scanned
    pattern = re.compile(b'"(?:' + b"|".join(re.escape(key.encode()) for key in keys) + rb')"\s*:\s*"')
    at = 0
    while (m := pattern.search(content, at)) is not None:
        start = m.end()
        length = sized(view[start:]) if sized is not None else None
        end = start + length if length is not None else -1
        if length is not None and length >= _LIFT_MIN and _closes(content, end):
            spans.append((start, end))
            at = end + 1
            continue
        end = content.find(b'"', start)
        if end < 0:
            break
        at = end + 1
        if end - start >= _LIFT_MIN and content[end - 1] != 0x5C:
            spans.append((start, end))
    if not spans:
        return loads(content)
    spans.sort()
    pieces: list[bytes] = []
    table: dict[str, memoryview] = {}
    pos = 0
    for i, (start, end) in enumerate(spans):
        pieces += (content[pos:start], b"\\u0000%s:%d" % (_NONCE.encode(), i))
        table[f"\x00{_NONCE}:{i}"] = view[start:end]
        pos = end
    pieces.append(content[pos:])
    try:
        parsed = orjson.loads(b"".join(pieces))
    except orjson.JSONDecodeError:
        return loads(content)
    if not _put_back(parsed, frozenset(keys), table):
        return loads(content)
    return parsed


def _closes(content: bytes, end: int) -> bool:
    """Whether a string value's closing quote is at ``end`` (a quote not escaped by the byte before it)."""
    return end < len(content) and content[end] == 0x22 and content[end - 1] != 0x5C


def _put_back(document: Any, keys: frozenset[str], table: dict[str, memoryview]) -> bool:
    """Replace the placeholders of ``table`` under ``keys`` in ``document``; stop once all are back."""
    stack = [document]
    while stack and table:
        node = stack.pop()
        if type(node) is dict:
            for key, value in node.items():
                if type(value) is str:
                    if key in keys and value in table:
                        node[key] = table.pop(value)
                elif type(value) is dict or type(value) is list:
                    stack.append(value)
        elif type(node) is list:
            stack.extend(v for v in node if type(v) is dict or type(v) is list)
    return not table
