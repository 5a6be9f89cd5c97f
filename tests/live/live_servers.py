"""Session-scoped live servers stopped once no test left in the run uses them.

Left running until the session ends, an idle vLLM or SGLang server keeps a good part of a core busy, and the
servers of finished modules would pile up under the tests that come after them. A server fixture registers its
stop with :func:`stop_when_unused`; a test that requests a server fixture at run time (``getfixturevalue``)
names it with ``@pytest.mark.uses_live_servers("<fixture>", ...)`` so the server is kept for it; and
``tests/live/conftest.py`` calls :func:`after_teardown` after each test's teardown. A server stops at a module
boundary, so its module-scoped users (which may restore its state at their teardown) are gone by then; the
fixture's own stop at the end of the session then finds nothing to do.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import pytest

__all__ = ["LiveServers", "after_teardown", "stop_when_unused"]


class LiveServers:
    """The run's registered servers by fixture name, and where in the run each fixture is last used."""

    def __init__(self, items: Sequence[pytest.Item]) -> None:
        self._position = {item.nodeid: index for index, item in enumerate(items)}
        self._last_use: dict[str, int] = {}
        for index, item in enumerate(items):
            for name in getattr(item, "fixturenames", ()):
                self._last_use[name] = index
            for marker in item.iter_markers("uses_live_servers"):
                for name in marker.args:
                    self._last_use[name] = index
        self._stops: dict[str, Callable[[], object]] = {}

    def add(self, fixture_name: str, stop: Callable[[], object]) -> None:
        self._stops[fixture_name] = stop

    def module_done(self, item: pytest.Item) -> None:
        """Stop every registered server that no test after ``item`` uses."""
        index = self._position.get(item.nodeid)
        if index is None:
            return
        for name in [name for name in self._stops if self._last_use.get(name, -1) <= index]:
            stop = self._stops.pop(name)
            sys.stderr.write(f"\n[live] {name}: stopped, no test left in the run uses it\n")
            stop()


_KEY = pytest.StashKey[LiveServers]()


def stop_when_unused(request: pytest.FixtureRequest, stop: Callable[[], object]) -> None:
    """Call ``stop`` (idempotent) after the last module of the run that uses the fixture ``request`` belongs to."""
    session = request.session
    if _KEY not in session.stash:
        session.stash[_KEY] = LiveServers(session.items)
    session.stash[_KEY].add(request.fixturename, stop)


def after_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """At the end of a module (``nextitem`` in another one, or none), stop the servers no later test uses."""
    servers = item.session.stash.get(_KEY, None)
    if servers is None:
        return
    if nextitem is None or getattr(nextitem, "module", None) is not getattr(item, "module", None):
        servers.module_done(item)
