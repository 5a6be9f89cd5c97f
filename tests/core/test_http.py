"""The HTTP choke point: every failure leaves as a backends error with the server's words attached."""

from __future__ import annotations

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
    answers = iter([httpx.ConnectError("refused"), httpx.Response(503, json={}), httpx.Response(200, json=[1])])

    def handler(request: httpx.Request) -> httpx.Response:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert await make_server(handler).request("GET", "/x") == [1]


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
            httpx.ReadError("connection reset"),
            httpx.Response(200, json={"ok": 1}),
            httpx.ReadError("connection reset"),
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


async def test_per_request_headers_are_sent() -> None:
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        return httpx.Response(200, json={})

    await make_server(handler).request("POST", "/flush_cache", plane="admin", headers={"authorization": "Bearer adm"})
    assert seen == ["Bearer adm"]
