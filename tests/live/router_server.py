"""The router recipe of the live tests: cached venvs for vllm-router and sglang-router, and router processes.

Routers RL stacks put in front of engine replicas (the client's router-front mode), installed from PyPI as binary
(Rust) wheels into their own cached venvs beside the servers' (``$BACKENDS_SERVER_VENVS``, default
``~/.cache/backends/server-venvs``), pinned by ``routers.constraints.txt`` (a pip freeze of working installs):

* ``vllm-router==0.1.17``: console script ``vllm-router``; ``--worker-urls URL...``, ``--policy`` (``round_robin``,
  ``consistent_hash`` for ``x-session-id`` stickiness, ...).
* ``sglang-router==0.3.2`` (SGLang Model Gateway): ``python -m sglang_router.launch_router``; ``--worker-urls``,
  ``--policy`` (``round_robin``, ``manual`` for ``X-SMG-Routing-Key`` stickiness, ``cache_aware``, ...).

A router starts in front of replicas that are already up (the live vLLM / SGLang server fixtures);
:meth:`RouterProcess.wait_workers_healthy` waits, with a deadline, until the router's own ``GET /workers`` lists every
replica as healthy. What the routers were observed to do is in ``ROUTERS.md``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import vllm_server  # the same interpreter choice as the servers' venvs

from backends_testkit.live import (
    ServerProcess,
    ServerStartError,
    ensure_venv,
    free_port,
    log_tail,
    probe_client,
    stable_copy,
)

VLLM_ROUTER_VERSION = "0.1.17"
SGLANG_ROUTER_VERSION = "0.3.2"
CONSTRAINTS = Path(__file__).with_name("routers.constraints.txt")
START_TIMEOUT_S = 120.0
"""Seconds to wait for a router to list every replica healthy (seen: well under 10 s; the wheels are native)."""
STOP_TIMEOUT_S = 10.0

ROUTER_ENV: dict[str, str | None] = {"PYTHONUNBUFFERED": "1", "PYTHONPATH": None, "RUST_LOG": None}


def stable_constraints() -> Path:
    """A copy of ``CONSTRAINTS`` beside the venvs, named by its content (so the recipe is checkout-independent)."""
    return stable_copy(CONSTRAINTS.read_text(encoding="utf-8"), "routers-constraints")


def _ensure(distribution: str, version: str, smoke: str) -> Path:
    return ensure_venv(
        f"{distribution}-{version}",
        python=vllm_server.venv_python(),
        install=[
            ["pip", "install", f"{distribution}=={version}", "-c", str(stable_constraints())],
            ["python", "-c", smoke],
        ],
        marker_extra=CONSTRAINTS.read_text(encoding="utf-8"),
    )


def ensure_vllm_router_venv() -> Path:
    """Build (once per machine and recipe) and return the vllm-router venv."""
    return _ensure(
        "vllm-router",
        VLLM_ROUTER_VERSION,
        "import importlib.metadata as md; print('vllm-router', md.version('vllm-router'))",
    )


def ensure_sglang_router_venv() -> Path:
    """Build (once per machine and recipe) and return the sglang-router venv."""
    return _ensure(
        "sglang-router",
        SGLANG_ROUTER_VERSION,
        "import importlib.metadata as md, sglang_router; print('sglang-router', md.version('sglang-router'))",
    )


def vllm_router_command(venv: Path, worker_urls: Sequence[str], *, policy: str) -> list[str]:
    """The command line of vllm-router on ``{host}:{port}`` in front of ``worker_urls``.

    Its Prometheus exporter gets a free port of its own: by default it binds 127.0.0.1:29000, and a second router
    on the machine (another test run's) then panics at start-up ("Address already in use").
    """
    return [
        str(venv / "bin" / "vllm-router"),
        "--host",
        "{host}",
        "--port",
        "{port}",
        "--prometheus-host",
        "{host}",
        "--prometheus-port",
        str(free_port()),
        "--worker-urls",
        *worker_urls,
        "--policy",
        policy,
    ]


def sglang_router_command(venv: Path, worker_urls: Sequence[str], *, policy: str) -> list[str]:
    """The command line of sglang-router on ``{host}:{port}`` in front of ``worker_urls`` (its Prometheus exporter
    on a free port of its own, as vllm-router's: it binds 0.0.0.0:29000 by default)."""
    return [
        str(venv / "bin" / "python"),
        "-m",
        "sglang_router.launch_router",
        "--host",
        "{host}",
        "--port",
        "{port}",
        "--prometheus-host",
        "{host}",
        "--prometheus-port",
        str(free_port()),
        "--worker-urls",
        *worker_urls,
        "--policy",
        policy,
    ]


def healthy_worker_urls(router_url: str, client: httpx.Client) -> set[str]:
    """The replica URLs the router's ``GET /workers`` lists as healthy (both routers answer a ``workers`` list
    whose items carry ``url`` and ``is_healthy``)."""
    response = client.get(router_url + "/workers")
    response.raise_for_status()
    body: Any = response.json()
    workers = body.get("workers", []) if isinstance(body, dict) else body
    return {str(w["url"]).rstrip("/") for w in workers if isinstance(w, dict) and w.get("is_healthy")}


class RouterProcess(ServerProcess):
    """A router process in front of ``worker_urls``."""

    def __init__(self, argv: Sequence[str], *, worker_urls: Sequence[str], venv: Path, **kwargs: Any) -> None:
        env = dict(ROUTER_ENV)
        env["VIRTUAL_ENV"] = str(venv)
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
        super().__init__(argv, env=env, **kwargs)
        self.worker_urls = [url.rstrip("/") for url in worker_urls]
        self.healthy_after: float | None = None
        """Seconds from start to every replica listed healthy (set by :meth:`wait_workers_healthy`)."""

    def wait_workers_healthy(self, *, timeout: float = START_TIMEOUT_S, interval: float = 0.25) -> None:
        """Wait until ``GET /workers`` lists every replica of :attr:`worker_urls` as healthy.

        :raises ServerStartError: when the router exits or the deadline passes, with the log's tail.
        """
        started = time.monotonic()
        deadline = started + timeout
        last = "no answer yet"
        with probe_client(5.0) as client:
            while True:
                if not self.running():
                    raise ServerStartError(
                        f"{self.name} exited before its workers were healthy (log {self.log_path}); its tail:\n"
                        f"{log_tail(self.log_path)}"
                    )
                try:
                    healthy = healthy_worker_urls(self.url, client)
                    if set(self.worker_urls) <= healthy:
                        if self._started_at is not None:
                            self.healthy_after = time.monotonic() - self._started_at
                        return
                    last = f"healthy: {sorted(healthy)}"
                except (httpx.HTTPError, ValueError, KeyError) as exc:
                    last = f"{type(exc).__name__}: {exc}"
                if time.monotonic() >= deadline:
                    raise ServerStartError(
                        f"{self.name} did not list {self.worker_urls} healthy within {timeout:.0f}s (last: {last}; "
                        f"log {self.log_path}); its tail:\n{log_tail(self.log_path)}"
                    )
                time.sleep(interval)


def vllm_router(venv: Path, worker_urls: Sequence[str], *, policy: str, log_path: Path, name: str) -> RouterProcess:
    """A not-yet-started vllm-router in front of ``worker_urls``."""
    return RouterProcess(
        vllm_router_command(venv, worker_urls, policy=policy),
        worker_urls=worker_urls,
        venv=venv,
        name=name,
        log_path=log_path,
    )


def sglang_router(venv: Path, worker_urls: Sequence[str], *, policy: str, log_path: Path, name: str) -> RouterProcess:
    """A not-yet-started sglang-router in front of ``worker_urls`` (run in the log's directory, away from the
    checkout's ``tests/live/sglang``)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    return RouterProcess(
        sglang_router_command(venv, worker_urls, policy=policy),
        worker_urls=worker_urls,
        venv=venv,
        name=name,
        log_path=log_path,
        cwd=log_path.parent,
    )
