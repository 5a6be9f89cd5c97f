"""tests/live/live_servers.py: a session server is stopped after the last module of the run that uses it."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

LIVE_SERVERS = Path(__file__).parents[1] / "live" / "live_servers.py"

CONFTEST = """
import pytest
import live_servers

STOPPED = []

@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield)
    finally:
        live_servers.after_teardown(item, nextitem)

def _server(request, name):
    live_servers.stop_when_unused(request, lambda: STOPPED.append(name))
    yield name
    if name not in STOPPED:
        STOPPED.append(name)

@pytest.fixture(scope="session")
def server_a(request):
    yield from _server(request, "a")

@pytest.fixture(scope="session")
def server_b(request):
    yield from _server(request, "b")

@pytest.fixture
def stopped():
    return STOPPED
"""


@pytest.fixture
def run(pytester: pytest.Pytester):
    pytester.makepyfile(live_servers=LIVE_SERVERS.read_text())
    pytester.makeconftest(CONFTEST)
    pytester.makeini(
        "[pytest]\nasyncio_default_fixture_loop_scope = function\n"
        "markers =\n    uses_live_servers(*fixtures): session server fixtures requested at run time\n"
    )
    return pytester


def test_a_server_stops_after_the_last_module_using_it(run: pytest.Pytester) -> None:
    run.makepyfile(
        test_1="""
def test_uses_a(server_a, stopped):
    assert stopped == []

def test_uses_b(server_b, stopped):
    assert stopped == []

def test_nothing(stopped):
    assert stopped == []
""",
        test_2="""
def test_a_is_still_up(server_a, stopped):
    assert stopped == ["b"]  # b's last user was in test_1

def test_after(stopped):
    assert stopped == ["b"]  # a module's last test stops nothing before the module ends
""",
        test_3="""
def test_every_server_is_stopped(stopped):
    assert stopped == ["b", "a"]
""",
    )
    run.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=6)


def test_a_server_requested_at_run_time_is_kept_for_a_marked_test(run: pytest.Pytester) -> None:
    run.makepyfile(
        test_1="""
def test_uses_a(server_a, stopped):
    assert stopped == []
""",
        test_2="""
import pytest

@pytest.mark.uses_live_servers("server_a")
def test_dynamic(request, stopped):
    assert request.getfixturevalue("server_a") == "a" and stopped == []
""",
    )
    run.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=2)
