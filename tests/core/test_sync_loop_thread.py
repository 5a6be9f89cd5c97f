"""The SyncClient's loop thread (``_LoopThread.run``: one callback to the loop, a bare lock to wait on): a call's
result and its exception come back unchanged (also one the factory raises before awaiting anything), a call that
is cancelled on the loop raises ``concurrent.futures.CancelledError`` as a cancelled future's result does, one cut by
``close`` raises ``ClientClosedError``. (An interrupted caller: test_sync_client, with a real signal.)"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Iterator

import pytest

from backends_core import ClientClosedError
from backends_core.sync_client import _LoopThread

DEADLINE_S = 120.0


@pytest.fixture
def portal() -> Iterator[_LoopThread]:
    loop_thread = _LoopThread("backends-sync-client-test")
    try:
        yield loop_thread
    finally:
        loop_thread.close(None)


def test_results_and_exceptions_come_back_unchanged(portal: _LoopThread) -> None:
    async def answer() -> tuple[str, bool]:
        return threading.current_thread().name, asyncio.get_running_loop() is portal.loop

    assert portal.run("answer", answer) == ("backends-sync-client-test", True)
    error = KeyError("k")

    async def fails() -> None:
        raise error

    with pytest.raises(KeyError) as info:
        portal.run("fails", fails)
    assert info.value is error

    def not_a_coroutine() -> asyncio.Future[None]:
        raise ValueError("raised by the factory itself")

    with pytest.raises(ValueError, match="factory itself"):
        portal.run("factory", not_a_coroutine)
    assert portal.call("call", lambda: 42) == 42


def test_a_call_cancelled_on_the_loop_raises_cancelled_error(portal: _LoopThread) -> None:
    async def cancelled() -> None:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        await asyncio.sleep(0)

    with pytest.raises(concurrent.futures.CancelledError):
        portal.run("cancelled", cancelled)


def test_close_cuts_a_running_call_with_client_closed_error(portal: _LoopThread) -> None:
    started = threading.Event()

    async def forever() -> None:
        started.set()
        await asyncio.Event().wait()

    errors: list[BaseException] = []

    def caller() -> None:
        try:
            portal.run("forever", forever)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=caller)
    thread.start()
    assert started.wait(DEADLINE_S)
    portal.close(None)
    thread.join(DEADLINE_S)
    assert len(errors) == 1 and isinstance(errors[0], ClientClosedError)
    with pytest.raises(ClientClosedError, match="is closed"):
        portal.run("after", forever)
