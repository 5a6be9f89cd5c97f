"""Finding and loading backends: one plugin manager per client, holding only the selected backend.

Backends register under the entry-point group :data:`ENTRY_POINT_GROUP`; the entry-point name is the
string users put in ``ClientConfig.backend``. Listing never imports a backend; loading imports only the
selected one, so a broken unrelated backend can't break anyone.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import pluggy

from backends_core import hookspecs
from backends_core.errors import (
    BackendConflictError,
    BackendLoadError,
    BackendNotFoundError,
    BackendValidationError,
    ConfigError,
)
from backends_core.fronts import BUILTIN_FRONTS
from backends_core.hookspecs import hookimpl
from backends_core.multiturn.prefix_cache import PrefixRenderCache
from backends_core.parsing import BUILTIN_REASONING_PARSERS, BUILTIN_TOOL_PARSERS

__all__ = ["ENTRY_POINT_GROUP", "BackendInfo", "CoreDefaults", "available_backends", "make_plugin_manager"]

#: Entry-point group backends register under.
ENTRY_POINT_GROUP = "backends_core.backends"
#: Set to 1 to print every hook call and result to stderr.
TRACE_ENV = "BACKENDS_TRACE_HOOKS"


@attrs.frozen(kw_only=True)
class BackendInfo:
    """An installed backend as its package metadata describes it (nothing is imported)."""

    name: str
    distribution: str
    version: str
    target: str


def _entry_points() -> list[md.EntryPoint]:
    return list(md.entry_points(group=ENTRY_POINT_GROUP))


def available_backends() -> list[BackendInfo]:
    """Installed backends, sorted by name, read from package metadata without importing them.

    :raises BackendConflictError: two distributions register the same name.
    """
    found: dict[str, BackendInfo] = {}
    for ep in _entry_points():
        dist = ep.dist
        info = BackendInfo(
            name=ep.name,
            distribution=dist.name if dist is not None else "?",
            version=dist.version if dist is not None else "?",
            target=ep.value,
        )
        previous = found.get(ep.name)
        if previous is not None and previous.distribution != info.distribution:
            raise BackendConflictError(ep.name, [previous.distribution, info.distribution])
        found[ep.name] = info
    return sorted(found.values(), key=lambda b: b.name)


def make_plugin_manager(
    backend: str, *, plugin: object | None = None, extra_plugins: Iterable[object] = ()
) -> pluggy.PluginManager:
    """Build a plugin manager holding the core defaults, exactly one backend, and ``extra_plugins``.

    :param backend: the backend's name.
    :param plugin: register this object as the backend instead of loading the entry point (in-process
        backends, tests, embedders).
    :param extra_plugins: cross-cutting plugins (``observe``, ``prepare_request`` wrappers).
    :raises BackendNotFoundError: nothing is installed under ``backend``.
    :raises BackendConflictError: several distributions claim ``backend``.
    :raises BackendLoadError: the backend's module failed to import.
    :raises BackendValidationError: a hook has a bad signature or a required hook is missing.
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    pm.register(CoreDefaults(), name="backends_core.defaults")
    if plugin is None:
        plugin = _load_entry_point(backend)
    try:
        pm.register(plugin, name=backend)
        for i, extra in enumerate(extra_plugins):
            pm.register(extra, name=f"extra-{i}-{type(extra).__name__}")
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise BackendValidationError(backend, str(exc)) from exc
    implemented = implemented_hooks(pm, plugin)
    missing = sorted(hookspecs.REQUIRED_HOOKS - implemented)
    if missing:
        raise BackendValidationError(
            backend, f"required hook(s) not implemented: {', '.join(missing)}", missing=missing
        )
    if os.environ.get(TRACE_ENV) == "1":
        pm.trace.root.setwriter(lambda msg: print(msg, end="", file=sys.stderr))
        pm.enable_tracing()
    return pm


class HookCall:
    """One ``firstresult`` hook of a plugin manager, called as pluggy calls it, without its per-call machinery
    on the request path: the implementations run last-registered first (``tryfirst``/``trylast`` respected),
    each with the arguments it names, until one returns something other than ``None``; that is the result.

    Anything pluggy does beyond that goes through pluggy itself: an implementation that is a wrapper, an
    argument the call does not give (pluggy fills hookspec defaults), a plugin manager tracing its calls
    (``BACKENDS_TRACE_HOOKS``). Plugins registered later are seen on the next call.
    """

    __slots__ = ("_caller", "_direct")

    def __init__(self, pm: pluggy.PluginManager, name: str) -> None:
        self._caller: pluggy.HookCaller = getattr(pm.hook, name)
        spec = self._caller.spec
        if spec is None or not spec.opts.get("firstresult"):
            raise ValueError(f"hook {name!r} is not a firstresult hook")
        self._direct = os.environ.get(TRACE_ENV) != "1"

    def __call__(self, **kwargs: Any) -> Any:
        impls = self._caller.get_hookimpls()
        if not self._direct or any(i.hookwrapper or i.wrapper for i in impls):
            return self._caller(**kwargs)
        for impl in reversed(impls):
            try:
                args = [kwargs[name] for name in impl.argnames]
            except KeyError:
                return self._caller(**kwargs)
            result = impl.function(*args)
            if result is not None:
                return result
        return None


def implemented_hooks(pm: pluggy.PluginManager, plugin: object) -> frozenset[str]:
    """Names of the hooks ``plugin`` implements."""
    return frozenset(caller.name for caller in pm.get_hookcallers(plugin) or ())


def _load_entry_point(backend: str) -> Any:
    matches = [ep for ep in _entry_points() if ep.name == backend]
    if not matches:
        raise BackendNotFoundError(backend, {ep.name for ep in _entry_points()})
    dists = sorted({ep.dist.name if ep.dist else "?" for ep in matches})
    if len(dists) > 1:
        raise BackendConflictError(backend, dists)
    ep = matches[0]
    try:
        return ep.load()
    except Exception as exc:
        raise BackendLoadError(backend, ep.value, exc) from exc


class CoreDefaults:
    """Default implementations every plugin manager carries; backends override by implementing the hook."""

    def __init__(self) -> None:
        #: The default render's prefix cache (one per plugin manager, so per client).
        self.prefix_cache = PrefixRenderCache()

    @hookimpl(trylast=True)
    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        chat_template_kwargs: Mapping[str, Any],
        add_generation_prompt: bool,
        tokenizer: Any,
    ) -> list[int]:
        if tokenizer is None:
            raise ConfigError(
                ["rendering messages needs a tokenizer: set tokenizer (or model) to a local path @ $.tokenizer"]
            )
        return self.prefix_cache.render(
            tokenizer,
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
        )

    @hookimpl(trylast=True)
    def prepare_request(self, request: Any) -> Any:
        return request

    @hookimpl
    def tool_parsers(self) -> Mapping[str, Any]:
        return BUILTIN_TOOL_PARSERS

    @hookimpl
    def reasoning_parsers(self) -> Mapping[str, Any]:
        return BUILTIN_REASONING_PARSERS

    @hookimpl
    def fronts(self) -> Mapping[str, Any]:
        return BUILTIN_FRONTS
