"""A backend's ``backend_options``, structured into its attrs options class by cattrs.

A backend declares its options once, as an ``@attrs.frozen(kw_only=True)`` class whose field types and
defaults say what is accepted (``bool``, ``float``, ``Literal[...]``, ``int | None``, ``tuple[...]``), with
:func:`require` validators for value rules, and turns the mapping into it with :func:`structure_options`::

    @attrs.frozen(kw_only=True)
    class AcmeOptions:
        transport: Literal["generate", "completions"] = "generate"
        poll_interval: float = attrs.field(default=0.05, validator=require(lambda v: v > 0, "must be > 0"))

    def parse_options(options: Mapping[str, Any]) -> AcmeOptions:
        return structure_options(options, AcmeOptions)

Every problem becomes one :class:`~backends_core.errors.ConfigError` line naming its path, in the words
:class:`~backends_core.config.ClientConfig` uses: ``unknown option @ $.backend_options.trasnport (known:
transport, poll_interval)``, ``expected a boolean, got 'yes' @ $.backend_options.stream``. Rules that
involve several fields (or the client config) stay in the backend, after structuring, with their paths.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, TypeVar, get_args, get_origin

import attrs
import cattrs
from attrs import AttrsInstance
from cattrs.cols import homogenous_tuple_structure_factory
from cattrs.gen import make_dict_structure_fn, override

from backends_core.converters import format_error, make_converter
from backends_core.errors import ConfigError

__all__ = ["OPTIONS_PATH", "options_converter", "require", "structure_options"]

T = TypeVar("T", bound=AttrsInstance)
#: Where ``backend_options`` sits in a :class:`~backends_core.config.ClientConfig`; every message's path.
OPTIONS_PATH = "$.backend_options"


class _Refused(ValueError):
    """A :func:`require` rule refused the value of ``field``."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def require(rule: Callable[[Any], object], message: str) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    """An attrs validator for an options field: a value (other than ``None``) for which ``rule`` is false is
    refused with ``message``, formatted with ``value`` (``"must be >= 1, got {value!r}"``; leave the value out
    of the message where it may be a secret), at the field's path."""

    def validate(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is not None and not rule(value):
            raise _Refused(attribute.name, message.format(value=value))

    return validate


def _is_tuple_of(type_: Any) -> bool:
    args = get_args(type_)
    return get_origin(type_) is tuple and len(args) == 2 and args[1] is Ellipsis


def _tuple_of(type_: Any, converter: cattrs.Converter) -> Callable[[Any, Any], tuple[Any, ...]]:
    """``tuple[X, ...]`` from a list; a string is refused rather than split into characters."""
    items = homogenous_tuple_structure_factory(type_, converter)

    def structure(value: Any, type_: Any) -> tuple[Any, ...]:
        if isinstance(value, str | bytes) or not isinstance(value, Sequence):
            raise TypeError(f"expected a list, got {value!r}")
        result: tuple[Any, ...] = items(value, type_)
        return result

    return structure


def _messages(exc: cattrs.BaseValidationError) -> list[str]:
    """One line per problem; a :func:`require` refusal is reported at its field (cattrs puts it on the class)."""
    refused, rest = exc.split(_Refused)
    lines = cattrs.transform_error(rest, path=OPTIONS_PATH, format_exception=format_error) if rest else []
    leaves: list[BaseException] = list(refused.exceptions) if refused else []
    while leaves:
        leaf = leaves.pop(0)
        if isinstance(leaf, BaseExceptionGroup):
            leaves[:0] = leaf.exceptions
        elif isinstance(leaf, _Refused):
            lines.append(f"{leaf} @ {OPTIONS_PATH}.{leaf.field}")
    return lines


def options_converter() -> cattrs.Converter:
    """The strict core converter (:func:`~backends_core.converters.make_converter`) that also refuses a string
    where a list is expected; a backend that registers hooks for its own types passes it to
    :func:`structure_options`."""
    converter = make_converter()
    converter.register_structure_hook_factory(_is_tuple_of, _tuple_of)
    return converter


def structure_options(
    options: Mapping[str, Any],
    cls: type[T],
    *,
    hooks: Mapping[str, Callable[[Any, Any], Any]] | None = None,
    derived: Collection[str] = (),
    converter: cattrs.Converter | None = None,
) -> T:
    """``options`` structured into the attrs class ``cls`` by a strict core converter (no silent coercion: a
    ``bool`` field refuses ``"yes"``, a ``float`` field takes an int but not a string).

    :param hooks: per-field cattrs structure hooks ``(value, type) -> value`` for fields whose shape the type
        alone cannot say; raise ``TypeError``/``ValueError`` (or let cattrs' own errors through) to refuse.
    :param converter: an :func:`options_converter` with the backend's own type hooks (default: a fresh one).
    :param derived: fields the backend fills in itself after structuring (``attrs.evolve``): not options, so
        a key of that name is unknown.
    :raises ConfigError: one message per problem, each naming its path under ``$.backend_options``: unknown
        fields (with the known ones), values of the wrong type, values a :func:`require` rule refuses.
    """
    known = [a.name for a in attrs.fields(cls) if a.name not in derived]
    problems = [
        f"unknown option @ {OPTIONS_PATH}.{key} (known: {', '.join(known)})" for key in options if key not in known
    ]
    converter = converter or options_converter()
    overrides: dict[str, Any] = {name: override(struct_hook=hook) for name, hook in (hooks or {}).items()}
    overrides.update({name: override(omit=True) for name in derived})
    structure = make_dict_structure_fn(cls, converter, **overrides)
    try:
        structured = structure({key: value for key, value in options.items() if key in known}, cls)
    except cattrs.BaseValidationError as exc:
        problems += _messages(exc)
    if problems:
        raise ConfigError(problems)
    return structured
