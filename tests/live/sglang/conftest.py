"""Live tests against real SGLang 0.5.23 on the CPU, started by session fixtures.

Same policy as ``tests/live/conftest.py`` (whose ``BACKENDS_SKIP_LIVE=1`` skip applies here too): live tests
(``@pytest.mark.live``) run by default; a failed install or server start is a test ERROR carrying the log's
tail, never a skip.

Fixtures (session-scoped, started lazily by the first test that asks, stopped at the end of the session):

* ``sglang_venv``: the cached, trimmed SGLang venv (see ``sglang_server.py``; built once per machine: 5.5 min
  with an empty pip cache, 3.5 min with a warm one).
* ``sglang_dense_url``: base URL of SGLang serving ``tiny-qwen3`` (served name ``tiny-qwen3``) with LoRA
  (``--enable-lora --lora-backend torch_native --max-lora-rank 8``; adapters are loaded with
  ``/load_lora_adapter`` and selected by name in ``lora_path``; note that SGLang silently reloads an
  adapter that was unloaded when a request names it again: only never-loaded names are a 400).
* ``sglang_dense_url_2``: a second such server, for the fleet tests.
* ``sglang_moe_url``: the same for ``tiny-qwen3-moe`` (served name ``tiny-qwen3``) with
  ``--enable-return-routed-experts``, without LoRA.
* ``sglang_vl_url``: the tiny Qwen2.5-VL model (served name ``tiny-qwen2_5-vl``), without LoRA, with the
  ``vl_runtime/`` start-up shim (see ``SGLANG_IMAGES.md``).

Both servers may be up at once (about 1.9 GB of RSS each, in three processes: HTTP/tokenizer, scheduler,
detokenizer); idle, they sleep (``--sleep-on-idle``). A start takes 50-130 s here (nearly all imports; the
lower end when the two cores are not busy with other work), a graceful stop about 10 s. Tests sharing a
server must leave it as they found it (unload their LoRA adapters, continue after pausing, restore weights
and version...). Server logs are in pytest's base temp directory (``<basetemp>/live-logs/sglang-*.log``),
install output in ``<venv>/install.log``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import live_servers
import pytest
import sglang_server  # this directory is on sys.path: pytest's default "prepend" import mode puts it there

from backends_testkit.tinymodel import TinyModels, default_models_dir
from backends_testkit.tinymodel_vl import build_tiny_vl_model


@pytest.fixture(scope="session")
def sglang_venv() -> Path:
    """The trimmed SGLang venv, installed on first use (~4 min, ~2.5 GB; cached under ~/.cache/backends)."""
    started = time.monotonic()
    venv = sglang_server.ensure_sglang_venv()
    sys.stderr.write(f"\n[live] sglang venv {venv} ready after {time.monotonic() - started:.1f}s\n")
    return venv


def _serve(
    venv: Path,
    model_dir: Path,
    *,
    name: str,
    lora: bool = False,
    routed_experts: bool = False,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[str]:
    log_path = tmp_path_factory.getbasetemp() / "live-logs" / f"{name}.log"
    server = sglang_server.sglang_server(
        venv, model_dir, log_path=log_path, name=name, lora=lora, routed_experts=routed_experts
    )
    live_servers.stop_when_unused(request, lambda: server.stop(timeout=sglang_server.STOP_TIMEOUT_S))
    server.start()
    try:
        server.wait_ready(sglang_server.READY_PATH, timeout=sglang_server.START_TIMEOUT_S)
        sys.stderr.write(f"\n[live] {name} ready at {server.url} after {server.ready_after:.1f}s (log {log_path})\n")
        yield server.url
    finally:
        server.stop(timeout=sglang_server.STOP_TIMEOUT_S)


@pytest.fixture(scope="session")
def sglang_dense_url(
    sglang_venv: Path, tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[str]:
    """Base URL of a live SGLang server on the tiny dense model, LoRA enabled."""
    yield from _serve(
        sglang_venv,
        tiny_models.dense,
        name="sglang-dense",
        lora=True,
        tmp_path_factory=tmp_path_factory,
        request=request,
    )


@pytest.fixture(scope="session")
def sglang_dense_url_2(
    sglang_venv: Path, tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[str]:
    """A second live SGLang server on the tiny dense model (LoRA enabled), for fleet tests."""
    yield from _serve(
        sglang_venv,
        tiny_models.dense,
        name="sglang-dense-2",
        lora=True,
        tmp_path_factory=tmp_path_factory,
        request=request,
    )


@pytest.fixture(scope="session")
def sglang_moe_url(
    sglang_venv: Path, tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[str]:
    """Base URL of a live SGLang server on the tiny MoE model, routed experts enabled (no LoRA)."""
    yield from _serve(
        sglang_venv,
        tiny_models.moe,
        name="sglang-moe",
        routed_experts=True,
        tmp_path_factory=tmp_path_factory,
        request=request,
    )


@pytest.fixture(scope="session")
def sglang_vl_url(
    sglang_venv: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[str]:
    """Base URL of a live SGLang server on the tiny Qwen2.5-VL model (``vl_runtime/`` shim, no LoRA)."""
    name = "sglang-vl"
    log_path = tmp_path_factory.getbasetemp() / "live-logs" / f"{name}.log"
    model_dir = build_tiny_vl_model(default_models_dir())
    server = sglang_server.sglang_vl_server(sglang_venv, model_dir, log_path=log_path, name=name)
    live_servers.stop_when_unused(request, lambda: server.stop(timeout=sglang_server.STOP_TIMEOUT_S))
    server.start()
    try:
        server.wait_ready(sglang_server.READY_PATH, timeout=sglang_server.START_TIMEOUT_S)
        sys.stderr.write(f"\n[live] {name} ready at {server.url} after {server.ready_after:.1f}s (log {log_path})\n")
        yield server.url
    finally:
        server.stop(timeout=sglang_server.STOP_TIMEOUT_S)
