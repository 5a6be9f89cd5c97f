"""Admin shapes of Dynamo 1.6.1, pure functions (no I/O).

Frontend (``base_url``)::

    GET /health                  200 {"status": "healthy", "endpoints": [...], "instances": [...]}
    GET /v1/models               {"object": "list", "data": [{"id", "object", "created", "owned_by", ...}]}
                                 (loaded LoRA adapters are listed as models; a sleeping worker's are not)
    GET /v1/models/{id}/ready    {"model", "ready": bool, "namespaces": {...}}
    GET /metrics                 Prometheus text; dynamo_request_plane_inflight_requests is the in-flight gauge

Worker system port (``DYN_SYSTEM_PORT``)::

    GET  /health                 200 {"status": "ready", ...} | 503 {"status": "notready", ...}
    POST /engine/<route> {...}   200 {"status": "ok" | "success", ...} | 200 {"status": "error", "message"}
                                 | 404 {"error": "Route not found", "message": "Route /engine/<route> not found"}
                                 | 500 {"error": "Handler error", "message"}

A 200 whose body says ``"status": "error"`` is a failure (:class:`ServerRefusedError`), whatever HTTP says.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from backends_core.errors import ResponseParseError, ServerRefusedError
from backends_dynamo._json import Node

__all__ = [
    "ENGINE_PREFIX",
    "already_loaded",
    "engine_answer",
    "frontend_healthy",
    "gauge",
    "is_frontend_404",
    "lora_not_found",
    "lora_uri",
    "missing_route_hint",
    "model_ids",
    "model_ready",
    "needs_pause",
    "weight_version",
    "worker_ready",
]

ENGINE_PREFIX = "/engine/"
_OK = ("ok", "success")
_LORA_ROUTES = ("load_lora", "unload_lora")
_SAMPLE = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{[^}]*\})?\s+(?P<value>\S+)")


def engine_answer(raw: Any, route: str, *, url: str, method: str = "POST") -> Mapping[str, Any]:
    """The body of a successful ``/engine/<route>`` call.

    :raises ServerRefusedError: the body says ``"status": "error"`` (or any status but ok/success).
    :raises ResponseParseError: the body is not an object with a ``status``.
    """
    body = Node(raw, "$", url)
    status = body.get("status").string()
    if status not in _OK:
        raise ServerRefusedError(f"/engine/{route}", method=method, url=url, body=raw)
    return body.obj()


def needs_pause(error: ServerRefusedError) -> bool:
    """Whether a refused weight update asks for ``pause_generation`` first."""
    body = error.body if isinstance(error.body, Mapping) else {}
    return "paused" in str(body.get("message", "")).lower()


def already_loaded(answer: Mapping[str, Any]) -> bool:
    """Whether a ``load_lora`` success only says the name was loaded before (the new path was NOT loaded;
    Dynamo swaps in place only with ``DYN_LORA_HOTSWAP_ENABLED``, and then says ``hot_swap: true``)."""
    return answer.get("hot_swap") is not True and "already loaded" in str(answer.get("message", ""))


def lora_not_found(error: BaseException | None) -> bool:
    """Whether a refused ``unload_lora`` says the worker has no adapter of that name
    (``"LoRA adapter '<name>' not found. Available LoRAs: [...]"``)."""
    if not isinstance(error, ServerRefusedError) or not isinstance(error.body, Mapping):
        return False
    message = str(error.body.get("message", ""))
    return message.startswith("LoRA adapter") and "not found" in message


def weight_version(answer: Mapping[str, Any]) -> str | None:
    """The version in a ``get_weight_version`` / ``update_weights_*`` answer; ``None`` until one is declared."""
    if answer.get("version_declared") is False or answer.get("version") is None:
        return None
    value = answer["version"]
    return value if isinstance(value, str) else str(value)


def is_frontend_404(body: Any) -> bool:
    """A 404 in the frontend's error shape (``{"message", "type": "Not Found", "code"}``), not a worker's."""
    return isinstance(body, Mapping) and body.get("type") == "Not Found" and "code" in body


def missing_route_hint(route: str, url: str) -> str:
    """Why a worker may lack ``/engine/<route>``."""
    if route in _LORA_ROUTES:
        why = "LoRA routes exist only when dynamo.vllm runs with --enable-lora (and DYN_LORA_ENABLED=true)"
    else:
        why = "RL admin routes exist only when the worker runs with --enable-rl (the mocker registers none)"
    return f"worker {url} has no {ENGINE_PREFIX}{route} (404): {why}"


def lora_uri(path: str) -> str:
    """``source.uri`` of an adapter: URIs pass through, local paths become absolute ``file://`` URIs."""
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", path):
        return path
    return Path(path).absolute().as_uri()


def frontend_healthy(raw: Any, url: str) -> bool:
    """The frontend's ``/health``: healthy when ``status`` is ``healthy``."""
    return Node(raw, "$", url).get("status").string() == "healthy"


def worker_ready(raw: Any, url: str) -> bool:
    """A worker system port's ``/health``: ready when ``status`` is ``ready``."""
    return Node(raw, "$", url).get("status").string() == "ready"


def model_ready(raw: Any, url: str) -> bool:
    """``/v1/models/{id}/ready``."""
    return Node(raw, "$", url).get("ready").boolean()


def model_ids(raw: Any, url: str) -> list[str]:
    """Every served name in ``/v1/models`` (base models and LoRA adapters alike)."""
    return [entry.get("id").string() for entry in Node(raw, "$", url).get("data").items()]


def gauge(text: str, name: str, url: str | None = None) -> float | None:
    """The sum over label sets of a Prometheus sample ``name``; ``None`` when the text has none.

    :raises ResponseParseError: a sample of ``name`` whose value is not a number.
    """
    total, found = 0.0, False
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or match["name"] != name:
            continue
        try:
            value = float(match["value"])
        except ValueError as exc:
            raise ResponseParseError(f"metric {name} has value {match['value']!r}", url=url) from exc
        if not math.isnan(value):
            total, found = total + value, True
    return total if found else None
