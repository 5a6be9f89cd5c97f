"""Gateways for the tests: over the vLLM emulator (a real HTTP engine with the tiny model's random weights), or over
a scripted backend (a chosen reply per turn: tool calls, reasoning) on the same template, parsers and bridging."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from served_gateway import OFF, Served

from backends_core import Client, ClientConfig
from backends_core.multiturn.rendering import load_tokenizer
from backends_gateway import Gateway, GatewayLimits, Keys, SQLiteStore, serve
from backends_testkit.engine import ReferenceEngine
from backends_testkit.postgres import PostgresServer
from backends_vllm_testing.emulator import VllmEmulator
from scripted_stream import StreamingScript

_DATABASES = itertools.count()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One PostgreSQL server for the session, from the machine's server binaries (missing ones fail the tests that
    need it, naming what to install)."""
    with PostgresServer() as server:
        yield server


@pytest.fixture
def postgres_dsn(postgres_server: PostgresServer) -> str:
    """A fresh empty database of that server for this test: its ``postgresql://`` URL (with a password)."""
    return postgres_server.create_database(f"t{next(_DATABASES)}")


@pytest.fixture
async def vllm_gateway(tiny_models: Any, tmp_path: Path) -> AsyncIterator[Served]:
    """A gateway over the vLLM emulator serving the tiny dense model."""
    engine = ReferenceEngine(tiny_models.dense, seed=0)
    emulator = VllmEmulator(engine)
    try:
        async with emulator.serve() as engine_url:
            config = ClientConfig(
                backend="vllm",
                base_url=engine_url,
                model=emulator.served_model_name,
                tokenizer=str(tiny_models.dense),
                stateless=OFF,
            )
            store = tmp_path / "gateway.db"
            async with Client(config) as client, Gateway(client, SQLiteStore(store)) as gateway, serve(gateway) as url:
                yield Served(url, gateway, client, emulator.served_model_name, store)
    finally:
        await engine.aclose()


@pytest.fixture
def scripted_gateway(tiny_models: Any, tmp_path: Path) -> Any:
    """``async with scripted_gateway(replies, limits=...) as served``: a gateway whose engine answers ``replies``
    in order (``served.script`` records the requests)."""
    tokenizer = load_tokenizer(str(tiny_models.dense))

    @contextlib.asynccontextmanager
    async def make(
        replies: list[str], *, limits: GatewayLimits | None = None, name: str = "g", keys: Keys | None = None
    ) -> AsyncIterator[Served]:
        script = StreamingScript(tokenizer, replies)
        config = ClientConfig(
            backend="scripted",
            base_url="http://scripted",
            model="tiny",
            tokenizer=str(tiny_models.dense),
            stateless=OFF,
        )
        store = tmp_path / f"{name}.db"
        async with (
            Client(config, plugin=script) as client,
            Gateway(client, SQLiteStore(store), limits=limits) as gateway,
            serve(gateway, keys=keys) as url,
        ):
            yield Served(url, gateway, client, "tiny", store, script)

    return make
