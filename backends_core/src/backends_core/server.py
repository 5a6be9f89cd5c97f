"""The one choke point between hooks and HTTP.

Backends never build an ``httpx`` client or map an ``httpx`` exception: they get a :class:`Server` and call
:meth:`Server.request`. Every failure leaves here as a :mod:`backends_core.errors` type with the cause
chained: timeouts as :class:`RequestTimeout`, connection trouble as :class:`NetworkError`, non-2xx as
:class:`ServerStatusError` carrying the server's own error body, a non-JSON 2xx body as
:class:`ResponseParseError`. Retries follow the client's :class:`RetryPolicy` and only cover failures where
the server certainly did not act (connect errors), said "not now" (the policy's refused statuses), or, for a
request that is safe to repeat (``idempotent``), answered one of the policy's retry statuses.

Bodies are encoded and decoded by :mod:`backends_core.jsonio`; ``large_strings`` lets a backend name keys whose
big string values (base64 routed experts) come back as ``memoryview`` objects of the raw body.

Some servers (uvicorn behind vLLM's admin routes) answer a 5xx and then reset that keep-alive connection, so the
*next* request on the pooled connection dies with a connection error although the server never saw it. After a
5xx the next request's connection-level failure is therefore retried once, immediately, on a fresh connection,
but only when no byte of an answer had arrived: once the answer started, the server certainly ran the request.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import attrs
import httpx

from backends_core.config import RetryPolicy
from backends_core.errors import NetworkError, RequestTimeout, ResponseParseError, ServerStatusError
from backends_core.jsonio import dumps, loads, loads_lifting

__all__ = ["Plane", "Server", "StatusHint"]

#: Where a request goes: the data plane (generation, scoring) or the admin plane (separate pool and timeout).
Plane = Literal["data", "admin"]
#: Builds a hint for a non-2xx status (e.g. "start the server with --enable-scale-out"), or returns None.
StatusHint = Callable[[int, Any], str | None]


@attrs.define(eq=False)
class Server:
    """One inference server as a backend hook sees it.

    :ivar base_url: data-plane root URL, no trailing slash.
    :ivar admin_url: admin-plane root URL (equals ``base_url`` unless configured).
    """

    base_url: str
    admin_url: str
    _data: httpx.AsyncClient = attrs.field(alias="data_client", repr=False)
    _admin: httpx.AsyncClient = attrs.field(alias="admin_client", repr=False)
    _retry: RetryPolicy = attrs.field(alias="retry", repr=False, factory=RetryPolicy)
    _admin_timeout: float | None = attrs.field(alias="admin_timeout", default=None, repr=False)
    #: Part of a fleet: data-plane connect failures are not retried here, the client fails over instead.
    failover: bool = attrs.field(default=False, repr=False)
    #: Per-server memo for backends (e.g. ``max_model_len`` read once from ``/v1/models``).
    cache: dict[str, Any] = attrs.field(factory=dict, repr=False)
    #: Secret values (API and admin keys) redacted from every error this server's answers produce.
    secrets: set[str] = attrs.field(factory=set, repr=False)
    #: Headers of admin calls to the configured servers (``headers``, the API key, the admin headers).
    home_headers: Mapping[str, str] = attrs.field(factory=dict, repr=False)
    #: Headers of admin calls to other hosts a backend reaches (Dynamo workers): the admin credentials only.
    admin_headers: Mapping[str, str] = attrs.field(factory=dict, repr=False)
    #: Roots the configured credentials belong to (``base_url`` and the configured ``admin_url``).
    _home: frozenset[str] = attrs.field(alias="home", default=frozenset(), repr=False)
    #: Planes whose last answer was a 5xx: their pooled connection may have been reset by the server.
    _reset_suspected: set[str] = attrs.field(factory=set, init=False, repr=False)

    def url(self, path: str, *, plane: Plane = "data") -> str:
        root = self.admin_url if plane == "admin" else self.base_url
        return root + (path if path.startswith("/") else "/" + path)

    async def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: Mapping[str, Any] | None = None,
        plane: Plane = "data",
        expect: Literal["json", "text", "none"] = "json",
        retry: bool = True,
        idempotent: bool | None = None,
        status_hint: StatusHint | None = None,
        headers: Mapping[str, str] | None = None,
        large_strings: Sequence[str] = (),
    ) -> Any:
        """Send one request and return the decoded body.

        :param method: HTTP method.
        :param path: path below the plane's root URL.
        :param json_body: JSON-serialisable body, or ``None`` for no body.
        :param params: query parameters.
        :param plane: ``"data"`` or ``"admin"`` (separate connection pool and timeout).
        :param expect: ``"json"`` decodes JSON, ``"text"`` returns text, ``"none"`` ignores the body.
        :param retry: allow the client's retry policy (turn off for non-idempotent admin calls).
        :param idempotent: running the request twice is harmless (reads, scoring): retried on every status of
            ``RetryPolicy.retry_statuses``; otherwise (generation) only on ``refused_statuses``. Default: true
            for ``GET`` and ``HEAD``.
        :param status_hint: turns a failing status into advice appended to the error.
        :param headers: extra headers for this request (e.g. an admin key), on top of the client's.
        :param large_strings: object keys whose large string values come back as ``memoryview`` objects of the raw
            body instead of ``str`` (escape-free values only, e.g. base64; anything else parses as usual).
        :raises RequestTimeout: a timeout expired.
        :raises NetworkError: the connection failed.
        :raises ServerStatusError: the server answered non-2xx.
        :raises ResponseParseError: ``expect="json"`` and the body is not JSON.
        """
        url = self.url(path, plane=plane)
        client = self._admin if plane == "admin" else self._data
        attempts = self._retry.attempts if retry else 1
        statuses = self._retry.statuses(idempotent=method in ("GET", "HEAD") if idempotent is None else idempotent)
        extra: dict[str, Any] = {}
        if plane == "admin":
            extra["timeout"] = httpx.Timeout(self._admin_timeout)
        content = None if json_body is None else dumps(json_body)
        if plane == "admin":
            own = self.home_headers if self.admin_url in self._home or not self._home else self.admin_headers
            sent_headers = {**own, **headers} if headers else dict(own)
        else:
            sent_headers = dict(headers or {})
        for name, value in sent_headers.items():
            if name.lower() in ("authorization", "x-api-key", "api-key"):
                self.secrets.add(value.removeprefix("Bearer ").strip())
        if content is not None:
            sent_headers["content-type"] = "application/json"
        attempt = 0
        while True:
            attempt += 1
            try:
                if plane == "admin":
                    response = await _send_admin(client, method, url, content, params, sent_headers, extra["timeout"])
                else:
                    response = await client.request(
                        method, url, content=content, params=params, headers=sent_headers, **extra
                    )
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                if attempt < attempts and not (self.failover and plane == "data"):
                    await asyncio.sleep(self._retry.delay(attempt))
                    continue
                raise _map_transport(exc, method, url) from exc
            except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError) as exc:
                # the server reset the connection after its last 5xx, before answering this request
                if plane in self._reset_suspected and not answer_started(exc):
                    self._reset_suspected.discard(plane)
                    attempt -= 1
                    continue
                raise _map_transport(exc, method, url) from exc
            except httpx.TransportError as exc:
                raise _map_transport(exc, method, url) from exc
            if response.status_code >= 500:
                self._reset_suspected.add(plane)
            else:
                self._reset_suspected.discard(plane)
            if response.is_success:
                try:
                    return _decode(response, expect, url, large_strings)
                except ResponseParseError as exc:
                    exc.args = (_redact(str(exc), self.secrets),)
                    raise
            if response.status_code in statuses and attempt < attempts:
                await asyncio.sleep(self._retry.delay(attempt))
                continue
            body = _redact(_error_body(response), self.secrets)
            hint = status_hint(response.status_code, body) if status_hint else None
            raise ServerStatusError(method=method, url=url, status_code=response.status_code, body=body, hint=hint)


#: httpcore's words for a connection closed before any byte of the answer (its transport marks nothing else).
_NO_ANSWER = "Server disconnected without sending a response."


def answer_started(exc: httpx.TransportError) -> bool:
    """Whether any byte of the answer may have arrived before ``exc``: false only when that is certain (the
    request was not fully written, or the transport says the connection closed before any answer byte)."""
    if isinstance(exc, httpx.WriteError | httpx.WriteTimeout | httpx.ConnectError | httpx.ConnectTimeout):
        return False
    marked = getattr(exc, "answer_started", None)
    if marked is not None:
        return bool(marked)
    return not str(exc).startswith(_NO_ANSWER)


async def _send_admin(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    content: bytes | None,
    params: Mapping[str, Any] | None,
    headers: Mapping[str, str],
    limits: httpx.Timeout,
) -> httpx.Response:
    """``client.request(...)`` for an admin call, without the parts of ``httpx.AsyncClient.send`` an admin client
    never uses: the same request (client headers, then the call's; the client's cookies; the timeout) goes to the
    same transport (``mounts`` included), and the whole body is read. Cookies the server sets are kept as httpx
    keeps them. A client with auth, event hooks or redirects on takes httpx's own path.

    This cuts the client's CPU per admin call by ~40 % (a fleet of 64 servers costs 64 calls per phase on one
    event loop: ``bench/bench_fleet.py``): httpx's request building, cookie extraction for every answer and
    logging were most of the per-call cost once the transport is lean.
    """
    if client.auth is not None or client.follow_redirects or any(client.event_hooks.values()):
        return await client.request(method, url, content=content, params=params, headers=headers, timeout=limits)
    merged = httpx.Headers(client.headers)
    merged.update(headers)
    cookies = client.cookies
    request = httpx.Request(
        method,
        _parsed_url(url),
        params=params,
        headers=merged,
        cookies=cookies if cookies else None,
        content=content,
        extensions={"timeout": limits.as_dict()},
    )
    try:
        response = await client._transport_for_url(request.url).handle_async_request(request)
    except httpx.RequestError as exc:  # as httpx's own path: the error names its request
        try:
            exc.request  # noqa: B018
        except RuntimeError:
            exc.request = request
        raise
    response.request = request
    try:
        await response.aread()
    finally:
        await response.aclose()
    if "set-cookie" in response.headers:
        cookies.extract_cookies(response)
    return response


@functools.lru_cache(maxsize=4096)
def _parsed_url(url: str) -> httpx.URL:
    """``httpx.URL(url)``, parsed once per admin route (httpx's URL parser was half of building the request)."""
    return httpx.URL(url)


def _map_transport(exc: httpx.TransportError, method: str, url: str) -> RequestTimeout | NetworkError:
    # never connected, or the request body was not fully written: the server cannot have acted on it
    unsent = isinstance(
        exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout | httpx.WriteError | httpx.WriteTimeout
    )
    if isinstance(exc, httpx.TimeoutException):
        return RequestTimeout(
            f"{type(exc).__name__}: {exc or 'timed out'}", method=method, url=url, maybe_processed=not unsent
        )
    return NetworkError(
        f"{type(exc).__name__}: {exc or 'connection failed'}", method=method, url=url, maybe_processed=not unsent
    )


def _decode(response: httpx.Response, expect: str, url: str, large_strings: Sequence[str] = ()) -> Any:
    if expect == "none":
        return None
    if expect == "text":
        return response.text
    try:
        return loads_lifting(response.content, large_strings) if large_strings else loads(response.content)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        snippet = response.content[:200].decode("utf-8", "replace")
        raise ResponseParseError(
            f"body is not JSON ({exc.msg if hasattr(exc, 'msg') else exc}): {snippet!r}", url=url
        ) from exc


def _redact(value: Any, secrets: set[str]) -> Any:
    """``value`` with every secret replaced by ``<redacted>`` (servers sometimes echo request headers)."""
    if not secrets:
        return value
    if isinstance(value, str):
        for secret in secrets:
            if secret:
                value = value.replace(secret, "<redacted>")
        return value
    if isinstance(value, dict):
        return {_redact(k, secrets): _redact(v, secrets) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact(v, secrets) for v in value]
    return value


def _error_body(response: httpx.Response) -> Any:
    try:
        return loads(response.content)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return response.content.decode("utf-8", "replace")
