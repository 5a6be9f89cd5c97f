"""The gateway (``backends_gateway``) in front of real vLLM 0.32 (CPU), directly and behind vllm-router 0.1.17 in
router-front mode, driven by the official ``openai`` SDK as an unmodified harness drives it (see
``gateway_checks.py``; the SGLang and Dynamo suites run the same check in their directories). And the ``backends
gateway`` command killed mid-session and started again on its store: the session goes on from the exact ids of
its last answered turn."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from gateway_checks import (
    GATEWAY_TURNS,
    check_anthropic_rollout,
    check_extends,
    check_gateway_rollout,
    harness,
    trajectory,
)
from router_probe_checks import SETTLE_S, http, vllm_finished

from backends_core import Client, ClientConfig, FrontConfig
from backends_testkit.tinymodel import TinyModels
from test_cli_serve import first_line

pytestmark = pytest.mark.live

MODEL = "tiny-qwen3"
START_DEADLINE_S = 180.0
STOP_DEADLINE_S = 60.0


async def test_a_harness_session_through_the_gateway_on_real_vllm_is_one_exact_branch(
    vllm_dense_url: str, tiny_models: TinyModels, tmp_path: Path
) -> None:
    config = ClientConfig(
        backend="vllm", base_url=vllm_dense_url, model=MODEL, tokenizer=str(tiny_models.dense), stateless=GATEWAY_TURNS
    )
    async with Client(config) as client:
        figures = await check_gateway_rollout(client, tmp_path / "gateway.db", name="vllm")
    assert figures.turns == 3


async def test_an_anthropic_sdk_session_through_the_gateway_on_real_vllm_is_one_exact_branch(
    vllm_dense_url: str, tiny_models: TinyModels, tmp_path: Path
) -> None:
    config = ClientConfig(
        backend="vllm", base_url=vllm_dense_url, model=MODEL, tokenizer=str(tiny_models.dense), stateless=GATEWAY_TURNS
    )
    async with Client(config) as client:
        figures = await check_anthropic_rollout(client, tmp_path / "gateway.db", name="vllm")
    assert figures.turns == 3 and all(figures.reused_ids[1:])


async def test_a_harness_session_through_the_gateway_behind_vllm_router_stays_on_one_replica(
    vllm_dense_url: str, vllm_dense_url_2: str, start_router: Any, tiny_models: TinyModels, tmp_path: Path
) -> None:
    """Router-front mode (vllm-router, ``consistent_hash`` on the gateway's session key): the session's turns
    are finished by one replica, counted on the replicas themselves."""
    replicas = [vllm_dense_url, vllm_dense_url_2]
    router = start_router("vllm", replicas, policy="consistent_hash")
    config = ClientConfig(
        backend="vllm",
        base_url=router.url,
        model=MODEL,
        tokenizer=str(tiny_models.dense),
        front=FrontConfig(kind="vllm-router"),
        stateless=GATEWAY_TURNS,
    )
    moved: list[int] = []

    async def counted(run: Callable[[], Awaitable[Any]]) -> Any:
        with http() as probe:
            before = [await asyncio.to_thread(vllm_finished, probe, url) for url in replicas]
            result = await run()
            deadline = time.monotonic() + SETTLE_S
            while True:
                after = [await asyncio.to_thread(vllm_finished, probe, url) for url in replicas]
                moved[:] = [a - b for a, b in zip(after, before, strict=True)]
                if sum(moved) >= 3:
                    return result
                assert time.monotonic() < deadline, f"the replicas finished {moved} requests, not 3"
                await asyncio.sleep(0.05)

    async with Client(config) as client:
        figures = await check_gateway_rollout(client, tmp_path / "gateway.db", name="vllm-router", around=counted)
    assert sorted(moved) == [0, 3], f"the session's 3 turns were finished by the replicas as {moved}"
    sys.stderr.write(f"[gateway] vllm-router: turns finished per replica {moved}\n")
    assert figures.turns == 3


# -- the command, killed and restarted ---------------------------------------------------------------------------


@attrs.define
class GatewayProcess:
    """``backends gateway`` as a child process, and what it printed once serving."""

    proc: subprocess.Popen[str]
    log: Path
    ready: dict[str, Any]

    @property
    def url(self) -> str:
        return str(self.ready["url"])

    def stop(self) -> None:
        """Gone, whatever it was doing (clean-up)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=STOP_DEADLINE_S)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


def start_gateway(server_url: str, tiny_models: TinyModels, store: Path, log: Path) -> GatewayProcess:
    argv = [
        *("gateway", "--backend", "vllm", "--url", server_url, "--model", MODEL),
        *("--tokenizer", str(tiny_models.dense), "--port", "0", "--store", str(store), "--json"),
        *("--max-completion-tokens", "64"),
    ]
    with log.open("ab") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "backends_core", *argv], stdout=subprocess.PIPE, stderr=err, text=True
        )
    try:
        line = first_line(proc, START_DEADLINE_S)
        assert line, f"backends gateway exited {proc.poll()} before serving: {log.read_text()[-3000:]}"
        ready = json.loads(line)
        assert ready["store"] == str(store.resolve()) and ready["model"] == MODEL, ready
    except BaseException:
        GatewayProcess(proc, log, {}).stop()
        raise
    return GatewayProcess(proc, log, ready)


@pytest.fixture
def gateways() -> Iterator[list[GatewayProcess]]:
    """Every gateway process a test starts, killed at its end if still running."""
    started: list[GatewayProcess] = []
    try:
        yield started
    finally:
        for gateway in started:
            gateway.stop()


async def test_the_gateway_command_killed_and_restarted_on_its_store_continues_the_session_on_its_exact_ids(
    vllm_dense_url: str, tiny_models: TinyModels, tmp_path: Path, gateways: list[GatewayProcess]
) -> None:
    store, log = tmp_path / "gateway.db", tmp_path / "gateway.log"
    session = "cli-restart"
    gateways.append(start_gateway(vllm_dense_url, tiny_models, store, log))
    first = gateways[-1]
    answered, history = await harness(first.url, session, MODEL, turns=2)
    before = await trajectory(first.url, session)
    assert len(before["turns"]) == 2
    first.proc.send_signal(signal.SIGKILL)
    assert first.proc.wait(timeout=STOP_DEADLINE_S) == -signal.SIGKILL

    gateways.append(start_gateway(vllm_dense_url, tiny_models, store, log))
    second = gateways[-1]
    kept = await trajectory(second.url, session)
    assert kept["turns"] == before["turns"], "the restarted gateway does not hold both answered turns as they were"
    assert [t["reply"].get("content") or "" for t in kept["turns"]] == [c.choices[0].message.content for c in answered]

    (third,), _ = await harness(second.url, session, MODEL, turns=1, history=history, first=2)
    body = await trajectory(second.url, session)
    turns = body["turns"]
    assert turns[:2] == before["turns"] and len(turns) == 3
    reused = check_extends(turns[1], turns[2])
    assert turns[2]["branch"] == 0 and (body["bridged"], body["branched"], body["rerendered"]) == (2, 0, 0)
    (branch,) = body["branches"]
    assert branch["turns"] == [0, 1, 2] and branch["input_ids"] == turns[2]["prompt_ids"] + turns[2]["completion_ids"]
    assert third.choices[0].message.content == (turns[2]["reply"].get("content") or "")
    sys.stderr.write(
        f"\n[gateway] cli kill/restart: 2 turns kept across SIGKILL, turn 3 reused {reused} ids of turn 2 "
        f"(turns on {first.url} then {second.url})\n"
    )

    second.proc.send_signal(signal.SIGTERM)
    assert second.proc.wait(timeout=STOP_DEADLINE_S) == 0, log.read_text()[-3000:]
