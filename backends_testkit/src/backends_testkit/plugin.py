"""The pytest side of the test kit: options and fixtures (re-exported by ``backends_testkit``)."""

from __future__ import annotations

from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("backends", "backends conformance")
    group.addoption("--backend-url", default=None, help="run conformance suites against this real server")
    group.addoption("--backend", default=None, help="with --backend-url: the backend whose suite runs live")
    group.addoption("--backend-model", default=None, help="with --backend-url: the served model name")
    group.addoption(
        "--backend-moe", action="store_true", help="with --backend-url: the server runs a MoE model with routing"
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "live: talks to a real server given by --backend-url")


@pytest.fixture(scope="session")
def tiny_models() -> Any:
    """The tiny dense / MoE / LoRA models, built once per machine (cached; see ``default_models_dir``)."""
    from backends_testkit.tinymodel import build_tiny_models, default_models_dir

    return build_tiny_models(default_models_dir())


@pytest.fixture
def fake_server() -> Any:
    """A fresh :class:`~backends_testkit.fakes.FakeServer`."""
    from backends_testkit.fakes import FakeServer

    return FakeServer()
