"""SyncClient: the :class:`~backends_core.client.Client` for synchronous code (trainer loops, scripts, notebooks).

``asyncio.run(client.generate(...))`` works once: the client's connection pools belong to the loop that first used
them, and ``asyncio.run`` closes that loop, so the second call fails (``Event loop is closed``). A
:class:`SyncClient` instead owns one event loop on its own daemon thread for its whole life; the async ``Client``
is built on that loop and only ever used there. Each method hands its call to the loop and blocks until it ends::

    with SyncClient(config) as client:
        result = client.generate(messages=[{"role": "user", "content": "2+2?"}], sampling=SamplingParams(max_tokens=8))
        client.admin.pause(mode="keep")

* Every method mirrors ``Client``'s (same arguments, same results, same exceptions, raised unchanged).
* Calls from several threads run concurrently on the loop, as concurrent tasks would (not one after the other).
* An interrupt (``KeyboardInterrupt``) or any other exception raised in the waiting caller cancels the call on
  the loop, as cancelling the task would with ``Client``: its server request is aborted.
* After :meth:`SyncClient.close` every call raises :class:`~backends_core.errors.ClientClosedError`; calls still
  running when it is called are cancelled and raise it too.
* Called from a thread that runs an event loop (inside an ``async def``), a method raises
  :class:`~backends_core.errors.RunningEventLoopError`: async code uses ``Client``.

Each mirror is one line, ``name = _blocking(Client.name)``: :func:`_blocking` keeps the async method's parameters
(a ``ParamSpec``), so a type checker checks every call against ``Client``'s own signature.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import threading
import weakref
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

import httpx

from backends_core.client import Client, GenerateStream
from backends_core.config import ClientConfig
from backends_core.errors import ClientClosedError, RunningEventLoopError
from backends_core.fleet import Admin
from backends_core.membership import Fleet
from backends_core.multiturn import BridgeStats, Conversation
from backends_core.types import GenerateResult, Message, SamplingParams, StreamDelta, TensorSpec, TransferPlan

__all__ = ["SyncAdmin", "SyncClient", "SyncConversation", "SyncFleet", "SyncGenerateStream"]

P = ParamSpec("P")
T = TypeVar("T")
S = TypeVar("S")
R = TypeVar("R")
W = TypeVar("W")


def _refuse_running_loop(what: str) -> None:
    """Raise :class:`RunningEventLoopError` when the calling thread runs an event loop (blocking would stall it)."""
    if asyncio._get_running_loop() is None:  # the non-raising form of get_running_loop: this runs on every call
        return
    raise RunningEventLoopError(
        f"SyncClient.{what} was called from a thread that runs an event loop (inside async code), where blocking "
        "would stall that loop: use backends_core.Client there and await its methods"
    )


class _LoopThread:
    """One event loop running on its own daemon thread, taking calls from any other thread.

    It holds no reference to the :class:`SyncClient` it serves, so that client can be collected (its finalizer
    then closes this).
    """

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._lock = threading.Lock()  # orders "closed?" + scheduling against close()
        self._closing = threading.Lock()  # one close at a time; later ones wait for it
        self._closed = False
        self._stopped = False
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def run(self, what: str, factory: Callable[[], Awaitable[T]]) -> T:
        """Run ``await factory()`` on the loop and return its result; ``factory`` itself is called on the loop.

        The call is handed over as one callback (:meth:`_start`) and waited for on a bare lock its task releases
        when done: the least a hop between threads costs (``run_coroutine_threadsafe`` adds a second future, its
        condition variable and the callbacks chaining the two).

        :raises RunningEventLoopError: the calling thread runs an event loop.
        :raises ClientClosedError: closed before the call, or while it ran.
        """
        _refuse_running_loop(what)
        call: _Call[T] = _Call(factory)
        with self._lock:
            if self._closed:
                raise ClientClosedError(f"SyncClient.{what}: the client is closed")
            self.loop.call_soon_threadsafe(self._start, call)
        try:
            call.done.acquire()
        except BaseException:  # an interrupt in the caller: cancel the task, which aborts its server request
            self._cancel_soon(call)
            raise
        task = call.task
        assert task is not None
        if task.cancelled():
            if self._closed:
                raise ClientClosedError(f"SyncClient.{what}: the client was closed while the call ran") from None
            raise concurrent.futures.CancelledError()
        return task.result()

    def _start(self, call: _Call[Any]) -> None:
        """On the loop: start ``call``'s task, unless its caller already left."""
        if call.cancelled:
            return
        call.task = task = self.loop.create_task(call.run())
        task.add_done_callback(call.finished)

    def _cancel_soon(self, call: _Call[Any]) -> None:
        try:
            self.loop.call_soon_threadsafe(call.cancel)
        except RuntimeError:  # the loop is closed: nothing runs there any more
            pass

    def call(self, what: str, function: Callable[[], T]) -> T:
        """Run the plain function ``function()`` on the loop's thread and return its result."""

        async def call() -> T:
            return function()

        return self.run(what, call)

    def close(self, finish: Callable[[], Awaitable[None]] | None) -> None:
        """Refuse new calls, cancel the running ones, ``await finish()``, then stop the loop and join its thread.

        Idempotent; a second caller waits for the first. Called on the loop's own thread (a finalizer run there),
        it schedules all of that and returns without waiting.
        """
        with self._lock:
            self._closed = True
        if threading.current_thread() is self.thread:
            if not self._stopped:
                self._stopped = True
                self.loop.create_task(self._shutdown(finish, stop=True))
            return
        with self._closing:
            if self._stopped:
                return
            self._stopped = True
            try:
                asyncio.run_coroutine_threadsafe(self._shutdown(finish, stop=False), self.loop).result()
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self.thread.join()  # the thread closes the loop on its way out

    async def _shutdown(self, finish: Callable[[], Awaitable[None]] | None, *, stop: bool) -> None:
        try:
            await self._cancel_others()
            if finish is not None:
                await finish()
            await self._cancel_others()  # anything the finish started and left running
            await self.loop.shutdown_asyncgens()
        finally:
            if stop:
                self.loop.stop()

    @staticmethod
    async def _cancel_others() -> None:
        current = asyncio.current_task()
        others = [task for task in asyncio.all_tasks() if task is not current]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)


class _Call(Generic[T]):
    """One call handed to the loop by :meth:`_LoopThread.run`: its task once started there, and a lock held until
    the task is done."""

    __slots__ = ("cancelled", "done", "factory", "task")

    def __init__(self, factory: Callable[[], Awaitable[T]]) -> None:
        self.factory = factory
        self.task: asyncio.Task[T] | None = None
        self.cancelled = False
        self.done = threading.Lock()
        self.done.acquire()

    async def run(self) -> T:
        return await self.factory()

    def finished(self, _task: asyncio.Task[T]) -> None:
        self.done.release()

    def cancel(self) -> None:
        """On the loop: the caller left; cancel the task (or never start it)."""
        self.cancelled = True
        if self.task is not None:
            self.task.cancel()


class _Mirror(Generic[S]):
    """A synchronous face of the async object :attr:`_target`, which lives on :attr:`_portal`'s loop."""

    _portal: _LoopThread
    _target: S


def _blocking(method: Callable[Concatenate[S, P], Awaitable[T]]) -> Callable[Concatenate[_Mirror[S], P], T]:
    """The blocking mirror of the coroutine method ``method``: same parameters, same result, run on the loop."""
    what = method.__name__

    @functools.wraps(method)
    def mirror(self: _Mirror[S], /, *args: P.args, **kwargs: P.kwargs) -> T:
        # by name: a subclass of the target's class (FrontFleet for Fleet) answers with its own method
        bound: Callable[P, Awaitable[T]] = getattr(self._target, what)
        return self._portal.run(what, lambda: bound(*args, **kwargs))

    return mirror


def _on_loop(method: Callable[Concatenate[S, P], T]) -> Callable[Concatenate[_Mirror[S], P], T]:
    """The mirror of the plain method ``method``, run on the loop's thread (it touches the async object's state)."""
    what = method.__name__

    @functools.wraps(method)
    def mirror(self: _Mirror[S], /, *args: P.args, **kwargs: P.kwargs) -> T:
        bound: Callable[P, T] = getattr(self._target, what)
        return self._portal.call(what, lambda: bound(*args, **kwargs))

    return mirror


def _wrapping(
    method: Callable[Concatenate[S, P], R], face: Callable[[_LoopThread, R], W]
) -> Callable[Concatenate[_Mirror[S], P], W]:
    """The mirror of the plain method ``method`` that returns an async object: the method runs on the loop's
    thread, and its result is handed back in its blocking face, ``face(portal, result)``."""
    what = method.__name__

    @functools.wraps(method)
    def mirror(self: _Mirror[S], /, *args: P.args, **kwargs: P.kwargs) -> W:
        bound: Callable[P, R] = getattr(self._target, what)
        return face(self._portal, self._portal.call(what, lambda: bound(*args, **kwargs)))

    name = getattr(face, "__name__", None)
    if name is not None:  # help() shows the blocking face, not the async object
        mirror.__signature__ = inspect.signature(method).replace(return_annotation=name)  # type: ignore[attr-defined]
    return mirror


class SyncAdmin(_Mirror[Admin]):
    """``sync_client.admin``: every operation of :class:`~backends_core.fleet.Admin`, blocking. Each returns the
    per-server values (in server order) and raises :class:`~backends_core.errors.AdminError` if any server failed,
    exactly as the async ``client.admin``."""

    def __init__(self, portal: _LoopThread, admin: Admin) -> None:
        self._portal = portal
        self._target = admin

    def deadline(self, operation: str) -> float | None:
        """Seconds one server gets for ``operation``, retries included (``None``: no limit)."""
        return self._target.deadline(operation)

    def transfer_plan(self, tensors: Sequence[TensorSpec], *, bucket_bytes: int | None = None) -> TransferPlan:
        """How the engines receive ``tensors`` (see :meth:`Admin.transfer_plan`); sends nothing."""
        return self._target.transfer_plan(tensors, bucket_bytes=bucket_bytes)

    health = _blocking(Admin.health)
    ready = _blocking(Admin.ready)
    pause = _blocking(Admin.pause)
    resume = _blocking(Admin.resume)
    flush_cache = _blocking(Admin.flush_cache)
    update_weights = _blocking(Admin.update_weights)
    init_weight_transfer = _blocking(Admin.init_weight_transfer)
    destroy_weight_transfer = _blocking(Admin.destroy_weight_transfer)
    update_weights_distributed = _blocking(Admin.update_weights_distributed)
    load_lora = _blocking(Admin.load_lora)
    unload_lora = _blocking(Admin.unload_lora)
    state = _blocking(Admin.state)
    sleep = _blocking(Admin.sleep)
    wake = _blocking(Admin.wake)
    abort = _blocking(Admin.abort)
    fleet_state = _blocking(Admin.fleet_state)
    weight_sync = _blocking(Admin.weight_sync)


class SyncFleet(_Mirror[Fleet]):
    """``sync_client.fleet``: the membership of the fleet (see :class:`~backends_core.membership.Fleet`),
    blocking. Servers added are caught up before they serve; ``remove`` returns once the server is drained."""

    def __init__(self, portal: _LoopThread, fleet: Fleet) -> None:
        self._portal = portal
        self._target = fleet

    @property
    def catch_up_failures(self) -> int:
        """Catch-ups that failed since the client was built."""
        return self._target.catch_up_failures

    members = _on_loop(Fleet.members)
    add = _blocking(Fleet.add)
    remove = _blocking(Fleet.remove)
    refresh = _blocking(Fleet.refresh)


class SyncConversation(_Mirror[Conversation]):
    """A multi-turn conversation of a :class:`SyncClient` (see :class:`~backends_core.multiturn.Conversation`):
    :meth:`send` blocks until the turn's result is back. Its turns are sent one at a time."""

    def __init__(self, portal: _LoopThread, conversation: Conversation) -> None:
        self._portal = portal
        self._target = conversation

    def send(
        self,
        new_messages: Sequence[Message],
        *,
        sampling: SamplingParams | None = None,
        assistant_message: Message | None = None,
        **generate_kwargs: Any,
    ) -> GenerateResult:
        """Run the next turn (see :meth:`Conversation.send <backends_core.multiturn.Conversation.send>`); written
        out rather than ``_blocking(Conversation.send)``: a method taking ``**kwargs`` does not fit a
        ``Concatenate`` whose first parameter is named."""
        return self._portal.run(
            "send",
            lambda: self._target.send(
                new_messages, sampling=sampling, assistant_message=assistant_message, **generate_kwargs
            ),
        )

    @property
    def session(self) -> str:
        """The session key every turn sticks to one server with."""
        return self._target.session

    @property
    def messages(self) -> list[Message]:
        """Every message so far."""
        return self._target.messages

    @property
    def turns(self) -> list[GenerateResult]:
        """Each turn's result, in order."""
        return self._target.turns

    @property
    def token_ids(self) -> tuple[int, ...]:
        """The exact ids so far (last prompt + last completion)."""
        return self._target.token_ids


class SyncGenerateStream(_Mirror[GenerateStream]):
    """One streamed generation of a :class:`SyncClient` (see :meth:`Client.stream
    <backends_core.client.Client.stream>`): a context manager and, inside it, an iterator of
    :class:`~backends_core.types.StreamDelta`; each delta is waited for on the client's loop. Leaving the block
    early (``break``, an exception, an interrupt) closes the stream and the server aborts the request."""

    def __init__(self, portal: _LoopThread, stream: GenerateStream) -> None:
        self._portal = portal
        self._target = stream

    def __enter__(self) -> SyncGenerateStream:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __iter__(self) -> SyncGenerateStream:
        return self

    def __next__(self) -> StreamDelta:
        try:
            return self._portal.run("stream", self._target.__anext__)
        except StopAsyncIteration:
            raise StopIteration from None

    def close(self) -> None:
        """Leave the stream: before its end, this closes it and the server aborts the request."""
        self._portal.run("stream.close", self._target.aclose)

    @property
    def result(self) -> GenerateResult:
        """The whole sample, once the stream ran to its end (see ``GenerateStream.result``)."""
        return self._target.result

    @property
    def server(self) -> str | None:
        """The base URL of the server generating it."""
        return self._target.server


class SyncClient(_Mirror[Client]):
    """The :class:`~backends_core.client.Client` for synchronous code: same constructor, same methods, blocking.

    Use it as ``with SyncClient(config) as client:``, or call :meth:`close` when done. It runs one event loop on
    a daemon thread of its own, where the async ``Client`` is built and used; calls from any number of threads
    run there concurrently. A client collected without :meth:`close` is closed by its finalizer (at the latest
    when the interpreter exits); its thread, a daemon, never holds up the exit.

    :param config: what to talk to and how.
    :param transport: testing seam: an ``httpx.AsyncBaseTransport`` used instead of the network, for both planes
        (it runs on this client's loop).
    :param plugin: register this object as the backend instead of loading ``config.backend``'s entry point.
    :param plugins: cross-cutting plugins (metrics via ``observe``, ``prepare_request`` wrappers); their hooks
        run on this client's loop thread.
    :param tokenizer: a ready tokenizer, instead of loading ``config.tokenizer`` on first use.
    :raises RunningEventLoopError: built in a thread that runs an event loop (use ``Client`` there).
    """

    def __init__(
        self,
        config: ClientConfig,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        plugin: object | None = None,
        plugins: Sequence[object] = (),
        tokenizer: Any = None,
    ) -> None:
        _refuse_running_loop("__init__")
        portal = _LoopThread(f"backends-sync-client-{config.backend}")

        async def build() -> Client:
            return Client(config, transport=transport, plugin=plugin, plugins=plugins, tokenizer=tokenizer)

        try:
            client = portal.run("__init__", build)
        except BaseException:
            portal.close(None)
            raise
        self._portal = portal
        self._target = client
        self._finalizer = weakref.finalize(self, portal.close, client.aclose)
        #: Admin operations over every server, blocking (see :class:`SyncAdmin`).
        self.admin = SyncAdmin(portal, client.admin)
        #: Servers joining and leaving at run time, blocking (see :class:`SyncFleet`).
        self.fleet = SyncFleet(portal, client.fleet)

    def run(self, function: Callable[[Client], Awaitable[T]]) -> T:
        """``await function(client)`` with the async :class:`~backends_core.client.Client` behind this one, on
        this client's loop, blocking: how an extension built on the async API offers a blocking form."""
        _refuse_running_loop("run")
        target = self._target
        return self._portal.run("run", lambda: function(target))

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close every connection pool, stop the loop and join its thread. Calls still running are cancelled
        (their server requests aborted) and raise :class:`~backends_core.errors.ClientClosedError`, as does
        every later call. Idempotent.

        :raises RunningEventLoopError: called on this client's own loop thread (from a plugin hook), where it
            could not wait for itself.
        """
        if threading.current_thread() is self._portal.thread:
            raise RunningEventLoopError("SyncClient.close was called on the client's own loop thread")
        self._finalizer.detach()
        self._portal.close(self._target.aclose)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (every call now raises ``ClientClosedError``)."""
        return self._portal.closed

    @property
    def config(self) -> ClientConfig:
        return self._target.config

    @property
    def base_urls(self) -> list[str]:
        """The servers' base URLs, in config order."""
        return self._target.base_urls

    @property
    def backend(self) -> str:
        return self._target.backend

    @property
    def capabilities(self) -> frozenset[str]:
        """Optional operations the backend implements (hook names, e.g. ``admin_pause``)."""
        return self._target.capabilities

    @property
    def tokenizer(self) -> Any:
        """The chat-template tokenizer, loaded offline on first use from ``config.tokenizer`` (or ``model``)."""
        return self._portal.call("tokenizer", lambda: self._target.tokenizer)

    @property
    def bridge_stats(self) -> BridgeStats:
        """Multi-turn bridge counters shared by every conversation of this client."""
        return self._target.bridge_stats

    @property
    def weight_version(self) -> str | None:
        """The weight version this client last set on every server."""
        return self._target.weight_version

    generate = _blocking(Client.generate)
    generate_samples = _blocking(Client.generate_samples)
    generate_group = _blocking(Client.generate_group)
    send = _blocking(Client.send)
    teacher_logprobs = _blocking(Client.teacher_logprobs)
    check_tokenizer = _blocking(Client.check_tokenizer)
    render = _on_loop(Client.render)
    parse_completion = _on_loop(Client.parse_completion)

    conversation = _wrapping(Client.conversation, SyncConversation)
    stream = _wrapping(Client.stream, SyncGenerateStream)
