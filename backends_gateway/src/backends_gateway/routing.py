"""What every route of the gateway shares: the application's and request's keys, JSON in and out, who sent a
request (the keys middleware) and what it may read, the session a request names, a turn's headers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, overload

import orjson
from aiohttp import web

from backends_gateway.errors import GatewayError
from backends_gateway.gateway import OWNER_SEPARATOR, Gateway, Served, Started, check_session_id, owned_name
from backends_gateway.keys import Keys, Principal

__all__ = [
    "GATEWAY_KEY",
    "HOSTS_KEY",
    "KEYS_KEY",
    "LOOPBACK_HOSTS",
    "PRINCIPAL_KEY",
    "PUBLIC_PATHS",
    "Handler",
    "auth",
    "browsers",
    "check_model",
    "gateway_of",
    "group_of",
    "harness_session_of",
    "is_retry",
    "json_response",
    "owner_of",
    "read_json",
    "reader_of",
    "require_trainer",
    "scoped",
    "session_of",
    "shown",
    "shown_summary",
    "turn_headers",
]

GATEWAY_KEY: web.AppKey[Gateway] = web.AppKey("gateway", Gateway)
KEYS_KEY: web.AppKey[Keys | None] = web.AppKey("keys")
HOSTS_KEY: web.AppKey[frozenset[str] | None] = web.AppKey("allowed_hosts")
PRINCIPAL_KEY: web.RequestKey[Principal | None] = web.RequestKey("principal")
#: routes anyone may call on a gateway with keys: nothing in them is a session's
PUBLIC_PATHS = frozenset({"/", "/health", "/ui"})
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json_response(body: Any, *, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json", headers=headers)


#: the names a gateway listening on a loopback address answers to (any other ``Host`` is a DNS rebinding)
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


@web.middleware
async def browsers(request: web.Request, handler: Handler) -> web.StreamResponse:
    """What keeps a web page in a browser on the same machine from driving the gateway: the ``Host`` must be one
    the gateway answers to (:data:`HOSTS_KEY`; ``None``: any), a request from a page of another origin (its
    ``Origin`` header) is refused, and a POST body must be declared JSON (a browser sends ``text/plain`` and form
    bodies to any origin without asking first; a JSON one only after a CORS preflight, which the gateway never
    grants). Harnesses and SDKs send no ``Origin`` and declare their JSON."""
    allowed = request.app[HOSTS_KEY]
    host = _hostname(request.host)
    if allowed is not None and host not in allowed:
        raise GatewayError(
            403,
            f"Host {request.host!r} is not one this gateway answers to ({', '.join(sorted(allowed))}; "
            "--allowed-hosts adds more)",
            kind="permission_error",
            code="host_not_allowed",
        )
    origin = request.headers.get("Origin")
    if origin is not None and origin != f"{request.scheme}://{request.host}":
        raise GatewayError(
            403,
            f"a request from the web page {origin!r} is refused: the gateway answers its own page and programs only",
            kind="permission_error",
            code="cross_origin",
        )
    if request.method == "POST" and request.body_exists and not _declares_json(request.content_type):
        raise GatewayError(
            415,
            f"a POST body must be JSON: send 'Content-Type: application/json' (got {request.content_type!r})",
            param="Content-Type",
            code="unsupported_media_type",
        )
    return await handler(request)


def _hostname(host: str) -> str:
    """``Host`` without its port (``[::1]:8080`` -> ``::1``), lower-cased."""
    if host.startswith("["):
        return host[1:].partition("]")[0].lower()
    return host.rpartition(":")[0].lower() if host.count(":") == 1 else host.lower()


def _declares_json(content_type: str) -> bool:
    return content_type == "application/json" or (
        content_type.startswith("application/") and content_type.endswith("+json")
    )


@web.middleware
async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Who sent the request (:data:`PRINCIPAL_KEY`), from ``Authorization: Bearer`` or ``x-api-key``."""
    keys = request.app[KEYS_KEY]
    if keys is None or request.path in PUBLIC_PATHS:
        request[PRINCIPAL_KEY] = None
        return await handler(request)
    scheme, _, bearer = request.headers.get("Authorization", "").partition(" ")
    sent = {key for key in (request.headers.get("x-api-key", ""), bearer if scheme.lower() == "bearer" else "") if key}
    if not sent:
        raise _unauthorized("no key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')")
    if len({key.strip() for key in sent}) > 1:
        raise _unauthorized("two different keys (x-api-key and Authorization): send one")
    principal = keys.identify(sent.pop().strip())
    if principal is None:
        raise _unauthorized("the key is not one of this gateway's")
    request[PRINCIPAL_KEY] = principal
    return await handler(request)


def _unauthorized(message: str) -> GatewayError:
    return GatewayError(401, message, kind="authentication_error", code="invalid_api_key")


def owner_of(request: web.Request) -> str | None:
    """The key a turn's session belongs to (``None`` on a gateway without keys)."""
    principal = request[PRINCIPAL_KEY]
    return None if principal is None else principal.name


def reader_of(request: web.Request) -> str | None:
    """Whose sessions the request may read: ``None`` for all (the trainer, or a gateway without keys)."""
    principal = request[PRINCIPAL_KEY]
    return None if principal is None or principal.trainer else principal.name


def require_trainer(request: web.Request) -> None:
    """Refuse (403) a request not sent with the trainer key on a gateway with keys."""
    principal = request[PRINCIPAL_KEY]
    if principal is not None and not principal.trainer:
        raise GatewayError(
            403,
            f"{request.method} {request.path} needs the trainer key",
            kind="permission_error",
            code="trainer_key_required",
        )


MAX_JSON_DEPTH = 128
"""How deeply a request body may nest: far past any real request (a tool's JSON schema included), well inside what
the store can write back (orjson writes at most 254 levels)."""


async def read_json(request: web.Request) -> Any:
    """The request's JSON body; a body that cannot be read (a broken compressed stream), is not JSON, or nests
    deeper than :data:`MAX_JSON_DEPTH` is a 400 before anything else looks at it."""
    deadline = request.app[GATEWAY_KEY].limits.body_timeout_s
    try:
        async with asyncio.timeout(deadline):
            raw = await request.read()
    except TimeoutError:
        raise GatewayError(
            408,
            f"the body did not arrive within {deadline} s of the headers (the gateway's body_timeout_s)",
            param="body",
            code="body_timeout",
        ) from None
    except web.RequestPayloadError as exc:
        encoding = request.headers.get("Content-Encoding", "identity")
        raise GatewayError(
            400, f"the body could not be read (Content-Encoding {encoding!r}): {exc}", param="body", code="invalid_body"
        ) from None
    if not raw:
        raise GatewayError(400, "the request has no body: send a JSON object", param="body", code="invalid_json")
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise GatewayError(400, f"the body is not valid JSON: {exc}", param="body", code="invalid_json") from None
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH:  # else it cannot nest that deep: no walk
        _check_depth(value)
    return value


def _check_depth(value: Any) -> None:
    pending = [(value, 1)] if isinstance(value, dict | list) else []
    while pending:
        node, depth = pending.pop()
        if depth > MAX_JSON_DEPTH:
            raise GatewayError(
                400, f"the body nests deeper than {MAX_JSON_DEPTH} levels", param="body", code="too_deep"
            )
        children = node.values() if isinstance(node, dict) else node
        pending.extend((child, depth + 1) for child in children if isinstance(child, dict | list))


@overload
def scoped(request: web.Request, name: str, where: str) -> str: ...
@overload
def scoped(request: web.Request, name: None, where: str) -> None: ...
@overload
def scoped(request: web.Request, name: str | None, where: str) -> str | None: ...
def scoped(request: web.Request, name: str | None, where: str) -> str | None:
    """The gateway's name for the session or group ``name`` that the request names (``where``: in which field): a
    harness key's names are its own (:func:`~backends_gateway.gateway.owned_name`), the trainer's and a keyless
    gateway's are the gateway's."""
    harness = reader_of(request)
    if name is None or harness is None:
        return name
    return owned_name(harness, check_session_id(name, where, owned=False))


def shown(request: web.Request, name: str) -> str:
    """``name`` as the request's key calls it (the inverse of :func:`scoped`)."""
    harness = reader_of(request)
    return name if harness is None else name.removeprefix(harness + OWNER_SEPARATOR)


def shown_summary(request: web.Request, summary: dict[str, Any]) -> dict[str, Any]:
    """A session's summary as the request's key names its session and group."""
    if reader_of(request) is None:
        return summary
    group = summary["group"]
    return {**summary, "session": shown(request, summary["session"]), "group": group and shown(request, group)}


def session_of(request: web.Request) -> str | None:
    """The session a request names, as the gateway names it: the path's ``/s/{session}``, else its
    ``X-Session-ID`` header."""
    named = request.match_info.get("session") or request.headers.get("X-Session-ID") or None
    return scoped(request, named, "session")


def group_of(request: web.Request) -> str | None:
    """The group a turn's session joins, as the gateway names it: the ``X-Session-Group`` header."""
    return scoped(request, request.headers.get("X-Session-Group") or None, "X-Session-Group")


#: headers in which harnesses name their own conversation: Claude Code's, then Codex's (its thread is the
#: conversation, resumed by ``codex exec resume``; its session-id names the same thread in ``exec`` mode)
HARNESS_SESSION_HEADERS = ("x-claude-code-session-id", "thread-id", "session-id", "conversation_id")


def harness_session_of(request: web.Request, body: Any) -> str | None:
    """:func:`_harness_named`, as the gateway names it; ``None`` where it cannot name a session (history
    decides)."""
    named = _harness_named(request, body)
    if named is None or reader_of(request) is None:
        return named
    try:
        return scoped(request, named, "session")
    except GatewayError:
        return None


def _harness_named(request: web.Request, body: Any) -> str | None:
    """The harness's own id for its conversation, when it sends one: a header of
    :data:`HARNESS_SESSION_HEADERS`, else the ``session_id`` of Anthropic's ``metadata.user_id`` (Claude Code
    sends a JSON object there as a string), else a Responses ``prompt_cache_key``. The session of a request
    naming none (no ``/s/{id}``, no ``X-Session-ID``)."""
    for name in HARNESS_SESSION_HEADERS:
        value = request.headers.get(name)
        if value:
            return value
    if not isinstance(body, dict):
        return None
    metadata = body.get("metadata")
    user = metadata.get("user_id") if isinstance(metadata, dict) else None
    if isinstance(user, str) and user.startswith("{"):
        with contextlib.suppress(orjson.JSONDecodeError):
            parsed = orjson.loads(user)
            if isinstance(parsed, dict) and isinstance(parsed.get("session_id"), str) and parsed["session_id"]:
                return str(parsed["session_id"])
    elif isinstance(user, str) and "_session_" in user:  # user_<hash>_account_<uuid>_session_<uuid>
        return user.rsplit("_session_", 1)[1] or None
    key = body.get("prompt_cache_key")
    return key if isinstance(key, str) and key else None


def is_retry(request: web.Request) -> bool:
    """Whether the request says it repeats an earlier attempt: the official SDKs' ``x-stainless-retry-count``."""
    count = request.headers.get("x-stainless-retry-count", "0").strip()
    return count.isascii() and count.isdigit() and int(count) > 0


def gateway_of(request: web.Request) -> Gateway:
    return request.app[GATEWAY_KEY]


def check_model(gateway: Gateway, model: str) -> None:
    served = gateway.model
    if served is not None and model != served:
        raise GatewayError(
            404,
            f"the model {model!r} is not served here: this gateway serves {served!r}",
            kind="not_found_error",
            param="model",
            code="model_not_found",
        )


def turn_headers(request: web.Request, served: Served | Started) -> dict[str, str]:
    """The session, turn and branch a turn's answer names (a stream's, before its turn is generated)."""
    headers = {"X-Session-ID": shown(request, served.session)}
    if isinstance(served, Served):
        headers["X-Turn"] = str(served.record.turn)
        headers["X-Branch"] = str(served.record.branch)
    elif served.turn >= 0:
        headers["X-Turn"] = str(served.turn)
        headers["X-Branch"] = str(served.branch)
    return headers
