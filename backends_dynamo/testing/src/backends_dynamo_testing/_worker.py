"""The worker's system port: ``/health``, ``/live``, ``/metrics`` and the ``/engine/<route>`` admin routes that
Dynamo's vLLM worker registers (RL routes with ``--enable-rl``, LoRA routes with ``--enable-lora``).

Shapes from the captures: JSON labelled ``text/plain``; a route that fails answers 200
``{"status": "error", "message"}``; an unknown route 404 ``{"error": "Route not found", "message"}``; a Python
exception 500 ``{"error": "Handler error", "message"}``. Behaviour: ``pause_generation`` modes keep / wait /
abort (aborted requests end with finish reason ``stop``), weight updates need a pause, ``abort_request`` wants
the bare request UUID and says ``ok`` for any id, loading a loaded adapter says ``already loaded`` (no hot
swap unless enabled), ``control/sleep`` takes the worker out of discovery until ``control/wake_up``.
The worker extension RPCs behind distributed weight transfer are missing, as on vLLM's CPU worker.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import httpx

from backends_dynamo_testing._deployment import Deployment
from backends_testkit.emulator import json_reply
from backends_testkit.engine import EngineError

__all__ = ["WorkerRoutes"]

_TEXT = "text/plain; charset=utf-8"
Body = Mapping[str, Any]
Route = Callable[[Body], Awaitable[dict[str, Any]]]
_CPU_WORKER = (
    "Call to collective_rpc method failed: Worker failed with error ''CPUWorker' object has no attribute '{}'', "
    "please check the stack trace above for the root cause"
)


def _local_dir(uri: str) -> Path | None:
    """The directory of a ``file://`` URI, if it exists (the only source the emulator can "download")."""
    parts = urlsplit(uri)
    path = Path(unquote(parts.path))
    return path if parts.scheme == "file" and path.is_dir() else None


def _error(message: str) -> dict[str, Any]:
    return {"status": "error", "message": message}


def _ok(message: str, **more: Any) -> dict[str, Any]:
    return {"status": "ok", "message": message, **more}


class WorkerRoutes:
    """Answers the worker system routes of one :class:`Deployment`."""

    def __init__(self, deployment: Deployment) -> None:
        self.d = deployment
        rl: dict[str, Route] = {
            "liveness_probe": self._liveness,
            "pause_generation": self._pause,
            "resume_generation": self._resume,
            "flush_cache": self._flush,
            "abort_request": self._abort,
            "get_weight_version": self._get_version,
            "set_weight_version": self._set_version,
            "update_weights_from_disk": self._update_from_disk,
            "update_weights_from_distributed": self._update_distributed,
            "update_weights_from_tensor": self._update_tensor,
            "init_weights_update_group": self._rpc_missing("init_broadcaster"),
            "destroy_weights_update_group": self._rpc_missing("destroy_broadcaster"),
        }
        self.routes: dict[str, Route] = {
            "control/sleep": self._sleep,
            "control/wake_up": self._wake,
            "control/start_profile": self._profile,
            "control/stop_profile": self._profile,
            "control/ep_capacity": self._ep_capacity,
            "control/scale_elastic_ep": self._scale_elastic_ep,
            "update/model_taints": self._model_taints,
            **(rl if deployment.enable_rl else {}),
        }
        if deployment.enable_lora:
            self.routes.update({"load_lora": self._load_lora, "unload_lora": self._unload_lora})

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path in ("/health", "/live"):
            return json_reply(200, self._health(), content_type=_TEXT)
        if path == "/metrics":
            return httpx.Response(200, text=self._metrics(), headers={"content-type": _TEXT})
        if path == "/metadata":
            return httpx.Response(404, text="Discovery metadata not available", headers={"content-type": _TEXT})
        if not path.startswith("/engine/"):
            return httpx.Response(404, text="Route not found", headers={"content-type": _TEXT})
        return await self.engine_route(path.removeprefix("/engine/"), request.content)

    async def engine_route(self, name: str, content: bytes) -> httpx.Response:
        """``/engine/<name>``; GET and POST alike (a GET has the body ``{}``)."""
        route = self.routes.get(name)
        if route is None:
            body = {"error": "Route not found", "message": f"Route /engine/{name} not found"}
            return json_reply(404, body, content_type=_TEXT)
        try:
            payload = json.loads(content) if content else {}
            if not isinstance(payload, Mapping):
                raise TypeError("the body must be a JSON object")
            answer = await route(payload)
        except (ValueError, TypeError, KeyError, EngineError) as exc:
            body = {"error": "Handler error", "message": f"Python callback failed: {type(exc).__name__}: {exc}"}
            return json_reply(500, body, content_type=_TEXT)
        return json_reply(200, answer, content_type=_TEXT)

    # -- health and metrics -------------------------------------------------------------------------

    def _health(self) -> dict[str, Any]:
        up = time.monotonic() - self.d.started
        endpoints = ["generate", "clear_kv_blocks", "get_perf_metrics", "list_loras"]
        if self.d.enable_rl:
            endpoints.insert(0, "rl")
        if self.d.enable_lora:
            endpoints += ["load_lora", "unload_lora"]
        return {
            "status": "ready",
            "uptime": {"secs": int(up), "nanos": int((up % 1) * 1e9)},
            "endpoints": dict.fromkeys(endpoints, "ready"),
        }

    def _metrics(self) -> str:
        state = self.d.engine.state()
        labels = (
            'dynamo_component="backend",dynamo_endpoint="generate",dynamo_namespace="dynamo",'
            f'worker_id="{self.d.worker_id:x}"'
        )
        model = f'engine="0",model_name="{self.d.model_name}"'
        return (
            "# HELP dynamo_component_inflight_requests Number of requests currently being processed by work handler\n"
            "# TYPE dynamo_component_inflight_requests gauge\n"
            f"dynamo_component_inflight_requests{{{labels}}} {state.in_flight + state.queued}\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{{{model}}} {state.in_flight}\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{{{model}}} {state.queued}\n"
        )

    # -- RL routes ----------------------------------------------------------------------------------

    async def _liveness(self, body: Body) -> dict[str, Any]:
        return {"status": "ok", "alive": True}

    async def _pause(self, body: Body) -> dict[str, Any]:
        mode = body.get("mode", "keep")
        if mode not in ("keep", "wait", "abort"):
            return _error(f"Invalid mode {mode!r}; expected keep|wait|abort")
        clear = bool(body.get("clear_cache", False))
        await self.d.engine.pause(mode)
        if clear:
            self.d.engine.flush_cache()
        return _ok("Engine paused", mode=mode, clear_cache=clear)

    async def _resume(self, body: Body) -> dict[str, Any]:
        await self.d.engine.resume()
        return _ok("Engine resumed")

    async def _flush(self, body: Body) -> dict[str, Any]:
        if not self.d.engine.flush_cache():
            return _error("Failed to flush cache: requests are in flight")
        return _ok("Cache flushed")

    async def _abort(self, body: Body) -> dict[str, Any]:
        rid = body.get("request_id")
        if rid is None:
            return _error("Missing 'request_id' in body")
        for engine_id in [r for r in self.d.requests if r == rid or r.startswith(f"{rid}-")]:  # n > 1: "<uuid>-<i>"
            self.d.engine.abort(engine_id)
        return {"status": "ok", "request_id": rid}

    def _version_answer(self) -> dict[str, Any]:
        declared = self.d.declared_version
        return {"status": "ok", "version": declared, "version_declared": declared is not None}

    async def _get_version(self, body: Body) -> dict[str, Any]:
        return self._version_answer()

    async def _set_version(self, body: Body) -> dict[str, Any]:
        if "weight_version" not in body:
            return _error("Missing 'weight_version' in body")
        version = body["weight_version"]
        self._declare(version)
        return {"status": "ok", "version": version}

    def _declare(self, version: Any) -> None:
        if version is not None:
            self.d.declared_version = version if isinstance(version, str) else json.dumps(version)
            self.d.engine.update_weight_version(self.d.declared_version)

    def _needs_pause(self) -> dict[str, Any] | None:
        if self.d.engine.state().paused:
            return None
        return _error(
            "Worker must be paused via pause_generation() before updating weights. "
            "Call pause_generation() first, then update, then resume_generation()."
        )

    async def _update_from_disk(self, body: Body) -> dict[str, Any]:
        if "model_path" not in body:
            return _error("Missing 'model_path' in body")
        refusal = self._needs_pause()
        if refusal is not None:
            return refusal
        try:
            self.d.engine.load_weights(str(body["model_path"]))
        except EngineError as exc:
            return _error(f"Failed to update weights: {exc}")
        self._declare(body.get("weight_version"))
        return self._version_answer()

    async def _update_distributed(self, body: Body) -> dict[str, Any]:
        rpc = body.get("engine_rpc", "update_weights_from_path")
        if rpc != "reload_weights":
            return _error(_CPU_WORKER.format(rpc))
        if not body.get("allow_unpaused") and (refusal := self._needs_pause()) is not None:
            return refusal
        try:
            self.d.engine.load_weights(str(body.get("weights_path", "")))
        except EngineError as exc:
            return _error(f"Call to collective_rpc method failed: {exc}")
        self._declare(body.get("weight_version"))
        return self._version_answer()

    async def _update_tensor(self, body: Body) -> dict[str, Any]:
        return _error("update_weights_from_tensor is not implemented")

    @staticmethod
    def _rpc_missing(method: str) -> Route:
        async def route(body: Body) -> dict[str, Any]:
            return _error(_CPU_WORKER.format(method))

        return route

    # -- control ------------------------------------------------------------------------------------

    async def _sleep(self, body: Body) -> dict[str, Any]:
        level = body.get("level", 1)
        if self.d.sleeping:
            return _ok("Engine already sleeping")
        await self.d.engine.sleep(int(level))
        self.d.sleeping = True
        return _ok(f"Engine slept (level={level})")

    async def _wake(self, body: Body) -> dict[str, Any]:
        if not self.d.sleeping:
            return _ok("Engine already awake")
        await self.d.engine.wake()
        self.d.sleeping = False
        self.d.unroutable_until = time.monotonic() + self.d.wake_lag
        return _ok("Engine woke")

    async def _profile(self, body: Body) -> dict[str, Any]:
        return _error(
            "Call to profile method failed: Worker failed with error 'Profiling is not enabled. Please set "
            "--profiler-config to enable profiling. Example: '--profiler-config.profiler=torch "
            "--profiler-config.torch_profiler_dir=YOUR_DIR_PATH_TO_DUMP_TRACE'', please check the stack trace "
            "above for the root cause"
        )

    async def _ep_capacity(self, body: Body) -> dict[str, Any]:
        return {
            "status": "ok",
            "data_parallel_size": 1,
            "tensor_parallel_size": 1,
            "data_parallel_backend": "mp",
            "data_parallel_external_lb": False,
            "total_gpus": None,
            "available_gpus": None,
            "used_gpus": None,
            "nodes": None,
        }

    async def _scale_elastic_ep(self, body: Body) -> dict[str, Any]:
        if "new_data_parallel_size" not in body:
            return _error("Missing required field: new_data_parallel_size")
        return _error("Elastic EP scaling is not supported by the emulator")

    async def _model_taints(self, body: Body) -> dict[str, Any]:
        taints = body.get("taints")
        if not isinstance(taints, list) or not all(isinstance(t, str) for t in taints):
            raise ValueError("'taints' must be a JSON array of strings")
        return {"status": "ok", "taints": taints}

    # -- LoRA ---------------------------------------------------------------------------------------

    async def _load_lora(self, body: Body) -> dict[str, Any]:
        name = body.get("lora_name")
        source = body.get("source")
        if not isinstance(name, str) or not name:
            return _error("'lora_name' is required in request")
        if not isinstance(source, Mapping) or not isinstance(source.get("uri"), str):
            return _error("'source' object is required in request")
        uri = source["uri"]
        lora_id = self.d.lora_id(name)
        hot_swap = name in self.d.loras
        if hot_swap and not self.d.lora_hot_swap:
            message = f"LoRA adapter '{name}' already loaded"
            return {"status": "success", "message": message, "lora_name": name, "lora_id": lora_id, "hot_swap": False}
        path = _local_dir(uri)
        if path is None:
            return _error(f"Failed to download LoRA: Download failed: Local LoRA not found: {uri}")
        try:
            self.d.engine.load_lora(name, path, replace=hot_swap)
        except EngineError as exc:
            return {"status": "error", "message": f"Failed to add LoRA '{name}': {exc}", "lora_name": name}
        self.d.loras[name] = (uri, lora_id)
        message = f"LoRA adapter '{name}' loaded successfully"
        return {"status": "success", "message": message, "lora_name": name, "lora_id": lora_id, "hot_swap": hot_swap}

    async def _unload_lora(self, body: Body) -> dict[str, Any]:
        name = body.get("lora_name")
        if name not in self.d.loras:
            return _error(f"LoRA adapter '{name}' not found. Available LoRAs: {list(self.d.loras)}")
        self.d.engine.unload_lora(str(name))
        _, lora_id = self.d.loras.pop(str(name))
        message = f"LoRA adapter '{name}' unloaded successfully"
        return {"status": "success", "message": message, "lora_name": name, "lora_id": lora_id}
