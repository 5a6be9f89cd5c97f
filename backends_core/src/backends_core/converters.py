"""cattrs converters for wire types. Each backend calls :func:`make_converter` and adds its own hooks;
nobody touches a global converter.

The core converter is strict where silent coercion would corrupt data: an int field refuses ``"12"``,
``1.5`` and ``true``; a float field takes ints but not strings or booleans; ``str`` refuses numbers.
Unknown keys in server responses are ignored (servers add fields); structuring errors are turned into one
:class:`~backends_core.errors.ResponseParseError` naming the field path by :func:`structure_response`.
"""

from __future__ import annotations

import difflib
import re
from typing import Any, TypeVar

import attrs
import cattrs

from backends_core.errors import ResponseParseError

__all__ = ["format_error", "make_converter", "structure_response"]

T = TypeVar("T")


def _int(value: Any, _t: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def _float(value: Any, _t: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"expected a number, got {value!r}")
    return float(value)


def _str(value: Any, _t: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {value!r}")
    return value


def _bool(value: Any, _t: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"expected a boolean, got {value!r}")
    return value


def make_converter(*, forbid_extra_keys: bool = False) -> cattrs.Converter:
    """A fresh strict converter for one backend's wire types (or, with ``forbid_extra_keys``, for config)."""
    conv = cattrs.Converter(omit_if_default=True, forbid_extra_keys=forbid_extra_keys)
    conv.register_structure_hook(int, _int)
    conv.register_structure_hook(float, _float)
    conv.register_structure_hook(str, _str)
    conv.register_structure_hook(bool, _bool)
    return conv


def structure_response(converter: cattrs.Converter, raw: Any, cls: type[T], *, url: str | None = None) -> T:
    """Structure a response body into ``cls``; any mismatch becomes a :class:`ResponseParseError` whose
    detail lists each bad field path (``$.samples[0].output_ids[3]: expected an integer, got '7'``)."""
    try:
        return converter.structure(raw, cls)
    except Exception as exc:
        if isinstance(exc, cattrs.BaseValidationError):
            detail = "; ".join(cattrs.transform_error(exc, path="$", format_exception=format_error))
        else:
            detail = f"{type(exc).__name__}: {exc} @ $"
        raise ResponseParseError(detail, url=url) from exc


def format_error(exc: BaseException, type_: Any) -> str:
    """One readable line for a structuring error (used with ``cattrs.transform_error``)."""
    if isinstance(exc, KeyError):
        return "required field missing" + (f" (expected {getattr(type_, '__name__', type_)})" if type_ else "")
    if isinstance(exc, cattrs.ForbiddenExtraKeysError):
        return f"unknown field(s) {sorted(exc.extra_fields)}" + _did_you_mean(exc)
    literal = re.match(r"^(.*) not in literal typing\.Literal\[(.*)\]$", str(exc))
    if literal:
        return f"expected one of [{literal.group(2)}], got {literal.group(1)!r}"
    if isinstance(exc, TypeError | ValueError) and str(exc):
        return str(exc)
    text = cattrs.v.format_exception(exc, type_)
    return text if not text.startswith("unknown error") else f"{type(exc).__name__}: {exc}"


def _did_you_mean(exc: cattrs.ForbiddenExtraKeysError) -> str:
    """``"; did you mean 'timeouts'?"`` for each unknown key close to a field of the class (a typo), else ``""``."""
    if not attrs.has(exc.cl):
        return ""
    known = [field.alias or field.name for field in attrs.fields(exc.cl)]
    close = {key: difflib.get_close_matches(key, known, n=1, cutoff=0.6) for key in sorted(exc.extra_fields)}
    hints = {key: match[0] for key, match in close.items() if match}
    if len(exc.extra_fields) == 1 and hints:
        return f"; did you mean {next(iter(hints.values()))!r}?"
    return "".join(f"; {key!r}: did you mean {match!r}?" for key, match in hints.items())
