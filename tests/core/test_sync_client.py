"""SyncClient from plain synchronous code, against the vLLM emulator over the reference engine (in-process): calls
in sequence and from many threads at once, closing, refusing to block an event loop, conversations and admin
operations, an interrupted call aborted on the server, and mirrors that keep Client's signatures."""

from __future__ import annotations

import asyncio
import gc
import inspect
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from backends_core import (
    Client,
    ClientClosedError,
    ClientConfig,
    InvalidRequestError,
    RunningEventLoopError,
    SamplingParams,
    ServerStatusError,
    SyncAdmin,
    SyncClient,
    SyncConversation,
    SyncFleet,
)
from backends_core.fleet import Admin
from backends_core.membership import Fleet
from backends_core.multiturn import Conversation
from backends_testkit.emulators import make_emulator
from backends_testkit.engine import ReferenceEngine
from backends_testkit.tinymodel import write_perturbed_weights

#: Seconds a condition may take to come true (a hang guard on a loaded machine, not a speed check).
DEADLINE_S = 120.0
GENERATE = "/inference/v1/generate"
THREADS = 8
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
HELLO = [{"role": "user", "content": "hello"}]


class VllmServer:
    """The vLLM emulator over one reference engine, answered in-process; ``on_generate`` (when set) answers a
    generation request in its place, e.g. to hold it or to act while it runs."""

    def __init__(self, engine: ReferenceEngine) -> None:
        self.engine = engine
        self.emulator = make_emulator("vllm", engine)
        self.on_generate: Callable[[httpx.Request], Awaitable[httpx.Response]] | None = None

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == GENERATE and self.on_generate is not None:
            return await self.on_generate(request)
        response: httpx.Response = await self.emulator.handle(request)
        return response

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)


@pytest.fixture
def config(tiny_models) -> ClientConfig:
    return ClientConfig(
        backend="vllm", base_url="http://vllm.test", model="tiny-qwen3", tokenizer=str(tiny_models.dense)
    )


@pytest.fixture
def server(tiny_models) -> VllmServer:
    # the engine's step loop runs on the SyncClient's loop; closing the client stops it
    return VllmServer(ReferenceEngine(tiny_models.dense, seed=0))


@pytest.fixture
def client(config: ClientConfig, server: VllmServer) -> Iterator[SyncClient]:
    with SyncClient(config, transport=server.transport()) as c:
        yield c


def loop_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("backends-sync-client")}


def wait_until(condition: Callable[[], bool], what: str) -> None:
    """Poll ``condition`` from the test's thread until it holds, failing after :data:`DEADLINE_S`."""
    done = threading.Event()
    for _ in range(int(DEADLINE_S / 0.01)):
        if condition():
            return
        done.wait(0.01)
    raise AssertionError(f"{what} did not happen within {DEADLINE_S} s")


def test_two_generate_calls_in_a_row_from_plain_code(client: SyncClient) -> None:
    # the reported bug: asyncio.run(client.generate(...)) twice fails with "Event loop is closed"
    first = client.generate(messages=HELLO, sampling=GREEDY)
    second = client.generate(messages=HELLO, sampling=GREEDY)
    assert first.completion_ids == second.completion_ids and len(first.completion_ids) == 4
    assert first.logprobs.dtype == np.float32 and np.allclose(first.logprobs, second.logprobs)
    samples = client.generate_samples(prompt_ids=list(first.prompt_ids), sampling=SamplingParams(max_tokens=3, n=2))
    assert len(samples) == 2 and all(s.prompt_ids == first.prompt_ids for s in samples)
    group = client.generate_group(prompt_ids=list(first.prompt_ids), n=2, sampling=SamplingParams(max_tokens=3, seed=4))
    alone = client.generate(prompt_ids=list(first.prompt_ids), sampling=SamplingParams(max_tokens=3, seed=5))
    assert len(group) == 2 and group[1].completion_ids == alone.completion_ids  # sample i is seed + i
    teacher = client.teacher_logprobs(first.token_ids)
    assert np.allclose(teacher.logprobs[len(first.prompt_ids) :], first.logprobs, atol=1e-4)
    assert client.check_tokenizer(HELLO).match
    assert client.render(HELLO) == list(first.prompt_ids)
    parsed = client.parse_completion(first)
    assert parsed["role"] == "assistant" and isinstance(parsed["content"], str)


def test_calls_from_eight_threads_are_in_flight_on_the_server_together(client: SyncClient, server: VllmServer) -> None:
    arrived: list[int] = []
    everyone = asyncio.Event()

    async def hold_until_all_arrived(request: httpx.Request) -> httpx.Response:
        # calls run one after the other would never get here together: the first would wait out the deadline
        arrived.append(threading.get_ident())
        if len(arrived) == THREADS:
            everyone.set()
        async with asyncio.timeout(DEADLINE_S):
            await everyone.wait()
        response: httpx.Response = await server.emulator.handle(request)
        return response

    server.on_generate = hold_until_all_arrived
    callers: set[int] = set()

    def one(seed: int) -> tuple[int, ...]:
        callers.add(threading.get_ident())
        return client.generate(messages=HELLO, sampling=SamplingParams(max_tokens=3, seed=seed)).completion_ids

    with ThreadPoolExecutor(THREADS) as pool:
        results = list(pool.map(one, range(THREADS)))
    assert len(arrived) == THREADS and len(callers) == THREADS
    assert all(len(ids) == 3 for ids in results)
    assert len(set(arrived)) == 1 and arrived[0] not in callers  # all answered on the client's one loop thread


def test_errors_come_back_unchanged(client: SyncClient, server: VllmServer) -> None:
    with pytest.raises(InvalidRequestError, match="exactly one of messages= or prompt_ids="):
        client.generate(messages=HELLO, prompt_ids=[1, 2], sampling=SamplingParams(max_tokens=16))
    with pytest.raises(InvalidRequestError, match="pause mode"):
        client.admin.pause(mode="later")  # type: ignore[arg-type]

    async def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(500, json={"error": "engine is on fire"})

    server.on_generate = refuse
    with pytest.raises(ServerStatusError, match="engine is on fire") as caught:
        client.generate(prompt_ids=[1, 2, 3], sampling=GREEDY)
    assert caught.value.status_code == 500


def test_after_close_every_call_raises_and_the_thread_is_gone(config: ClientConfig, server: VllmServer) -> None:
    before = loop_threads()
    client = SyncClient(config, transport=server.transport())
    (thread,) = loop_threads() - before
    conversation = client.conversation()
    assert client.generate(prompt_ids=[1, 2, 3], sampling=GREEDY).completion_ids
    client.close()
    client.close()  # idempotent
    assert client.closed and not thread.is_alive()
    with pytest.raises(ClientClosedError, match="closed"):
        client.generate(prompt_ids=[1, 2, 3], sampling=GREEDY)
    with pytest.raises(ClientClosedError):
        client.admin.health()
    with pytest.raises(ClientClosedError):
        conversation.send(HELLO)
    with pytest.raises(ClientClosedError):
        client.render(HELLO)


def test_close_cuts_a_running_call_short_with_a_library_error(client: SyncClient, server: VllmServer) -> None:
    arrived = threading.Event()
    cancelled_on_server = threading.Event()

    async def hold(request: httpx.Request) -> httpx.Response:
        arrived.set()
        try:
            await asyncio.Event().wait()  # never answers: only cancelling ends it
        except asyncio.CancelledError:
            cancelled_on_server.set()
            raise
        raise AssertionError("unreachable")

    server.on_generate = hold
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(client.generate, prompt_ids=[1, 2, 3], sampling=GREEDY)
        assert arrived.wait(DEADLINE_S)
        client.close()
        with pytest.raises(ClientClosedError, match="closed while the call ran"):
            call.result(DEADLINE_S)
    assert cancelled_on_server.is_set()


def test_inside_a_running_event_loop_it_says_to_use_client(config: ClientConfig, client: SyncClient) -> None:
    async def call_it() -> None:
        client.generate(prompt_ids=[1, 2, 3], sampling=GREEDY)

    async def build_one() -> None:
        SyncClient(config)

    with pytest.raises(RunningEventLoopError, match=r"use backends_core\.Client"):
        asyncio.run(call_it())
    with pytest.raises(RunningEventLoopError, match=r"use backends_core\.Client"):
        asyncio.run(build_one())
    assert client.generate(prompt_ids=[1, 2, 3], sampling=GREEDY).completion_ids  # still usable


def test_a_conversation_sends_turns_synchronously(client: SyncClient) -> None:
    conversation = client.conversation()
    sampling = SamplingParams(max_tokens=6, seed=1)
    first = conversation.send(HELLO, sampling=sampling)
    second = conversation.send([{"role": "user", "content": "and more"}], sampling=sampling)
    assert second.prompt_ids[: len(first.token_ids)] == first.token_ids
    assert conversation.turns == [first, second] and conversation.token_ids == second.token_ids
    assert [m["role"] for m in conversation.messages] == ["user", "assistant", "user"]
    assert client.bridge_stats.successes == 1 and client.bridge_stats.failed == 0


def test_admin_operations_block_until_every_server_answered(
    client: SyncClient, server: VllmServer, tiny_models, tmp_path: Path
) -> None:
    assert client.admin.health() == [True] and client.admin.ready() == [True]
    base = client.generate(messages=HELLO, sampling=GREEDY)
    assert client.admin.pause(mode="keep") == [True]
    assert client.admin.state()[0].paused
    assert client.admin.resume() == [True]
    new = write_perturbed_weights(tiny_models.dense, tmp_path / "step-1", seed=1, scale=0.3)
    assert client.admin.update_weights(str(new), version="step-1") == [True]
    assert client.weight_version == "step-1" and client.admin.state()[0].weight_version == "step-1"
    assert client.admin.flush_cache() == [True]
    moved = client.generate(messages=HELLO, sampling=GREEDY)
    assert not np.allclose(moved.logprobs, base.logprobs, atol=1e-4)
    report = client.admin.weight_sync(path=str(tiny_models.dense), version="base", mode="wait")
    assert report.ok and list(report.phases)[:2] == ["pause", "update"]
    back = client.generate(messages=HELLO, sampling=GREEDY)
    assert back.completion_ids == base.completion_ids and np.allclose(back.logprobs, base.logprobs, atol=1e-5)
    (report,) = client.admin.fleet_state()
    assert report.reachable and report.state is not None and report.state.weight_version == "base"
    assert [type(n) for n in client.admin.abort()] == [int]  # how many, where the server says (else -1)


def test_an_interrupted_call_is_aborted_on_the_server(client: SyncClient, server: VllmServer) -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    main = threading.main_thread().ident
    assert main is not None
    ended: list[str] = []

    async def interrupt_the_caller_once_generating(request: httpx.Request) -> httpx.Response:
        answer = asyncio.ensure_future(server.emulator.handle(request))
        async with asyncio.timeout(DEADLINE_S):
            while not server.engine.state().in_flight:  # noqa: ASYNC110 - the engine has no event to wait on
                await asyncio.sleep(0.001)
        signal.pthread_kill(main, signal.SIGINT)  # Ctrl-C in the trainer while its request runs
        try:
            # held open until the client gives up on it: on a loaded machine the interrupt may reach the caller
            # only after the engine could have finished, and a finished answer would prove nothing
            async with asyncio.timeout(DEADLINE_S):
                await asyncio.Event().wait()
        except asyncio.CancelledError:
            ended.append("cancelled")
            answer.cancel()  # the route's handler is gone: the engine drops the request
            raise
        except TimeoutError:
            ended.append(f"not cancelled within {DEADLINE_S} s")
        response: httpx.Response = await answer
        return response

    server.on_generate = interrupt_the_caller_once_generating
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            client.generate(prompt_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=1800, ignore_eos=True))
    finally:
        signal.signal(signal.SIGINT, previous)
    server.on_generate = None
    wait_until(lambda: client.admin.state()[0].in_flight == 0, "the engine dropping the interrupted request")
    assert ended == ["cancelled"]
    assert client.generate(prompt_ids=[1, 2, 3], sampling=GREEDY).completion_ids  # and the client goes on


def test_a_client_dropped_without_close_stops_its_thread(config: ClientConfig, server: VllmServer) -> None:
    before = loop_threads()
    client = SyncClient(config, transport=server.transport())
    client.generate(prompt_ids=[1, 2, 3], sampling=GREEDY)
    (thread,) = loop_threads() - before
    assert thread.daemon
    del client
    gc.collect()
    assert not thread.is_alive()


def test_a_client_whose_last_reference_drops_on_its_own_loop_thread_stops_it(
    config: ClientConfig, server: VllmServer
) -> None:
    # e.g. a plugin hook, run on the loop, holding the last reference: the finalizer cannot wait for itself there
    client = SyncClient(config, transport=server.transport())
    portal = client._portal
    holder = [client]
    del client
    portal.call("drop", holder.clear)
    portal.thread.join(DEADLINE_S)
    assert not portal.thread.is_alive() and portal.loop.is_closed()


def test_a_process_that_never_closes_its_client_exits_cleanly(tiny_models) -> None:
    script = textwrap.dedent(
        f"""
        from backends_core import ClientConfig, SyncClient

        config = ClientConfig(backend="vllm", base_url="http://127.0.0.1:9", tokenizer={str(tiny_models.dense)!r})
        client = SyncClient(config)
        assert client.render([{{"role": "user", "content": "hi"}}])
        print("done")
        """
    )
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", script], capture_output=True, text=True, timeout=DEADLINE_S
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "done\n", "")


def _public(cls: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(member)
        for name, member in vars(cls).items()
        if not name.startswith("_") and inspect.iscoroutinefunction(member)
    }


@pytest.mark.parametrize(
    ("sync", "async_", "plain"),
    [
        (SyncClient, Client, ["render", "parse_completion", "conversation", "stream", "__init__"]),
        (SyncAdmin, Admin, ["deadline"]),
        (SyncConversation, Conversation, []),
        (SyncFleet, Fleet, ["members"]),
    ],
)
def test_every_async_method_has_a_blocking_mirror_with_its_signature(
    sync: type, async_: type, plain: list[str]
) -> None:
    # a method added to Client, Admin or Conversation needs its mirror here (one line: name = _blocking(...))
    wanted = _public(async_)
    assert wanted, async_
    for name, signature in wanted.items():
        mirror = {"aclose": "close"}.get(name, name)
        assert mirror in vars(sync), f"{sync.__name__} has no mirror of {async_.__name__}.{name}"
        assert inspect.signature(vars(sync)[mirror]).parameters == signature.parameters, name
    for name in plain:
        mirrored = inspect.signature(vars(sync)[name]).parameters
        original = inspect.signature(vars(async_)[name]).parameters
        assert list(mirrored.items())[1:] == list(original.items())[1:], name


def test_a_stream_yields_deltas_synchronously_and_leaving_early_aborts_it(
    client: SyncClient, server: VllmServer
) -> None:
    sampling = SamplingParams(max_tokens=6, temperature=0.0)
    with client.stream(prompt_ids=[1, 2, 3], sampling=sampling) as stream:
        deltas = list(stream)
    whole = client.generate(prompt_ids=[1, 2, 3], sampling=sampling)
    assert sum((d.completion_ids for d in deltas), ()) == stream.result.completion_ids == whole.completion_ids
    with client.stream(prompt_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=1800, ignore_eos=True)) as stream:
        for _ in stream:
            break
    wait_until(lambda: client.admin.state()[0].in_flight == 0, "the engine dropping the stream left early")
