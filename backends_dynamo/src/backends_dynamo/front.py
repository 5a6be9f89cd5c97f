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

import logging
from collections.abc import Mapping
from typing import Any, ClassVar

from backends_core.config import FrontConfig, _urls
from backends_core.errors import ConfigError, FrontError
from backends_core.fronts import Front, Replica
from backends_core.server import Server

__all__ = ["DynamoFront", "rl_workers"]

log = logging.getLogger("backends_dynamo.front")

#: Where the frontend lists its workers for RL (on ``DYN_RL_PORT``).
RL_WORKERS = "/v1/rl/workers"


def rl_workers(raw: Any, front: Front, known: Mapping[str, str] | None = None) -> list[Replica]:
    """The workers of a ``GET /v1/rl/workers`` answer, by system URL.

    A worker that stopped answering stays listed for a while (until its discovery lease expires: about 10 s seen)
    as ``{"instance_id", "error": "Unavailable: ...", "routes": []}`` with no system URL: it is returned as an
    unhealthy replica (no admin operation goes to it) when ``known`` (instance id -> system URL, from earlier
    lists) names it, and left out otherwise.

    :raises FrontError: the answer is not in that shape (naming the ``$.path``).
    """
    if not isinstance(raw, Mapping) or not isinstance(raw.get("workers"), list):
        raise front.error(f"GET {RL_WORKERS}: expected {{'workers': [...]}} @ $.workers, got {str(raw)[:200]}")
    out = []
    for i, item in enumerate(raw["workers"]):
        if not isinstance(item, Mapping):
            raise front.error(f"GET {RL_WORKERS}: expected an object @ $.workers[{i}], got {item!r}")
        instance = item.get("instance_id")
        worker_id = None if instance is None else str(instance)
        url = item.get("system_url")
        if url is None and isinstance(item.get("error"), str):
            was = (known or {}).get(worker_id or "")
            if was is not None:
                out.append(Replica(url=was, id=worker_id, healthy=False))
            else:
                log.warning("%s lists worker %s unavailable (%s): left out", front.url, worker_id, item["error"])
            continue
        if not isinstance(url, str):
            raise front.error(f"GET {RL_WORKERS}: no system URL @ $.workers[{i}].system_url, got {item!r}")
        try:
            (url,) = _urls(url)
        except ConfigError as exc:
            raise front.error(f"GET {RL_WORKERS}: {exc} @ $.workers[{i}].system_url") from exc
        out.append(Replica(url=url, id=worker_id, healthy=True))
    return out


class DynamoFront(Front):
    """Dynamo's frontend: workers from ``GET /v1/rl/workers`` (``FrontConfig.workers_url``: the RL port)."""

    kind: ClassVar[str] = "dynamo"
    #: Dynamo's own session header; honoured only by a frontend started with ``--router-session-affinity-ttl-secs``
    #: (``DYN_ROUTER_SESSION_AFFINITY_TTL_SECS``), which a client cannot see from outside.
    session_header: ClassVar[str | None] = "x-dynamo-session-id"
    admin_through_front: ClassVar[bool] = True

    def __init__(self, server: Server, config: FrontConfig) -> None:
        super().__init__(server, config)
        self._known: dict[str, str] = {}

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
        listed = rl_workers(raw, self, self._known)
        self._known.update({r.id: r.url for r in listed if r.id is not None})
        return listed
