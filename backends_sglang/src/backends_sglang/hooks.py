"""Hook implementations of the ``sglang`` backend: each hook is a few lines; the wire mapping is in ``wire.py``,
the control-plane waits and credentials in ``control.py``.

Pause modes, mapped onto SGLang's ``/pause_generation`` modes:

* ``abort`` -> ``abort``: in-flight requests end now with ``finish_reason="abort"`` and the tokens generated so
  far; SGLang answers once they are gone.
* ``wait`` -> drain, then ``retract``: the backend polls ``/v1/loads`` until nothing runs or waits (at most
  ``pause_drain_timeout`` seconds), then pauses with ``retract``. Guarantee: no request is lost or aborted.
  Every request in flight when ``pause`` was called finishes before it returns if it finishes within the
  timeout; whatever is still running at the deadline, or arrives during the call, is retracted (put back in
  SGLang's queue with its tokens so far) and finishes after resume.
* ``keep`` -> ``in_place``: running requests are frozen with their KV cache and continue after resume;
  SGLang then refuses ``/flush_cache``, so ``clear_cache`` is ignored as the contract says.

New requests sent while paused (any mode) queue and run after resume. SGLang exposes no "is paused" or "is
asleep" flag: :func:`admin_state` reports what this client last did to the server (``None`` until it paused,
resumed, slept or woke it).

Health and readiness: SGLang's ``/health`` and ``/health_generate`` both run a 1-token generation and answer 503
when it does not complete within ``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s), which is what happens while generation
is paused or memory is released. :func:`admin_health` and :func:`admin_ready` pass that 503 on as ``False``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Literal

import attrs

from backends_core import Server, StatusHint, hookimpl
from backends_core.config import ClientConfig
from backends_core.errors import ConfigError, InvalidRequestError, ServerStatusError, TransportError
from backends_core.images import image_token_id
from backends_core.transfer import capped_buckets, one_by_one
from backends_core.types import (
    SAMPLING_FEATURES,
    DistributedGroup,
    GenerateRequest,
    GenerateResult,
    LoraAdapter,
    PauseMode,
    ServerState,
    StreamDelta,
    TeacherLogprobs,
    TeacherRequest,
    TensorSpec,
    TransferPlan,
)
from backends_sglang import control, wire
from backends_sglang.options import SglangOptions, parse_options

_LIMIT = "sglang.max_req_input_len"  # Server.cache: read once from /server_info
_PAUSED = "sglang.paused"  # Server.cache: what this client last did (SGLang exposes no flag)
_SLEEPING = "sglang.sleeping"
_MODES = {"abort": "abort", "wait": "retract", "keep": "in_place"}


#: Server.cache key: adapters this client unloaded (SGLang would silently reload them by name).
_UNLOADED = "sglang.unloaded_loras"


@hookimpl
def validate_backend_options(options: Mapping[str, Any], config: ClientConfig) -> SglangOptions:
    return parse_options(options, config)


# -- generation -------------------------------------------------------------------------------------------


async def _read_limit(source: Server, plane: Literal["data", "admin"]) -> int:
    try:
        raw = await source.request("GET", "/server_info", plane=plane)
    except ServerStatusError as exc:
        if exc.status_code != 404:
            raise
        raw = await source.request("GET", "/get_server_info", plane=plane)  # before /server_info existed
    return wire.max_req_input_len(raw, source.url("", plane=plane).rstrip("/"))


async def _max_req_input_len(server: Server) -> int:
    """The scheduler's prompt limit, read once per server (a wrong answer is remembered too: a router mistaken for
    a server fails every request at once, without asking again). Behind a front, a router has no engine limits:
    the first replica serving behind it that answers gives them (the fleet runs one model)."""
    if _LIMIT not in server.cache:
        try:
            if server.front is None:
                server.cache[_LIMIT] = await _read_limit(server, "data")
            else:
                server.cache[_LIMIT] = await _replica_limit(server)
        except ConfigError as exc:
            server.cache[_LIMIT] = exc
    limit = server.cache[_LIMIT]
    if isinstance(limit, ConfigError):
        raise ConfigError(limit.messages)
    return int(limit)


async def _replica_limit(server: Server) -> int:
    if not server.replicas:
        raise ConfigError(
            [
                f"no replica behind the {server.front} front {server.base_url} is known yet to read max_req_input_len "
                "from @ $.front"
            ]
        )
    unreachable: list[TransportError] = []
    for url in server.replicas:
        try:
            return await _read_limit(attrs.evolve(server, admin_url=url, cache={}), "admin")
        except TransportError as exc:  # a replica that died since the front listed it: ask the next one
            unreachable.append(exc)
    raise unreachable[-1]


def _lifted(request: GenerateRequest) -> tuple[str, ...]:
    """Keys whose values stay in the raw body as memoryviews: the routed experts (base64, megabytes), never
    JSON-scanned nor copied."""
    return ("routed_experts",) if request.return_routed_experts else ()


async def _check_length(server: Server, prompt: int, max_tokens: int) -> None:
    limit = await _max_req_input_len(server)
    if prompt > limit:
        raise InvalidRequestError(
            f"prompt of {prompt} tokens exceeds max_req_input_len {limit} of {server.base_url}: SGLang would abort it"
        )
    ceiling = limit + 4  # the scheduler clips prompt + max_new_tokens to max_req_len - 1 = max_req_input_len + 4
    if prompt + max_tokens > ceiling:
        raise InvalidRequestError(
            f"prompt of {prompt} tokens + max_tokens {max_tokens} = {prompt + max_tokens} exceeds {ceiling} on "
            f"{server.base_url} (max_req_input_len {limit} + 4): SGLang would silently lower max_tokens to "
            f"{ceiling - prompt}"
        )


@hookimpl
def sampling_features() -> frozenset[str]:
    """Stop strings, logit bias, every structured kind (``json_schema`` / ``regex`` / ``ebnf``, a choice as a
    regex; needs the server's grammar backend, xgrammar by default) and the ``sampling_params`` keys of
    ``wire.EXTRA_KEYS``."""
    return SAMPLING_FEATURES


@hookimpl
async def post_generate(server: Server, request: GenerateRequest, options: SglangOptions) -> Any:
    body = wire.generate_payload(request)  # first: a field SGLang would refuse is refused before any request
    if options.check_prompt_length:
        await _check_length(server, len(request.prompt_ids), request.sampling.max_tokens)
    if request.lora is not None and request.lora in server.cache.get(_UNLOADED, ()):
        # SGLang silently re-loads an evicted adapter by name and answers 200: refuse it here instead
        raise InvalidRequestError(
            f"LoRA adapter {request.lora!r} was unloaded from {server.base_url}; load it again first"
        )
    if request.sampling.n > 1 and request.sampling.seed is not None:
        return await _fan_out(server, request)
    return await server.request("POST", "/generate", json_body=body, large_strings=_lifted(request))


@hookimpl
def image_refusal() -> None:
    # /generate takes image_data beside input_ids, widens each image's one placeholder and answers the ids it ran
    # (return_prompt_token_ids); the wire module salts each image's cache key with the weight version
    return None


@hookimpl
async def post_generate_stream(
    server: Server, request: GenerateRequest, config: ClientConfig, options: SglangOptions
) -> AsyncIterator[StreamDelta | GenerateResult]:
    if options.check_prompt_length:
        await _check_length(server, len(request.prompt_ids), request.sampling.max_tokens)
    if request.lora is not None and request.lora in server.cache.get(_UNLOADED, ()):
        raise InvalidRequestError(
            f"LoRA adapter {request.lora!r} was unloaded from {server.base_url}; load it again first"
        )
    fold = wire.StreamFold(request, server.base_url, options.routing, image_token=_image_token(config))
    async with server.stream("POST", "/generate", json_body=wire.stream_payload(request)) as stream:
        async for raw in stream.json_events():
            if isinstance(raw, dict) and "error" in raw:  # {"error": {"message", "type", "code", ...}}
                error = raw["error"]
                code = error.get("code") if isinstance(error, dict) else None
                raise stream.error(error, status_code=code if isinstance(code, int) else 500)
            delta = fold.event(raw)
            if delta is not None:
                yield delta
    yield fold.result()


async def _fan_out(server: Server, request: GenerateRequest) -> list[Any]:
    """``n`` seeded samples as ``n`` single requests to one server, sample ``i`` with seed ``seed + i``: SGLang's
    own ``n`` gives every sample the request's one seed (identical samples once sampling is deterministic)."""
    tasks = [
        asyncio.ensure_future(
            server.request("POST", "/generate", json_body=wire.generate_payload(one), large_strings=_lifted(one))
        )
        for one in wire.single_samples(request)
    ]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


@hookimpl
def parse_response(
    raw: Any, request: GenerateRequest, server_url: str, config: ClientConfig, options: SglangOptions
) -> list[GenerateResult]:
    front = config.front.kind if config.front is not None else None
    return wire.parse_generate(raw, request, server_url, options.routing, front=front, image_token=_image_token(config))


def _image_token(config: ClientConfig) -> int | None:
    return image_token_id(config.tokenizer) if config.tokenizer else None


@hookimpl
async def tokenize_messages(
    server: Server,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    chat_template_kwargs: Mapping[str, Any],
    add_generation_prompt: bool,
    config: ClientConfig,
) -> list[int]:
    """SGLang's ``/v1/tokenize`` takes the messages form and renders it with the server's chat template (note:
    it passes tools through its own schema model, which adds ``description``/``defer_loading`` nulls)."""
    body: dict[str, Any] = {
        "model": config.model or "default",
        "messages": [dict(m) for m in messages],
        "add_generation_prompt": add_generation_prompt,
        "chat_template_kwargs": dict(chat_template_kwargs),
    }
    if tools:
        body["tools"] = [dict(t) for t in tools]
    raw = await server.request("POST", "/v1/tokenize", json_body=body, idempotent=True)
    return wire.token_list(raw, server.base_url)


@hookimpl
async def teacher_logprobs(
    server: Server, request: TeacherRequest, config: ClientConfig, options: SglangOptions
) -> TeacherLogprobs:
    if options.check_prompt_length:
        await _check_length(server, len(request.token_ids), 0)
    raw = await server.request("POST", "/generate", json_body=wire.teacher_payload(request), idempotent=True)
    return wire.parse_teacher(raw, request, server.base_url, image_token=_image_token(config))


# -- admin: liveness and state ----------------------------------------------------------------------------


async def _answers(server: Server, path: str) -> bool:
    """``True`` on 200, ``False`` on 503 (SGLang's "not now"); other failures raise."""
    try:
        await server.request("GET", path, plane="admin", expect="none", retry=False)
    except ServerStatusError as exc:
        if exc.status_code == 503:
            return False
        raise
    return True


@hookimpl
async def admin_health(server: Server) -> bool:
    # Liveness from a route the HTTP process answers itself: SGLang's /health is /health_generate (a 1-token
    # generation), which a paused server holds for 20 s, then answers 503 and marks itself unhealthy until the next
    # health check passes.
    return await _answers(server, "/model_info")


@hookimpl
async def admin_ready(server: Server) -> bool:
    return await _answers(server, "/health_generate")  # runs a 1-token generation: 503 while paused or asleep


@hookimpl
async def admin_state(server: Server) -> ServerState:
    info, loads, models = await asyncio.gather(
        control.read(server, "/model_info"), control.read(server, "/v1/loads"), control.read(server, "/v1/models")
    )
    url = server.admin_url
    return ServerState(
        paused=server.cache.get(_PAUSED),
        sleeping=server.cache.get(_SLEEPING),
        weight_version=wire.weight_version(info, url),
        in_flight=wire.in_flight(loads, url),
        loras=wire.lora_names(models, url),
    )


# -- admin: scheduling ------------------------------------------------------------------------------------


@hookimpl
async def admin_pause(server: Server, mode: PauseMode, clear_cache: bool, options: SglangOptions) -> bool:
    if mode == "wait":
        await control.drain(server, options)
    raw = await control.call(server, options, "POST", "/pause_generation", {"mode": _MODES[mode]})
    control.require_success(server, "/pause_generation", raw, key="status")
    server.cache[_PAUSED] = True
    if clear_cache and mode != "keep":
        await control.flush_cache(server, options)
    return True


@hookimpl
async def admin_resume(server: Server, options: SglangOptions) -> bool:
    raw = await control.call(server, options, "POST", "/continue_generation", {})
    control.require_success(server, "/continue_generation", raw, key="status")
    server.cache[_PAUSED] = False
    return True


@hookimpl
async def admin_flush_cache(server: Server, options: SglangOptions) -> bool:
    await control.flush_cache(server, options)
    return True


@hookimpl
async def admin_abort(server: Server, request_ids: Sequence[str] | None, options: SglangOptions) -> int:
    """SGLang aborts every request whose id starts with the given one (so ``n > 1`` samples, ``<id>_<i>``,
    go too) and answers an empty 200 whatever it found: the count is unknown."""
    bodies = [{"abort_all": True}] if request_ids is None else [{"rid": rid} for rid in request_ids if rid]
    for body in bodies:
        await control.call(server, options, "POST", "/abort_request", body, expect="none")
    return -1


@hookimpl
async def admin_sleep(server: Server, options: SglangOptions) -> bool:
    """``/release_memory_occupation`` of every tag (weights and KV cache) for both levels: whether weights
    survive is the server's ``--enable-weights-cpu-backup``. Needs ``--enable-memory-saver`` (and a GPU).

    SGLang's scheduler asserts it is idle here and dies otherwise, so a server with requests running, waiting
    or paused in place is refused before anything is sent."""
    pending = await control.in_flight(server)
    if pending:
        raise InvalidRequestError(
            f"{server.admin_url} has {pending} request(s) in flight: SGLang releases memory only when idle (its "
            "scheduler asserts it and exits otherwise); pause('abort') or let them finish first"
        )
    await control.call(server, options, "POST", "/release_memory_occupation", {}, expect="none")
    server.cache[_SLEEPING] = True
    return True


@hookimpl
async def admin_wake(server: Server, options: SglangOptions) -> bool:
    await control.call(server, options, "POST", "/resume_memory_occupation", {}, expect="none")
    server.cache[_SLEEPING] = False
    return True


# -- admin: weights ---------------------------------------------------------------------------------------


async def _flush_with_update(server: Server) -> bool:
    """Ask the update itself to flush only when nothing is in flight: SGLang treats a refused flush after a
    weight update as fatal, and refuses while requests run, wait or sit paused in place."""
    return await control.in_flight(server) == 0


@hookimpl
async def admin_update_weights(server: Server, path: str, version: str | None, options: SglangOptions) -> bool:
    body: dict[str, Any] = {
        "model_path": path,
        "abort_all_requests": False,
        "flush_cache": await _flush_with_update(server),
    }
    if version is not None:
        body["weight_version"] = version
    raw = await control.call(server, options, "POST", "/update_weights_from_disk", body)
    control.require_success(server, "/update_weights_from_disk", raw)
    return True


@hookimpl
async def admin_init_weight_transfer(server: Server, group: DistributedGroup, options: SglangOptions) -> bool:
    body = {
        "master_address": group.master_address,
        "master_port": group.master_port,
        "rank_offset": group.rank_offset,
        "world_size": group.world_size,
        "group_name": group.group_name,
        "backend": group.backend,
    }
    raw = await control.call(server, options, "POST", "/init_weights_update_group", body)
    control.require_success(server, "/init_weights_update_group", raw)
    return True


def _destroy_hint(group_name: str) -> StatusHint:
    def hint(status: int, body: Any) -> str | None:
        if status == 400 and isinstance(body, Mapping) and "does not exist" in str(body.get("message")):
            return (
                f"this server has no weight-update group {group_name!r}: it was never joined "
                "(init_weight_transfer) or was already destroyed"
            )
        return control._hint("/destroy_weights_update_group")(status, body)

    return hint


@hookimpl
async def admin_destroy_weight_transfer(server: Server, group_name: str, options: SglangOptions) -> bool:
    """``/destroy_weights_update_group``: SGLang answers 400 ``{"success": false, "message": "The group to be
    destroyed does not exist."}`` for a name it does not have (also the second time)."""
    path = "/destroy_weights_update_group"
    raw = await control.call(
        server, options, "POST", path, {"group_name": group_name}, status_hint=_destroy_hint(group_name)
    )
    control.require_success(server, path, raw)
    return True


def _dtype(name: str) -> str:
    return name.removeprefix("torch.")


@hookimpl
def weight_transfer_plan(tensors: Sequence[TensorSpec], bucket_bytes: int | None) -> TransferPlan:
    """One broadcast per tensor, or flattened buckets of at most ``bucket_bytes`` (``load_format:
    "flattened_bucket"``: one ``uint8`` broadcast per bucket, each announced by its own call)."""
    return one_by_one(tensors) if bucket_bytes is None else capped_buckets(tensors, bucket_bytes)


@hookimpl
async def admin_update_weights_distributed(
    server: Server,
    group_name: str,
    tensors: Sequence[TensorSpec],
    version: str | None,
    plan: TransferPlan | None,
    options: SglangOptions,
) -> bool:
    """``/begin_weight_update`` -> ``/update_weights_from_distributed`` per bucket -> ``/end_weight_update``
    (SGLang 0.5.23 refuses the update outside such a session); the session is closed even when the update
    fails. The version and the cache flush go with the last bucket, so a failure part-way leaves the version
    as it was."""
    buckets = [list(tensors)] if plan is None else [list(bucket) for bucket in plan.buckets]
    flush = await _flush_with_update(server)
    begun = await control.call(server, options, "POST", "/begin_weight_update", {})
    control.require_success(server, "/begin_weight_update", begun)
    try:
        for index, bucket in enumerate(buckets):
            last = index == len(buckets) - 1
            body: dict[str, Any] = {
                "names": [t.name for t in bucket],
                "dtypes": [_dtype(t.dtype) for t in bucket],
                "shapes": [list(t.shape) for t in bucket],
                "group_name": group_name,
                "abort_all_requests": False,
                "flush_cache": flush and last,
            }
            if plan is not None and plan.packed:
                body["load_format"] = "flattened_bucket"
            if version is not None and last:
                body["weight_version"] = version
            raw = await control.call(server, options, "POST", "/update_weights_from_distributed", body)
            control.require_success(server, "/update_weights_from_distributed", raw)
    except BaseException:
        try:
            await control.call(server, options, "POST", "/end_weight_update", {})
        except Exception:  # the update's own error is the one to report
            control.log.warning("%s: /end_weight_update failed after a failed update", server.admin_url)
        raise
    ended = await control.call(server, options, "POST", "/end_weight_update", {})
    control.require_success(server, "/end_weight_update", ended)
    return True


# -- admin: LoRA ------------------------------------------------------------------------------------------


@hookimpl
async def admin_load_lora(server: Server, adapter: LoraAdapter, options: SglangOptions) -> bool:
    """``adapter.replace`` on a loaded name unloads it first (SGLang has no in-place reload): requests naming
    the adapter between the two calls get a 400."""
    if adapter.replace and adapter.name in wire.lora_names(await control.read(server, "/v1/models"), server.admin_url):
        await admin_unload_lora(server, adapter.name, options)
    body = {"lora_name": adapter.name, "lora_path": adapter.path}
    raw = await control.call(server, options, "POST", "/load_lora_adapter", body)
    control.require_success(server, "/load_lora_adapter", raw)
    server.cache.setdefault(_UNLOADED, set()).discard(adapter.name)
    return True


@hookimpl
async def admin_unload_lora(server: Server, name: str, options: SglangOptions) -> bool:
    raw = await control.call(server, options, "POST", "/unload_lora_adapter", {"lora_name": name})
    control.require_success(server, "/unload_lora_adapter", raw)
    server.cache.setdefault(_UNLOADED, set()).add(name)
    return True
