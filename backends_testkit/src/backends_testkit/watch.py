"""Watching a fleet's admin state while a generation runs."""

from __future__ import annotations

import asyncio
from typing import Any

from backends_core.client import Client

__all__ = ["in_flight_or_ended"]


async def in_flight_or_ended(
    client: Client, task: asyncio.Task[Any], *, server: int = 0, within: float, poll_s: float = 0.05
) -> bool | None:
    """Poll ``client.admin.state()`` until ``server`` reports a request in flight (``True``), reports no count at
    all (``None``: this server does not count them), or ``task`` ends first (``False``).

    A poll still unanswered when ``task`` ends is abandoned: a lagging admin plane may answer only after the whole
    generation.

    :raises TimeoutError: ``within`` seconds passed with ``task`` still running and no request reported.
    """
    async with asyncio.timeout(within):
        while not task.done():
            poll = asyncio.ensure_future(client.admin.state())
            try:
                await asyncio.wait({poll, task}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not poll.done():
                    poll.cancel()
                    await asyncio.wait({poll})
            if poll.cancelled():
                return False
            in_flight = poll.result()[server].in_flight
            if in_flight is None:
                return None
            if in_flight > 0:
                return True
            await asyncio.sleep(poll_s)
    return False
