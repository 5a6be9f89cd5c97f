"""A third-party-style backend passes the conformance suite, registered in-process and through a real
entry point of a throwaway installed distribution."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

import fake_backend
from backends_testkit.conformance import BackendConformance
from backends_testkit.engine import ReferenceEngine


class TestFakeBackendInProcess(BackendConformance):
    backend_name = "fake"
    plugin = fake_backend
    expected_capabilities = frozenset({"teacher_logprobs", "admin_health"})

    def emulator_transport(self, engine: ReferenceEngine) -> httpx.AsyncBaseTransport:
        return fake_backend.FakeEmulator(engine).transport()


@pytest.fixture(scope="class")
def installed_fake(tmp_path_factory: pytest.TempPathFactory):
    """Install the fake backend as a distribution: a dist-info with an entry point, on sys.path."""
    site = tmp_path_factory.mktemp("site")
    info = site / "backends_fake-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: backends-fake\nVersion: 0.0.1\n")
    (info / "entry_points.txt").write_text("[backends_core.backends]\nfake_ep = fake_backend\n")
    sys.path.insert(0, str(site))
    yield Path(site)
    sys.path.remove(str(site))


@pytest.mark.usefixtures("installed_fake")
class TestFakeBackendThroughEntryPoint(TestFakeBackendInProcess):
    backend_name = "fake_ep"
    plugin = None
