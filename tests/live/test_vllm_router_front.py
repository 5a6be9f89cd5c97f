"""The client in router-front mode (issue #15) behind a real vllm-router 0.1.17 (``--policy consistent_hash``) in front
of two real vLLM 0.32 CPU replicas.

Fixtures of this module: one router for the whole module in front of the two session replicas (``vllm_dense_url``,
``vllm_dense_url_2``), and a spare third replica (same tiny dense model, LoRA enabled) that the membership tests
start, add, remove or kill. Everything is checked replica by replica, directly (never through the router): vLLM's
``/is_paused``, its ``/metrics`` request counters, its answers' weight versions, its ``/v1/models`` adapters.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import router_server
import vllm_server
from router_probe_checks import http

from backends_testkit.live import ServerProcess
from backends_testkit.tinymodel import TinyModels

pytestmark = pytest.mark.live

PROMPT = [1878, 426, 198, 54, 441, 355, 220, 17, 10, 17, 30, 1879, 198, 1878, 515, 198]


@pytest.fixture(scope="module")
def replicas(vllm_dense_url: str, vllm_dense_url_2: str) -> list[str]:
    """The two replicas the router starts with."""
    return [vllm_dense_url, vllm_dense_url_2]


@pytest.fixture(scope="module")
def router(
    vllm_router_venv: Path, replicas: list[str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[router_server.RouterProcess]:
    """vllm-router (consistent_hash: ``x-session-id`` pins a session) in front of the two replicas, for the module."""
    log_path = tmp_path_factory.getbasetemp() / "live-logs" / "vllm-router-front.log"
    process = router_server.vllm_router(
        vllm_router_venv, replicas, policy="consistent_hash", log_path=log_path, name="vllm-router-front"
    )
    process.start()
    try:
        process.wait_workers_healthy()
        sys.stderr.write(
            f"\n[live] {process.name} at {process.url}: workers healthy after {process.healthy_after:.2f}s\n"
        )
        yield process
    finally:
        process.stop(timeout=router_server.STOP_TIMEOUT_S)


class Spare:
    """A third replica the tests start on demand (and may kill); stopped at the module's end."""

    def __init__(self, venv: Path, model_dir: Path, log_dir: Path) -> None:
        self._venv = venv
        self._model_dir = model_dir
        self._log_dir = log_dir
        self._starts = 0
        self.process: ServerProcess | None = None

    def ensure(self) -> ServerProcess:
        """The spare, running and healthy (started again on a new port if it was killed)."""
        if self.process is not None and self.process.running():
            return self.process
        self._starts += 1
        name = f"vllm-dense-spare-{self._starts}"
        self.process = vllm_server.vllm_server(
            self._venv, self._model_dir, lora=True, log_path=self._log_dir / f"{name}.log", name=name
        )
        self.process.start()
        self.process.wait_ready("/health", timeout=vllm_server.START_TIMEOUT_S)
        sys.stderr.write(f"\n[live] {name} ready at {self.process.url} after {self.process.ready_after:.1f}s\n")
        return self.process

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


@pytest.fixture(scope="module")
def spare(vllm_venv: Path, tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Spare]:
    handle = Spare(vllm_venv, tiny_models.dense, tmp_path_factory.getbasetemp() / "live-logs")
    try:
        yield handle
    finally:
        handle.stop()


def listed(client: httpx.Client, router_url: str) -> list[str]:
    """The replicas the router lists now (``GET /list_workers``)."""
    return sorted(u.rstrip("/") for u in client.get(router_url + "/list_workers").json()["urls"])


def test_fixtures_router_and_spare_serve(
    router: router_server.RouterProcess, replicas: list[str], spare: Spare
) -> None:
    """The module's fixtures: the router lists both replicas and generates through them; the spare serves and the
    router takes it in and lets it go."""
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2, "temperature": 0.0}}
    with http() as client:
        assert listed(client, router.url) == sorted(replicas)
        answer = client.post(router.url + "/inference/v1/generate", json=body, headers={"x-session-id": "probe"})
        assert answer.status_code == 200, answer.text
        url = spare.ensure().url
        try:
            assert client.post(router.url + "/add_worker", params={"url": url}).status_code == 200
            assert listed(client, router.url) == sorted([*replicas, url])
        finally:
            client.post(router.url + "/remove_worker", params={"url": url})
        assert listed(client, router.url) == sorted(replicas)
