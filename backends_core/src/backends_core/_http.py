"""The one choke point between hooks and HTTP.

Backends never build an ``httpx`` client or map an ``httpx`` exception: they get a :class:`Server` and call
:meth:`Server.request`. Every failure leaves here as a :mod:`backends_core.errors` type with the cause
chained: timeouts as :class:`RequestTimeout`, connection trouble as :class:`NetworkError`, non-2xx as
:class:`ServerStatusError` carrying the server's own error body, a non-JSON 2xx body as
:class:`ResponseParseError`. Retries follow the client's :class:`RetryPolicy` and only cover failures where
the server certainly did not act (connect errors) or said "not now" (the policy's statuses).

Some servers (uvicorn behind vLLM's admin routes) answer a 5xx and then reset that keep-alive connection, so the
*next* request on the pooled connection dies with a connection error although the server never saw it. After a
5xx the next request's connection-level failure is therefore retried once, immediately, on a fresh connection.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from typing import Any, Literal

import attrs
import httpx

from backends_core.config import RetryPolicy
from backends_core.errors import NetworkError, RequestTimeout, ResponseParseError, ServerStatusError

__all__ = ["Server"]

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
        status_hint: StatusHint | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Any:
        """Send one request and return the decoded body.

        :param method: HTTP method.
        :param path: path below the plane's root URL.
        :param json_body: JSON-serialisable body, or ``None`` for no body.
        :param params: query parameters.
        :param plane: ``"data"`` or ``"admin"`` (separate connection pool and timeout).
        :param expect: ``"json"`` decodes JSON, ``"text"`` returns text, ``"none"`` ignores the body.
        :param retry: allow the client's retry policy (turn off for non-idempotent admin calls).
        :param status_hint: turns a failing status into advice appended to the error.
        :param headers: extra headers for this request (e.g. an admin key), on top of the client's.
        :raises RequestTimeout: a timeout expired.
        :raises NetworkError: the connection failed.
        :raises ServerStatusError: the server answered non-2xx.
        :raises ResponseParseError: ``expect="json"`` and the body is not JSON.
        """
        url = self.url(path, plane=plane)
        client = self._admin if plane == "admin" else self._data
        attempts = self._retry.attempts if retry else 1
        extra: dict[str, Any] = {}
        if plane == "admin":
            extra["timeout"] = httpx.Timeout(self._admin_timeout)
        content = None if json_body is None else json.dumps(json_body, separators=(",", ":")).encode()
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
                response = await client.request(
                    method, url, content=content, params=params, headers=sent_headers, **extra
                )
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                if attempt < attempts and not (self.failover and plane == "data"):
                    await asyncio.sleep(self._retry.delay(attempt))
                    continue
                raise _map_transport(exc, method, url) from exc
            except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError) as exc:
                if plane in self._reset_suspected:  # the server reset the connection after its last 5xx
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
                    return _decode(response, expect, url)
                except ResponseParseError as exc:
                    exc.args = (_redact(str(exc), self.secrets),)
                    raise
            if response.status_code in self._retry.retry_statuses and attempt < attempts:
                await asyncio.sleep(self._retry.delay(attempt))
                continue
            body = _redact(_error_body(response), self.secrets)
            hint = status_hint(response.status_code, body) if status_hint else None
            raise ServerStatusError(method=method, url=url, status_code=response.status_code, body=body, hint=hint)


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


def _decode(response: httpx.Response, expect: str, url: str) -> Any:
    if expect == "none":
        return None
    if expect == "text":
        return response.text
    try:
        return json.loads(response.content)
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
        return json.loads(response.content)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return response.content.decode("utf-8", "replace")
