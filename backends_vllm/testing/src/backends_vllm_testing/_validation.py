"""Request validation in the manner of vLLM's pydantic request models (lax mode), written from the captures.

A *spec* is a callable ``spec(value, loc, strict) -> coerced value`` that raises :class:`ValidationFailure`.
Coercions follow pydantic v2's lax mode (``"5"`` and ``5.0`` are valid integers, ``1`` and ``"true"`` valid
booleans, numbers are never valid strings); unions try every member strictly before trying them laxly.
:func:`model` validates an object against named field specs; unknown fields are *ignored*, as vLLM does
(it only logs them), and reported to the caller so the emulator can record them.

Failures become vLLM's 400 body: ``{"error": {"message": "1 validation error:\\n  {...}", "type": "Bad Request",
"param": "body.token_ids", "code": 400}}``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

__all__ = [
    "REQUIRED",
    "Field",
    "Spec",
    "ValidationFailure",
    "any_value",
    "boolean",
    "integer",
    "list_of",
    "literal",
    "model",
    "nullable",
    "number",
    "object_any",
    "string",
    "union",
    "validation_error_body",
]

Loc = tuple[str | int, ...]
Spec = Callable[[Any, Loc, bool], Any]


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()
"""Default marker of a required field."""


@attrs.frozen
class Error:
    """One pydantic-style error."""

    type: str
    loc: Loc
    msg: str
    input: Any
    ctx: Mapping[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type, "loc": ".".join(str(p) for p in self.loc), "msg": self.msg}
        out["input"] = _abbreviate(self.input)
        if self.ctx is not None:
            out["ctx"] = dict(self.ctx)
        return out


class ValidationFailure(Exception):
    """One or more validation errors (becomes a 400)."""

    def __init__(self, errors: Sequence[Error]) -> None:
        self.errors = list(errors)
        super().__init__(validation_error_message(self.errors))

    @classmethod
    def one(cls, type_: str, loc: Loc, msg: str, value: Any, ctx: Mapping[str, Any] | None = None) -> ValidationFailure:
        return cls([Error(type_, loc, msg, value, ctx)])


def _abbreviate(value: Any) -> Any:
    if isinstance(value, list):
        return f"<list of {len(value)} items>"
    if isinstance(value, dict):
        return f"<dict of {len(value)} items>"
    return value


def validation_error_message(errors: Sequence[Error]) -> str:
    """The message vLLM builds from pydantic errors."""
    lines = "".join(f"\n  {error.as_dict()!r}" for error in errors)
    return f"{len(errors)} validation error{'s' if len(errors) != 1 else ''}:{lines}"


def validation_error_body(failure: ValidationFailure) -> dict[str, Any]:
    """The 400 body of a validation failure."""
    loc = failure.errors[0].loc if failure.errors else ()
    return {
        "error": {
            "message": validation_error_message(failure.errors),
            "type": "Bad Request",
            "param": ".".join(str(p) for p in loc) or None,
            "code": 400,
        }
    }


# -- scalar specs ---------------------------------------------------------------------------------------

_TRUE = {"1", "on", "t", "true", "y", "yes"}
_FALSE = {"0", "off", "f", "false", "n", "no"}


def _bounded(value: Any, loc: Loc, ge: float | None, le: float | None) -> None:
    if ge is not None and value < ge:
        raise ValidationFailure.one(
            "greater_than_equal", loc, f"Input should be greater than or equal to {ge}", value, {"ge": ge}
        )
    if le is not None and value > le:
        raise ValidationFailure.one(
            "less_than_equal", loc, f"Input should be less than or equal to {le}", value, {"le": le}
        )


def integer(*, ge: int | None = None, le: int | None = None) -> Spec:
    """An integer (lax: integral floats, numeric strings and booleans are accepted)."""

    def spec(value: Any, loc: Loc, strict: bool) -> int:
        out: int
        if isinstance(value, int) and not isinstance(value, bool):
            out = value
        elif strict:
            raise ValidationFailure.one("int_type", loc, "Input should be a valid integer", value)
        elif isinstance(value, bool):
            out = int(value)
        elif isinstance(value, float):
            if not math.isfinite(value) or value != int(value):
                raise ValidationFailure.one(
                    "int_from_float", loc, "Input should be a valid integer, got a number with a fractional part", value
                )
            out = int(value)
        elif isinstance(value, str):
            try:
                out = int(value.strip())
            except ValueError:
                raise ValidationFailure.one(
                    "int_parsing", loc, "Input should be a valid integer, unable to parse string as an integer", value
                ) from None
        else:
            raise ValidationFailure.one("int_type", loc, "Input should be a valid integer", value)
        _bounded(out, loc, ge, le)
        return out

    return spec


def number(*, ge: float | None = None, le: float | None = None) -> Spec:
    """A float (lax: integers, numeric strings and booleans are accepted)."""

    def spec(value: Any, loc: Loc, strict: bool) -> float:
        if isinstance(value, float) or (isinstance(value, int) and not isinstance(value, bool)):
            out = float(value)
        elif strict:
            raise ValidationFailure.one("float_type", loc, "Input should be a valid number", value)
        elif isinstance(value, bool):
            out = float(value)
        elif isinstance(value, str):
            try:
                out = float(value.strip())
            except ValueError:
                raise ValidationFailure.one(
                    "float_parsing", loc, "Input should be a valid number, unable to parse string as a number", value
                ) from None
        else:
            raise ValidationFailure.one("float_type", loc, "Input should be a valid number", value)
        _bounded(out, loc, ge, le)
        return out

    return spec


def boolean() -> Spec:
    """A boolean (lax: 0/1 and the usual strings are accepted)."""

    def spec(value: Any, loc: Loc, strict: bool) -> bool:
        if isinstance(value, bool):
            return value
        if not strict:
            if isinstance(value, int | float) and value in (0, 1):
                return bool(value)
            if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
                return value.strip().lower() in _TRUE
            if isinstance(value, str):
                raise ValidationFailure.one(
                    "bool_parsing", loc, "Input should be a valid boolean, unable to interpret input", value
                )
        raise ValidationFailure.one("bool_type", loc, "Input should be a valid boolean", value)

    return spec


def string(*, min_length: int | None = None, max_length: int | None = None) -> Spec:
    """A string (never coerced from numbers, as in pydantic)."""

    def spec(value: Any, loc: Loc, strict: bool) -> str:
        if not isinstance(value, str):
            raise ValidationFailure.one("string_type", loc, "Input should be a valid string", value)
        if min_length is not None and len(value) < min_length:
            s = "s" if min_length != 1 else ""
            raise ValidationFailure.one(
                "string_too_short",
                loc,
                f"String should have at least {min_length} character{s}",
                value,
                {"min_length": min_length},
            )
        if max_length is not None and len(value) > max_length:
            s = "s" if max_length != 1 else ""
            raise ValidationFailure.one(
                "string_too_long",
                loc,
                f"String should have at most {max_length} character{s}",
                value,
                {"max_length": max_length},
            )
        return value

    return spec


def literal(*choices: str) -> Spec:
    """One of the given strings."""
    quoted = [repr(c) for c in choices]
    expected = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"

    def spec(value: Any, loc: Loc, strict: bool) -> str:
        if not isinstance(value, str) or value not in choices:
            raise ValidationFailure.one(
                "literal_error", loc, f"Input should be {expected}", value, {"expected": expected}
            )
        return value

    return spec


def any_value() -> Spec:
    """Anything."""

    def spec(value: Any, loc: Loc, strict: bool) -> Any:
        return value

    return spec


def object_any() -> Spec:
    """A JSON object with any content."""

    def spec(value: Any, loc: Loc, strict: bool) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise ValidationFailure.one("dict_type", loc, "Input should be a valid dictionary", value)
        return value

    return spec


# -- combinators ----------------------------------------------------------------------------------------


def nullable(inner: Spec) -> Spec:
    """``inner`` or ``null``."""

    def spec(value: Any, loc: Loc, strict: bool) -> Any:
        return None if value is None else inner(value, loc, strict)

    return spec


def list_of(item: Spec, *, min_length: int | None = None, max_length: int | None = None) -> Spec:
    """A JSON array of ``item``."""

    def spec(value: Any, loc: Loc, strict: bool) -> list[Any]:
        if not isinstance(value, list):
            raise ValidationFailure.one("list_type", loc, "Input should be a valid list", value)
        errors: list[Error] = []
        out = []
        for i, element in enumerate(value):
            try:
                out.append(item(element, (*loc, i), strict))
            except ValidationFailure as exc:
                errors.extend(exc.errors)
        if errors:
            raise ValidationFailure(errors)
        if min_length is not None and len(out) < min_length:
            s = "s" if min_length != 1 else ""
            raise ValidationFailure.one(
                "too_short",
                loc,
                f"List should have at least {min_length} item{s} after validation, not {len(out)}",
                value,
                {"field_type": "List", "min_length": min_length, "actual_length": len(out)},
            )
        if max_length is not None and len(out) > max_length:
            s = "s" if max_length != 1 else ""
            raise ValidationFailure.one(
                "too_long",
                loc,
                f"List should have at most {max_length} item{s} after validation, not {len(out)}",
                value,
                {"field_type": "List", "max_length": max_length, "actual_length": len(out)},
            )
        return out

    return spec


def union(*members: Spec) -> Spec:
    """The first member that validates strictly, else the first that validates laxly."""

    def spec(value: Any, loc: Loc, strict: bool) -> Any:
        for member in members:
            try:
                return member(value, loc, True)
            except ValidationFailure:
                pass
        errors: list[Error] = []
        if not strict:
            for member in members:
                try:
                    return member(value, loc, False)
                except ValidationFailure as exc:
                    errors.extend(exc.errors[:1])
        else:
            for member in members:
                try:
                    member(value, loc, True)
                except ValidationFailure as exc:
                    errors.extend(exc.errors[:1])
        raise ValidationFailure(errors)

    return spec


@attrs.frozen
class Field:
    """A field of a :func:`model`: its spec and default (:data:`REQUIRED` for required fields)."""

    spec: Spec
    default: Any = None


def model(fields: Mapping[str, Field]) -> Callable[[Any, Loc], tuple[dict[str, Any], list[str]]]:
    """A validator of JSON objects: returns ``(values with defaults, names of ignored unknown fields)``."""

    def validate(value: Any, loc: Loc) -> tuple[dict[str, Any], list[str]]:
        if not isinstance(value, dict):
            raise ValidationFailure.one(
                "model_attributes_type",
                loc,
                "Input should be a valid dictionary or object to extract fields from",
                value,
            )
        out: dict[str, Any] = {}
        errors: list[Error] = []
        for name, field in fields.items():
            if name not in value:
                if field.default is REQUIRED:
                    errors.append(Error("missing", (*loc, name), "Field required", value))
                else:
                    out[name] = field.default
                continue
            try:
                out[name] = field.spec(value[name], (*loc, name), False)
            except ValidationFailure as exc:
                errors.extend(exc.errors)
        if errors:
            raise ValidationFailure(errors)
        return out, [name for name in value if name not in fields]

    return validate
