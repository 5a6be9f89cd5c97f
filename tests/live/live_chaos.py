"""Helpers of the live chaos tests (``test_vllm_chaos.py``, ``sglang/test_sglang_chaos.py``): killing a server
outright and waiting on conditions under a deadline.

A kill is ``SIGKILL`` to the server's whole process group (``ServerProcess`` starts each server in its own
session, so the group holds the API process and every engine process it spawned): nothing gets to close a
socket or answer a request, as when a machine loses power or the OOM killer strikes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable

from backends_testkit.live import ServerProcess

KILL_TIMEOUT_S = 30.0
"""Seconds for a SIGKILLed process group to be gone (milliseconds in practice)."""


class ChaosSetupError(RuntimeError):
    """A step that sets up the fault did not do what it must (a precondition, not the behaviour under test)."""


def require(condition: bool, message: str) -> None:
    """Raise :class:`ChaosSetupError` unless ``condition`` holds.

    Used for preconditions of ``xfail(raises=AssertionError)`` tests: a broken set-up is then reported as a
    failure, never mistaken for the expected failure.
    """
    if not condition:
        raise ChaosSetupError(message)


def port_open(host: str, port: int) -> bool:
    """Whether something accepts TCP connections on ``host:port`` right now."""
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def sigkill(server: ServerProcess, *, timeout: float = KILL_TIMEOUT_S) -> float:
    """SIGKILL every process of ``server``'s group, reap the leader and wait until its port refuses connections.

    :returns: the monotonic time of the kill.
    :raises ChaosSetupError: the server was not running, or it still listened after ``timeout``.
    """
    pgid = server.pid
    if pgid is None or not server.running():
        raise ChaosSetupError(f"{server.name} is not running: nothing to kill")
    killed_at = time.monotonic()
    os.killpg(pgid, signal.SIGKILL)
    try:
        server.wait(timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise ChaosSetupError(f"{server.name} (pid {pgid}) survived SIGKILL for {timeout} s") from exc
    deadline = killed_at + timeout
    while port_open(server.host, server.port):
        if time.monotonic() >= deadline:
            raise ChaosSetupError(f"{server.url} still accepts connections {timeout} s after SIGKILL")
        time.sleep(0.01)
    return killed_at


async def wait_until(
    condition: Callable[[], Awaitable[bool]], *, within: float, what: str, interval: float = 0.1
) -> float:
    """Poll ``condition`` (a remote state: nothing to await an event on) until it returns true; fail after
    ``within`` seconds.

    :returns: the seconds it took.
    :raises ChaosSetupError: the condition did not hold in time (the message says what was awaited).
    """
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        async with asyncio.timeout(within):  # bounds a hanging condition too, not only a false one
            while not await condition():  # noqa: ASYNC110 - polls a server's state
                await asyncio.sleep(interval)
    except TimeoutError as exc:
        raise ChaosSetupError(f"timed out after {within:.0f} s waiting for {what}") from exc
    return loop.time() - started
