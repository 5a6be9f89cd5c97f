"""The one choke point between hooks and HTTP.

Backends never build an ``httpx`` client or map an ``httpx`` exception: they get a :class:`Server` and call
:meth:`Server.request`. Every failure leaves here as a :mod:`backends_core.errors` type with the cause
chained: timeouts as :class:`RequestTimeout`, connection trouble as :class:`NetworkError`, non-2xx as
:class:`ServerStatusError` carrying the server's own error body, a non-JSON 2xx body as
:class:`ResponseParseError`. Retries follow the client's :class:`RetryPolicy` and only cover failures where
the server certainly did not act (connect errors), said "not now" (the policy's refused statuses), or, for a
request that is safe to repeat (``idempotent``), answered one of the policy's retry statuses. This is the only
retry layer: the fleet declares which admin operations are safe to repeat (:func:`idempotent_requests`) and a
backend declares an answer of its server that means "not now" for one request (:class:`Refusal`); neither loops.
Waits follow the server's ``Retry-After`` when it sends one, else the policy's backoff with jitter.

Every retry is logged at INFO on the ``backends_core.server`` logger: method, URL, what failed, the attempt, the wait,
and the caller's request id (:data:`REQUEST_ID`); never a header, so never a key.

Bodies are encoded and decoded by :mod:`backends_core.jsonio`; ``large_strings`` lets a backend name keys whose
big string values (base64 routed experts) come back as ``memoryview`` objects of the raw body.

Some servers (uvicorn behind vLLM's admin routes) answer a 5xx and then reset that keep-alive connection, so the
*next* request on the pooled connection dies with a connection error although the server never saw it. After a
5xx the next request's connection-level failure is therefore retried once, immediately, on a fresh connection,
but only when no byte of an answer had arrived: once the answer started, the server certainly ran the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import email.utils
import functools
import json
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import attrs
import httpx

from backends_core._http import STREAMED
from backends_core.config import RetryPolicy
from backends_core.errors import NetworkError, RequestTimeout, ResponseParseError, ServerStatusError
from backends_core.jsonio import dumps, loads, loads_lifting
from backends_core.routed_experts import npy_base64_length
from backends_core.sse import ResponseStream

__all__ = ["REQUEST_ID", "Plane", "Refusal", "Server", "StatusHint", "idempotent_requests"]

log = logging.getLogger("backends_core.server")

#: The caller's id of the request being sent (``GenerateRequest.request_id``), named in log lines; the client sets
#: it around each generation.
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("backends_request_id", default=None)

#: Where a request goes: the data plane (generation, scoring) or the admin plane (separate pool and timeout).
Plane = Literal["data", "admin"]
#: Builds a hint for a non-2xx status (e.g. "start the server with --enable-scale-out"), or returns None.
StatusHint = Callable[[int, Any], str | None]

#: Admin requests sent in this context belong to an operation that is safe to repeat.
_IDEMPOTENT_ADMIN: contextvars.ContextVar[bool] = contextvars.ContextVar("backends_idempotent_admin", default=False)


@contextlib.contextmanager
def idempotent_requests(declared: bool = True) -> Iterator[None]:
    """Declare every admin-plane request sent inside the block (and in tasks it starts) safe to repeat, or, with
    ``declared=False``, not: declared ones are retried like ``Server.request(idempotent=True)`` by the admin
    plane's policy, whatever the backend's hook passed as ``retry``."""
    token = _IDEMPOTENT_ADMIN.set(declared)
    try:
        yield
    finally:
        _IDEMPOTENT_ADMIN.reset(token)


@attrs.frozen
class Refusal:
    """An answer that means "not now" for one request (e.g. SGLang's 400 to a cache flush while requests run):
    the request is sent again every ``interval`` seconds until answered otherwise or ``within`` seconds have
    passed, whatever the retry policy; the last refusal is raised as :class:`ServerStatusError`.

    :ivar status: the refusing status.
    :ivar within: seconds from the first attempt after which a refusal is raised.
    :ivar interval: seconds between attempts.
    """

    status: int
    within: float
    interval: float


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
    #: The admin plane's retry policy (``AdminPolicy.retry_policy``); ``retry`` when not given.
    _admin_retry: RetryPolicy | None = attrs.field(alias="admin_retry", default=None, repr=False)
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
    #: The kind of router ``base_url`` is (``FrontConfig.kind``) when this server is a front: its answers come
    #: from a replica behind it, and its admin routes reach one replica at best.
    front: str | None = attrs.field(default=None, repr=False)
    #: Behind a front whose backend reaches the replicas itself (Dynamo's workers): the admin URLs of the replicas
    #: that serve, as the front last listed them; ``None`` when the backend's own configuration says.
    replicas: tuple[str, ...] | None = attrs.field(default=None, repr=False)
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
        expect: Literal["json", "text", "none", "stream"] = "json",
        retry: bool = True,
        idempotent: bool | None = None,
        status_hint: StatusHint | None = None,
        headers: Mapping[str, str] | None = None,
        large_strings: Sequence[str] = (),
        refusal: Refusal | None = None,
    ) -> Any:
        """Send one request and return the decoded body.

        :param method: HTTP method.
        :param path: path below the plane's root URL.
        :param json_body: JSON-serialisable body, or ``None`` for no body.
        :param params: query parameters.
        :param plane: ``"data"`` or ``"admin"`` (separate connection pool and timeout).
        :param expect: ``"json"`` decodes JSON, ``"text"`` returns text, ``"none"`` ignores the body, ``"stream"``
            returns a :class:`~backends_core.sse.ResponseStream` over a 2xx body as it arrives (see :meth:`stream`).
        :param retry: allow the plane's retry policy (turn off for non-idempotent admin calls; an admin request
            declared safe to repeat by :func:`idempotent_requests` is retried anyway).
        :param idempotent: running the request twice is harmless (reads, scoring): retried on every status of
            ``RetryPolicy.retry_statuses`` (and after a failure once sent, if the policy's ``resend_idempotent``);
            otherwise (generation) only on ``refused_statuses``. Default: true for ``GET`` and ``HEAD``, and for
            admin requests declared by :func:`idempotent_requests`.
        :param status_hint: turns a failing status into advice appended to the error.
        :param headers: extra headers for this request (e.g. an admin key), on top of the client's.
        :param large_strings: object keys whose large string values come back as ``memoryview`` objects of the raw
            body instead of ``str``: the raw text between the quotes, escapes included, for a consumer that
            validates it (base64 decoding; see :func:`~backends_core.jsonio.loads_lifting`).
        :param refusal: an answer of this request that means "ask again later" (see :class:`Refusal`).
        :raises RequestTimeout: a timeout expired.
        :raises NetworkError: the connection failed.
        :raises ServerStatusError: the server answered non-2xx.
        :raises ResponseParseError: ``expect="json"`` and the body is not JSON.
        """
        url = self.url(path, plane=plane)
        client = self._admin if plane == "admin" else self._data
        policy = self._admin_retry if plane == "admin" and self._admin_retry is not None else self._retry
        if plane == "admin" and _IDEMPOTENT_ADMIN.get():
            retry, idempotent = True, True if idempotent is None else idempotent
        repeatable = method in ("GET", "HEAD") if idempotent is None else idempotent
        attempts = policy.attempts if retry else 1
        statuses = policy.statuses(idempotent=repeatable)
        resend = repeatable and policy.resend_idempotent
        refused_until = None if refusal is None else time.monotonic() + refusal.within
        timeout = _timeout(self._admin_timeout) if plane == "admin" else None
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
                if expect == "stream":
                    built = client.build_request(
                        method,
                        url,
                        content=content,
                        params=params,
                        headers=sent_headers,
                        timeout=timeout or httpx.USE_CLIENT_DEFAULT,
                    )
                    built.extensions[STREAMED] = True
                    response = await client.send(built, stream=True)
                    if not response.is_success:
                        try:
                            await response.aread()
                        finally:
                            await response.aclose()
                else:
                    response = await _send(client, method, url, content, params, sent_headers, timeout)
            except httpx.TransportError as exc:
                # the server reset the connection after its last 5xx, before answering this request
                reset = isinstance(exc, httpx.ReadError | httpx.WriteError | httpx.RemoteProtocolError)
                if reset and plane in self._reset_suspected and not answer_started(exc):
                    self._reset_suspected.discard(plane)
                    attempt -= 1
                    log.info(
                        "%s %s: connection reset after the server's last 5xx (%s); sent again on a fresh "
                        "connection [request %s]",
                        method,
                        _Shown(url, self.secrets),
                        type(exc).__name__,
                        REQUEST_ID.get(),
                    )
                    continue
                # a fleet's data plane fails a refused connection over to another server instead
                unsent = isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout)
                if attempt < attempts and (resend or (unsent and not (self.failover and plane == "data"))):
                    wait = policy.delay(attempt)
                    log.info(
                        "%s %s: %s (attempt %d of %d); retrying in %.2f s [request %s]",
                        method,
                        _Shown(url, self.secrets),
                        _Shown(exc, self.secrets),
                        attempt,
                        attempts,
                        wait,
                        REQUEST_ID.get(),
                    )
                    await asyncio.sleep(wait)
                    continue
                raise _map_transport(exc, method, url) from exc
            if response.status_code >= 500:
                self._reset_suspected.add(plane)
            else:
                self._reset_suspected.discard(plane)
            if response.is_success:
                if expect == "stream":
                    return ResponseStream(
                        response,
                        method=method,
                        url=url,
                        map_transport=_map_transport,
                        redact=functools.partial(_redact, secrets=self.secrets),
                    )
                try:
                    return _decode(response, expect, url, large_strings)
                except ResponseParseError as exc:
                    exc.args = (_redact(str(exc), self.secrets),)
                    raise
            if response.status_code in statuses and attempt < attempts:
                wait = policy.delay(attempt, retry_after(response))
                log.info(
                    "%s %s: status %d (attempt %d of %d); retrying in %.2f s [request %s]",
                    method,
                    _Shown(url, self.secrets),
                    response.status_code,
                    attempt,
                    attempts,
                    wait,
                    REQUEST_ID.get(),
                )
                await asyncio.sleep(wait)
                continue
            if refusal is not None and refused_until is not None and response.status_code == refusal.status:
                remaining = refused_until - time.monotonic()
                if remaining > 0:
                    wait = min(refusal.interval, remaining)
                    log.info(
                        "%s %s: status %d means not now; asking again in %.2f s (for %.1f s more) [request %s]",
                        method,
                        _Shown(url, self.secrets),
                        response.status_code,
                        wait,
                        remaining,
                        REQUEST_ID.get(),
                    )
                    await asyncio.sleep(wait)
                    attempt -= 1
                    continue
            body = _redact(_error_body(response), self.secrets)
            hint = status_hint(response.status_code, body) if status_hint else None
            raise ServerStatusError(method=method, url=url, status_code=response.status_code, body=body, hint=hint)

    @contextlib.asynccontextmanager
    async def stream(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        status_hint: StatusHint | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> AsyncIterator[ResponseStream]:
        """Send one data-plane request whose answer is read as it arrives (a streamed generation); the block
        gets the open :class:`~backends_core.sse.ResponseStream` and leaving it closes the stream (before the
        body's end, its connection: the server sees its client leave).

        Sent like :meth:`request` (same retries before an answer, same error for a non-2xx status, raised before
        the block is entered); a connection lost mid-body raises :class:`NetworkError` from the stream.
        """
        answer = await self.request(
            method, path, json_body=json_body, expect="stream", status_hint=status_hint, headers=headers
        )
        assert isinstance(answer, ResponseStream)
        try:
            yield answer
        finally:
            await answer.aclose()


class _Shown:
    """A URL or an exception as a log line shows it: formatted only if the line is emitted, with this server's
    secrets and any password in a URL (``//user:pass@host``) replaced."""

    __slots__ = ("secrets", "value")

    def __init__(self, value: object, secrets: set[str]) -> None:
        self.value = value
        self.secrets = secrets

    def __str__(self) -> str:
        value = self.value
        if isinstance(value, BaseException):
            text = f"{type(value).__name__}: {value}" if str(value) else type(value).__name__
        else:
            text = str(value)
        return _USERINFO.sub("//<redacted>@", _redact(text, self.secrets))


_USERINFO = re.compile(r"//[^/@\s]+@")


async def _send(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    content: bytes | None,
    params: Mapping[str, Any] | None,
    headers: Mapping[str, str],
    timeout: httpx.Timeout | None,  # noqa: ASYNC109  # the request's own, as httpx takes it
) -> httpx.Response:
    """``client.request(...)`` for both planes, without the layers of ``httpx.AsyncClient.send`` these clients
    never use: the same request (client headers, then the call's; the client's cookies; the timeout, the client's
    unless given) goes to the same transport (``mounts`` included) after the client's request hooks, and the whole
    body is read and the answer closed. Cookies the server sets are kept as httpx keeps them. A client with auth,
    redirects on or default query parameters takes httpx's own path.

    A fleet's phase costs one event loop the client's CPU per call times the number of servers
    (``bench/bench_fleet.py``): httpx's request building from a string URL, the redirect/auth layers, cookie
    extraction of every answer and its logging were a large part of that per-call cost.
    """
    if client.auth is not None or client.follow_redirects or client.params:
        return await client.request(
            method, url, content=content, params=params, headers=headers, timeout=timeout or httpx.USE_CLIENT_DEFAULT
        )
    if client.is_closed:
        raise RuntimeError("Cannot send a request, as the client has been closed.")
    cookies = client.cookies
    target = _request_url(url, params)
    extensions = {"timeout": (timeout or client.timeout).as_dict()}
    empty = not content and method in ("POST", "PUT", "PATCH")
    own = tuple(headers.items()) if headers else ()
    head = None if cookies else _head(target.netloc, tuple(client.headers.raw), own, empty_body=empty)
    if head is None:
        merged = httpx.Headers(client.headers)
        if headers:
            merged.update(headers)
        request = httpx.Request(method, target, headers=merged, cookies=cookies, content=content, extensions=extensions)
    else:
        if content:
            head = [*head, (b"Content-Length", b"%d" % len(content))]
        request = httpx.Request(
            method, target, headers=head, stream=httpx.ByteStream(content or b""), extensions=extensions
        )
        request.read()
    hooks = client.event_hooks
    for hook in hooks["request"]:
        await hook(request)
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
    for hook in hooks["response"]:
        await hook(response)
    return response


@functools.lru_cache(maxsize=1024)
def _head(
    netloc: bytes,
    client_headers: tuple[tuple[bytes, bytes], ...],
    own: tuple[tuple[str, str], ...],
    *,
    empty_body: bool,
) -> list[tuple[bytes, bytes]] | None:
    """The headers ``httpx.Request`` gives a request, in its order and spelling, but a body's ``Content-Length``
    (the caller appends it, as httpx does): ``Host`` and, for a POST/PUT/PATCH without a body, ``Content-Length:
    0`` first, then the client's headers updated with the call's. Worked out once per host, client headers, call
    headers and kind of body; ``None`` when the headers set the body's framing themselves (httpx's own path
    handles that)."""
    merged = httpx.Headers(list(client_headers))
    merged.update(dict(own))
    if "Content-Length" in merged or "Transfer-Encoding" in merged:
        return None
    auto = [] if "Host" in merged else [(b"Host", netloc)]
    if empty_body:
        auto.append((b"Content-Length", b"0"))
    return [*auto, *merged.raw]


def _request_url(url: str, params: Mapping[str, Any] | None) -> httpx.URL:
    """``httpx.URL(url, params=params)`` as ``httpx.Request`` builds it, parsed once per route and query of
    scalar values (parsing and merging the query was most of the cost of building a request)."""
    if not params:
        return _parsed_url(url)
    try:  # the type is part of the key: True, 1 and 1.0 are equal keys but different query values
        return _url_with_query(url, tuple((k, v.__class__, v) for k, v in params.items()))
    except TypeError:  # an unhashable value (a list of values for one name)
        return _parsed_url(url).copy_merge_params(params)


@functools.lru_cache(maxsize=4096)
def _parsed_url(url: str) -> httpx.URL:
    return httpx.URL(url)


@functools.lru_cache(maxsize=4096)
def _url_with_query(url: str, items: tuple[tuple[str, type, Any], ...]) -> httpx.URL:
    return _parsed_url(url).copy_merge_params({k: v for k, _, v in items})


@functools.lru_cache(maxsize=64)
def _timeout(seconds: float | None) -> httpx.Timeout:
    return httpx.Timeout(seconds)


def retry_after(response: httpx.Response) -> float | None:
    """The seconds ``Retry-After`` asks to wait (delay-seconds or an HTTP date), or ``None`` without a usable
    header."""
    value = response.headers.get("retry-after")
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    seconds = when.timestamp() - time.time()
    return max(0.0, seconds) if math.isfinite(seconds) else None


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
        if large_strings:
            return loads_lifting(response.content, large_strings, sized=npy_base64_length)
        return loads(response.content)
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
