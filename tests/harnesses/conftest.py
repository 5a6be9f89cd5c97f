"""The gateway the real agent programs talk to: served from a thread of its own (the harness runs as a blocking
subprocess beside it) over :class:`~agent_engine.AgentEngine`, with the gateway's default limits."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
from agent_engine import AgentEngine, ShellLoop

from backends_core import Client, ClientConfig
from backends_core.config import StatelessPolicy
from backends_core.multiturn.rendering import load_tokenizer
from backends_gateway import Gateway, GatewayLimits, Keys, SQLiteStore, serve

MODEL = "tiny"
START_TIMEOUT_S = 120.0


@attrs.define
class AgentGateway:
    """A running gateway: its base URL (no ``/v1``), its engine, and the trainer's view of what it kept."""

    url: str
    engine: AgentEngine
    store: Path
    trainer_key: str | None = None

    def _get(self, path: str) -> Any:
        headers = {"Authorization": f"Bearer {self.trainer_key}"} if self.trainer_key else {}
        with httpx.Client(base_url=self.url, timeout=60, trust_env=False, headers=headers) as http:
            response = http.get(path)
            response.raise_for_status()
            return response.json()

    def sessions(self) -> list[dict[str, Any]]:
        return list(self._get("/v1/sessions")["data"])

    def trajectory(self, session: str) -> dict[str, Any]:
        return dict(self._get(f"/v1/sessions/{session}/trajectory"))


@contextlib.contextmanager
def _served(
    tokenizer_dir: Path,
    store: Path,
    policy: Callable[[str], str],
    limits: GatewayLimits | None,
    keys: Keys | None,
) -> Iterator[AgentGateway]:
    engine = AgentEngine(load_tokenizer(str(tokenizer_dir)), policy)
    ready: list[str] = []
    failed: list[BaseException] = []
    started = threading.Event()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def main() -> None:
        config = ClientConfig(
            backend="scripted",
            base_url="http://scripted",
            model=MODEL,
            tokenizer=str(tokenizer_dir),
            stateless=StatelessPolicy(enabled=False),
        )
        async with (
            Client(config, plugin=engine) as client,
            Gateway(client, SQLiteStore(store), limits=limits) as gateway,
            serve(gateway, keys=keys) as url,
        ):
            ready.append(url)
            started.set()
            await stop.wait()

    def run() -> None:
        try:
            loop.run_until_complete(main())
        except BaseException as exc:
            failed.append(exc)
        finally:
            started.set()

    thread = threading.Thread(target=run, name="agent-gateway", daemon=True)
    thread.start()
    if not started.wait(START_TIMEOUT_S) or not ready:
        raise RuntimeError(f"the gateway did not start: {failed}")
    try:
        yield AgentGateway(url=ready[0], engine=engine, store=store)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(START_TIMEOUT_S)
        loop.close()
        if failed:
            raise failed[0]


@pytest.fixture(scope="session")
def long_context_model(tiny_models: Any) -> Path:
    """The tiny dense model with a 128K context: real harnesses send prompts of tens of thousands of its ids."""
    from backends_testkit.tinymodel import write_long_context_variant

    return write_long_context_variant(tiny_models.dense, tiny_models.root / "tiny-qwen3-128k")


@pytest.fixture
def agent_gateway(
    long_context_model: Path, tmp_path: Path
) -> Callable[..., contextlib.AbstractContextManager[AgentGateway]]:
    """``with agent_gateway(policy=ShellLoop(), limits=None, keys=None) as gw``: a gateway over the agent engine
    (its replies computed by ``policy`` from each prompt), serving at ``gw.url``."""
    names = iter(range(1000))

    def make(
        policy: Callable[[str], str] | None = None, *, limits: GatewayLimits | None = None, keys: Keys | None = None
    ) -> contextlib.AbstractContextManager[AgentGateway]:
        store = tmp_path / f"gateway-{next(names)}.db"
        return _served(long_context_model, store, policy or ShellLoop(), limits, keys)

    return make
