"""Checks of a request's fields that every wire module shares: each failure a 400 naming the field."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from backends_gateway.errors import GatewayError

__all__ = ["bad", "integer", "number", "refuse_unenforceable_tool_choice"]


def bad(message: str, param: str, code: str = "invalid_value") -> GatewayError:
    return GatewayError(400, message, param=param, code=code)


def number(body: Mapping[str, Any], key: str, *, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad(f"{key} must be a number, got {value!r}", key, "invalid_type")
    if not low <= value <= high:
        raise bad(f"{key} must be in [{low}, {high}], got {value!r}", key)
    return float(value)


def integer(body: Mapping[str, Any], key: str, *, low: int, high: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"{key} must be an integer, got {value!r}", key, "invalid_type")
    if value < low or (high is not None and value > high):
        raise bad(f"{key} must be an integer in [{low}, {high if high is not None else '∞'}], got {value}", key)
    return value


def refuse_unenforceable_tool_choice(choice: Any, parallel: Any, *, has_tools: bool) -> None:
    """Refuse what a template-rendered prompt cannot make the model obey: a forced or named tool choice, and
    ``parallel_tool_calls: false`` (nothing stops a sampled reply from calling two tools, and the answer must be
    what was sampled)."""
    if choice not in (None, "auto") and not (choice == "none" and not has_tools):
        raise bad(
            f"tool_choice {choice!r} cannot be enforced by the gateway: send 'auto' (or omit it)",
            "tool_choice",
            "unsupported_parameter",
        )
    if parallel not in (None, True):
        raise bad(
            "parallel_tool_calls=false cannot be enforced by the gateway",
            "parallel_tool_calls",
            "unsupported_parameter",
        )
