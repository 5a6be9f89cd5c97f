"""Requests of both planes send exactly what ``httpx.AsyncClient.request`` would send (client headers, then the
call's; cookies; the admin timeout or the client's; the client's hooks; the mounted transport) and read answers the
way it does."""

from __future__ import annotations

import gzip
from typing import Any

import httpx
import orjson
import pytest

from backends_core import NetworkError, RequestTimeout, RetryPolicy, Server, ServerStatusError


def make_server(admin_client: httpx.AsyncClient) -> Server:
    return Server(
        base_url="http://data",
        admin_url="http://admin:8000",
        data_client=httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(500))),
        admin_client=admin_client,
        retry=RetryPolicy(attempts=3, backoff=0),
        admin_timeout=7.0,
    )


def seen(request: httpx.Request) -> tuple[Any, ...]:
    return (
        request.method,
        str(request.url),
        request.headers.multi_items(),
        request.read(),
        request.extensions.get("timeout"),
    )


CALLS: list[dict[str, Any]] = [
    {"method": "GET", "path": "/health"},
    {"method": "POST", "path": "/pause", "params": {"mode": "wait", "clear_cache": "false"}},
    {"method": "POST", "path": "/update_weight_version", "json_body": {"new_version": "v1"}},
    {"method": "POST", "path": "/sleep", "params": {"level": 1}, "headers": {"authorization": "Bearer admin"}},
    {"method": "GET", "path": "/is_paused", "headers": {"x-extra": "1", "user-agent": "trainer"}},
]


@pytest.mark.parametrize("call", CALLS, ids=[c["path"] for c in CALLS])
async def test_the_admin_request_is_the_one_httpx_would_send(call: dict[str, Any]) -> None:
    requests: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        return httpx.Response(200, json={"ok": True})

    client = httpx.AsyncClient(
        transport=httpx.MockTransport(handler),
        headers={"authorization": "Bearer api", "x-client": "backends"},
        timeout=httpx.Timeout(99.0),
    )
    server = make_server(client)
    assert await server.request(**call, plane="admin") == {"ok": True}
    headers = dict(call.get("headers", {}))
    content = None
    if "json_body" in call:
        content = orjson.dumps(call["json_body"])
        headers["content-type"] = "application/json"
    await client.request(
        call["method"],
        "http://admin:8000" + call["path"],
        params=call.get("params"),
        headers=headers,
        content=content,
        timeout=httpx.Timeout(7.0),
    )
    assert seen(requests[0]) == seen(requests[1])
    assert requests[0].extensions["timeout"]["read"] == 7.0


def make_data_server(data_client: httpx.AsyncClient) -> Server:
    return Server(
        base_url="http://data:8000",
        admin_url="http://admin",
        data_client=data_client,
        admin_client=httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(500))),
        retry=RetryPolicy(attempts=1, backoff=0),
    )


@pytest.mark.parametrize("call", CALLS, ids=[c["path"] for c in CALLS])
async def test_the_data_request_is_the_one_httpx_would_send(call: dict[str, Any]) -> None:
    requests: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        return httpx.Response(200, json={"ok": True})

    client = httpx.AsyncClient(
        transport=httpx.MockTransport(handler),
        headers={"authorization": "Bearer api"},
        timeout=httpx.Timeout(5.0, connect=2.0, pool=9.0),
    )
    assert await make_data_server(client).request(**call) == {"ok": True}
    headers = dict(call.get("headers", {}))
    content = None
    if "json_body" in call:
        content = orjson.dumps(call["json_body"])
        headers["content-type"] = "application/json"
    await client.request(
        call["method"], "http://data:8000" + call["path"], params=call.get("params"), headers=headers, content=content
    )
    assert seen(requests[0]) == seen(requests[1])
    assert requests[0].extensions["timeout"] == {"connect": 2.0, "read": 5.0, "write": 5.0, "pool": 9.0}


async def test_query_values_that_compare_equal_stay_distinct() -> None:
    """``True == 1 == 1.0``, but httpx writes them as ``true``, ``1`` and ``1.0``; the same route and name in turn."""
    queries: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        queries.append(request.url.query.decode())
        return httpx.Response(200, json={})

    server = make_server(httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    for value in (True, 1, 1.0, "1", None, ["a", "b"], True):
        await server.request("POST", "/sleep", params={"level": value}, plane="admin", expect="none")
    assert queries == ["level=true", "level=1", "level=1.0", "level=1", "level=", "level=a&level=b", "level=true"]


async def test_the_data_client_hooks_see_every_request_and_answer() -> None:
    seen_requests: list[str | None] = []
    seen_answers: list[int] = []

    async def on_request(request: httpx.Request) -> None:
        request.headers["x-session"] = "s1"

    async def on_answer(response: httpx.Response) -> None:
        seen_answers.append(response.status_code)

    def handler(request: httpx.Request) -> httpx.Response:
        seen_requests.append(request.headers.get("x-session"))
        return httpx.Response(201, json={})

    client = httpx.AsyncClient(
        transport=httpx.MockTransport(handler), event_hooks={"request": [on_request], "response": [on_answer]}
    )
    await make_data_server(client).request("POST", "/generate", json_body={})
    assert seen_requests == ["s1"]
    assert seen_answers == [201]


@pytest.mark.parametrize("plane", ["data", "admin"])
async def test_a_closed_client_sends_nothing(plane: str) -> None:
    sent: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(200, json={})

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    server = make_data_server(client) if plane == "data" else make_server(client)
    await client.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await server.request("GET", "/health", plane=plane)  # type: ignore[arg-type]
    assert sent == []


async def test_cookies_the_data_server_sets_are_kept_and_sent_back() -> None:
    cookies: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        cookies.append(request.headers.get("cookie"))
        return httpx.Response(200, json={}, headers={"set-cookie": "route=d1; Path=/"})

    server = make_data_server(httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    await server.request("GET", "/v1/models", expect="none")
    await server.request("GET", "/v1/models", expect="none")
    assert cookies == [None, "route=d1"]


async def test_cookies_the_admin_server_sets_are_kept_and_sent_back() -> None:
    cookies: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        cookies.append(request.headers.get("cookie"))
        return httpx.Response(200, json={}, headers={"set-cookie": "route=a1; Path=/"})

    server = make_server(httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    await server.request("GET", "/health", plane="admin", expect="none")
    await server.request("GET", "/health", plane="admin", expect="none")
    assert cookies == [None, "route=a1"]


async def test_the_mounted_transport_for_the_url_is_used() -> None:
    mounted = httpx.MockTransport(lambda r: httpx.Response(200, json="mounted"))
    default = httpx.MockTransport(lambda r: httpx.Response(200, json="default"))
    client = httpx.AsyncClient(transport=default, mounts={"http://admin:8000": mounted})
    assert await make_server(client).request("GET", "/x", plane="admin") == "mounted"


async def test_encoded_bodies_are_decoded_and_every_answer_is_closed() -> None:
    closed: list[bool] = []

    class Body(httpx.AsyncByteStream):
        async def __aiter__(self):  # type: ignore[no-untyped-def]
            yield gzip.compress(b'{"weight_version": "v7"}')

        async def aclose(self) -> None:
            closed.append(True)

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-encoding": "gzip"}, stream=Body())

    server = make_server(httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    assert await server.request("GET", "/weight_info", plane="admin") == {"weight_version": "v7"}
    assert closed == [True]


async def test_a_client_with_event_hooks_or_auth_keeps_httpx_own_path() -> None:
    hooked: list[str] = []

    async def hook(request: httpx.Request) -> None:
        hooked.append(request.url.path)

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"auth": request.headers.get("authorization")})

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler), event_hooks={"request": [hook]})
    await make_server(client).request("GET", "/health", plane="admin")
    assert hooked == ["/health"]
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler), auth=("u", "p"))
    assert (await make_server(client).request("GET", "/health", plane="admin"))["auth"].startswith("Basic ")


@pytest.mark.parametrize(
    ("exc", "mapped"),
    [
        (httpx.ReadTimeout("slow"), RequestTimeout),
        (httpx.PoolTimeout("busy"), RequestTimeout),
        (httpx.RemoteProtocolError("reset"), NetworkError),
        (httpx.ReadError("eof"), NetworkError),
        (httpx.ConnectError("refused"), NetworkError),
    ],
)
async def test_admin_transport_errors_map_as_on_the_data_plane(exc: Exception, mapped: type) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc

    server = make_server(httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    with pytest.raises(mapped) as info:
        await server.request("POST", "/pause", plane="admin", retry=False)
    assert info.value.__cause__ is exc
    assert exc.request.url == "http://admin:8000/pause"  # type: ignore[attr-defined]  # as httpx attaches it


async def test_admin_redirects_are_not_followed() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(307, headers={"location": "http://elsewhere/pause"}, json={})

    server = make_server(httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    with pytest.raises(ServerStatusError) as info:
        await server.request("POST", "/pause", plane="admin", retry=False)
    assert info.value.status_code == 307


def test_the_ca_bundle_is_loaded_once_for_all_pools(monkeypatch: pytest.MonkeyPatch) -> None:
    """64 servers used to build 65 verifying SSL contexts (one per admin pool, ~50 ms each: seconds at start-up)."""
    import ssl

    from backends_core import Client, ClientConfig

    built: list[object] = []
    create = ssl.create_default_context

    def counting(*args: Any, **kwargs: Any) -> ssl.SSLContext:
        built.append(kwargs.get("cafile"))
        return create(*args, **kwargs)

    monkeypatch.setattr(ssl, "create_default_context", counting)
    urls = [f"http://127.0.0.1:{9000 + i}" for i in range(8)]
    client = Client(ClientConfig(backend="reference", base_url=urls))
    assert len(built) == 1
    contexts = {id(c._transport._tls) for c in [client._data, *client._admin_clients]}  # type: ignore[attr-defined]
    assert len(contexts) == 1
