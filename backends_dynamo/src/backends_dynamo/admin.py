"""Admin hooks of the ``dynamo`` backend: the frontend for health, readiness and state, every worker's
``/engine/<route>`` for the rest, and what Dynamo 1.6.1 does not report kept client-side.

Workers. Where admin calls go: the frontend (``base_url``) and every worker's system URL, with Dynamo's failures
turned into errors that say what to do.

Admin routes of Dynamo 1.6.1 live on each worker's system port as ``/engine/<route>``, not on the frontend
(where they answer 404). A worker without a route (no ``--enable-rl``, no ``--enable-lora``, the mocker)
answers 404 too, in another shape; the two are told apart:

* frontend-shaped 404: :class:`ConfigError` (the worker URLs are not configured);
* worker-shaped 404: :class:`UnsupportedOperationError` naming the route and the flag that adds it.

An operation that changes the workers runs on each of them to the end (:func:`each_worker`) and reports every
worker's outcome when one failed (:func:`raise_for`): with several workers behind one frontend, a failure on one
of them can leave the others changed (new weights, an adapter, a pause), and the caller needs to know which.

All I/O goes through the core :class:`~backends_core.server.Server`; a worker is the same server handle with
its admin URL pointed at the worker (same connection pool, same per-server cache).

Client-side state. What this client knows about a Dynamo frontend that Dynamo 1.6.1 does not report, kept per
server in ``Server.cache``.

* Pause and sleep state: 1.6.1 has no route that reports them; they are what this client last set
  (``None`` until it set them).
* The weight version: not attached to answers; it is the version this client last set or read, attached to a
  result only when it did not change while the request was in flight. It is unknown (``None``) from the start
  of a weight update until the update succeeded on every worker, so a failed update leaves no version to trust
  until ``state()`` reads the workers' versions again.
* Aborts: aborted requests end with ``finish_reason: "stop"``; a request that was in flight when this client
  aborted it (pause with mode abort, abort of its id, abort of everything) is reported as aborted.
* Request ids: the frontend takes its request id from the ``x-dynamo-request-id`` header (a UUID) and the
  worker's ``abort_request`` wants that bare UUID; caller ids map to UUIDs deterministically, and the
  in-flight ones are remembered so an abort reaches every sample of a fanned-out request.

Wire shapes. The admin answers of Dynamo 1.6.1, read by pure functions (no I/O).

Frontend (``base_url``)::

    GET /health                  200 {"status": "healthy", "endpoints": [...],
                                      "instances": [{"endpoint": "generate", "instance_id": u64, ...}, ...]}
    GET /v1/models               {"object": "list", "data": [{"id", "object", "created", "owned_by", ...}]}
                                 (loaded LoRA adapters are listed as models; a sleeping worker's are not)
    GET /v1/models/{id}/ready    {"model", "ready": bool, "namespaces": {...}}
    GET /metrics                 Prometheus text; dynamo_request_plane_inflight_requests is the in-flight gauge
    POST /v1/completions {"model", "prompt": [0], "max_tokens": 1, "nvext": {"backend_instance_id": u64}}
                                 200 | 503 (the instance is not routable yet) | 400 (an unknown instance)

Worker system port (``DYN_SYSTEM_PORT``)::

    GET  /health                 200 {"status": "ready", ...} | 503 {"status": "notready", ...}
    POST /engine/<route> {...}   200 {"status": "ok" | "success", ...} | 200 {"status": "error", "message"}
                                 | 404 {"error": "Route not found", "message": "Route /engine/<route> not found"}
                                 | 500 {"error": "Handler error", "message"}

A 200 whose body says ``"status": "error"`` is a failure (:class:`ServerRefusedError`), whatever HTTP says.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import attrs

from backends_core import Server, hookimpl
from backends_core.config import ClientConfig
from backends_core.errors import (
    AdminError,
    ConfigError,
    FrontError,
    InvalidRequestError,
    RequestError,
    RequestTimeout,
    ResponseParseError,
    ServerRefusedError,
    ServerStatusError,
    UnsupportedOperationError,
)
from backends_core.errors import UnsupportedOperationError as Unsupported
from backends_core.fleet import ServerOutcome
from backends_core.jsonnode import Node
from backends_core.transfer import one_by_one
from backends_core.types import DistributedGroup, LoraAdapter, PauseMode, ServerState, TensorSpec, TransferPlan
from backends_dynamo.options import DynamoOptions

__all__ = [
    "ENGINE_PREFIX",
    "Flight",
    "REQUEST_ID_HEADER",
    "Tracker",
    "admin_abort",
    "admin_destroy_weight_transfer",
    "admin_flush_cache",
    "admin_health",
    "admin_init_weight_transfer",
    "admin_load_lora",
    "admin_pause",
    "admin_ready",
    "admin_resume",
    "admin_sleep",
    "admin_state",
    "admin_unload_lora",
    "admin_update_weights",
    "admin_update_weights_distributed",
    "admin_wake",
    "already_loaded",
    "at",
    "dynamo_request_id",
    "each_worker",
    "engine_answer",
    "engine_call",
    "frontend",
    "frontend_healthy",
    "gather_all",
    "gauge",
    "generate_instances",
    "is_frontend_404",
    "lora_not_found",
    "lora_uri",
    "missing_route_hint",
    "model_ids",
    "model_ready",
    "names",
    "needs_pause",
    "on_workers",
    "raise_for",
    "refused",
    "tracker",
    "wake_probe",
    "weight_version",
    "worker_ready",
    "worker_urls",
    "weight_transfer_plan",
]


# -- wire shapes (pure functions, no I/O) -----------------------------------------------------------------


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


def generate_instances(raw: Any, url: str) -> list[int]:
    """Instance ids of the ``generate`` endpoints the frontend's ``/health`` lists (one per serving worker)."""
    instances = Node(raw, "$", url).get("instances").items()
    return [i.get("instance_id").integer() for i in instances if i.get("endpoint").string() == "generate"]


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


# -- client-side state ------------------------------------------------------------------------------------


#: The header the Dynamo frontend reads its request id from (it must be a UUID).
REQUEST_ID_HEADER = "x-dynamo-request-id"
_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://pypi.org/project/backends-dynamo/request-id")
_KEY = "dynamo.tracker"


def dynamo_request_id(caller_id: str | None, sample: int = 0) -> str:
    """The UUID sent for sample ``sample`` of a request: the caller's id itself when it is a UUID (sample 0),
    a name-based UUID of it otherwise, a random one without a caller id."""
    if caller_id is None:
        return str(uuid.uuid4())
    if sample == 0:
        try:
            return str(uuid.UUID(caller_id))
        except ValueError:
            return str(uuid.uuid5(_NAMESPACE, caller_id))
    return str(uuid.uuid5(_NAMESPACE, f"{caller_id}#{sample}"))


@attrs.frozen
class Flight:
    """One request in flight: its UUID, the caller's id, and the tracker's counters when it started."""

    uuid: str
    caller_id: str | None
    abort_epoch: int
    version_epoch: int


@attrs.define(eq=False)
class Tracker:
    """Client-side state of one frontend (and the workers behind it)."""

    paused: bool | None = None
    sleeping: bool | None = None
    weight_version: str | None = None
    #: The frontend answered with another request id than the one sent in ``x-dynamo-request-id``.
    ignores_request_ids: bool = False
    _abort_epoch: int = 0
    _version_epoch: int = 0
    _aborted: set[str] = attrs.field(factory=set)
    _in_flight: dict[str, str | None] = attrs.field(factory=dict)
    #: Set whenever a request ends.
    _ended: asyncio.Event = attrs.field(factory=asyncio.Event)

    def begin(self, request_uuid: str, caller_id: str | None) -> Flight:
        """Record a request about to be sent."""
        self._in_flight[request_uuid] = caller_id
        return Flight(request_uuid, caller_id, self._abort_epoch, self._version_epoch)

    def end(self, flight: Flight) -> tuple[bool, str | None]:
        """Forget a finished request; returns whether this client aborted it while in flight, and the weight
        version when it was known and did not change meanwhile."""
        self._in_flight.pop(flight.uuid, None)
        self._ended.set()
        aborted = flight.abort_epoch != self._abort_epoch or flight.uuid in self._aborted
        self._aborted.discard(flight.uuid)
        version = self.weight_version if flight.version_epoch == self._version_epoch else None
        return aborted, version

    def in_flight(self) -> frozenset[str]:
        """The UUIDs of the requests in flight now."""
        return frozenset(self._in_flight)

    async def answered(self, uuids: frozenset[str]) -> None:
        """Return once none of ``uuids`` is in flight any more (each answer arrived or its request failed)."""
        while any(u in self._in_flight for u in uuids):
            self._ended.clear()
            await self._ended.wait()

    def abort_everything(self) -> list[str]:
        """Mark every request now in flight as aborted (pause with mode abort, abort of all); their UUIDs."""
        self._abort_epoch += 1
        return list(self._in_flight)

    def abort_ids(self, caller_ids: list[str]) -> list[str]:
        """Mark the requests of these caller ids as aborted; the UUIDs to send (the in-flight samples, plus the
        derived UUID of each id, for requests this client does not know about)."""
        wanted = set(caller_ids)
        uuids = [u for u, caller in self._in_flight.items() if caller in wanted]
        uuids.extend(dynamo_request_id(c) for c in caller_ids)
        uuids = list(dict.fromkeys(uuids))
        self._aborted.update(u for u in uuids if u in self._in_flight)
        return uuids

    def set_weight_version(self, version: str | None) -> None:
        """The server now serves ``version`` (``None``: unknown); requests in flight get no version."""
        self.weight_version = version
        self._version_epoch += 1


def tracker(server: Server) -> Tracker:
    """The :class:`Tracker` of ``server`` (created on first use)."""
    found = server.cache.get(_KEY)
    if not isinstance(found, Tracker):
        found = server.cache[_KEY] = Tracker()
    return found


# -- where admin calls go ---------------------------------------------------------------------------------


T = TypeVar("T")
BACKEND = "dynamo"


def at(server: Server, url: str) -> Server:
    """``server`` with its admin plane pointed at ``url`` (shares the pools and the cache)."""
    return attrs.evolve(server, admin_url=url.rstrip("/"), cache=server.cache)


def frontend(server: Server) -> Server:
    """The frontend, on the admin pool."""
    return at(server, server.base_url)


def worker_urls(server: Server, options: DynamoOptions) -> tuple[str, ...]:
    """System URLs of the workers behind ``server``: as its front discovered them (``[front] kind = "dynamo"``),
    else as configured."""
    if server.replicas is not None:
        if not server.replicas:  # an operation on no worker would report success for nothing
            raise FrontError(server.base_url, "dynamo", "no worker behind it serves (none listed, or none caught up)")
        return server.replicas
    return options.workers(server.base_url, server.admin_url)


async def gather_all(calls: Iterable[Awaitable[T]]) -> list[T]:
    """Run every call to the end; if any failed, raise the first failure (the others are added as notes)."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        first = errors[0]
        for other in errors[1:]:
            first.add_note(f"also failed: {type(other).__name__}: {other}")
        raise first
    return [r for r in results if not isinstance(r, BaseException)]


async def engine_call(
    server: Server,
    url: str,
    route: str,
    body: Mapping[str, Any] | None = None,
    *,
    operation: str,
    retry: bool = False,
) -> Mapping[str, Any]:
    """``POST /engine/<route>`` on the worker at ``url``; the body of a successful answer.

    :param operation: the admin hook this serves (named in errors).
    :param retry: allow the client's retry policy (only for calls that change nothing).
    :raises ConfigError: ``url`` answered like a Dynamo frontend.
    :raises UnsupportedOperationError: the worker has no such route.
    :raises ServerRefusedError: the worker answered ``"status": "error"``.
    """
    worker = at(server, url)
    path = ENGINE_PREFIX + route
    try:
        raw = await worker.request("POST", path, json_body=dict(body or {}), plane="admin", retry=retry)
    except ServerStatusError as exc:
        if exc.status_code != 404:
            raise
        if is_frontend_404(exc.body):
            raise ConfigError(
                [
                    f"{url} answered like a Dynamo frontend: {path} lives on each worker's system port "
                    "(DYN_SYSTEM_PORT); list them in backend_options.worker_urls (or set admin_base_url) "
                    "@ $.backend_options.worker_urls"
                ]
            ) from exc
        raise UnsupportedOperationError(BACKEND, operation, hint=missing_route_hint(route, url)) from exc
    return engine_answer(raw, route, url=worker.url(path, plane="admin"))


async def on_workers(
    server: Server,
    options: DynamoOptions,
    route: str,
    body: Mapping[str, Any] | None = None,
    *,
    operation: str,
    retry: bool = False,
) -> list[Mapping[str, Any]]:
    """:func:`engine_call` on every worker behind ``server``, concurrently; fails if any fails."""
    return await gather_all(
        engine_call(server, url, route, body, operation=operation, retry=retry) for url in worker_urls(server, options)
    )


async def _outcome(url: str, call: Awaitable[T]) -> ServerOutcome[T]:
    started = time.perf_counter()
    try:
        value = await call
    except Exception as exc:
        return ServerOutcome(server=url, error=exc, duration_s=time.perf_counter() - started)
    return ServerOutcome(server=url, value=value, duration_s=time.perf_counter() - started)


async def each_worker(urls: Iterable[str], run: Callable[[str], Awaitable[T]]) -> list[ServerOutcome[T]]:
    """``run(url)`` for every worker URL, concurrently, each to its end; every worker's outcome, in order
    (never raises for a worker's failure)."""
    return list(await asyncio.gather(*(_outcome(url, run(url)) for url in urls)))


def raise_for(operation: str, server: Server, outcomes: Sequence[ServerOutcome[Any]], state: str | None) -> None:
    """Raise if a worker failed; return otherwise.

    A single worker's failure that left nothing to report (``state`` is ``None``) is raised as it is; otherwise
    the error is an :class:`AdminError` over every worker's outcome (successes included), named after the
    frontend, whose message ends with ``state``: what the deployment now serves and what to do.
    """
    failed = [o.error for o in outcomes if o.error is not None]
    if not failed:
        return
    if len(outcomes) == 1 and state is None:
        raise failed[0]
    raise AdminError(f"{operation} on the workers behind {server.base_url}", outcomes, state=state)


def refused(error: BaseException | None) -> bool:
    """Whether a worker's error says that the operation did not happen there (a refusal in the body, a 4xx, a
    missing route, a request that never reached the worker), as opposed to a lost answer (timeout, broken
    connection, 5xx) that leaves it unknown."""
    if isinstance(error, ServerStatusError):
        return error.status_code < 500
    if isinstance(error, RequestError) and not error.maybe_processed:
        return True
    return isinstance(error, ServerRefusedError | UnsupportedOperationError | ConfigError | InvalidRequestError)


def names(urls: Iterable[str]) -> str:
    """Worker URLs for a message: ``a``, ``a and b``, ``a, b and c``."""
    listed = list(urls)
    if len(listed) < 2:
        return "".join(listed) or "no worker"
    return ", ".join(listed[:-1]) + " and " + listed[-1]


# -- admin hooks ------------------------------------------------------------------------------------------


#: How long ``admin_wake`` waits for the frontend to route to the model again.
WAKE_READY_TIMEOUT_S = 30.0
#: How long ``load_lora`` / ``unload_lora`` wait for the frontend when the operation has no admin deadline.
UNBOUNDED_WAIT_S = 120.0
#: How long a ``wait`` pause gives this client's in-flight answers to arrive once the workers confirmed it.
ANSWER_GRACE_S = 0.5
#: How many times a ``wait`` pause lets requests of this client that a worker held in and drains them again.
PAUSE_REDRAINS = 3


# -- health -----------------------------------------------------------------------------------------------


async def _status(server: Server, path: str, read: Any) -> bool:
    """GET ``path`` on ``server``'s admin URL: ``read(body)`` on 200, ``False`` on 503 (not ready)."""
    try:
        raw = await server.request("GET", path, plane="admin")
    except ServerStatusError as exc:
        if exc.status_code == 503:
            return False
        raise
    return bool(read(raw, server.admin_url))


@hookimpl
async def admin_health(server: Server, options: DynamoOptions) -> bool:
    """The frontend's ``/health`` and, for every worker configured apart from it, the worker's system ``/health``."""
    checks = [_status(frontend(server), "/health", frontend_healthy)]
    checks.extend(
        _status(at(server, url), "/health", worker_ready)
        for url in worker_urls(server, options)
        if url != server.base_url
    )
    return all(await gather_all(checks))


async def _model_ready(server: Server, model: str | None) -> bool:
    front = frontend(server)
    if model is None:
        return bool(model_ids(await front.request("GET", "/v1/models", plane="admin"), front.admin_url))
    try:
        return await _status(front, f"/v1/models/{quote(model, safe='')}/ready", model_ready)
    except ServerStatusError as exc:
        if exc.status_code == 404:  # not registered (a sleeping worker leaves discovery)
            return False
        raise


#: The prompt of the request :func:`_unroutable` routes to each instance: one id that every vocabulary has.
WAKE_PROBE_PROMPT = (0,)


def wake_probe(model: str, instance_id: int) -> dict[str, Any]:
    """The ``/v1/completions`` body :func:`_unroutable` sends: one token of :data:`WAKE_PROBE_PROMPT`, pinned to
    the instance."""
    return {
        "model": model,
        "prompt": list(WAKE_PROBE_PROMPT),
        "max_tokens": 1,
        "nvext": {"backend_instance_id": instance_id},
    }


async def _unroutable(server: Server, model: str | None, routed: set[int]) -> str | None:
    """What keeps the frontend from routing to ``model`` after a wake (``None``: nothing); ``routed`` collects the
    instances a request already reached.

    ``/v1/models/{id}/ready`` counts the instances in the router's discovery view. Dynamo 1.6.1's request plane
    also marks an instance that left discovery (the worker went to sleep) as removed, and a separate discovery
    consumer clears that mark when the instance comes back (or after 5 s). Until then a request routed to the
    woken instance fails at once and the frontend answers 503, while ``/ready`` already says ready and ``/health``
    already lists the instance. No route reports the mark, so a routed request is the only observation of it:
    one token of a one-token prompt, pinned (``nvext.backend_instance_id``) to each ``generate`` instance the
    frontend lists. It answers 503 while the mark holds, 400 while the router does not know the instance yet.
    """
    if not await _model_ready(server, model):
        return f"the frontend did not say {model!r} ready"
    front = frontend(server)
    try:
        listed = generate_instances(await front.request("GET", "/health", plane="admin"), front.admin_url)
    except ServerStatusError as exc:
        if exc.status_code == 503:
            return "the frontend's /health said not ready"
        raise
    if not listed:
        return "the frontend's /health listed no generate instance"
    name = model if model is not None else (await _served_names(server))[0]
    refused: list[str] = []
    for instance in listed:
        if instance in routed:
            continue
        try:
            body = wake_probe(name, instance)
            await front.request("POST", "/v1/completions", json_body=body, plane="admin", retry=False)
        except ServerStatusError as exc:
            if exc.status_code not in (400, 503):
                raise
            refused.append(f"{instance} ({exc.status_code})")
            continue
        routed.add(instance)
    if refused:
        return f"the frontend did not route a request for {name!r} to instance {names(refused)}"
    return None


@hookimpl
async def admin_ready(server: Server, config: ClientConfig) -> bool:
    """The frontend routes to the model (``/v1/models/{id}/ready``) and this client has not paused or put the
    workers to sleep."""
    track = tracker(server)
    if track.paused or track.sleeping:
        return False
    return await _model_ready(server, config.model)


# -- pause, cache, weights --------------------------------------------------------------------------------


def _budget(config: ClientConfig, operation: str) -> float:
    """Seconds a wait inside ``admin_<operation>`` may take: the operation's admin deadline (the core enforces
    it around the whole hook) less a margin, so that the hook's own error, which says what was not seen, comes
    first; :data:`UNBOUNDED_WAIT_S` when the deadline is ``None``."""
    deadline = config.admin.deadlines.get(operation, config.timeouts.admin)
    if deadline is None:
        return UNBOUNDED_WAIT_S
    return max(0.0, deadline - min(5.0, 0.25 * deadline))


def _plural(urls: Sequence[str], one: str, many: str) -> str:
    return one if len(urls) == 1 else many


async def _resume_workers(server: Server, urls: Sequence[str], operation: str) -> list[str]:
    """Resume ``urls``; the ones whose resume failed."""
    outcomes = await each_worker(urls, lambda url: engine_call(server, url, "resume_generation", operation=operation))
    return [o.server for o in outcomes if not o.ok]


async def _answered(track: Tracker, flights: frozenset[str], within: float) -> bool:
    """Whether this client's requests ``flights`` were all answered within ``within`` seconds."""
    try:
        async with asyncio.timeout(max(0.0, within)):
            await track.answered(flights)
    except TimeoutError:
        return False
    return True


async def _drain(
    server: Server,
    urls: Sequence[str],
    pause: Mapping[str, Any],
    track: Tracker,
    flights: frozenset[str],
    started: float,
    budget: float,
) -> None:
    """After the workers confirmed a ``wait`` pause: make sure this client's requests that were in flight when it
    was asked for are answered.

    A worker drains only the requests its engine has admitted. One that the frontend had already sent to it but
    that the engine had not admitted yet (a busy worker, seen on a loaded machine) is held until ``resume``, so
    the pause would return with it still in flight. Such requests are let in (resume) and drained again (pause
    ``wait``), up to :data:`PAUSE_REDRAINS` times; requests of others sent meanwhile are drained with them.
    """
    for _ in range(PAUSE_REDRAINS):
        grace = min(ANSWER_GRACE_S, budget - (time.monotonic() - started))
        if await _answered(track, flights, grace) or time.monotonic() - started >= budget:
            return
        for route, body in (("resume_generation", None), ("pause_generation", pause)):

            def call(url: str, route: str = route, body: Mapping[str, Any] | None = body) -> Awaitable[Any]:
                return engine_call(server, url, route, body, operation="admin_pause")

            outcomes = await each_worker(urls, call)
            if not all(o.ok for o in outcomes):
                track.paused = None
                others = [o.server for o in outcomes if not o.ok]
                verb = "resuming them" if route == "resume_generation" else "pausing them again"
                state = (
                    f"the workers behind {server.base_url} paused, then were resumed to let in requests a worker "
                    f"held, and {verb} failed on {names(others)}: call pause again, or resume"
                )
                raise_for("admin_pause", server, outcomes, state)
    await _answered(track, flights, min(ANSWER_GRACE_S, budget - (time.monotonic() - started)))


@hookimpl
async def admin_pause(
    server: Server, mode: PauseMode, clear_cache: bool, config: ClientConfig, options: DynamoOptions
) -> bool:
    """Pause every worker. If some refuse, the ones that paused are resumed again, so a failed pause leaves
    nothing paused (or says which worker stays paused). With mode ``wait`` the call returns once this client's
    requests in flight when it was called are answered (see :func:`_drain`)."""
    started = time.monotonic()
    track = tracker(server)
    flights = track.in_flight()
    if mode == "abort":
        track.abort_everything()  # before sending: aborted answers may arrive before the pause is confirmed
    body = {"mode": mode, "clear_cache": clear_cache and mode != "keep"}
    outcomes = await each_worker(
        worker_urls(server, options),
        lambda url: engine_call(server, url, "pause_generation", body, operation="admin_pause"),
    )
    paused = [o.server for o in outcomes if o.ok]
    if len(paused) < len(outcomes):
        # a worker whose answer was lost may have paused too: resume it as well (resuming is harmless)
        maybe = [o.server for o in outcomes if o.ok or not refused(o.error)]
        state = None
        if maybe:
            others = [o.server for o in outcomes if not o.ok]
            stuck = await _resume_workers(server, maybe, "admin_pause")
            state = f"{names(paused)} paused, {names(others)} did not; " if paused else ""
            if mode == "abort" and paused:
                state += f"requests in flight on {names(paused)} were aborted; "
            if stuck:
                state += f"{names(stuck)} {_plural(stuck, 'stays', 'stay')} paused (resuming it failed): call resume"
                track.paused = None
            else:
                resumed = _plural(maybe, "was", "were")
                state += f"{names(maybe)} {resumed} resumed again, so nothing behind {server.base_url} is paused"
        raise_for("admin_pause", server, outcomes, state)
    track.paused = True
    if mode == "wait" and flights:
        urls = worker_urls(server, options)
        await _drain(server, urls, body, track, flights, started, _budget(config, "pause"))
    return True


@hookimpl
async def admin_resume(server: Server, options: DynamoOptions) -> bool:
    track = tracker(server)
    outcomes = await each_worker(
        worker_urls(server, options),
        lambda url: engine_call(server, url, "resume_generation", operation="admin_resume"),
    )
    resumed = [o.server for o in outcomes if o.ok]
    if len(resumed) < len(outcomes):
        state = None
        if resumed:
            track.paused = None  # partly paused
            stuck = [o.server for o in outcomes if refused(o.error)]
            unknown = [o.server for o in outcomes if not o.ok and not refused(o.error)]
            parts = [f"{names(resumed)} resumed"]
            if stuck:
                parts.append(f"{names(stuck)} {_plural(stuck, 'stays', 'stay')} paused")
            if unknown:
                parts.append(f"{names(unknown)} may still be paused (no answer)")
            state = ", ".join(parts) + "; retry resume"
        raise_for("admin_resume", server, outcomes, state)
    track.paused = False
    return True


@hookimpl
async def admin_flush_cache(server: Server, options: DynamoOptions) -> bool:
    outcomes = await each_worker(
        worker_urls(server, options),
        lambda url: engine_call(server, url, "flush_cache", operation="admin_flush_cache"),
    )
    flushed = [o.server for o in outcomes if o.ok]
    state = None
    if flushed and len(flushed) < len(outcomes):
        others = [o.server for o in outcomes if not o.ok]
        state = (
            f"the prefix cache was flushed on {names(flushed)}, not on {names(others)} (which may still reuse "
            "entries computed before); retry flush_cache"
        )
    raise_for("admin_flush_cache", server, outcomes, state)
    return True


#: The pause a worker gets when it refuses a weight update for not being paused.
_PAUSE_FOR_UPDATE = {"mode": "wait", "clear_cache": False}


@attrs.define
class _Update:
    """What one weight update did on each worker, filled in as it goes (so a later failure cannot hide it)."""

    switched: dict[str, Mapping[str, Any]] = attrs.field(factory=dict)
    left_paused: list[str] = attrs.field(factory=list)


async def _resume_after_update(server: Server, url: str, operation: str, update: _Update) -> None:
    try:
        await engine_call(server, url, "resume_generation", operation=operation)
    except Exception:
        update.left_paused.append(url)
        raise


async def _update_worker(
    server: Server, url: str, route: str, body: Mapping[str, Any], operation: str, update: _Update
) -> Mapping[str, Any]:
    """A weight update on one worker. Dynamo refuses one unless the worker is paused: a worker that refuses for
    that reason is paused (mode ``wait``), updated and resumed; a worker already paused is updated as it is
    (and never resumed)."""
    try:
        answer = await engine_call(server, url, route, body, operation=operation)
    except ServerRefusedError as exc:
        if not needs_pause(exc):
            raise
    else:
        update.switched[url] = answer
        return answer
    await engine_call(server, url, "pause_generation", _PAUSE_FOR_UPDATE, operation=operation)
    try:
        answer = await engine_call(server, url, route, body, operation=operation)
    except BaseException as exc:
        try:
            await _resume_after_update(server, url, operation, update)
        except Exception as again:
            exc.add_note(f"resuming {url} afterwards failed too: {type(again).__name__}: {again}")
        raise
    update.switched[url] = answer
    await _resume_after_update(server, url, operation, update)
    return answer


def _update_state(
    server: Server, outcomes: Sequence[ServerOutcome[Any]], update: _Update, target: str, retry: str
) -> str | None:
    """What a weight update that failed somewhere left behind, and what to do."""
    if all(o.ok for o in outcomes):
        return None
    switched = [o.server for o in outcomes if o.server in update.switched]
    if len(outcomes) == 1 and not switched and not update.left_paused:
        return None  # one worker, unchanged: its own error says it all
    front = server.base_url
    refusals = [o.server for o in outcomes if o.server not in update.switched and refused(o.error)]
    unknown = [o.server for o in outcomes if o.server not in update.switched and not refused(o.error)]
    if not switched:
        state = f"no worker behind {front} switched to {target}"
        if unknown:
            state += f" as far as is known ({names(unknown)} did not answer)"
        state += f"; retry {retry}, or roll back to the previous checkpoint if a worker failed part-way through"
    elif refusals or unknown:
        others = []
        if refusals:
            others.append(f"{names(refusals)} did not")
        if unknown:
            others.append(f"{names(unknown)} may or may not have (no answer)")
        state = (
            f"mixed weights behind {front}: {names(switched)} switched to {target}, {', '.join(others)}; "
            f"retry {retry} or roll back to the previous checkpoint"
        )
    else:
        state = f"every worker behind {front} switched to {target}"
    if update.left_paused:
        stuck = update.left_paused
        verb, whose = _plural(stuck, "stays", "stay"), _plural(stuck, "its", "their")
        state += f"; {names(stuck)} {verb} paused ({whose} resume failed): call resume"
    return state


async def _paused_update(
    server: Server,
    options: DynamoOptions,
    route: str,
    body: Mapping[str, Any],
    *,
    operation: str,
    target: str,
    retry: str,
    version: str | None,
) -> None:
    """A weight update on every worker (see :func:`_update_worker`), then the version this client records.

    While it runs, and after it failed anywhere, this client knows no version for the frontend: some workers may
    serve the new weights and some the old. ``state()`` reads the workers' versions again.
    """
    track = tracker(server)
    track.set_weight_version(None)
    update = _Update()
    outcomes = await each_worker(
        worker_urls(server, options), lambda url: _update_worker(server, url, route, body, operation, update)
    )
    raise_for(operation, server, outcomes, _update_state(server, outcomes, update, target, retry))
    versions = {weight_version(a) for a in update.switched.values()}
    track.set_weight_version(versions.pop() if len(versions) == 1 else version)


def _target(what: str, version: str | None) -> str:
    return what if version is None else f"{what} (version {version!r})"


@hookimpl
async def admin_update_weights(server: Server, path: str, version: str | None, options: DynamoOptions) -> bool:
    body: dict[str, Any] = {"model_path": path}
    if version is not None:
        body["weight_version"] = version
    await _paused_update(
        server,
        options,
        "update_weights_from_disk",
        body,
        operation="admin_update_weights",
        target=_target(path, version),
        retry="update_weights",
        version=version,
    )
    return True


@hookimpl
async def admin_init_weight_transfer(server: Server, group: DistributedGroup, options: DynamoOptions) -> bool:
    urls = worker_urls(server, options)
    if len(urls) > 1:
        raise InvalidRequestError(
            f"{server.base_url} has {len(urls)} workers but a DistributedGroup gives one rank_offset per server: "
            "configure each worker as its own server to join them to a group"
        )
    body = {
        "master_address": group.master_address,
        "master_port": group.master_port,
        "rank_offset": group.rank_offset,
        "world_size": group.world_size,
        "group_name": group.group_name,
        "backend": group.backend,
    }
    await on_workers(server, options, "init_weights_update_group", body, operation="admin_init_weight_transfer")
    return True


@hookimpl
async def admin_destroy_weight_transfer(server: Server, group_name: str, options: DynamoOptions) -> bool:
    """``/engine/destroy_weights_update_group`` on every worker: Dynamo forwards the body as the keyword
    arguments of the worker's ``destroy_broadcaster`` RPC (stock vLLM workers lack it: ``"status": "error"``,
    a :class:`ServerRefusedError`)."""
    outcomes = await each_worker(
        worker_urls(server, options),
        lambda url: engine_call(
            server,
            url,
            "destroy_weights_update_group",
            {"group_name": group_name},
            operation="admin_destroy_weight_transfer",
        ),
    )
    left = [o.server for o in outcomes if o.ok]
    state = None
    if left and len(left) < len(outcomes):
        others = [o.server for o in outcomes if not o.ok]
        state = f"{names(left)} left group {group_name!r}, {names(others)} did not"
    raise_for("admin_destroy_weight_transfer", server, outcomes, state)
    return True


@hookimpl
def weight_transfer_plan(tensors: Sequence[TensorSpec], bucket_bytes: int | None) -> TransferPlan:
    """One broadcast per tensor, announced at once: the frontend forwards the announcement to each worker's
    ``update_weights_from_distributed`` as it is, with no packed form."""
    if bucket_bytes is not None:
        raise InvalidRequestError(
            "Dynamo 1.6.1 forwards weight updates one broadcast per tensor: join the group without bucket_bytes"
        )
    return one_by_one(tensors)


@hookimpl
async def admin_update_weights_distributed(
    server: Server, group_name: str, tensors: Sequence[TensorSpec], version: str | None, options: DynamoOptions
) -> bool:
    body: dict[str, Any] = {
        "names": [t.name for t in tensors],
        "dtypes": [t.dtype for t in tensors],
        "shapes": [list(t.shape) for t in tensors],
        "group_name": group_name,
    }
    if version is not None:
        body["weight_version"] = version
    await _paused_update(
        server,
        options,
        "update_weights_from_distributed",
        body,
        operation="admin_update_weights_distributed",
        target=_target(f"the weights broadcast in group {group_name!r}", version),
        retry="update_weights_distributed",
        version=version,
    )
    return True


# -- LoRA -------------------------------------------------------------------------------------------------


async def _load_lora(server: Server, url: str, adapter: LoraAdapter, unloaded: list[str]) -> None:
    body = {"lora_name": adapter.name, "source": {"uri": lora_uri(adapter.path)}}
    answer = await engine_call(server, url, "load_lora", body, operation="admin_load_lora")
    if not already_loaded(answer):
        return
    where = f"{url}{ENGINE_PREFIX}load_lora"
    if not adapter.replace:
        raise ServerRefusedError(
            f"load_lora of {adapter.name!r} (the name is loaded already and Dynamo kept the loaded adapter; "
            "pass replace=True to reload it)",
            method="POST",
            url=where,
            body=answer,
        )
    # no hot swap without DYN_LORA_HOTSWAP_ENABLED on the worker: unload, then load (not atomic)
    await engine_call(server, url, "unload_lora", {"lora_name": adapter.name}, operation="admin_load_lora")
    unloaded.append(url)
    answer = await engine_call(server, url, "load_lora", body, operation="admin_load_lora")
    if already_loaded(answer):
        what = f"load_lora of {adapter.name!r} after unloading it"
        raise ServerRefusedError(what, method="POST", url=where, body=answer)
    unloaded.remove(url)


async def _served_names(server: Server) -> list[str]:
    front = frontend(server)
    return model_ids(await front.request("GET", "/v1/models", plane="admin", retry=True), front.admin_url)


async def _until_frontend(
    server: Server, check: Callable[[], Awaitable[str | None]], budget: float, fail: Callable[[str, float], str]
) -> None:
    """Poll ``check()`` (``None``: done; else what is still missing) until it is done; after ``budget`` seconds a
    :class:`RequestTimeout` with ``fail(missing, budget)``."""
    missing = "no answer from the frontend yet"
    pause = 0.02
    try:
        async with asyncio.timeout(budget):
            while (found := await check()) is not None:
                missing = found
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.5)
    except TimeoutError as exc:
        error = RequestTimeout(fail(missing, budget), method="GET", url=server.url("/v1/models", plane="data"))
        raise error from exc


@hookimpl
async def admin_load_lora(server: Server, adapter: LoraAdapter, config: ClientConfig, options: DynamoOptions) -> bool:
    """Load the adapter on every worker, then wait until the frontend routes to it: each worker publishes the
    adapter's model card in discovery, which the frontend picks up later. Returns once ``/v1/models`` lists the
    name and ``/v1/models/{name}/ready`` says ready, within the operation's admin deadline."""
    started = time.monotonic()
    unloaded: list[str] = []
    outcomes = await each_worker(worker_urls(server, options), lambda url: _load_lora(server, url, adapter, unloaded))
    loaded = [o.server for o in outcomes if o.ok]
    name = adapter.name
    if len(loaded) < len(outcomes):
        parts = []
        if loaded:
            others = [o.server for o in outcomes if not o.ok]
            parts.append(
                f"adapter {name!r} is loaded on {names(loaded)} only: requests for it that the frontend routes to "
                f"{names(others)} fail; load_lora again with replace=True, or unload_lora({name!r})"
            )
        if unloaded:
            parts.append(f"{names(unloaded)} unloaded the earlier {name!r} to replace it and did not load it again")
        raise_for("admin_load_lora", server, outcomes, "; ".join(parts) or None)

    async def routable() -> str | None:
        if name not in await _served_names(server):
            return "listed"
        if not await _model_ready(server, name):
            return "ready"
        return None

    def fail(missing: str, budget: float) -> str:
        front = server.base_url
        seen = (
            f"{front}/v1/models did not list {name!r}"
            if missing == "listed"
            else f"{front}/v1/models/{name}/ready did not say ready"
        )
        return (
            f"load_lora of {name!r}: every worker loaded it, but {seen} within {budget:.1f} s (the frontend picks "
            "adapters up from discovery); requests for it may fail until it does"
        )

    await _until_frontend(server, routable, _budget(config, "load_lora") - (time.monotonic() - started), fail)
    return True


@hookimpl
async def admin_unload_lora(server: Server, name: str, config: ClientConfig, options: DynamoOptions) -> bool:
    """Unload the adapter from every worker (a worker that does not have it counts as done, as long as one
    worker had it), then wait until the frontend no longer lists it, within the operation's admin deadline."""
    started = time.monotonic()
    outcomes = await each_worker(
        worker_urls(server, options),
        lambda url: engine_call(server, url, "unload_lora", {"lora_name": name}, operation="admin_unload_lora"),
    )
    unloaded = [o.server for o in outcomes if o.ok]
    kept = [o.server for o in outcomes if not o.ok and not lora_not_found(o.error)]
    if not unloaded or kept:
        state = None
        if unloaded:
            state = (
                f"adapter {name!r} is unloaded from {names(unloaded)} but still loaded on {names(kept)}: requests "
                f"for it that the frontend routes there still use it; retry unload_lora"
            )
        raise_for("admin_unload_lora", server, outcomes, state)

    async def gone() -> str | None:
        return "listed" if name in await _served_names(server) else None

    def fail(missing: str, budget: float) -> str:
        return (
            f"unload_lora of {name!r}: every worker unloaded it, but {server.base_url}/v1/models still listed "
            f"{name!r} after {budget:.1f} s (the frontend drops adapters through discovery)"
        )

    await _until_frontend(server, gone, _budget(config, "unload_lora") - (time.monotonic() - started), fail)
    return True


# -- state, sleep, abort ----------------------------------------------------------------------------------


async def _versions(server: Server, options: DynamoOptions) -> list[str | None] | None:
    try:
        answers = await on_workers(server, options, "get_weight_version", operation="admin_state", retry=True)
    except Unsupported:  # a worker without RL routes (the mocker): the version is unknown
        return None
    return [weight_version(a) for a in answers]


@hookimpl
async def admin_state(server: Server, config: ClientConfig, options: DynamoOptions) -> ServerState:
    """Pause and sleep state as this client set them (Dynamo 1.6.1 reports neither), the workers' declared weight
    version, the frontend's in-flight gauge, and the served names other than ``ClientConfig.model``."""
    front = frontend(server)
    metrics, models, versions = await asyncio.gather(
        front.request("GET", "/metrics", plane="admin", expect="text"),
        front.request("GET", "/v1/models", plane="admin"),
        _versions(server, options),
    )
    track = tracker(server)
    version = None
    if versions is not None:
        if len(set(versions)) > 1:
            detail = f"the workers behind {server.base_url} report different weight versions {versions}"
            raise ResponseParseError(detail, url=server.admin_url)
        version = versions[0] if versions else None
        if version != track.weight_version:
            track.set_weight_version(version)
    in_flight = gauge(metrics, "dynamo_request_plane_inflight_requests", front.admin_url)
    served = model_ids(models, front.admin_url)
    return ServerState(
        paused=track.paused,
        sleeping=track.sleeping,
        weight_version=version,
        in_flight=None if in_flight is None else int(in_flight),
        loras=tuple(n for n in served if n != config.model),
    )


@hookimpl
async def admin_sleep(server: Server, level: int, options: DynamoOptions) -> bool:
    track = tracker(server)
    outcomes = await each_worker(
        worker_urls(server, options),
        lambda url: engine_call(server, url, "control/sleep", {"level": level}, operation="admin_sleep"),
    )
    asleep = [o.server for o in outcomes if o.ok]
    state = None
    if asleep and len(asleep) < len(outcomes):
        track.sleeping = None  # partly asleep
        awake = [o.server for o in outcomes if not o.ok]
        state = (
            f"{names(asleep)} {_plural(asleep, 'is', 'are')} asleep (out of discovery), {names(awake)} not: the "
            f"frontend routes only to {names(awake)}; call wake, or retry sleep"
        )
    raise_for("admin_sleep", server, outcomes, state)
    track.sleeping = True
    return True


@hookimpl
async def admin_wake(server: Server, config: ClientConfig, options: DynamoOptions) -> bool:
    """Wake every worker, then wait until the frontend routes to the model again (a sleeping worker leaves
    discovery, and requests get 503 until it is back): ``/v1/models/{id}/ready`` says ready and a one-token request
    pinned to each ``generate`` instance the frontend lists is answered (see :func:`_unroutable`)."""
    track = tracker(server)
    outcomes = await each_worker(
        worker_urls(server, options),
        lambda url: engine_call(server, url, "control/wake_up", operation="admin_wake"),
    )
    awake = [o.server for o in outcomes if o.ok]
    state = None
    if awake and len(awake) < len(outcomes):
        track.sleeping = None  # partly asleep
        asleep = [o.server for o in outcomes if not o.ok]
        state = f"{names(awake)} woke, {names(asleep)} may still be asleep; retry wake"
    raise_for("admin_wake", server, outcomes, state)
    track.sleeping = False
    routed: set[int] = set()
    deadline = time.monotonic() + WAKE_READY_TIMEOUT_S
    while (missing := await _unroutable(server, config.model, routed)) is not None:
        if time.monotonic() > deadline:
            raise ServerRefusedError(
                f"wake_up (the workers woke but {missing} within {WAKE_READY_TIMEOUT_S:.0f} s)",
                method="GET",
                url=server.url("/v1/models", plane="data"),
                body=None,
            )
        await asyncio.sleep(0.05)
    return True


@hookimpl
async def admin_abort(server: Server, request_ids: Sequence[str] | None, options: DynamoOptions) -> int:
    """Abort by caller id (sent as the bare request UUID, on every worker) or every request this client has in
    flight (Dynamo 1.6.1 has no abort-all). Returns -1: Dynamo says ``ok`` whether or not the id was known."""
    track = tracker(server)
    if request_ids is not None and track.ignores_request_ids:
        raise Unsupported(
            BACKEND,
            "admin_abort",
            hint=f"{server.base_url} does not take request ids from {REQUEST_ID_HEADER}, so no id can be aborted",
        )
    uuids = track.abort_everything() if request_ids is None else track.abort_ids(list(request_ids))
    if not uuids:
        return 0

    async def abort_on(url: str) -> None:
        await gather_all(
            engine_call(server, url, "abort_request", {"request_id": u}, operation="admin_abort") for u in uuids
        )

    outcomes = await each_worker(worker_urls(server, options), abort_on)
    reached = [o.server for o in outcomes if o.ok]
    state = None
    if reached and len(reached) < len(outcomes):
        others = [o.server for o in outcomes if not o.ok]
        state = f"the abort reached {names(reached)}, not {names(others)}: requests running there go on; retry abort"
    raise_for("admin_abort", server, outcomes, state)
    return -1
