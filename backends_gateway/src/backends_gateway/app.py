"""The gateway's HTTP routes (aiohttp's server): OpenAI's chat completions and models for harnesses, with or
without a session in the path, and the trajectory routes for the trainer.

| route | what |
|---|---|
| ``POST /v1/chat/completions``, ``/s/{session}/v1/chat/completions`` | a turn (``stream`` or not) |
| ``POST /v1/responses``, ``/s/{session}/v1/responses`` | a turn on OpenAI's Responses wire |
| ``GET /v1/models``, ``/s/{session}/v1/models`` | the served model |
| ``POST /v1/messages``, ``/s/{session}/v1/messages`` | a turn over Anthropic's Messages API (errors in its shape) |
| ``POST /v1/messages/count_tokens`` | the prompt's length as the template renders it |
| ``GET /v1/sessions?group=&status=&limit=&after=`` | session summaries |
| ``GET /v1/sessions/{id}`` | one summary |
| ``GET /v1/sessions/{id}/trajectory`` | every turn and branch, with each branch's training view |
| ``GET /v1/sessions/{id}/trajectory?tokens=1`` | the same, each branch with the text piece of each id (the page's) |
| ``POST /v1/sessions/{id}/reward`` | ``{"reward": float, "info"?: {...}}`` |
| ``POST /v1/sessions/{id}/close`` | no more turns; the trajectory is final |
| ``GET /health`` | ``{"status": "ok", ...}`` |
| ``GET /ui`` | the page: sessions and trajectories token by token (``ui.py``; it reads the routes above) |

A session comes from the path, else the ``X-Session-ID`` header, else the request joins the open session whose
turn its messages extend, else starts one; the answer's ``X-Session-ID`` header names it. ``X-Session-Group``
puts a new session in a group (GRPO).

With :class:`~backends_gateway.keys.Keys`, every route but ``/health`` and the page's shell needs a key: a harness
key sends turns and lists or reads its own sessions, named in names of its own (``routing.scoped``: the trainer
sees team-a's ``run-1`` as ``team-a~run-1``); trajectories, rewards and closing need the trainer key (403
otherwise); no key or an unknown one: 401.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import AsyncIterator, Iterable
from typing import Any

from aiohttp import web

from backends_gateway import anthropic_messages as anthropic
from backends_gateway import ui
from backends_gateway.errors import GatewayError, Overloaded
from backends_gateway.gateway import Gateway, check_session_id
from backends_gateway.keys import Keys
from backends_gateway.openai_chat import ChatStream, chat_completion, error_body, parse_chat_request, token_logprobs
from backends_gateway.openai_responses import create_response
from backends_gateway.routing import (
    GATEWAY_KEY,
    HOSTS_KEY,
    KEYS_KEY,
    LOOPBACK_HOSTS,
    Handler,
    auth,
    browsers,
    check_model,
    gateway_of,
    group_of,
    harness_session_of,
    is_retry,
    json_response,
    owner_of,
    read_json,
    reader_of,
    require_trainer,
    scoped,
    session_of,
    shown,
    shown_summary,
    turn_headers,
)
from backends_gateway.streaming import deliver, stream_turn

__all__ = ["create_app", "serve"]

log = logging.getLogger("backends_gateway")


def _error(request: web.Request, exc: GatewayError) -> web.Response:
    """``exc`` in the shape of the API the request's path is under (Anthropic's for the Messages routes)."""
    headers = {"Retry-After": str(exc.retry_after)} if isinstance(exc, Overloaded) else None
    if exc.status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    shape = anthropic.error_body if anthropic.is_messages_path(request.path) else error_body
    return json_response(shape(exc), status=exc.status, headers=headers)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure in its API's error shape, naming what was wrong."""
    try:
        return await handler(request)
    except GatewayError as exc:
        return _error(request, exc)
    except web.HTTPRequestEntityTooLarge as exc:
        return _error(
            request,
            GatewayError(
                413,
                f"the body is larger than the gateway's max_body_bytes ({exc.text})",
                param="body",
                code="body_too_large",
            ),
        )
    except web.HTTPNotFound:
        return _error(
            request,
            GatewayError(
                404, f"no route {request.method} {request.path}", kind="not_found_error", code="unknown_route"
            ),
        )
    except web.HTTPMethodNotAllowed as exc:
        return _error(
            request,
            GatewayError(
                405,
                f"{request.method} {request.path} is not allowed (allowed: {sorted(exc.allowed_methods)})",
                code="method_not_allowed",
            ),
        )
    except web.HTTPException:
        raise
    except Exception as exc:  # a bug or a store failure: said in the API's shape, logged with its traceback
        log.exception("%s %s failed", request.method, request.path)
        return _error(request, GatewayError(500, f"{type(exc).__name__}: {exc}", kind="server_error", code="internal"))


def _turn_args(request: web.Request, body: Any) -> dict[str, Any]:
    """Where a turn goes and who sent it, from its request."""
    return {
        "session": session_of(request),
        "harness_session": harness_session_of(request, body),
        "group": group_of(request),
        "owner": owner_of(request),
        "retry": is_retry(request),
    }


async def chat_completions(request: web.Request) -> web.StreamResponse:
    gateway = gateway_of(request)
    body = await read_json(request)
    call = parse_chat_request(body, limit=gateway.completion_limit)
    check_model(gateway, call.model)
    args = _turn_args(request, body)
    tokenizer = gateway.client.tokenizer
    if call.stream:
        events = gateway.stream_turn(call.turn, **args)
        return await stream_turn(
            request, gateway, events, lambda first: ChatStream(call, shown(request, first.session), tokenizer)
        )
    served = await gateway.turn(call.turn, **args)
    result = served.result
    answer = chat_completion(
        id=f"chatcmpl-{shown(request, served.session)}-{served.record.turn}",
        model=call.model,
        message=served.message,
        finish=result.finish_reason,
        prompt_tokens=len(result.prompt_ids),
        completion_tokens=len(result.completion_ids),
        logprobs=token_logprobs(tokenizer, result) if call.logprobs else None,
        fingerprint=result.weight_version,
    )
    return await deliver(request, gateway, served, json_response(answer, headers=turn_headers(request, served)))


async def messages(request: web.Request) -> web.StreamResponse:
    """A turn over Anthropic's Messages API (:mod:`backends_gateway.anthropic_messages`)."""
    gateway = gateway_of(request)
    body = await read_json(request)
    call = anthropic.parse_messages_request(body, limit=gateway.completion_limit)
    check_model(gateway, call.model)
    args = _turn_args(request, body)
    stop = call.turn.sampling.stop
    if call.stream:
        events = gateway.stream_turn(call.turn, **args)
        return await stream_turn(
            request,
            gateway,
            events,
            lambda first: anthropic.MessageStream(id=anthropic.new_message_id(), model=call.model, stop=stop),
        )
    served = await gateway.turn(call.turn, **args)
    message = anthropic.message_body(
        id=anthropic.new_message_id(), model=call.model, message=served.message, result=served.result, stop=stop
    )
    return await deliver(request, gateway, served, json_response(message, headers=turn_headers(request, served)))


async def count_tokens(request: web.Request) -> web.Response:
    gateway = gateway_of(request)
    body = await read_json(request)
    call = anthropic.parse_messages_request(body, limit=gateway.completion_limit, counting=True)
    check_model(gateway, call.model)
    return json_response({"input_tokens": len(gateway.prompt_ids(call.turn))})


async def models(request: web.Request) -> web.Response:
    gateway = gateway_of(request)
    name = gateway.model or "default"
    model = {"id": name, "object": "model", "created": int(gateway.started), "owned_by": "backends"}
    return json_response({"object": "list", "data": [model]})


def _after(request: web.Request) -> float | None:
    raw = request.query.get("after")
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise GatewayError(400, f"after must be a time in seconds, got {raw!r}", param="after", code="invalid_value")
    return value


def _limit(request: web.Request) -> int:
    raw = request.query.get("limit", "1000")
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= 10_000:
        raise GatewayError(
            400, f"limit must be an integer in [1, 10000], got {raw!r}", param="limit", code="invalid_value"
        )
    return int(raw)


async def list_sessions(request: web.Request) -> web.Response:
    gateway = gateway_of(request)
    unknown = sorted(set(request.query) - {"group", "status", "limit", "after"})
    if unknown:
        raise GatewayError(400, f"unknown query parameter {unknown[0]!r}", param=unknown[0], code="unknown_parameter")
    data = await gateway.sessions(
        group=scoped(request, request.query.get("group"), "group"),
        status=request.query.get("status"),
        limit=_limit(request),
        after=_after(request),
        owner=reader_of(request),
    )
    return json_response({"object": "list", "data": [shown_summary(request, summary) for summary in data]})


async def get_session(request: web.Request) -> web.Response:
    session = scoped(request, request.match_info["id"], "session")
    summary = await gateway_of(request).summary(session, owner=reader_of(request))
    return json_response(shown_summary(request, summary))


async def trajectory(request: web.Request) -> web.Response:
    require_trainer(request)
    gateway = gateway_of(request)
    body = await gateway.trajectory(request.match_info["id"])
    if ui.tokens_requested(request):
        await ui.add_token_pieces(gateway.client.tokenizer, body)
    return json_response(body)


async def reward(request: web.Request) -> web.Response:
    require_trainer(request)
    body = await read_json(request)
    if not isinstance(body, dict) or set(body) - {"reward", "info"}:
        raise GatewayError(
            400, 'the body must be {"reward": number, "info"?: {...}}', param="body", code="invalid_value"
        )
    value = body.get("reward")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise GatewayError(400, f"reward must be a finite number, got {value!r}", param="reward", code="invalid_value")
    info = body.get("info")
    if info is not None and not isinstance(info, dict):
        raise GatewayError(400, "info must be an object", param="info", code="invalid_type")
    return json_response(await gateway_of(request).set_reward(request.match_info["id"], float(value), info))


async def close(request: web.Request) -> web.Response:
    require_trainer(request)
    check_session_id(request.match_info["id"], "session")
    return json_response(await gateway_of(request).close(request.match_info["id"]))


async def health(request: web.Request) -> web.Response:
    gateway = gateway_of(request)
    return json_response(
        {
            "status": "ok",
            "model": gateway.model,
            "open_sessions": gateway.open_sessions,
            "unplaced": gateway.unplaced,
        }
    )


async def root(request: web.Request) -> web.Response:
    """``GET /`` (and ``HEAD /``, which harnesses send to see the server is up): what serves here."""
    gateway = gateway_of(request)
    return json_response({"service": "backends gateway", "model": gateway.model, "health": "/health"})


def create_app(
    gateway: Gateway, *, keys: Keys | None = None, allowed_hosts: frozenset[str] | None = None
) -> web.Application:
    """The aiohttp application serving ``gateway`` (its client and store opened by the caller); ``keys``: who may
    call it (``None``: anyone who can reach it); ``allowed_hosts``: the ``Host`` names it answers to (``None``:
    any)."""
    app = web.Application(middlewares=[_errors, browsers, auth], client_max_size=gateway.limits.max_body_bytes)
    app[GATEWAY_KEY] = gateway
    app[KEYS_KEY] = keys
    app[HOSTS_KEY] = allowed_hosts

    for prefix in ("", "/s/{session}"):
        app.router.add_post(prefix + "/v1/chat/completions", chat_completions)
        app.router.add_post(prefix + "/v1/responses", create_response)
        app.router.add_get(prefix + "/v1/models", models)
        app.router.add_post(prefix + "/v1/messages", messages)
        app.router.add_post(prefix + "/v1/messages/count_tokens", count_tokens)
    app.router.add_get("/v1/sessions", list_sessions)
    app.router.add_get("/v1/sessions/{id}", get_session)
    app.router.add_get("/v1/sessions/{id}/trajectory", trajectory)
    app.router.add_post("/v1/sessions/{id}/reward", reward)
    app.router.add_post("/v1/sessions/{id}/close", close)
    app.router.add_get("/health", health)
    app.router.add_get("/", root)
    ui.add_routes(app)
    return app


def _answered_hosts(host: str, extra: Iterable[str]) -> frozenset[str] | None:
    names = frozenset(name.lower().strip("[]") for name in extra)
    if host.strip("[]") in LOOPBACK_HOSTS or host.startswith("127."):
        return LOOPBACK_HOSTS | {host} | names
    return names or None


@contextlib.asynccontextmanager
async def serve(
    gateway: Gateway,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    backlog: int = 4096,
    keys: Keys | None = None,
    allowed_hosts: Iterable[str] = (),
) -> AsyncIterator[str]:
    """Serve ``gateway`` until the block exits; yields the base URL (``port=0``: a free port). ``keys``: who may
    call it (:mod:`backends_gateway.keys`; ``None``: anyone who can reach it).

    :param allowed_hosts: ``Host`` names the gateway answers to besides its loopback names when it listens on a
        loopback address (any other is a DNS rebinding of a web page); listening on another address, it answers
        any ``Host`` unless names are given here.

    :param backlog: connections the kernel queues before they are accepted (capped by ``net.core.somaxconn``).
        aiohttp's default, 128, is too few for a rollout batch connecting at once: the overflow ends in connection
        resets and SYN retries (``bench/bench_gateway.py --parts scale``).
    """
    # handler_cancellation: a turn whose client went away is cancelled, and its generation aborted on the engine
    runner = web.AppRunner(
        create_app(gateway, keys=keys, allowed_hosts=_answered_hosts(host, allowed_hosts)),
        access_log=None,
        handle_signals=False,
        handler_cancellation=True,
        keepalive_timeout=gateway.limits.idle_timeout_s,
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, backlog=backlog)
        await site.start()
        server = site._server
        assert server is not None
        bound = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        yield f"http://{host}:{bound}"
    finally:
        await runner.cleanup()
