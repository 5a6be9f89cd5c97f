"""Dynamo's frontend as a router front (``[front] kind = "dynamo"``): workers discovered for admin.

Dynamo 1.6.1's frontend started with ``DYN_ENABLE_RL=true DYN_RL_PORT=<port>`` lists its workers at
``GET /v1/rl/workers`` on that port (the HTTP port answers 404), each with the system URL where its
``/engine/<route>`` admin routes live (workers started with ``--enable-rl``)::

    {"protocol_version": 1, "namespace": "dynamo",
     "workers": [{"instance_id": ..., "system_url": "http://127.0.0.1:8281", "model": "...", "routes": [...]}]}

Admin operations keep going to the frontend's server: this backend's admin hooks fan out to the workers
themselves (the frontend for health, readiness and state; each worker's system port for the rest), now to the
workers discovered here instead of ``backend_options.worker_urls``. Workers register themselves (Dynamo's
discovery): the client takes no registrations.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from backends_core.config import _urls
from backends_core.errors import ConfigError, FrontError
from backends_core.fronts import Front, Replica

__all__ = ["DynamoFront", "rl_workers"]

#: Where the frontend lists its workers for RL (on ``DYN_RL_PORT``).
RL_WORKERS = "/v1/rl/workers"


def rl_workers(raw: Any, front: Front) -> list[Replica]:
    """The workers of a ``GET /v1/rl/workers`` answer, by system URL.

    :raises FrontError: the answer is not in that shape (naming the ``$.path``).
    """
    if not isinstance(raw, Mapping) or not isinstance(raw.get("workers"), list):
        raise front.error(f"GET {RL_WORKERS}: expected {{'workers': [...]}} @ $.workers, got {str(raw)[:200]}")
    out = []
    for i, item in enumerate(raw["workers"]):
        url = item.get("system_url") if isinstance(item, Mapping) else None
        if not isinstance(url, str):
            raise front.error(f"GET {RL_WORKERS}: no system URL @ $.workers[{i}].system_url, got {item!r}")
        try:
            (url,) = _urls(url)
        except ConfigError as exc:
            raise front.error(f"GET {RL_WORKERS}: {exc} @ $.workers[{i}].system_url") from exc
        instance = item.get("instance_id")
        out.append(Replica(url=url, id=None if instance is None else str(instance)))
    return out


class DynamoFront(Front):
    """Dynamo's frontend: workers from ``GET /v1/rl/workers`` (``FrontConfig.workers_url``: the RL port)."""

    kind: ClassVar[str] = "dynamo"
    session_header: ClassVar[str | None] = None
    admin_through_front: ClassVar[bool] = True

    async def replicas(self) -> list[Replica]:
        try:
            raw = await self._call("GET", RL_WORKERS)
        except FrontError as exc:
            if self.config.workers_url is None:
                raise self.error(
                    f"{exc}; Dynamo lists its workers on the port DYN_RL_PORT of a frontend started with "
                    "DYN_ENABLE_RL=true: set front.workers_url to it"
                ) from exc
            raise
        return rl_workers(raw, self)
