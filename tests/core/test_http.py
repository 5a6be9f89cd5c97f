"""The HTTP choke point: every failure leaves as a backends error with the server's words attached."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from backends_core import NetworkError, RequestTimeout, ResponseParseError, RetryPolicy, Server, ServerStatusError


def make_server(handler, *, retry: RetryPolicy | None = None) -> Server:
    transport = httpx.MockTransport(handler)
    return Server(
        base_url="http://data",
        admin_url="http://admin",
        data_client=httpx.AsyncClient(transport=transport),
        admin_client=httpx.AsyncClient(transport=transport),
        retry=retry or RetryPolicy(attempts=3, backoff=0),
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
