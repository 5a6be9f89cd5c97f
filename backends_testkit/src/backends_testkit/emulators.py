"""Finding a backend's emulator: the ``backends_testkit.emulators`` entry-point group.

A backend's distribution (or its testing companion) names a factory under the backend's own name::

    [project.entry-points."backends_testkit.emulators"]
    acme = "backends_acme.testing:make_emulator"

The factory takes the reference engine and ``routed_experts`` (answer MoE routed experts, as a server started with
routing enabled would) and returns an emulator: ``async handle(httpx.Request) -> httpx.Response`` and
``aclose()``. The demo and the conformance suite find emulators here; the driver contract knows nothing of them.
"""

from __future__ import annotations

import importlib.metadata as md
from typing import Any, Protocol

import httpx

from backends_testkit.engine import ReferenceEngine

__all__ = ["EMULATOR_GROUP", "Emulator", "NoEmulatorError", "make_emulator"]

EMULATOR_GROUP = "backends_testkit.emulators"


class Emulator(Protocol):
    async def handle(self, request: httpx.Request) -> httpx.Response: ...

    async def aclose(self) -> None: ...


class NoEmulatorError(LookupError):
    """No installed distribution provides an emulator for the backend (or several do)."""


def make_emulator(backend: str, engine: ReferenceEngine, *, routed_experts: bool = False) -> Emulator:
    """The emulator of ``backend`` over ``engine``, from the factory its distribution registered.

    :raises NoEmulatorError: none is registered under ``backend``, or several distributions claim it.
    """
    found = [ep for ep in md.entry_points(group=EMULATOR_GROUP) if ep.name == backend]
    if not found:
        known = sorted({ep.name for ep in md.entry_points(group=EMULATOR_GROUP)})
        raise NoEmulatorError(
            f"no emulator of backend {backend!r} is installed (entry-point group {EMULATOR_GROUP!r} lists {known})"
        )
    if len({ep.value for ep in found}) > 1:
        raise NoEmulatorError(f"several emulators claim backend {backend!r}: {sorted(ep.value for ep in found)}")
    factory: Any = found[0].load()
    emulator: Emulator = factory(engine, routed_experts=routed_experts)
    return emulator
