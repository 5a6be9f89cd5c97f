"""Checks of a request's fields that every wire module shares: each failure a 400 naming the field."""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any, TypeGuard

import attrs

from backends_core import InvalidRequestError, SamplingParams
from backends_core.images import image_of_url
from backends_gateway.errors import GatewayError

__all__ = [
    "CompletionLimit",
    "bad",
    "boolean",
    "check_image",
    "completion_tokens",
    "check_image_detail",
    "integer",
    "number",
    "one_of",
    "sampling_params",
    "ToolChoice",
    "tool_choice",
]


def bad(message: str, param: str, code: str = "invalid_value") -> GatewayError:
    return GatewayError(400, message, param=param, code=code)


def one_of(value: Any, allowed: Collection[str]) -> TypeGuard[str]:
    """Whether ``value`` is one of the strings ``allowed`` (a list or object where a name belongs is not, rather
    than a ``TypeError`` from hashing it)."""
    return isinstance(value, str) and value in allowed


def boolean(body: Mapping[str, Any], key: str) -> bool | None:
    """``body[key]`` when it is a JSON boolean (``0`` and ``1`` are not), ``None`` when absent or null."""
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise bad(f"{key} must be a boolean, got {value!r}", key, "invalid_type")
    return value


def sampling_params(names: Mapping[str, str] | None = None, **fields: Any) -> SamplingParams:
    """The turn's :class:`SamplingParams`; what the library refuses in them (``top_p`` 0, ``min_tokens`` above
    ``max_tokens``, an empty stop string...) is a 400 naming the request's field (``names`` maps the library's
    field to the route's, e.g. ``stop`` to ``stop_sequences``), never a server error."""
    try:
        return SamplingParams(**fields)
    except InvalidRequestError as exc:
        field = re.match(r"[a-z_]+", str(exc))
        name = field.group(0) if field and field.group(0) in fields else "body"
        raise bad(str(exc), (names or {}).get(name, name)) from exc


@attrs.frozen(kw_only=True)
class CompletionLimit:
    """The most completion ids a turn may ask for, and what sets that bound (said when a request asks more)."""

    tokens: int
    why: str


def completion_tokens(body: Mapping[str, Any], key: str, limit: CompletionLimit) -> int | None:
    """The completion limit ``body[key]`` names (``None``: none named), refused past ``limit`` with what sets it
    and how to raise it."""
    value = integer(body, key, low=1)
    if value is not None and value > limit.tokens:
        raise bad(
            f"{key} {value} is more than this gateway serves: {limit.why}. Ask for at most {limit.tokens}, or serve "
            "a model with a longer context (the gateway's --context-length, --max-completion-tokens)",
            key,
            "max_tokens_too_large",
        )
    return value


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


@attrs.frozen(kw_only=True)
class ToolChoice:
    """A tool choice the engine is constrained to: the reply only calls tools (``name``: only that one), one call
    (``single``) or several. Honoured with a grammar of the template's tool-call markup (the gateway refuses it,
    naming ``param``, where the tool parser or the engine has none)."""

    name: str | None
    single: bool
    param: str = "tool_choice"


def tool_choice(
    choice: Any, parallel: Any, *, tools: Sequence[Mapping[str, Any]] | None, named: str | None
) -> ToolChoice | None:
    """An OpenAI tool choice (``named``: the function a named choice names, already read from its wire's form),
    as what constrains the engine (``None``: the model chooses). ``parallel_tool_calls: false`` is honoured with a
    forced choice (one call) and refused without one: nothing else can stop a sampled reply from calling two
    tools, and the answer must be what was sampled."""
    if parallel is not None and not isinstance(parallel, bool):
        raise bad(f"parallel_tool_calls must be a boolean, got {parallel!r}", "parallel_tool_calls", "invalid_type")
    names = [t["function"]["name"] for t in tools or ()]
    if choice in (None, "auto"):
        if parallel not in (None, True):
            raise bad(
                "parallel_tool_calls=false can only be enforced with tool_choice 'required' or a named function",
                "parallel_tool_calls",
                "unsupported_parameter",
            )
        return None
    if choice == "none":
        if names:
            raise bad(
                "tool_choice 'none' with tools cannot be enforced by the gateway: send no tools (or 'auto')",
                "tool_choice",
                "unsupported_parameter",
            )
        return None
    if not names:
        raise bad(f"tool_choice {choice!r} needs tools", "tool_choice")
    if choice == "required":
        return ToolChoice(name=None, single=parallel is False)
    if named is None:
        raise bad(f"tool_choice {choice!r} is not a tool choice this route takes", "tool_choice")
    if named not in names:
        raise bad(f"tool_choice names {named!r}, which is not one of the tools {names}", "tool_choice")
    return ToolChoice(name=named, single=True)


def check_image(url: Any, param: str) -> None:
    """Refuse, naming ``param``, an image URL whose image cannot be read: a base64 ``data:`` URL of an encoded
    image (PNG, JPEG, GIF, BMP, WebP) or an ``http(s)`` URL the engine fetches. A ``file:`` URL is refused: a
    harness's request never makes the gateway read a file of its own machine."""
    if not isinstance(url, str) or not url.startswith(("data:", "http://", "https://")):
        shown = url[:80] if isinstance(url, str) else type(url).__name__
        raise bad(
            f"{param} must be a data: URL (base64) or an http(s) URL, got {shown!r}: the gateway reads no files",
            param,
            "invalid_image",
        )
    try:
        image_of_url(url, param)
    except InvalidRequestError as exc:
        raise bad(str(exc), param, "invalid_image") from exc


def check_image_detail(detail: Any, param: str) -> None:
    """Refuse an image ``detail`` other than ``auto``: the engine's image processor decides the resolution (the
    model's own minimum and maximum pixels), so a low or high detail could not be honoured."""
    if detail not in (None, "auto"):
        raise bad(
            f"{param} {detail!r} cannot be honoured: the served model's image processor decides the resolution "
            "(send 'auto' or leave it out)",
            param,
            "unsupported_parameter",
        )
