"""Router fronts (``ClientConfig.front``): a router as the fleet's data plane, every replica behind it reached
directly for admin.

Past a handful of replicas, RL stacks put a router in front of the engines. A router spreads generation well, but
it sends an admin call (pause, a weight update, a LoRA load) to ONE replica, like any request. So, with a front:

* **Data plane**: ``base_url`` is the front. The client's balancer has that one server and steps aside; a
  session's key goes in the header the router routes sessions by (:attr:`Front.session_header`, or
  ``FrontConfig.session_header``), so a conversation's turns stay on one replica and its prefix cache.
* **Admin plane**: the replicas the front lists, read before every admin operation and every
  ``FleetPolicy.refresh_interval`` seconds. Each operation fans out to every replica the router routes to,
  directly (never through the router), with one outcome per replica. A front that cannot list its replicas
  refuses the operation with :class:`~backends_core.errors.FrontError`: never a success that reached one replica.
  A replica the router reports unhealthy gets no traffic from it and no admin operation: it is caught up when
  the router reports it healthy again (at the next admin operation or refresh).
* **Membership** (``client.fleet``, a :class:`FrontFleet`): a replica the front lists for the first time is
  caught up (the last weight update and adapters this client made on every replica, see
  :mod:`backends_core.membership`) at the next admin operation or refresh. The router may route to it
  before then: :meth:`FrontFleet.add` closes that window where the router takes registrations, by catching the
  replica up first and registering it after. :meth:`FrontFleet.remove` deregisters a replica first, then drops it.

Kinds (``FrontConfig.kind``; a plugin adds one with the ``fronts`` hook):

* ``vllm-router`` (PyPI ``vllm-router``): replicas from ``GET /workers``; sessions by ``x-session-id`` (honoured
  under ``--policy consistent_hash``); registration ``POST /workers``, ``DELETE /workers/{url}``, applied before
  the answer.
* ``sglang-router`` (SGLang Model Gateway, PyPI ``sglang-router``): replicas from ``GET /workers``; sessions by
  ``X-SMG-Routing-Key`` (honoured under ``--policy manual``); registration ``POST /workers``,
  ``DELETE /workers/{id}``, applied in the background (waited for, under the admin deadline).
* ``static``: any router; the replicas are ``FrontConfig.replicas``; no registration.
* ``dynamo`` (Dynamo's frontend, from the ``dynamo`` backend): workers from ``GET /v1/rl/workers`` on the
  frontend's ``DYN_RL_PORT``; sessions by ``x-dynamo-session-id`` (honoured when the frontend runs with
  ``--router-session-affinity-ttl-secs``); workers register themselves.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar
from urllib.parse import quote

import attrs

from backends_core.balancer import Balancer
from backends_core.config import FrontConfig, _urls
from backends_core.errors import (
    ConfigError,
    FrontError,
    MembershipError,
    RequestError,
    ResponseParseError,
    TransportError,
    UnsupportedOperationError,
)
from backends_core.membership import Fleet, Member

if TYPE_CHECKING:
    from backends_core.client import Client
    from backends_core.server import Server

__all__ = ["BUILTIN_FRONTS", "Front", "FrontFleet", "Replica", "SglangRouterFront", "StaticFront", "VllmRouterFront"]

log = logging.getLogger("backends_core.fronts")

#: Seconds between two reads of a router's worker list while a background registration is applied.
_POLL_S = 0.1


@attrs.frozen(kw_only=True)
class Replica:
    """One replica as a front lists it.

    :ivar url: where its admin routes are (an engine's base URL; a Dynamo worker's system URL).
    :ivar id: the router's name for it, where the router names workers apart from their URL.
    :ivar healthy: whether the router routes to it (``None``: the front does not say).
    """

    url: str
    id: str | None = None
    healthy: bool | None = None


class Front:
    """A kind of router front. Subclasses list the replicas and, where the router takes them, registrations.

    :param server: the front, as the client's data-plane server (``base_url``).
    :param config: the client's ``FrontConfig``.
    """

    #: ``FrontConfig.kind`` naming it.
    kind: ClassVar[str] = ""
    #: The header the router routes a session's requests by (``None``: it routes sessions by other means).
    session_header: ClassVar[str | None] = None
    #: Admin operations go to the front's own server, whose backend reaches the replicas itself (through
    #: :attr:`Server.replicas <backends_core.server.Server.replicas>`); otherwise to each replica as its own server.
    admin_through_front: ClassVar[bool] = False

    def __init__(self, server: Server, config: FrontConfig) -> None:
        self.server = server
        self.config = config
        where = config.list_url
        #: The front as seen by the admin plane, at the root where it lists its replicas.
        self.lister = server if where is None else attrs.evolve(server, admin_url=where, cache=server.cache)

    @property
    def url(self) -> str:
        return self.server.base_url

    def error(self, detail: str) -> FrontError:
        return FrontError(self.url, self.kind, detail)

    async def replicas(self) -> list[Replica]:
        """Every replica the front routes to, healthy or not. :raises FrontError: it cannot say."""
        raise NotImplementedError

    async def register(self, url: str) -> None:
        """Have the router route to ``url`` from now on. :raises FrontError: it refused."""
        raise UnsupportedOperationError(self.kind, "register", hint="this front takes no registrations")

    async def deregister(self, replica: Replica) -> None:
        """Have the router stop routing to ``replica``. :raises FrontError: it refused."""
        raise UnsupportedOperationError(self.kind, "deregister", hint="this front takes no registrations")

    async def _call(self, method: str, path: str, *, body: Any = None, expect: Any = "json") -> Any:
        """One admin-plane request to the front (never retried: registrations are not idempotent); any failure
        becomes a :class:`FrontError` naming the route."""
        try:
            return await self.lister.request(
                method, path, json_body=body, plane="admin", expect=expect, retry=method == "GET"
            )
        except (RequestError, ResponseParseError) as exc:
            raise self.error(f"{method} {path} failed: {exc}") from exc


def _field(item: Any, key: str, where: str, front: Front, kind: type | tuple[type, ...]) -> Any:
    if not isinstance(item, Mapping) or not isinstance(item.get(key), kind):
        raise front.error(f"{where}.{key} is missing or not a {getattr(kind, '__name__', kind)}: got {item!r}")
    return item[key]


class _WorkersRouter(Front):
    """A router that lists its workers at ``GET /workers`` as ``{"workers": [{"url", "is_healthy", ...}]}``."""

    async def replicas(self) -> list[Replica]:
        raw = await self._call("GET", "/workers")
        if not isinstance(raw, Mapping) or not isinstance(raw.get("workers"), list):
            raise self.error(f"GET /workers: expected {{'workers': [...]}} @ $.workers, got {str(raw)[:200]}")
        out = []
        for i, item in enumerate(raw["workers"]):
            where = f"GET /workers: $.workers[{i}]"
            url = _field(item, "url", where, self, str)
            healthy = item.get("is_healthy")
            if healthy is not None and not isinstance(healthy, bool):
                raise self.error(f"{where}.is_healthy is not a boolean: got {healthy!r}")
            worker_id = item.get("id")
            try:
                (url,) = _urls(url)
            except ConfigError as exc:
                raise self.error(f"{where}.url: {exc}") from exc
            out.append(Replica(url=url, id=worker_id if isinstance(worker_id, str) else None, healthy=healthy))
        return out

    async def _until(self, what: str, check: Any) -> None:
        """Read the worker list until ``check(replicas)`` holds (the admin deadline bounds the wait)."""
        while not check(await self.replicas()):  # noqa: ASYNC110  # the router's state is remote: read it again
            await asyncio.sleep(_POLL_S)
        log.info("%s front %s: %s", self.kind, self.url, what)


class VllmRouterFront(_WorkersRouter):
    """vllm-router: registrations applied before the answer; workers named by URL."""

    kind = "vllm-router"
    session_header = "x-session-id"

    async def register(self, url: str) -> None:
        answer = await self._call("POST", "/workers", body={"url": url})
        if not isinstance(answer, Mapping) or answer.get("success") is not True:
            raise self.error(f"POST /workers refused {url}: {answer!r}")

    async def deregister(self, replica: Replica) -> None:
        answer = await self._call("DELETE", f"/workers/{quote(replica.url, safe='')}")
        if not isinstance(answer, Mapping) or answer.get("success") is not True:
            raise self.error(f"DELETE /workers refused {replica.url}: {answer!r}")


class SglangRouterFront(_WorkersRouter):
    """sglang-router (SGLang Model Gateway): registrations queued (202) and applied in the background; workers
    named by an id."""

    kind = "sglang-router"
    session_header = "X-SMG-Routing-Key"

    async def register(self, url: str) -> None:
        answer = await self._call("POST", "/workers", body={"url": url})
        if not isinstance(answer, Mapping) or answer.get("status") != "accepted":
            raise self.error(f"POST /workers refused {url}: {answer!r}")
        await self._until(f"{url} registered", lambda found: any(r.url == url and r.healthy for r in found))

    async def deregister(self, replica: Replica) -> None:
        if replica.id is None:
            raise self.error(f"{replica.url} has no worker id in GET /workers: it cannot be removed by id")
        answer = await self._call("DELETE", f"/workers/{quote(replica.id, safe='')}")
        if not isinstance(answer, Mapping) or answer.get("status") != "accepted":
            raise self.error(f"DELETE /workers/{replica.id} refused {replica.url}: {answer!r}")
        await self._until(f"{replica.url} removed", lambda found: all(r.url != replica.url for r in found))


class StaticFront(Front):
    """Any router; the replicas behind it are the configured ``FrontConfig.replicas``."""

    kind = "static"

    async def replicas(self) -> list[Replica]:
        return [Replica(url=url) for url in self.config.replicas]


#: The kinds the core provides (the ``fronts`` hook of its defaults).
BUILTIN_FRONTS: Mapping[str, type[Front]] = {f.kind: f for f in (VllmRouterFront, SglangRouterFront, StaticFront)}


def merge_fronts(contributions: Sequence[Mapping[str, type[Front]] | None]) -> dict[str, type[Front]]:
    """One kind -> class mapping from every plugin's ``fronts`` answer.

    :raises ConfigError: two plugins provide one kind, or an answer is not a mapping of kinds to ``Front`` classes.
    """
    merged: dict[str, type[Front]] = {}
    for answer in contributions:
        if answer is None:
            continue
        if not isinstance(answer, Mapping):
            raise ConfigError([f"a fronts hook returned {type(answer).__name__}, expected a mapping"])
        for kind, cls in answer.items():
            if not (isinstance(cls, type) and issubclass(cls, Front)) or kind != cls.kind:
                raise ConfigError([f"fronts hook: {kind!r} must map to a Front subclass whose kind is {kind!r}"])
            if kind in merged and merged[kind] is not cls:
                raise ConfigError([f"two plugins provide the front kind {kind!r}"])
            merged[kind] = cls
    return merged


class FrontFleet(Fleet):
    """``client.fleet`` behind a front: the replicas the front lists (see the module's doc).

    :ivar front: the front.
    """

    def __init__(self, client: Client, front: Front) -> None:
        self.front = front
        replicas: Balancer[Server] = Balancer([], slack=0, cooldown=client.config.fleet.cooldown)
        super().__init__(client, balancer=replicas)
        self._listed: dict[str, Replica] = {}
        #: Each member's URL, by index (a member behind a front whose backend reaches the replicas is a view of
        #: the front's server narrowed to that replica, so its ``base_url`` is the front's).
        self._urls: list[str] = []
        self._first: asyncio.Future[None] | None = None
        #: URLs :meth:`add` is bringing in: a list read before their registration does not take them out.
        self._adding: set[str] = set()
        #: Members found unreachable by the last check (kept out of that operation's catch-ups).
        self._unreachable: set[int] = set()
        #: Counts this client's registrations and deregistrations: a worker list read across one is stale.
        self._changes = 0

    def _find(self, url: str) -> int | None:
        url = url.rstrip("/")
        b = self._balancer
        return next((i for i, u in enumerate(self._urls) if u == url and b.states[i] != "gone"), None)

    def _member(self, index: int) -> Member:
        b = self._balancer
        server = b.servers[index]
        url = self._urls[index]
        return Member(
            url=url,
            admin_url=url if self.front.admin_through_front else server.admin_url,
            state=b.states[index],
            in_flight=b.load[index].in_flight,
            error=self._errors.get(index),
        )

    def _join(self, url: str, admin_url: str | None) -> int:
        (base,) = _urls(url)
        if self._find(base) is not None:
            raise MembershipError(f"{base} is a member of the fleet already")
        front = self.front.server
        if self.front.admin_through_front:
            server = attrs.evolve(front, replicas=(base,), cache=front.cache)
        else:
            server = self._client._make_server(base, base)
        index = self._balancer.add(server, state="joining")
        self._urls.append(base)
        self._client.versions.forget(server)
        return index

    def admin_servers(self) -> list[Server]:
        """Where admin operations go now: the replicas serving, or the front when its backend reaches them."""
        if self.front.admin_through_front:
            return [self.front.server]
        b = self._balancer
        return [b.servers[i] for i in b.serving()]

    def _point_front(self) -> None:
        """Tell the front's server which replicas serve behind it (:attr:`Server.replicas`): where its backend
        sends admin operations (``admin_through_front``) and reads engine limits the router does not report."""
        b = self._balancer
        self.front.server.replicas = tuple(self._urls[i] for i in b.serving())

    async def listed(self) -> None:
        """Read the front's replicas once, if that was never done (the first request behind a front waits for
        it: backends read engine limits from a replica)."""
        if self._first is None:
            self._first = asyncio.ensure_future(self.refresh())
        await asyncio.shield(self._first)

    async def add(self, url: str, admin_url: str | None = None) -> Member:
        """Catch up the replica at ``url``, then register it with the router: it serves once caught up.

        :raises MembershipError: ``url`` is a member already.
        :raises AdminError: the catch-up failed (it is not registered).
        :raises FrontError: the router refused the registration (the replica stays out of the fleet).
        :raises UnsupportedOperationError: this front takes no registrations.
        """
        if admin_url is not None and admin_url.rstrip("/") != url.rstrip("/"):
            raise MembershipError("behind a front a replica's admin routes are at its own URL: give url only")
        if type(self.front).register is Front.register:
            await self.front.register(url)  # raises UnsupportedOperationError, before anything changes
        index = self._join(url, None)
        self._adding.add(self._urls[index])
        try:
            await self._catch_up(index, raise_error=True, admit=False)
            await self.front.register(self._balancer.servers[index].base_url)
        except BaseException:
            self._balancer.retire(index)
            raise
        finally:
            self._adding.discard(self._urls[index])
            self._changes += 1
        self._balancer.admit(index)
        self._point_front()
        return self._member(index)

    async def remove(self, url: str, *, drain: bool = True) -> None:
        """Deregister the replica at ``url`` from the router, then drop it from the fleet (``drain``: the router
        has confirmed it routes nothing new to it).

        :raises MembershipError: ``url`` is not a member.
        :raises FrontError: the router refused.
        """
        index = self._find(url)
        if index is None:
            raise MembershipError(f"{url} is not a member of the fleet (members: {[m.url for m in self.members()]})")
        base = self._urls[index]
        listed = self._listed.get(base) or Replica(url=base)
        if base not in self._listed:  # its router-side name (an id) as the router lists it now
            listed = next((r for r in await self.front.replicas() if r.url == base), listed)
        await self.front.deregister(listed)
        self._changes += 1
        self._listed.pop(base, None)
        self._balancer.retire(index)
        self._errors.pop(index, None)
        self._point_front()
        self._client.driver.emit("fleet", "leave", base, time.perf_counter(), None)

    def everyone(self) -> list[Server]:
        """Every replica serving or joining (what ``fleet_state`` reports on)."""
        b = self._balancer
        return [b.servers[i] for i, state in enumerate(b.states) if state != "gone"]

    def _index(self, server: Server) -> int:
        return next(i for i, s in enumerate(self._balancer.servers) if s is server)

    def label(self, server: Server) -> str:
        """The replica's URL (a view of the front's server is named after its replica)."""
        if server is self.front.server:
            return server.base_url
        return self._urls[self._index(server)]

    def standing(self, server: Server) -> str:
        if server is self.front.server:
            return "serving"
        return self._balancer.states[self._index(server)]

    async def sync(self, strict: bool = True) -> None:
        """Read the front's replicas now, catch up the new ones, and point admin at the ones serving. Runs before
        every admin operation.

        :param strict: raise a catch-up's failure (an admin operation must not skip a replica the router routes
            to); otherwise it is recorded on the member, counted and reported through ``observe``.
        :raises FrontError: the front cannot list its replicas, or lists none the router routes to.
        :raises AdminError: (``strict``) a replica the router routes to could not be caught up.
        """
        listed = await self._read()
        if not any(r.healthy is not False for r in listed):
            raise self.front.error(
                f"lists no replica it routes to ({len(listed)} listed, none healthy): nothing to send admin "
                "operations to"
            )
        self._apply_listed(listed)
        await self._check_reachable()
        joining = self._joining()
        try:
            await asyncio.gather(*(self._catch_up(i, raise_error=strict) for i in joining))
        finally:
            self._point_front()

    async def _check_reachable(self) -> None:
        """Ask each serving replica whether it is alive (``admin_health``); one that cannot be reached at all
        serves nothing: it is evicted (see :meth:`_evict`) instead of failing the operation about to run."""
        client = self._client
        if self.front.admin_through_front or "admin_health" not in client.driver.capabilities:
            return
        b = self._balancer
        self._unreachable.clear()
        members = [*b.serving(), *self._joining()]
        if not members:
            return
        outcomes = await client.admin.outcomes([b.servers[i] for i in members]).health()
        dead = [
            (i, o.error)
            for i, o in zip(members, outcomes, strict=True)
            if isinstance(o.error, TransportError) and not o.error.maybe_processed
        ]
        await asyncio.gather(*(self._evict(i, error) for i, error in dead))

    async def _evict(self, index: int, error: BaseException) -> None:
        """Replica ``index`` cannot be reached: deregister it from the router and drop it (``evict_unreachable``
        and a router that takes registrations), else keep it out until it answers and is caught up."""
        url = self._urls[index]
        b = self._balancer
        started = time.perf_counter()
        front = self.front
        if front.config.evict_unreachable and type(front).deregister is not Front.deregister:
            try:
                await front.deregister(self._listed.get(url) or Replica(url=url))
            except (FrontError, RequestError) as exc:
                log.warning("%s cannot be reached (%s) and %s refused to deregister it: %s", url, error, front.url, exc)
            else:
                self._changes += 1
                self._listed.pop(url, None)
                b.retire(index)
                self._errors[index] = error
                self._client.driver.emit("fleet", "leave", url, started, error)
                log.warning(
                    "%s cannot be reached (%s): deregistered from %s and out of the fleet", url, error, front.url
                )
                return
        b.states[index] = "joining"
        self._errors[index] = error
        self._unreachable.add(index)
        log.warning("%s cannot be reached (%s): skipped until it answers and is caught up", url, error)

    def _joining(self) -> list[int]:
        b = self._balancer
        return [
            i
            for i, state in enumerate(b.states)
            if state == "joining"
            and i not in self._unreachable
            and self._urls[i] not in self._adding  # add catches it up itself
            and self._listed.get(self._urls[i], Replica(url="")).healthy is not False
        ]

    async def _read(self) -> list[Replica]:
        """The replicas the front lists, read again when this client registered or deregistered one while the
        list was read (it may predate that change)."""
        while True:
            changes = self._changes
            listed = await self.front.replicas()
            if changes == self._changes:
                return listed

    def _apply_listed(self, listed: Sequence[Replica]) -> None:
        b = self._balancer
        self._listed = {r.url: r for r in listed}
        for replica in listed:
            index = self._find(replica.url)
            if index is None:
                self._join(replica.url, None)
            elif replica.healthy is False and b.states[index] == "serving":
                # the router routes nothing to it; whatever it serves when it is back is looked at first
                b.states[index] = "joining"
                front = self.front
                log.warning("%s front %s reports %s unhealthy: out until caught up", front.kind, front.url, replica.url)
        for i, url in enumerate(self._urls):
            if b.states[i] != "gone" and url not in self._listed and url not in self._adding:
                b.retire(i)
                self._errors.pop(i, None)
                self._client.driver.emit("fleet", "leave", url, time.perf_counter(), None)
        self._point_front()

    async def refresh(self) -> None:
        """:meth:`sync`, with failures counted and reported through ``observe`` instead of raised."""
        started = time.perf_counter()
        try:
            listed = await self._read()
        except FrontError as exc:
            self._client.driver.emit("fleet", "discover", self.front.url, started, exc)
            log.warning("%s", exc)
            return
        self._client.driver.emit("fleet", "discover", self.front.url, started, None, urls=[r.url for r in listed])
        self._apply_listed(listed)
        await self._check_reachable()
        await asyncio.gather(*(self._catch_up(i, raise_error=False) for i in self._joining()))
        self._point_front()

    def _wanted(self) -> bool:
        return True
