"""The backends test kit, a pytest plugin registered through pytest's ``pytest11`` entry point: installing
``backends-core[testing]`` makes its options and fixtures available to every pytest run of that environment
(``-p no:backends_testkit`` turns it off).

It provides tiny models built locally (:mod:`.tinymodel`), the numpy reference engine (:mod:`.engine`),
scriptable fakes (:mod:`.fakes`) and the conformance suite every backend subclasses (:mod:`.conformance`).

Options: ``--backend-url URL`` runs conformance suites against a real server instead of their emulator;
``--backend NAME`` limits that to the suite of one backend (the others are skipped);
``--backend-model NAME`` is the served model name on that server; ``--backend-moe`` says it serves a MoE
model with routed experts enabled.
"""

from __future__ import annotations

try:  # the kit's models and engine work without pytest (the demo uses them); the plugin needs it
    import pytest  # noqa: F401
except ImportError:  # pragma: no cover - exercised only where pytest is absent
    pass
else:
    from backends_testkit.plugin import fake_server, pytest_addoption, pytest_configure, tiny_models

    __all__ = ["fake_server", "pytest_addoption", "pytest_configure", "tiny_models"]
