"""A Dynamo 1.6.1 deployment in-process: the OpenAI frontend and one ``dynamo.vllm`` worker's system port, over
the numpy :class:`~backends_testkit.engine.ReferenceEngine`.

One handler serves both. Requests to a worker URL (``worker_urls``, default :data:`WORKER_URL`) get the
worker's system routes (``/health``, ``/live``, ``/metrics``, ``/engine/<route>``); every other host gets the
frontend (``/health``, ``/live``, ``/metrics``, ``/v1/models``, ``/v1/models/{id}``, ``/v1/models/{id}/ready``,
``/busy_threshold``, ``/v1/chat/completions``, ``/v1/completions``). Unlike a real frontend, the emulated one
also answers ``/engine/<route>`` (for the worker) so that a single URL is enough in-process and in
``backends demo``; a real frontend answers those with 404.

``emulator.transport()`` is an in-process httpx transport, ``emulator.asgi()`` an ASGI app, and
:func:`backends_testkit.http_server.serve` puts ``emulator.handle`` on a real port.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

import httpx

from backends_dynamo_testing._deployment import Deployment, json_response
from backends_dynamo_testing._generation import Generation
from backends_dynamo_testing._schema import HttpError
from backends_dynamo_testing._text import Text
from backends_dynamo_testing._worker import WorkerRoutes
from backends_testkit.asgi import asgi_app
from backends_testkit.engine import ReferenceEngine

__all__ = ["WORKER_ID", "WORKER_URL", "DynamoEmulator"]

#: The worker system URL the emulator answers as, unless told others.
WORKER_URL = "http://dynamo-worker.test:8081"
#: The emulated worker's instance id: a u64 above 2**63, as real ones are.
WORKER_ID = 17251580120541680439


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.scheme, (parts.hostname or "").lower(), port


class DynamoEmulator:
    """Dynamo's frontend and one vLLM worker over ``engine``.

    :param engine: the engine the worker runs.
    :param routed_experts: return MoE routed experts in ``engine_data`` (as a worker started with
        ``--enable-return-routed-experts``; vLLM's CPU build cannot).
    :param model_name: the served model name (default: the engine's).
    :param worker_urls: the worker's system URLs (requests to them get the worker routes).
    :param enable_rl: register the RL admin routes (``--enable-rl``); without them only ``control/*`` exist.
    :param enable_lora: register ``load_lora`` / ``unload_lora`` (``--enable-lora``).
    :param lora_hot_swap: reload an adapter loaded under the same name (``DYN_LORA_HOTSWAP_ENABLED``).
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
    ) -> None:
        self.engine = engine
        self.deployment = Deployment(
            engine=engine,
            text=Text(engine.model_dir),
            model_name=model_name or engine.model_name,
            worker_id=WORKER_ID,
            routed_experts=routed_experts and engine.is_moe,
            enable_rl=enable_rl,
            enable_lora=enable_lora,
            lora_hot_swap=lora_hot_swap,
        )
        self.worker = WorkerRoutes(self.deployment)
        self.generation = Generation(self.deployment)
        self._workers = {_origin(u) for u in worker_urls}
        self._created = int(time.time())
        #: ``(method, url)`` of every request, in order.
        self.requests: list[tuple[str, str]] = []

    def transport(self) -> httpx.MockTransport:
        """An httpx transport that answers in-process."""
        return httpx.MockTransport(self.handle)

    def asgi(self) -> Callable[..., Any]:
        """The emulator as an ASGI application."""
        return asgi_app(self.handle)

    async def aclose(self) -> None:
        await self.engine.aclose()

    async def handle(self, request: httpx.Request) -> httpx.Response:
        """Answer one request as the frontend or, for a worker URL, as the worker's system port."""
        self.requests.append((request.method, str(request.url)))
        if _origin(str(request.url)) in self._workers:
            return await self.worker.handle(request)
        path = request.url.path
        if path.startswith("/engine/"):
            return await self.worker.engine_route(path.removeprefix("/engine/"), request.content)
        try:
            return await self._frontend(request, path)
        except HttpError as exc:
            return json_response(exc.status, exc.body)

    async def _frontend(self, request: httpx.Request, path: str) -> httpx.Response:
        method = request.method
        if method == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
            return await self.generation.handle(request, chat=path == "/v1/chat/completions")
        if method == "GET":
            answer = self._get(path)
            if answer is not None:
                return answer
        raise HttpError(404, f"Route not found: {method} {path}")

    def _get(self, path: str) -> httpx.Response | None:
        d = self.deployment
        if path == "/health":
            return json_response(200, self._health())
        if path == "/live":
            return json_response(200, {"status": "live", "message": "Service is live"})
        if path == "/metrics":
            return httpx.Response(200, text=self._metrics(), headers={"content-type": "text/plain; version=0.0.4"})
        if path == "/busy_threshold":
            return json_response(200, {"thresholds": [self._threshold(n) for n in d.served_names()]})
        if path == "/v1/models":
            return json_response(200, {"object": "list", "data": [self._model(n) for n in d.served_names()]})
        if path.startswith("/v1/models/"):
            name, _, rest = unquote(path.removeprefix("/v1/models/")).partition("/")
            if name not in d.served_names():
                raise HttpError(404, "Model not found")
            if rest == "ready":
                return json_response(200, self._ready(name))
            if not rest:
                return json_response(200, self._model(name))
        return None

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
