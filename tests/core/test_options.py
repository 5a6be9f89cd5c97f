"""``backends_core.options``: a backend's options mapping structured into its attrs class, every problem a
:class:`ConfigError` line with its ``$.backend_options`` path."""

from __future__ import annotations

from typing import Any, Literal

import attrs
import pytest

from backends_core import ConfigError
from backends_core.options import require, structure_options


@attrs.frozen(kw_only=True)
class Options:
    transport: Literal["generate", "completions"] = "generate"
    stream: bool = False
    interval: float = attrs.field(default=0.05, validator=require(lambda v: v > 0, "must be > 0, got {value!r}"))
    layers: int | None = None
    fields: tuple[str, ...] = ()
    resolved: str | None = None


KNOWN = "transport, stream, interval, layers, fields, resolved"


def messages(options: dict[str, Any], **kwargs: Any) -> list[str]:
    with pytest.raises(ConfigError) as info:
        structure_options(options, Options, **kwargs)
    return info.value.messages


def test_values_are_structured_with_their_types() -> None:
    got = structure_options({"transport": "completions", "interval": 2, "fields": ["a"]}, Options)
    assert got == Options(transport="completions", interval=2.0, fields=("a",))
    assert isinstance(got.interval, float)
    assert structure_options({}, Options) == Options()


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (
            {"trasnport": "generate"},
            f"unknown option @ $.backend_options.trasnport (known: {KNOWN})",
        ),
        ({"stream": "yes"}, "expected a boolean, got 'yes' @ $.backend_options.stream"),
        (
            {"transport": "grpc"},
            "expected one of ['generate', 'completions'], got 'grpc' @ $.backend_options.transport",
        ),
        ({"interval": "1"}, "expected a number, got '1' @ $.backend_options.interval"),
        ({"interval": 0}, "must be > 0, got 0.0 @ $.backend_options.interval"),
        ({"layers": True}, "expected an integer, got True @ $.backend_options.layers"),
        ({"fields": "a"}, "expected a list, got 'a' @ $.backend_options.fields"),
        ({"fields": ["a", 1]}, "expected a string, got 1 @ $.backend_options.fields[1]"),
    ],
)
def test_every_problem_names_its_path(options: dict[str, Any], expected: str) -> None:
    assert messages(options) == [expected]


def test_problems_are_reported_together() -> None:
    assert messages({"nope": 1, "stream": 1}) == [
        f"unknown option @ $.backend_options.nope (known: {KNOWN})",
        "expected a boolean, got 1 @ $.backend_options.stream",
    ]


def test_derived_fields_are_not_options_and_hooks_shape_a_field() -> None:
    assert messages({"resolved": "x"}, derived=("resolved",))[0].startswith(
        "unknown option @ $.backend_options.resolved"
    )

    def upper(value: Any, _type: Any) -> str:
        if not isinstance(value, str):
            raise TypeError(f"expected a name, got {value!r}")
        return value.upper()

    assert structure_options({"resolved": "x"}, Options, hooks={"resolved": upper}).resolved == "X"
    assert messages({"resolved": 3}, hooks={"resolved": upper}) == [
        "expected a name, got 3 @ $.backend_options.resolved"
    ]
