"""Typed reading of decoded JSON: every miss raises :class:`ResponseParseError` naming its JSON path."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from backends_core.errors import ResponseParseError

__all__ = ["Body"]


class Body:
    """One value of a decoded JSON answer, with its path (``$.meta_info.output_token_logprobs[3]``)."""

    __slots__ = ("path", "url", "value")

    def __init__(self, value: Any, path: str = "$", url: str | None = None) -> None:
        self.value, self.path, self.url = value, path, url

    def fail(self, message: str) -> ResponseParseError:
        """An error about this value."""
        return ResponseParseError(f"{message} @ {self.path}", url=self.url)

    def obj(self) -> Mapping[str, Any]:
        if not isinstance(self.value, Mapping):
            raise self.fail(f"expected an object, got {_describe(self.value)}")
        return self.value

    def get(self, key: str, *, required: bool = True) -> Body:
        """The member ``key`` (``null`` when absent and not required)."""
        obj = self.obj()
        if required and key not in obj:
            raise ResponseParseError(f"required field missing @ {self.path}.{key}", url=self.url)
        return Body(obj.get(key), f"{self.path}.{key}", self.url)

    def has(self, key: str) -> bool:
        return isinstance(self.value, Mapping) and self.value.get(key) is not None

    def items(self) -> list[Body]:
        if not isinstance(self.value, list):
            raise self.fail(f"expected a list, got {_describe(self.value)}")
        return [Body(v, f"{self.path}[{i}]", self.url) for i, v in enumerate(self.value)]

    def integer(self) -> int:
        if isinstance(self.value, bool) or not isinstance(self.value, int):
            raise self.fail(f"expected an integer, got {_describe(self.value)}")
        return self.value

    def string(self) -> str:
        if not isinstance(self.value, str):
            raise self.fail(f"expected a string, got {_describe(self.value)}")
        return self.value

    def boolean(self) -> bool:
        if not isinstance(self.value, bool):
            raise self.fail(f"expected a boolean, got {_describe(self.value)}")
        return self.value

    def logprob(self) -> float:
        """A finite log-probability (``<= 0`` up to rounding)."""
        v = self.value
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise self.fail(f"expected a logprob, got {_describe(v)}")
        if not math.isfinite(v) or v > 1e-3:
            raise self.fail(f"logprob {v!r} is not a finite log-probability")
        return float(v)


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "…"
