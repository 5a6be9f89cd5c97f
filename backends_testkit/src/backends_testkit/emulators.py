"""Finding a backend's emulator: the ``backends_testkit.emulators`` entry-point group.

A backend's distribution (or its testing companion) names a factory under the backend's own name::

    [project.entry-points."backends_testkit.emulators"]
    acme = "backends_acme.testing:make_emulator"

The factory takes the reference engine and ``routed_experts`` (answer MoE routed experts, as a server started with
routing enabled would) and returns an emulator written on :class:`~backends_testkit.emulator.EmulatorBase`. The
demo and the conformance suite find emulators here; the driver contract knows nothing of them.
"""

from __future__ import annotations

import importlib.metadata as md
from typing import Any

from backends_testkit.emulator import EmulatorBase
from backends_testkit.engine import ReferenceEngine

__all__ = ["EMULATOR_GROUP", "NoEmulatorError", "make_emulator"]

EMULATOR_GROUP = "backends_testkit.emulators"


class NoEmulatorError(LookupError):
    """No installed distribution provides an emulator for the backend (or several do)."""


def make_emulator(backend: str, engine: ReferenceEngine, *, routed_experts: bool = False) -> EmulatorBase:
    """The emulator of ``backend`` over ``engine``, from the factory its distribution registered.

    :raises NoEmulatorError: none is registered under ``backend``, or several distributions claim it.
    :raises TypeError: the factory returned something that is not an :class:`EmulatorBase`.
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
    emulator = factory(engine, routed_experts=routed_experts)
    if not isinstance(emulator, EmulatorBase):
        raise TypeError(
            f"the emulator factory {found[0].value!r} of backend {backend!r} returned a {type(emulator).__name__}, "
            "not a backends_testkit.emulator.EmulatorBase"
        )
    return emulator
