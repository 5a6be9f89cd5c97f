"""Helpers of the sglang tests: the captures (copies in tests/fixtures/wire/sglang) and in-process clients."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from backends_sglang_testing import SglangEmulator

CAPTURES = Path(__file__).resolve().parents[2] / "fixtures" / "wire" / "sglang"


def capture(name: str) -> dict[str, Any]:
    """One capture: ``request`` (method, path, json), ``status``, ``response`` (or one entry per step)."""
    data: dict[str, Any] = json.loads((CAPTURES / f"{name}.json").read_text())
    return data


def client_of(emulator: SglangEmulator, **headers: str) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` answering in-process from ``emulator`` (use with ``async with``)."""
    return httpx.AsyncClient(transport=emulator.transport(), base_url="http://sglang.test", headers=headers)
