"""A Dynamo 1.6.1 deployment in-process: the OpenAI frontend and one ``dynamo.vllm`` worker's system port, over
the numpy :class:`~backends_testkit.engine.ReferenceEngine`.

One handler serves both. Requests to a worker URL (``worker_urls``, default :data:`WORKER_URL`) get the
worker's system routes (``/health``, ``/live``, ``/metrics``, ``/engine/<route>``); every other host gets the
frontend (``/health``, ``/live``, ``/metrics``, ``/v1/models``, ``/v1/models/{id}``, ``/v1/models/{id}/ready``,
``/busy_threshold``, ``/v1/chat/completions``, ``/v1/completions``, and ``/v1/rl/workers``, the RL worker list).
Unlike a real frontend, the emulated one also answers ``/engine/<route>`` (for the worker) and ``/v1/rl/workers``
(a real one serves it on ``DYN_RL_PORT`` when started with ``DYN_ENABLE_RL=true``) so that a single URL is enough
in-process and in ``backends demo``; a real frontend answers those with 404 on its HTTP port.

Written on the test kit's :class:`~backends_testkit.emulator.EmulatorBase`: ``emulator.transport()`` answers
in-process, ``emulator.asgi()`` under an ASGI server, ``emulator.serve()`` on a real port.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

import httpx

from backends_dynamo_testing._deployment import Deployment
from backends_dynamo_testing._generation import Generation
from backends_dynamo_testing._schema import HttpError
from backends_dynamo_testing._text import Text
from backends_dynamo_testing._worker import WorkerRoutes
from backends_testkit.emulator import ANY_METHOD, GET, EmulatorBase, Route, json_reply
from backends_testkit.engine import ReferenceEngine

__all__ = ["WORKER_ID", "WORKER_URL", "DynamoEmulator"]

#: The routes a worker started with ``--enable-rl`` lists in ``/v1/rl/workers``.
RL_ROUTES = frozenset(
    {
        "abort_request",
        "destroy_weights_update_group",
        "flush_cache",
        "get_weight_version",
        "init_weights_update_group",
        "liveness_probe",
        "load_lora",
        "pause_generation",
        "resume_generation",
        "set_weight_version",
        "unload_lora",
        "update_weights_from_disk",
        "update_weights_from_distributed",
        "update_weights_from_tensor",
    }
)
#: The worker system URL the emulator answers as, unless told others.
WORKER_URL = "http://dynamo-worker.test:8081"
#: The emulated worker's instance id: a u64 above 2**63, as real ones are.
WORKER_ID = 17251580120541680439


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.scheme, (parts.hostname or "").lower(), port


class DynamoEmulator(EmulatorBase):
    """Dynamo's frontend and one vLLM worker over ``engine``.

    :param engine: the engine the worker runs.
    :param routed_experts: return MoE routed experts in ``engine_data`` (as a worker started with
        ``--enable-return-routed-experts``; vLLM's CPU build cannot).
    :param model_name: the served model name (default: the engine's).
    :param worker_urls: the worker's system URLs (requests to them get the worker routes).
    :param enable_rl: register the RL admin routes (``--enable-rl``); without them only ``control/*`` exist.
    :param enable_lora: register ``load_lora`` / ``unload_lora`` (``--enable-lora``).
    :param lora_hot_swap: reload an adapter loaded under the same name (``DYN_LORA_HOTSWAP_ENABLED``).
    :param wake_lag: seconds after ``control/wake_up`` during which the model is ready and listed but routed
        requests get 503 (see :class:`~backends_dynamo_testing._deployment.Deployment`).
    """

    def __init__(
        self,
        engine: ReferenceEngine,
        *,
        routed_experts: bool = False,
        model_name: str | None = None,
        worker_urls: Sequence[str] = (WORKER_URL,),
        enable_rl: bool = True,
        enable_lora: bool = True,
        lora_hot_swap: bool = False,
        wake_lag: float = 0.0,
    ) -> None:
        super().__init__(engine)
        self.deployment = Deployment(
            engine=engine,
            text=Text(engine.model_dir),
            model_name=model_name or engine.model_name,
            worker_id=WORKER_ID,
            routed_experts=routed_experts and engine.is_moe,
            enable_rl=enable_rl,
            enable_lora=enable_lora,
            lora_hot_swap=lora_hot_swap,
            wake_lag=wake_lag,
        )
        self.worker = WorkerRoutes(self.deployment)
        self.generation = Generation(self.deployment)
        self._workers = {_origin(u) for u in worker_urls}
        self._worker_urls = [u.rstrip("/") for u in worker_urls]
        self._created = int(time.time())

    def routes(self) -> dict[str, Route]:
        """The frontend's routes (``/v1/models/{id}`` and ``/engine/<route>`` are found by :meth:`find_route`)."""

        def get(answer: Callable[[], httpx.Response]) -> Route:
            async def handler(request: httpx.Request) -> httpx.Response:
                return answer()

            return Route(handler, methods=GET, level="open")

        return {
            "/v1/chat/completions": Route(self._chat, level="open"),
            "/v1/completions": Route(self._completions, level="open"),
            "/health": get(lambda: json_reply(200, self._health())),
            "/live": get(lambda: json_reply(200, {"status": "live", "message": "Service is live"})),
            "/metrics": get(self._metrics_answer),
            "/busy_threshold": get(
                lambda: json_reply(200, {"thresholds": [self._threshold(n) for n in self.deployment.served_names()]})
            ),
            "/v1/models": get(
                lambda: json_reply(
                    200, {"object": "list", "data": [self._model(n) for n in self.deployment.served_names()]}
                )
            ),
            "/v1/rl/workers": get(lambda: json_reply(200, self._rl_workers())),
        }

    def _rl_workers(self) -> dict[str, Any]:
        """The RL worker list (``../wire/dynamo-vllm/rl_workers.json``): workers started with ``--enable-rl``."""
        workers = [
            {
                "namespace": "dynamo",
                "component": "backend",
                "endpoint": "rl",
                "instance_id": WORKER_ID + i,
                "transport": {"tcp": f"127.0.0.1:{35581 + i}/{i:016x}/dynamo/backend/rl"},
                "request_plane_url": "dyn://dynamo.backend.rl",
                "system_url": url,
                "model": self.deployment.model_name,
                "routes": sorted(RL_ROUTES),
                "world_size": 1,
            }
            for i, url in enumerate(self._worker_urls)
            if self.deployment.enable_rl
        ]
        return {"protocol_version": 1, "namespace": "dynamo", "workers": workers}

    def find_route(self, request: httpx.Request) -> Route | None:
        """A worker URL gets the worker's system port; ``/engine/<route>`` the worker's engine routes; the rest the
        frontend."""
        if _origin(str(request.url)) in self._workers:
            return self._worker_port
        path = request.url.path
        if path.startswith("/engine/"):
            return self._engine_routes
        if path.startswith("/v1/models/"):
            return self._model_routes
        return super().find_route(request)

    def log_entry(self, request: httpx.Request) -> tuple[str, str]:
        return request.method, str(request.url)  # the host tells the frontend from the worker

    def not_found(self, request: httpx.Request) -> httpx.Response:
        return HttpError(404, f"Route not found: {request.method} {request.url.path}").response

    method_not_allowed = not_found  # the frontend's router answers an unknown method like an unknown path

    @functools.cached_property
    def _worker_port(self) -> Route:
        return Route(self.worker.handle, methods=ANY_METHOD, level="open")

    @functools.cached_property
    def _engine_routes(self) -> Route:
        async def handler(request: httpx.Request) -> httpx.Response:
            return await self.worker.engine_route(request.url.path.removeprefix("/engine/"), request.content)

        return Route(handler, methods=ANY_METHOD, level="open")

    @functools.cached_property
    def _model_routes(self) -> Route:
        async def handler(request: httpx.Request) -> httpx.Response:
            name, _, rest = unquote(request.url.path.removeprefix("/v1/models/")).partition("/")
            if name not in self.deployment.served_names():
                raise HttpError(404, "Model not found")
            if rest == "ready":
                return json_reply(200, self._ready(name))
            if not rest:
                return json_reply(200, self._model(name))
            return self.not_found(request)

        return Route(handler, methods=GET, level="open")

    async def _chat(self, request: httpx.Request) -> httpx.Response:
        return await self.generation.handle(request, chat=True)

    async def _completions(self, request: httpx.Request) -> httpx.Response:
        return await self.generation.handle(request, chat=False)

    def _names(self) -> list[str]:
        return self.deployment.served_names()

    def _metrics_answer(self) -> httpx.Response:
        return httpx.Response(200, text=self._metrics(), headers={"content-type": "text/plain; version=0.0.4"})

    # -- frontend bodies ----------------------------------------------------------------------------

    def _health(self) -> dict[str, Any]:
        instance = {
            "component": "backend",
            "endpoint": "generate",
            "namespace": "dynamo",
            "instance_id": WORKER_ID,
            "transport": {"tcp": f"127.0.0.1:41261/{WORKER_ID:x}/dynamo/backend/generate"},
            "device_type": "cpu",
            "request_plane_codec": "msgpack",
        }
        instances = [] if self.deployment.sleeping else [instance]
        return {"status": "healthy", "endpoints": ["dyn://dynamo.backend.generate"], "instances": instances}

    def _model(self, name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": self._created,
            "owned_by": "nvidia",
            "context_window": self.engine.max_model_len,
        }

    def _ready(self, name: str) -> dict[str, Any]:
        workers = {"aggregated": {"workers": 1, "needs": []}}
        namespace = {"ready": True, "worker_types": workers, "present": ["aggregated"], "missing_worker_types": []}
        return {"model": name, "ready": True, "namespaces": {"dynamo": namespace}}

    @staticmethod
    def _threshold(name: str) -> dict[str, Any]:
        return {
            "model": name,
            "active_decode_blocks_threshold": None,
            "active_prefill_tokens_threshold": None,
            "active_prefill_tokens_threshold_frac": None,
        }

    def _metrics(self) -> str:
        ready = 0 if self.deployment.sleeping else 1
        return (
            "# HELP dynamo_request_plane_inflight_requests Currently in-flight requests at AddressedPushRouter\n"
            "# TYPE dynamo_request_plane_inflight_requests gauge\n"
            f"dynamo_request_plane_inflight_requests {self.deployment.in_flight()}\n"
            "# TYPE dynamo_frontend_model_ready gauge\n"
            f'dynamo_frontend_model_ready{{model="{self.deployment.model_name}"}} {ready}\n'
        )
