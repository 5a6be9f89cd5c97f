"""Typed access to a decoded JSON body where every miss names its JSON path (``$.choices[0].logprobs``).

Backends parse server answers with :class:`Node` so that every problem becomes one
:class:`~backends_core.errors.ResponseParseError` saying what was wrong and where, never a ``KeyError`` from
deep inside a parser.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from backends_core.errors import ResponseParseError

__all__ = ["PLACEHOLDER_LOGPROB", "U32", "Node"]

#: What vLLM (and Dynamo's frontend) write where there is no real logprob; never passed on as a value.
PLACEHOLDER_LOGPROB = -9999.0
#: Token ids are u32 on every engine.
U32 = 2**32


def describe(value: Any) -> str:
    """A short description of a JSON value for error messages (never a huge dump)."""
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "…"


class Node:
    """One value of a decoded JSON document and its path.

    :ivar value: the decoded value.
    :ivar path: its JSON path, used in every error.
    :ivar url: where the document came from (for :class:`ResponseParseError`).
    """

    __slots__ = ("path", "url", "value")

    def __init__(self, value: Any, path: str = "$", url: str | None = None) -> None:
        self.value, self.path, self.url = value, path, url

    def fail(self, message: str) -> ResponseParseError:
        """A parse error about this node."""
        return ResponseParseError(f"{message} @ {self.path}", url=self.url)

    def obj(self) -> Mapping[str, Any]:
        if not isinstance(self.value, Mapping):
            raise self.fail(f"expected an object, got {describe(self.value)}")
        return self.value

    def has(self, key: str) -> bool:
        """Whether this object has ``key`` with a non-null value."""
        return isinstance(self.value, Mapping) and self.value.get(key) is not None

    def get(self, key: str, *, required: bool = True) -> Node:
        """The child ``key``; a missing key is an error unless ``required`` is false (then its value is None)."""
        obj = self.obj()
        if required and key not in obj:
            raise ResponseParseError(f"required field missing @ {self.path}.{key}", url=self.url)
        return Node(obj.get(key), f"{self.path}.{key}", self.url)

    def items(self) -> list[Node]:
        if not isinstance(self.value, list):
            raise self.fail(f"expected a list, got {describe(self.value)}")
        return [Node(v, f"{self.path}[{i}]", self.url) for i, v in enumerate(self.value)]

    def integer(self, *, below: int | None = None) -> int:
        """A non-boolean integer, optionally checked to be in ``[0, below)``."""
        v = self.value
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.fail(f"expected an integer, got {describe(v)}")
        if below is not None and not 0 <= v < below:
            raise self.fail(f"expected an integer in [0, {below}), got {v}")
        return v

    def string(self) -> str:
        if not isinstance(self.value, str):
            raise self.fail(f"expected a string, got {describe(self.value)}")
        return self.value

    def boolean(self) -> bool:
        if not isinstance(self.value, bool):
            raise self.fail(f"expected a boolean, got {describe(self.value)}")
        return self.value

    def number(self) -> float:
        v = self.value
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise self.fail(f"expected a number, got {describe(v)}")
        return float(v)

    def optional_items(self) -> list[Node] | None:
        return None if self.value is None else self.items()

    def optional_integer(self) -> int | None:
        return None if self.value is None else self.integer()

    def optional_string(self) -> str | None:
        return None if self.value is None else self.string()

    def token_ids(self) -> tuple[int, ...]:
        """A list of u32 token ids."""
        return tuple(item.integer(below=U32) for item in self.items())

    def logprob(self) -> float:
        """A finite log-probability; NaN, infinities, positive values and the ``-9999`` placeholder are refused."""
        v = self.value
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise self.fail(f"expected a logprob, got {describe(v)}")
        if not math.isfinite(v) or v <= PLACEHOLDER_LOGPROB or v > 1e-3:
            raise self.fail(f"logprob {v!r} is not a finite log-probability (the placeholder is {PLACEHOLDER_LOGPROB})")
        return float(v)
