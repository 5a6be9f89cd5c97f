"""sglang-router 0.3.2 (SGLang Model Gateway) as the client's front, before two real SGLang 0.5.23 replicas.

The router runs ``--policy manual --assignment-mode min_group``: a request's ``X-SMG-Routing-Key`` pins it to one
replica, and a new key goes to the replica holding the fewest keys (an even spread; the default ``random`` mode put
six new keys on one replica in one probe run, see ``../ROUTERS.md``). Evidence of where a request ran is read from
each replica directly (``/v1/loads`` ``total_prefill_uncached_tokens``), never through the router.

One router serves the whole module (it is stopped at the module's end); the routed-experts test puts a second one
before the MoE server. Every test leaves the replicas as it found them (resumed, original weights and version, no
adapter loaded) and the router listing exactly the two replicas.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import router_server
import sglang_server
from router_probe_checks import http, sglang_prefilled, which_replica

from backends_testkit.live import free_port
from backends_testkit.tinymodel import TinyModels

pytestmark = pytest.mark.live

PROMPT = [1878, 426, 198, 54, 441, 355, 220, 17, 10, 17, 30, 1879, 198, 1878, 515, 198]
GREEDY = {"max_new_tokens": 4, "temperature": 0.0}
ASSIGNMENT = ["--assignment-mode", "min_group"]
MEMBERSHIP_S = 60.0
"""Seconds a ``POST /workers`` / ``DELETE /workers/{id}`` (202, applied in the background) may take to show."""


def start_front(
    venv: Path, worker_urls: list[str], *, log_path: Path, name: str, policy: str = "manual"
) -> router_server.RouterProcess:
    """A started sglang-router (manual policy, min_group assignment) listing every replica healthy."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    router = router_server.RouterProcess(
        [
            *router_server.sglang_router_command(venv, worker_urls, policy=policy),
            *ASSIGNMENT,
            # its metrics exporter binds 29000 by default, as does vllm-router's: a second router would die on it
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
        ],
        worker_urls=worker_urls,
        venv=venv,
        name=name,
        log_path=log_path,
        cwd=log_path.parent,
    )
    router.start()
    try:
        router.wait_workers_healthy()
    except BaseException:
        router.stop(timeout=router_server.STOP_TIMEOUT_S)
        raise
    sys.stderr.write(f"\n[live] {name} at {router.url}: workers healthy after {router.healthy_after:.2f}s\n")
    return router


@pytest.fixture(scope="module")
def replicas(sglang_dense_url: str, sglang_dense_url_2: str) -> list[str]:
    return [sglang_dense_url, sglang_dense_url_2]


@pytest.fixture(scope="module")
def front(
    sglang_router_venv: Path, replicas: list[str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[router_server.RouterProcess]:
    """The module's router before the two dense replicas."""
    log = tmp_path_factory.getbasetemp() / "live-logs" / "sglang-front.log"
    router = start_front(sglang_router_venv, replicas, log_path=log, name="sglang-front")
    try:
        yield router
    finally:
        router.stop(timeout=router_server.STOP_TIMEOUT_S)


@pytest.fixture(scope="module")
def spare(
    sglang_venv: Path, tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[], str]]:
    """A third dense replica (LoRA enabled), started on first call, stopped at the module's end (or killed by a
    test)."""
    log = tmp_path_factory.getbasetemp() / "live-logs" / "sglang-spare.log"
    server = sglang_server.sglang_server(sglang_venv, tiny_models.dense, log_path=log, name="sglang-spare", lora=True)
    started = False

    def url() -> str:
        nonlocal started
        if not started:
            started = True
            server.start()
            server.wait_ready(sglang_server.READY_PATH, timeout=sglang_server.START_TIMEOUT_S)
            sys.stderr.write(f"\n[live] sglang-spare ready at {server.url} after {server.ready_after:.1f}s\n")
        return server.url

    url.process = server  # type: ignore[attr-defined]
    try:
        yield url
    finally:
        server.stop(timeout=sglang_server.STOP_TIMEOUT_S)


def workers(client: httpx.Client, router_url: str) -> list[dict]:
    answer = client.get(router_url + "/workers")
    assert answer.status_code == 200, answer.text
    return answer.json()["workers"]


def until(what: str, check: Callable[[], object], timeout: float = MEMBERSHIP_S) -> object:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f}s"
        time.sleep(0.1)


def test_min_group_pins_keys_and_spreads_them_evenly(front, replicas) -> None:
    """Under ``manual`` + ``min_group`` each routing key stays on one replica and new keys alternate between the
    replicas (fewest keys first), so eight keys split four and four."""
    keys = [f"spread-{i}" for i in range(8)]
    fresh = iter(range(1000, 2000))  # a new first token per request: never a prefix-cache hit
    landed: dict[str, list[int]] = {key: [] for key in keys}
    with http() as client:
        for _ in range(2):
            for key in keys:

                def send(key: str = key) -> None:
                    answer = client.post(
                        front.url + "/generate",
                        json={"input_ids": [next(fresh), *PROMPT], "sampling_params": GREEDY},
                        headers={"X-SMG-Routing-Key": key},
                    )
                    assert answer.status_code == 200, answer.text

                landed[key].append(which_replica(client, replicas, sglang_prefilled, send))
    sys.stderr.write(f"\n[router-front] min_group key -> replicas: {landed}\n")
    assert all(len(set(rs)) == 1 for rs in landed.values()), f"a key moved between replicas: {landed}"
    per_replica = [sum(rs[0] == i for rs in landed.values()) for i in range(2)]
    assert per_replica == [4, 4], f"new keys were not spread evenly: {landed}"


def test_router_drops_routed_experts(sglang_router_venv, sglang_moe_url, tmp_path_factory) -> None:
    """The MoE replica answers ``meta_info.routed_experts`` directly; the same request through sglang-router comes
    back without it (the router drops the field)."""
    log = tmp_path_factory.getbasetemp() / "live-logs" / "sglang-front-moe.log"
    router = start_front(sglang_router_venv, [sglang_moe_url], log_path=log, name="sglang-front-moe")
    body = {"input_ids": PROMPT, "sampling_params": GREEDY, "return_routed_experts": True}
    try:
        with http() as client:
            direct = client.post(sglang_moe_url + "/generate", json=body)
            routed = client.post(router.url + "/generate", json=body)
    finally:
        router.stop(timeout=router_server.STOP_TIMEOUT_S)
    assert direct.status_code == 200 and routed.status_code == 200, (direct.text, routed.text)
    assert direct.json()["meta_info"].get("routed_experts"), "the replica itself returned no routed experts"
    assert routed.json()["output_ids"] == direct.json()["output_ids"]
    assert "routed_experts" not in routed.json()["meta_info"], sorted(routed.json()["meta_info"])
