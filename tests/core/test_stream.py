"""Streaming to the caller: ``Client.stream`` hands each delta on as the server sends it, ``s.result`` is what
generate returns, leaving early closes the connection (the engine aborts), failures before the first delta are
generate's and fail over like it, failures after it never do; the transport and the test kit's servers stream."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import httpx
import numpy as np
import pytest

from backends_core import (
    Client,
    ClientConfig,
    GenerateResult,
    InvalidRequestError,
    NetworkError,
    ResponseParseError,
    RetryPolicy,
    SamplingParams,
    Server,
    ServerStatusError,
    StreamDelta,
    hookimpl,
)
from backends_core._http import AiohttpTransport
from backends_testkit.asgi import asgi_app
from backends_testkit.emulator import StreamedBody, sse_reply
from backends_testkit.engine import ReferenceEngine
from backends_testkit.http_server import serve
from backends_testkit.reference.emulator import ReferenceEmulator
from backends_testkit.tinymodel import TinyModels

PROMPT = [1, 2, 3, 4, 5]


@pytest.fixture
async def engine(tiny_models: TinyModels) -> AsyncIterator[ReferenceEngine]:
    engine = ReferenceEngine(tiny_models.dense, seed=0)
    try:
        yield engine
    finally:
        await engine.aclose()


def config(engine: ReferenceEngine, *urls: str, **fields: Any) -> ClientConfig:
    return ClientConfig(
        backend="reference",
        base_url=list(urls) or "http://emulator.test",
        model=engine.model_name,
        tokenizer=str(engine.model_dir),
        retry=RetryPolicy(attempts=1),
        **fields,
    )


def in_flight(engine: ReferenceEngine) -> int:
    state = engine.state()
    return state.in_flight + state.queued


async def _until(condition: Callable[[], bool], within: float = 30.0) -> None:
    """Return once ``condition()`` holds; fail after ``within`` seconds (a hang guard)."""
    async with asyncio.timeout(within):
        while True:
            if condition():
                return
            await asyncio.sleep(0.001)


async def _collect(server: Server, into: list[bytes]) -> None:
    async with server.stream("POST", "/gen", json_body={}) as stream:
        async for data in stream.events():
            into.append(data)


async def _deltas(client: Client, into: list[tuple[int, ...]]) -> None:
    async with client.stream(prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=16)) as stream:
        async for delta in stream:
            into.append(delta.completion_ids)


# -- the transport and the test kit's server -----------------------------------------------------------------


async def test_the_transport_hands_each_chunk_on_before_the_body_ends() -> None:
    """The server sends its second piece only once the client holds the first: a transport that read the body
    whole would wait forever."""
    first_seen = asyncio.Event()
    closed = asyncio.Event()

    async def pieces() -> AsyncGenerator[bytes, None]:
        try:
            yield b"one"
            await first_seen.wait()
            yield b"two"
        finally:
            closed.set()

    async def handler(request: httpx.Request) -> httpx.Response:
        body = pieces()
        return httpx.Response(200, stream=StreamedBody(body))

    async with serve(handler) as url:
        transport = AiohttpTransport()
        async with httpx.AsyncClient(transport=transport) as client:
            request = client.build_request("GET", url + "/x")
            request.extensions["backends_core.streamed"] = True
            response = await client.send(request, stream=True)
            got = []
            async for piece in response.aiter_raw():
                got.append(piece)
                first_seen.set()
            await response.aclose()
        await transport.aclose()
    assert b"".join(got) == b"onetwo" and len(got) == 2
    assert closed.is_set()


async def test_closing_a_stream_early_closes_its_connection_and_the_server_stops_producing() -> None:
    produced: list[int] = []
    stopped = asyncio.Event()
    more = asyncio.Event()

    async def pieces() -> AsyncGenerator[bytes, None]:
        try:
            for i in range(1000):
                produced.append(i)
                yield b"data: %d\n\n" % i
                if i == 0:
                    await more.wait()
        finally:
            stopped.set()

    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=StreamedBody(pieces()))

    async with serve(handler) as url, httpx.AsyncClient(transport=AiohttpTransport()) as client:
        server = Server(base_url=url, admin_url=url, data_client=client, admin_client=client)
        async with server.stream("POST", "/gen", json_body={}) as stream:
            async for data in stream.events():
                assert data == b"0"
                break
        more.set()
        await asyncio.wait_for(stopped.wait(), 30)
    assert len(produced) < 1000


async def test_a_connection_cut_mid_stream_is_a_network_error() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + b"b\r\ndata: 1\n\n\r\n")
        await writer.drain()
        writer.close()

    listener = await asyncio.start_server(cut, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}"
    try:
        async with httpx.AsyncClient(transport=AiohttpTransport()) as client:
            server = Server(base_url=url, admin_url=url, data_client=client, admin_client=client)
            got: list[bytes] = []
            with pytest.raises(NetworkError) as info:
                await _collect(server, got)
    finally:
        listener.close()
        await listener.wait_closed()
    assert got == [b"1"] and info.value.maybe_processed


async def test_a_non_2xx_answer_raises_before_the_stream_is_handed_out() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": "bad prompt"})

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    server = Server(base_url="http://s", admin_url="http://s", data_client=client, admin_client=client)
    got: list[bytes] = []
    with pytest.raises(ServerStatusError) as info:
        await _collect(server, got)
    assert not got and info.value.status_code == 400 and info.value.body == {"error": "bad prompt"}


async def test_events_are_read_whatever_the_pieces_and_a_body_that_is_no_event_stream_is_a_parse_error() -> None:
    pieces = [b'data: {"a"', b": 1}\r\n", b"\r\n: comment\n", b"event: x\ndata: [1,\ndata: 2]\n\n", b"data: [DONE]\n\n"]

    async def body() -> AsyncGenerator[bytes, None]:
        for piece in pieces:
            yield piece

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=StreamedBody(body()))

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    server = Server(base_url="http://s", admin_url="http://s", data_client=client, admin_client=client)
    async with server.stream("POST", "/gen", json_body={}) as stream:
        assert [event async for event in stream.json_events()] == [{"a": 1}, [1, 2]]

    def html(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"<html>surprise</html>")

    client = httpx.AsyncClient(transport=httpx.MockTransport(html))
    server = Server(base_url="http://s", admin_url="http://s", data_client=client, admin_client=client)
    with pytest.raises(ResponseParseError, match="not an event stream"):
        await _collect(server, [])


async def test_an_asgi_served_emulator_streams_its_events() -> None:
    async def events() -> AsyncGenerator[Any, None]:
        for i in range(3):
            yield {"i": i}

    async def handler(request: httpx.Request) -> httpx.Response:
        return sse_reply(events())

    app = asgi_app(handler)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://asgi") as client:
        response = await client.post("/gen")
    assert response.text == 'data: {"i": 0}\n\ndata: {"i": 1}\n\ndata: {"i": 2}\n\ndata: [DONE]\n\n'
    assert "content-length" not in response.headers


# -- Client.stream ------------------------------------------------------------------------------------------------


async def test_a_stream_on_a_real_port_delivers_deltas_making_up_generates_result(engine: ReferenceEngine) -> None:
    sampling = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    async with ReferenceEmulator(engine).serve() as url, Client(config(engine, url)) as client:
        whole = await client.generate(prompt_ids=PROMPT, sampling=sampling)
        async with client.stream(prompt_ids=PROMPT, sampling=sampling) as stream:
            deltas = [delta async for delta in stream]
    assert all(isinstance(d, StreamDelta) for d in deltas) and len(deltas) > 1
    assert sum((d.completion_ids for d in deltas), ()) == whole.completion_ids == stream.result.completion_ids
    np.testing.assert_allclose(stream.result.logprobs, whole.logprobs, atol=1e-6)
    assert stream.server == url


@pytest.mark.parametrize("leave", ["break", "exception", "cancel"])
async def test_leaving_the_block_early_aborts_the_engine_request(engine: ReferenceEngine, leave: str) -> None:
    long = SamplingParams(max_tokens=1500, ignore_eos=True)
    emulator = ReferenceEmulator(engine)
    async with emulator.serve() as url, Client(config(engine, url)) as client:

        async def consume() -> None:
            async with client.stream(prompt_ids=PROMPT, sampling=long) as stream:
                async for _ in stream:
                    if leave == "break":
                        break
                    if leave == "exception":
                        raise LookupError("the caller's own error")
                    await asyncio.Event().wait()  # cancelled here

        if leave == "cancel":
            task = asyncio.ensure_future(consume())
            await _until(lambda: in_flight(engine) > 0 or task.done())
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        elif leave == "exception":
            with pytest.raises(LookupError):
                await consume()
        else:
            await consume()
        await _until(lambda: in_flight(engine) == 0)
        assert client.balancer.load[0].in_flight == 0
        stream = client.stream(prompt_ids=PROMPT, sampling=long)
        with pytest.raises(InvalidRequestError, match="no result"):
            stream.result  # noqa: B018


async def test_bad_input_is_refused_before_anything_is_sent(engine: ReferenceEngine) -> None:
    sent: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(500)

    async with Client(config(engine), transport=httpx.MockTransport(handler)) as client:
        with pytest.raises(InvalidRequestError, match="n = 2"):
            client.stream(prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=16, n=2))
        with pytest.raises(InvalidRequestError, match="exactly one"):
            client.stream(
                prompt_ids=PROMPT, messages=[{"role": "user", "content": "hi"}], sampling=SamplingParams(max_tokens=16)
            )
    assert sent == []


async def test_a_stream_that_never_reached_a_server_fails_over_and_keeps_its_session_header(
    engine: ReferenceEngine,
) -> None:
    emulator = ReferenceEmulator(engine)
    hosts: list[tuple[str, str | None]] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        hosts.append((request.url.host, request.headers.get("x-session-id")))
        if request.url.host == "down":
            raise httpx.ConnectError("connection refused", request=request)
        return await emulator.handle(request)

    cfg = config(engine, "http://down", "http://up")
    async with Client(cfg, transport=httpx.MockTransport(handler)) as client:
        client.balancer.load[1].in_flight += 1  # the balancer picks "down" first
        stream = client.stream(prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=3), session="traj-1")
        async with stream:
            ids = [t async for delta in stream for t in delta.completion_ids]
        client.balancer.load[1].in_flight -= 1
    assert hosts == [("down", "traj-1"), ("up", "traj-1")]
    assert tuple(ids) == stream.result.completion_ids and stream.server == "http://up"


async def test_a_stream_that_delivered_a_delta_is_never_sent_again(engine: ReferenceEngine) -> None:
    hosts: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        hosts.append(request.url.host)

        async def events() -> AsyncGenerator[Any, None]:
            yield {"output_ids": [7], "output_logprobs": [-0.5]}
            raise httpx.ReadError("connection reset", request=request)

        return sse_reply(events(), done=False)

    async with Client(config(engine, "http://a", "http://b"), transport=httpx.MockTransport(handler)) as client:
        got: list[tuple[int, ...]] = []
        with pytest.raises(NetworkError) as info:
            await _deltas(client, got)
        assert [load.in_flight for load in client.balancer.load] == [0, 0]
    assert got == [(7,)] and len(hosts) == 1 and info.value.maybe_processed


# -- the driver's checks ------------------------------------------------------------------------------------------


class _Scripted:
    """A backend whose stream yields what a test scripts."""

    def __init__(self, events: list[Any]) -> None:
        self.events = events

    @hookimpl
    async def post_generate(self, server: Server) -> Any:
        raise AssertionError("not used")

    @hookimpl
    def parse_response(self, raw: Any) -> Any:
        raise AssertionError("not used")

    @hookimpl
    async def post_generate_stream(self) -> AsyncIterator[Any]:
        for event in self.events:
            yield event


def _delta(ids: tuple[int, ...], logprobs: list[float]) -> StreamDelta:
    return StreamDelta(completion_ids=ids, logprobs=np.asarray(logprobs, dtype=np.float32))


def _result(ids: tuple[int, ...], logprobs: list[float]) -> GenerateResult:
    return GenerateResult(
        prompt_ids=tuple(PROMPT),
        completion_ids=ids,
        logprobs=np.asarray(logprobs, dtype=np.float32),
        finish_reason="length",
    )


@pytest.mark.parametrize(
    ("events", "message"),
    [
        ([_delta((1,), [float("nan")]), _result((1,), [0.0])], "not finite"),
        ([_delta((1, 2), [-0.1]), _result((1, 2), [-0.1, -0.2])], "1 logprobs for 2 completion ids"),
        ([_delta((1,), [-0.1]), _result((1, 2), [-0.1, -0.2])], "not the 1 the deltas carried"),
        ([_delta((1,), [-0.1]), _result((1,), [-0.3])], "logprobs are not the ones"),
        ([_delta((1,), [-0.1])], "without its final result"),
        ([_result((), []), _delta((1,), [-0.1])], "went on after its final result"),
        (["chunk"], "streamed a str"),
    ],
)
async def test_the_driver_refuses_a_stream_breaking_the_invariants(events: list[Any], message: str) -> None:
    cfg = ClientConfig(backend="scripted", base_url="http://s", retry=RetryPolicy(attempts=1))
    async with Client(cfg, plugin=_Scripted(events), transport=httpx.MockTransport(lambda r: httpx.Response(500))) as c:
        with pytest.raises(ResponseParseError, match=message):
            await _deltas(c, [])
