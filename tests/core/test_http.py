"""The HTTP choke point: every failure leaves as a backends error with the server's words attached; the one retry
layer (waits with ``Retry-After`` and jitter, what the fleet declares safe to repeat, and the "not now" answers a
backend declares for one request)."""

from __future__ import annotations

import asyncio
import email.utils
import time
from collections.abc import Callable

import httpx
import pytest

from backends_core import (
    AdminError,
    AdminPolicy,
    Client,
    ClientConfig,
    ConfigError,
    LoraAdapter,
    NetworkError,
    Refusal,
    RequestTimeout,
    ResponseParseError,
    RetryPolicy,
    Server,
    ServerStatusError,
    idempotent_requests,
)
from backends_core import server as server_module


def make_server(handler, *, retry: RetryPolicy | None = None, admin: AdminPolicy | None = None) -> Server:
    transport = httpx.MockTransport(handler)
    retry = retry or RetryPolicy(attempts=3, backoff=0)
    return Server(
        base_url="http://data",
        admin_url="http://admin",
        data_client=httpx.AsyncClient(transport=transport),
        admin_client=httpx.AsyncClient(transport=transport),
        retry=retry,
        admin_retry=None if admin is None else admin.retry_policy(retry),
        admin_timeout=7.0,
    )


async def test_json_body_goes_to_the_right_plane() -> None:
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((str(request.url), request.content, request.extensions["timeout"]["read"]))
        return httpx.Response(200, json={"ok": True})

    server = make_server(handler)
    assert await server.request("POST", "/generate", json_body={"a": [1, 2]}) == {"ok": True}
    assert await server.request("POST", "pause", params={"mode": "wait"}, plane="admin") == {"ok": True}
    assert seen[0][:2] == ("http://data/generate", b'{"a":[1,2]}')
    assert seen[1][0] == "http://admin/pause?mode=wait"
    assert seen[1][2] == 7.0


async def test_non_2xx_carries_status_body_and_hint() -> None:
    server = make_server(lambda r: httpx.Response(403, json={"detail": "scale-out disabled"}))
    with pytest.raises(ServerStatusError) as info:
        await server.request("POST", "/inference/v1/generate", status_hint=lambda s, b: "start with --enable-scale-out")
    err = info.value
    assert err.status_code == 403
    assert err.body == {"detail": "scale-out disabled"}
    assert err.url == "http://data/inference/v1/generate"
    assert "--enable-scale-out" in str(err) and "scale-out disabled" in str(err)


async def test_text_error_body_is_kept_as_text() -> None:
    server = make_server(lambda r: httpx.Response(500, text="Internal Server Error"))
    with pytest.raises(ServerStatusError) as info:
        await server.request("GET", "/x")
    assert info.value.body == "Internal Server Error"


async def test_non_json_success_is_a_parse_error() -> None:
    server = make_server(lambda r: httpx.Response(200, text="<html>"))
    with pytest.raises(ResponseParseError, match="not JSON"):
        await server.request("GET", "/x")


@pytest.mark.parametrize(
    ("exc", "mapped"),
    [
        (httpx.ReadTimeout("slow"), RequestTimeout),
        (httpx.PoolTimeout("busy"), RequestTimeout),
        (httpx.RemoteProtocolError("reset"), NetworkError),
        (httpx.ReadError("eof"), NetworkError),
    ],
)
async def test_transport_errors_map_to_the_most_specific_class_without_retry(exc: Exception, mapped: type) -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        raise exc

    with pytest.raises(mapped) as info:
        await make_server(handler).request("POST", "/generate")
    assert info.value.__cause__ is exc
    assert len(calls) == 1  # the server may have acted on it: never replayed


async def test_connect_errors_and_retry_statuses_are_retried_within_the_bound() -> None:
    answers = iter([httpx.ConnectError("refused"), httpx.Response(502, json={}), httpx.Response(200, json=[1])])

    def handler(request: httpx.Request) -> httpx.Response:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert await make_server(handler).request("GET", "/x") == [1]


def counting(status: int) -> tuple[list[str], Callable[[httpx.Request], httpx.Response]]:
    """A handler answering ``status`` to every request, and the list of requests it saw."""
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        return httpx.Response(status, json={"detail": "from the gateway"})

    return seen, handler


@pytest.mark.parametrize("status", [502, 504, 500])
async def test_a_generation_answered_by_a_gateway_error_is_sent_once(status: int) -> None:
    """A 502/504 may come after the engine ran the request: re-sending it would sample twice."""
    seen, handler = counting(status)
    with pytest.raises(ServerStatusError) as info:
        await make_server(handler).request("POST", "/generate", json_body={})
    assert info.value.status_code == status
    assert seen == ["/generate"]


@pytest.mark.parametrize("status", [503, 429])
async def test_a_generation_the_server_refused_is_retried(status: int) -> None:
    seen, handler = counting(status)
    with pytest.raises(ServerStatusError):
        await make_server(handler).request("POST", "/generate", json_body={})
    assert seen == ["/generate"] * 3


@pytest.mark.parametrize("status", [502, 504])
async def test_requests_safe_to_repeat_are_retried_on_gateway_errors(status: int) -> None:
    seen, handler = counting(status)
    with pytest.raises(ServerStatusError):
        await make_server(handler).request("POST", "/score", json_body={}, idempotent=True)
    with pytest.raises(ServerStatusError):
        await make_server(handler).request("GET", "/v1/models")
    assert seen == ["/score"] * 3 + ["/v1/models"] * 3


async def test_resending_generation_on_gateway_errors_is_an_opt_in() -> None:
    seen, handler = counting(504)
    with pytest.raises(ServerStatusError):
        await make_server(handler, retry=RetryPolicy(backoff=0, resend_generation=True)).request("POST", "/generate")
    assert seen == ["/generate"] * 3


async def test_retries_stop_at_the_attempt_limit() -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        raise httpx.ConnectError("refused")

    with pytest.raises(NetworkError):
        await make_server(handler, retry=RetryPolicy(attempts=2, backoff=0)).request("GET", "/x")
    assert len(calls) == 2


async def test_retry_false_sends_once() -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return httpx.Response(503, json={"detail": "busy"})

    with pytest.raises(ServerStatusError):
        await make_server(handler).request("POST", "/pause", plane="admin", retry=False)
    assert len(calls) == 1


async def test_after_a_5xx_a_reset_connection_is_retried_once_on_a_fresh_one() -> None:
    """vLLM's admin routes answer 500 and then reset the keep-alive connection."""
    answers = iter(
        [
            httpx.Response(500, json={"error": "boom"}),
            httpx.RemoteProtocolError("Server disconnected without sending a response."),
            httpx.Response(200, json={"ok": 1}),
            httpx.RemoteProtocolError("Server disconnected without sending a response."),
        ]
    )

    def handler(request: httpx.Request) -> httpx.Response:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    server = make_server(handler)
    with pytest.raises(ServerStatusError):
        await server.request("POST", "/collective_rpc", plane="admin", retry=False)
    assert await server.request("POST", "/resume", plane="admin", retry=False) == {"ok": 1}
    with pytest.raises(NetworkError):  # without a preceding 5xx a reset is a real failure
        await server.request("POST", "/resume", plane="admin", retry=False)


@pytest.mark.parametrize(
    "failure",
    [
        httpx.ReadError("connection reset"),  # the transport cannot say whether the answer had started
        httpx.RemoteProtocolError("peer closed connection without sending complete message body"),
    ],
)
async def test_after_a_5xx_a_request_whose_answer_had_started_is_never_resent(failure: Exception) -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        if len(seen) == 1:
            return httpx.Response(500, json={"error": "boom"})
        raise failure

    server = make_server(handler)
    with pytest.raises(ServerStatusError):
        await server.request("POST", "/generate", json_body={})
    with pytest.raises(NetworkError) as info:
        await server.request("POST", "/generate", json_body={})
    assert info.value.maybe_processed
    assert seen == ["/generate", "/generate"]


async def test_per_request_headers_are_sent() -> None:
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        return httpx.Response(200, json={})

    await make_server(handler).request("POST", "/flush_cache", plane="admin", headers={"authorization": "Bearer adm"})
    assert seen == ["Bearer adm"]


# -- the one retry layer: waits, declared idempotent admin requests, declared refusals ------------------------


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The seconds every retry of ``Server.request`` waited (recorded, not slept)."""
    recorded: list[float] = []

    async def sleep(seconds: float) -> None:
        recorded.append(seconds)

    monkeypatch.setattr(server_module.asyncio, "sleep", sleep)
    return recorded


def answers(*responses: httpx.Response) -> tuple[list[str], Callable[[httpx.Request], httpx.Response]]:
    sent: list[str] = []
    queue = list(responses)

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request.url.path)
        return queue.pop(0) if len(queue) > 1 else queue[0]

    return sent, handler


@pytest.mark.parametrize(
    ("header", "expected"),
    [("3", 3.0), ("0", 0.0), ("600", 5.0)],  # the policy's max_backoff bounds what the server asks
    ids=["seconds", "zero", "bounded"],
)
async def test_retry_after_seconds_are_honoured_within_the_max_backoff(
    waits: list[float], header: str, expected: float
) -> None:
    sent, handler = answers(httpx.Response(503, headers={"retry-after": header}), httpx.Response(200, json={}))
    policy = RetryPolicy(attempts=3, backoff=0.01, max_backoff=5.0)
    assert await make_server(handler, retry=policy).request("POST", "/generate") == {}
    assert sent == ["/generate"] * 2
    assert waits == [expected]


async def test_retry_after_as_an_http_date(waits: list[float]) -> None:
    when = email.utils.formatdate(time.time() + 30, usegmt=True)
    _, handler = answers(httpx.Response(429, headers={"retry-after": when}), httpx.Response(200, json={}))
    await make_server(handler, retry=RetryPolicy(backoff=0.01, max_backoff=60.0)).request("GET", "/x")
    assert len(waits) == 1 and 25 <= waits[0] <= 30


async def test_unusable_retry_after_falls_back_to_the_backoff(waits: list[float]) -> None:
    _, handler = answers(httpx.Response(503, headers={"retry-after": "soon"}), httpx.Response(200, json={}))
    await make_server(handler, retry=RetryPolicy(backoff=2.0, jitter=0)).request("GET", "/x")
    assert waits == [2.0]


def test_jitter_shortens_the_backoff_by_at_most_its_fraction() -> None:
    policy = RetryPolicy(backoff=1.0, max_backoff=3.0, jitter=0.25)
    for attempt, base in [(1, 1.0), (2, 2.0), (3, 3.0), (6, 3.0)]:
        delays = [policy.delay(attempt) for _ in range(500)]
        assert all(0.75 * base <= d <= base for d in delays)
        assert max(delays) - min(delays) > 0.1 * base  # it does vary
    assert {RetryPolicy(backoff=1.0, jitter=0).delay(2) for _ in range(20)} == {2.0}
    for bad in (-0.1, 1.5, True):
        with pytest.raises(ConfigError, match="jitter"):
            RetryPolicy(jitter=bad)  # type: ignore[arg-type]


async def test_declared_idempotent_admin_requests_are_retried_after_a_5xx_or_a_lost_answer(
    waits: list[float],
) -> None:
    failures: list[httpx.Response | Exception] = [httpx.Response(500), httpx.ReadError("reset")]
    sent: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request.url.path)
        if failures:
            failure = failures.pop(0)
            if isinstance(failure, Exception):
                raise failure
            return failure
        return httpx.Response(200, json={})

    server = make_server(handler, retry=RetryPolicy(backoff=0), admin=AdminPolicy(retries=2, backoff=0))
    with idempotent_requests():
        assert await server.request("POST", "/pause", plane="admin", retry=False) == {}
    assert sent == ["/pause"] * 3
    failures.append(httpx.Response(500))
    with idempotent_requests(False), pytest.raises(ServerStatusError):
        await server.request("POST", "/pause", plane="admin", retry=False)
    assert sent == ["/pause"] * 4


async def test_a_refusal_is_sent_again_until_accepted_whatever_the_policy() -> None:
    sent, handler = answers(httpx.Response(400), httpx.Response(400), httpx.Response(200, text="ok"))
    server = make_server(handler, retry=RetryPolicy(attempts=1))
    refusal = Refusal(400, within=5.0, interval=0.001)
    assert await server.request("POST", "/flush", plane="admin", retry=False, expect="text", refusal=refusal) == "ok"
    assert sent == ["/flush"] * 3


async def test_a_refusal_past_its_time_or_another_status_is_raised() -> None:
    sent, handler = answers(httpx.Response(400, text="not now"))
    server = make_server(handler, retry=RetryPolicy(attempts=1))
    started = asyncio.get_running_loop().time()
    with pytest.raises(ServerStatusError) as info:
        await server.request("POST", "/flush", retry=False, refusal=Refusal(400, within=0.05, interval=0.01))
    assert info.value.status_code == 400 and 2 <= len(sent) <= 10
    assert asyncio.get_running_loop().time() - started < 2
    sent, handler = answers(httpx.Response(409))
    with pytest.raises(ServerStatusError):
        await make_server(handler, retry=RetryPolicy(attempts=1)).request(
            "POST", "/flush", refusal=Refusal(400, within=5.0, interval=0.001)
        )
    assert sent == ["/flush"]


@pytest.mark.parametrize("failure", ["500", "502", "reset"])
@pytest.mark.parametrize(
    ("operation", "route"),
    [("destroy_weight_transfer", "/shutdown_weight_transfer_engine"), ("load_lora", "/v1/load_lora_adapter")],
)
async def test_a_non_idempotent_admin_call_is_sent_once(operation: str, route: str, failure: str) -> None:
    sent: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request.url.path)
        if request.url.path == route:
            if failure == "reset":
                raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")
            return httpx.Response(int(failure), json={"error": "boom"})
        return httpx.Response(200, json={"data": [{"id": "m", "root": "m"}]})

    config = ClientConfig(
        backend="vllm", base_url="http://vllm", model="m", retry=RetryPolicy(backoff=0), admin=AdminPolicy(backoff=0)
    )
    async with Client(config, transport=httpx.MockTransport(handler)) as client:
        admin = client.admin
        call = (
            admin.load_lora(LoraAdapter(name="a", path="/adapters/a"))
            if operation == "load_lora"
            else admin.destroy_weight_transfer()
        )
        with pytest.raises(AdminError):
            await call
    assert sent.count(route) == 1


async def test_admin_policy_retries_are_the_layers_attempts() -> None:
    sent: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request.url.path)
        return httpx.Response(503, json={"error": "busy"})

    for retries in (0, 3):
        sent.clear()
        config = ClientConfig(
            backend="vllm",
            base_url="http://vllm",
            model="m",
            retry=RetryPolicy(attempts=5, backoff=0),
            admin=AdminPolicy(retries=retries, backoff=0),
        )
        async with Client(config, transport=httpx.MockTransport(handler)) as client:
            with pytest.raises(AdminError):
                await client.admin.resume()
        assert [path for path in sent if path == "/resume"] == ["/resume"] * (1 + retries)
