"""The admin facade: one typed driver method per admin hook, and what a backend's admin hook must answer."""

from __future__ import annotations

import inspect
import typing

import pytest

from backends_core import Client, ClientConfig, ResponseParseError, ServerState, hookspecs
from backends_core.driver import BackendDriver
from backends_core.fleet import AdminOutcomes

ADMIN_HOOKS = sorted(name for name in hookspecs.__all__ if name.startswith("admin_"))
CONTEXT = {"server", "config", "options"}


def test_there_is_no_string_dispatched_admin_call() -> None:
    assert not hasattr(BackendDriver, "admin")
    assert not hasattr(Client(ClientConfig(backend="reference", base_url="http://x", model="m")).admin, "run")


@pytest.mark.parametrize("hook", ADMIN_HOOKS)
def test_each_admin_hook_has_a_typed_driver_method_with_the_hooks_arguments(hook: str) -> None:
    method = getattr(BackendDriver, hook)
    spec_args = set(inspect.signature(getattr(hookspecs, hook)).parameters) - CONTEXT
    params = inspect.signature(method).parameters
    assert set(params) - {"self", "server"} == spec_args
    assert all(params[name].kind is inspect.Parameter.KEYWORD_ONLY for name in spec_args)
    returns = typing.get_type_hints(method)["return"]
    assert returns in (bool, int, ServerState), returns  # what the fleet relies on, never Any
    operation = hook.removeprefix("admin_")
    assert callable(getattr(AdminOutcomes, operation))  # and every operation fans out over a fleet


class _SaysYes:
    """A backend whose pause answers a string instead of the boolean the contract asks for."""

    @hookspecs.hookimpl
    async def post_generate(self, server, request, config, options):  # type: ignore[no-untyped-def]
        raise AssertionError("not called")

    @hookspecs.hookimpl
    def parse_response(self, raw, request, server_url, config, options):  # type: ignore[no-untyped-def]
        raise AssertionError("not called")

    @hookspecs.hookimpl
    async def admin_pause(self, server, mode, clear_cache, config, options):  # type: ignore[no-untyped-def]
        return "yes"


async def test_an_admin_answer_of_the_wrong_type_is_a_parse_error_naming_the_hook() -> None:
    config = ClientConfig(backend="says_yes", base_url="http://127.0.0.1:9", model="m")
    async with Client(config, plugin=_SaysYes()) as client:
        outcomes = await client.admin.outcomes().pause("abort", clear_cache=False)
    (outcome,) = outcomes
    assert isinstance(outcome.error, ResponseParseError)
    assert "returned str from admin_pause, expected bool" in str(outcome.error)
