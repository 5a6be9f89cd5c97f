"""Fixtures of the sglang tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest_asyncio

from backends_sglang_testing import SglangEmulator
from backends_testkit.engine import ReferenceEngine
from backends_testkit.tinymodel import TinyModels


@pytest_asyncio.fixture
async def make_emulator(tiny_models: TinyModels) -> AsyncIterator[Callable[..., SglangEmulator]]:
    """Build emulators over fresh engines (``moe=True`` for the MoE model); all closed afterwards."""
    made: list[SglangEmulator] = []

    def make(*, moe: bool = False, **kwargs: Any) -> SglangEmulator:
        engine = ReferenceEngine(tiny_models.moe if moe else tiny_models.dense, seed=0)
        emulator = SglangEmulator(engine, **kwargs)
        made.append(emulator)
        return emulator

    yield make
    for emulator in made:
        await emulator.aclose()
