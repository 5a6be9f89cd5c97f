"""What the gateway fixtures of ``conftest.py`` give a test (a module of its own: test modules import it, and
``conftest`` names a different module in each test directory)."""

from __future__ import annotations

from pathlib import Path

import attrs

from backends_core import Client
from backends_core.config import StatelessPolicy
from backends_gateway import Gateway
from scripted_stream import StreamingScript

#: the gateway keeps the turns itself
OFF = StatelessPolicy(enabled=False)


@attrs.frozen
class Served:
    url: str
    gateway: Gateway
    client: Client
    model: str
    store: Path
    script: StreamingScript | None = None
