"""The contract documents itself completely, and the docs keep up with it."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import backends_core
from backends_core import hookspecs

SPECS = {name: getattr(hookspecs, name) for name in hookspecs.__all__}
README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_all_lists_every_spec_and_only_specs() -> None:
    declared = {name for name, obj in vars(hookspecs).items() if hasattr(obj, "backends_core_spec")}
    assert declared == set(hookspecs.__all__)
    assert hookspecs.__all__ == sorted(hookspecs.__all__)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_spec_is_typed_documented_and_firstresult(name: str) -> None:
    fn = SPECS[name]
    opts = fn.backends_core_spec
    assert opts["firstresult"] is (name not in hookspecs.COLLECTING_HOOKS)
    assert not opts.get("historic")
    doc = inspect.getdoc(fn) or ""
    params = inspect.signature(fn).parameters
    for arg in params:
        assert f":param {arg}:" in doc, f"{name}: no :param {arg}: line"
        assert params[arg].annotation is not inspect.Parameter.empty, f"{name}: {arg} is untyped"
    assert "versionadded" in doc
    if name != "observe":
        assert ":returns:" in doc and "Raises:" in doc


@pytest.mark.parametrize("name", sorted(SPECS))
def test_admin_teacher_and_generate_hooks_are_async(name: str) -> None:
    is_async = inspect.iscoroutinefunction(SPECS[name])
    assert is_async == (name.startswith("admin_") or name in {"post_generate", "teacher_logprobs", "tokenize_messages"})


@pytest.mark.parametrize("name", sorted(SPECS))
def test_readme_has_a_reference_section_for_every_hook(name: str) -> None:
    args = ", ".join(inspect.signature(SPECS[name]).parameters)
    assert re.search(rf"^#### `{name}\({re.escape(args)}\)`", README, re.M), f"README lacks '#### `{name}({args})`'"


def test_public_api_is_sorted_and_complete() -> None:
    assert backends_core.__all__ == sorted(backends_core.__all__)
    for name in backends_core.__all__:
        assert hasattr(backends_core, name)
    for must in ("Client", "ClientConfig", "SamplingParams", "available_backends", "hookimpl"):
        assert must in backends_core.__all__
