"""Elastic membership without a router (``client.fleet``): servers join and leave while the client runs.

* A server that **joins** (:meth:`Fleet.add`, or listed by the discovery source) gets no generation until it is
  caught up: the last weight update this client made on every server (checkpoint path and version) and the
  adapters it loaded are replayed to it through the same admin hooks, then checked with ``admin_state`` where
  the backend has it. The catch-up holds :attr:`Admin.changes <backends_core.fleet.Admin.changes>`, the lock of
  every weight and adapter operation, so a server joining during a ``weight_sync`` is caught up to the version
  that sync sets. A failed catch-up keeps it out: counted (:attr:`Fleet.catch_up_failures`), reported through
  ``observe`` (``Event(kind="fleet", operation="catch_up")``), tried again at the next :meth:`Fleet.refresh`.
* A server that **leaves** (:meth:`Fleet.remove`, or no longer listed) gets no new request; its requests in flight
  end as they would (answered, or failed with their typed error: a request that never reached it fails over), and
  ``remove`` returns when the last one ended. Removing the last serving server raises
  :class:`~backends_core.errors.MembershipError`.
* **Discovery** (``FleetPolicy.discovery``): a callable returning URLs, a file with one URL per line, or the A
  records of a host name; read every ``FleetPolicy.refresh_interval`` seconds while the client is open.

The balancer holds the membership (:attr:`Balancer.states <backends_core.balancer.Balancer.states>`): indices
never move, so requests in flight, versions and admin fan-out keep pointing at the right server.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import socket
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import attrs

from backends_core.balancer import Balancer, MemberState
from backends_core.config import _urls
from backends_core.errors import AdminError, ConfigError, MembershipError, WeightVersionMismatch
from backends_core.fleet import ServerOutcome

if TYPE_CHECKING:
    from backends_core.client import Client
    from backends_core.server import Server

__all__ = ["Fleet", "Member", "discover"]

log = logging.getLogger("backends_core.membership")


@attrs.frozen(kw_only=True)
class Member:
    """One server in :meth:`Fleet.members`.

    :ivar url: its base URL.
    :ivar admin_url: its admin URL.
    :ivar state: ``"serving"``, ``"joining"`` (not caught up yet: gets no requests), or ``"gone"`` (removed while
        :meth:`Fleet.add` caught it up).
    :ivar in_flight: this client's requests on it now.
    :ivar error: why its last catch-up failed, if it did.
    """

    url: str
    admin_url: str
    state: MemberState
    in_flight: int
    error: BaseException | None = None


async def discover(source: str | Callable[[], Any]) -> list[str]:
    """The server URLs ``source`` lists now (see ``FleetPolicy.discovery``), normalised, in its order.

    :raises ConfigError: a listed URL is not an http(s) URL with a host.
    :raises OSError: the file cannot be read, or the host name does not resolve.
    """
    if callable(source):
        found = source()
        if inspect.isawaitable(found):
            found = await found
        urls = list(found)
    elif source.startswith("file:"):
        text = await asyncio.to_thread(Path(source[5:]).read_text, encoding="utf-8")
        urls = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    else:
        host, port = source[4:].rsplit(":", 1)
        infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), family=socket.AF_INET)
        urls = [f"http://{ip}:{port}" for ip in dict.fromkeys(str(info[4][0]) for info in infos)]
    return list(dict.fromkeys(_urls(urls)))


class Fleet:
    """``client.fleet``: the servers of a client, joining and leaving at run time (see the module's doc)."""

    def __init__(self, client: Client, *, balancer: Balancer[Server] | None = None) -> None:
        self._client = client
        #: The membership: the client's balancer, or (behind a front) the replicas' own.
        self._balancer = client.balancer if balancer is None else balancer
        self._balancer.on_idle = self._idle
        self._errors: dict[int, BaseException] = {}
        self._drained: dict[int, asyncio.Event] = {}
        self._task: asyncio.Task[None] | None = None
        #: Catch-ups that failed since the client was built.
        self.catch_up_failures = 0

    # -- membership ---------------------------------------------------------------------------------------

    def members(self) -> list[Member]:
        """Every server serving or joining, in order of joining (the configured ones first)."""
        b = self._balancer
        return [self._member(i) for i in range(len(b.servers)) if b.states[i] != "gone"]

    def _member(self, index: int) -> Member:
        b = self._balancer
        server = b.servers[index]
        return Member(
            url=server.base_url,
            admin_url=server.admin_url,
            state=b.states[index],
            in_flight=b.load[index].in_flight,
            error=self._errors.get(index),
        )

    def _find(self, url: str) -> int | None:
        url = url.rstrip("/")
        b = self._balancer
        return next((i for i, s in enumerate(b.servers) if s.base_url == url and b.states[i] != "gone"), None)

    async def add(self, url: str, admin_url: str | None = None) -> Member:
        """Add the server at ``url`` (admin routes at ``admin_url``, default ``url``) and catch it up: it serves
        once it is on the fleet's weights and adapters.

        :raises MembershipError: ``url`` is a member already.
        :raises ConfigError: ``url`` or ``admin_url`` is not an http(s) URL with a host.
        :raises AdminError: the catch-up failed: the server stays joining (no requests) and is tried again at the
            next :meth:`refresh`.
        """
        index = self._join(url, admin_url)
        await self._catch_up(index, raise_error=True)
        return self._member(index)

    def _join(self, url: str, admin_url: str | None) -> int:
        (base,) = _urls(url)
        (admin,) = _urls(admin_url if admin_url is not None else base)
        if self._find(base) is not None:
            raise MembershipError(f"{base} is a member of the fleet already")
        index = self._balancer.add(self._client._make_server(base, admin), state="joining")
        self._client.versions.forget(self._balancer.servers[index])  # asked for its version before it serves
        return index

    async def remove(self, url: str, *, drain: bool = True) -> None:
        """Take the server at ``url`` out of the fleet: it gets no new request (nor admin operation), and (with
        ``drain``) this returns once its requests in flight ended, each answered or failed with its own error.

        :raises MembershipError: ``url`` is not a member, or it is the last server serving.
        """
        index = self._find(url)
        if index is None:
            raise MembershipError(f"{url} is not a member of the fleet (members: {[m.url for m in self.members()]})")
        b = self._balancer
        if b.serving() == [index]:
            raise MembershipError(
                f"{url} is the last server serving: removing it would leave no server; add another one first"
            )
        started = time.perf_counter()
        event = self._drained[index] = asyncio.Event()
        b.retire(index)
        self._errors.pop(index, None)
        url = self._balancer.servers[index].base_url
        self._client.driver.emit("fleet", "leave", url, started, None)
        log.info("%s left the fleet (removed; %d request(s) in flight)", url, b.load[index].in_flight)
        if drain:
            await event.wait()

    def _idle(self, index: int) -> None:
        event = self._drained.pop(index, None)
        if event is not None:
            event.set()

    # -- catching up ----------------------------------------------------------------------------------------

    async def _catch_up(self, index: int, *, raise_error: bool, admit: bool = True) -> None:
        """Bring member ``index`` to the fleet's weights and adapters; then it serves (``admit``)."""
        client = self._client
        server = self._balancer.servers[index]
        url = self._member(index).url
        started = time.perf_counter()
        try:
            async with client.admin.changes:
                if self._balancer.states[index] != "joining":  # removed while it waited
                    return
                version = await self._replay(server)
                client.versions.set(server, version)
                if client.admin.record.weights is not None:  # on the fleet's recorded version: vouched for
                    client.versions.trust(server)
                if admit:
                    self._balancer.admit(index)
        except Exception as exc:
            self.catch_up_failures += 1
            self._errors[index] = exc
            client.driver.emit("fleet", "catch_up", url, started, exc, failures=self.catch_up_failures)
            log.warning("%s stays out of the fleet: its catch-up failed (%s)", url, exc)
            self.start()  # tried again at the next refresh
            if raise_error:
                raise
            return
        self._errors.pop(index, None)
        client.driver.emit("fleet", "catch_up", url, started, None, version=version)
        client.driver.emit("fleet", "join", url, started, None)
        log.info("%s joined the fleet (caught up to weight version %s)", url, version)

    async def _replay(self, server: Server) -> str | None:
        """Bring ``server`` to the recorded weights and adapters; the version it then serves (``None`` when
        nothing was recorded or it cannot be told). Raises :class:`AdminError` for what failed."""
        admin = self._client.admin
        record = admin.record
        caps = self._client.driver.capabilities
        stateful = "admin_state" in caps
        state = await self._state(server) if stateful else None
        weights = record.weights
        if record.mixed:
            self._fail(
                server,
                "catch_up",
                None,
                "the fleet's weights are mixed (the last weight update failed on some servers): "
                "a server joins after an update that reaches every server",
            )
        if weights is not None and not (
            state is not None and weights.version is not None and state.weight_version == weights.version
        ):
            if weights.path is None:
                self._fail(
                    server,
                    "catch_up",
                    None,
                    f"the fleet's weights (version {weights.version!r}) came over the transfer group "
                    f"{weights.group_name!r}, which a joining server cannot be sent: start it on those weights, "
                    "or update the fleet from a checkpoint path",
                )
            (outcome,) = await admin.outcomes([server]).update_weights(weights.path, version=weights.version)
            self._check(outcome, "update_weights")
        loaded = set(state.loras or ()) if state is not None else set()
        for adapter in record.adapters.values():
            replay = attrs.evolve(adapter, replace=adapter.name in loaded)
            (outcome,) = await admin.outcomes([server]).load_lora(replay)
            self._check(outcome, "load_lora")
        if not stateful:
            return weights.version if weights is not None else None
        state = await self._state(server)
        expected = weights.version if weights is not None else None
        if expected is not None and state.weight_version not in (expected, None):
            error = WeightVersionMismatch(server.base_url, expected=expected, reported=state.weight_version)
            self._fail(server, "verify", error, f"it serves {state.weight_version!r}, not {expected!r}")
        missing = sorted(set(record.adapters) - set(state.loras)) if state.loras is not None else []
        if missing:
            self._fail(server, "verify", None, f"adapters {missing} are not loaded on it after the catch-up")
        return state.weight_version if state.weight_version is not None else expected

    async def _state(self, server: Server) -> Any:
        (outcome,) = await self._client.admin.outcomes([server]).state()
        self._check(outcome, "state")
        return outcome.value

    @staticmethod
    def _check(outcome: ServerOutcome[Any], step: str) -> None:
        if not outcome.ok:
            raise AdminError(f"catch_up: {step}", [outcome], state=f"{outcome.server} stays out of the fleet")

    @staticmethod
    def _fail(server: Server, step: str, error: BaseException | None, why: str) -> NoReturn:
        outcome: ServerOutcome[Any] = ServerOutcome(server=server.base_url, error=error or MembershipError(why))
        raise AdminError(f"catch_up: {step}", [outcome], state=f"{server.base_url} stays out of the fleet: {why}")

    # -- refreshing -------------------------------------------------------------------------------------------

    async def refresh(self) -> None:
        """Read the discovery source (if configured): servers it lists join, servers it no longer lists leave
        (without waiting for their requests in flight); then catch up every server still joining. Failures are
        counted and reported through ``observe``, never raised: the next refresh tries again."""
        client = self._client
        source = client.config.fleet.discovery
        if source is not None:
            started = time.perf_counter()
            try:
                urls = await discover(source)
            except (OSError, ConfigError, ValueError, TypeError) as exc:
                client.driver.emit("fleet", "discover", None, started, exc)
                log.warning("fleet discovery failed, membership unchanged: %s", exc)
            else:
                client.driver.emit("fleet", "discover", None, started, None, urls=urls)
                self._apply(urls)
        joining = [i for i, state in enumerate(self._balancer.states) if state == "joining"]
        await asyncio.gather(*(self._catch_up(i, raise_error=False) for i in joining))

    def _apply(self, urls: Iterable[str]) -> None:
        listed = list(urls)
        for url in listed:
            if self._find(url) is None:
                self._join(url, None)
        b = self._balancer
        for i in list(b.serving()) + [i for i, s in enumerate(b.states) if s == "joining"]:
            url = b.servers[i].base_url
            if url in listed or b.states[i] == "gone":
                continue
            if b.serving() == [i]:
                log.warning("discovery no longer lists %s, but it is the last server serving: it stays", url)
                continue
            b.retire(i)
            self._errors.pop(i, None)
            self._client.driver.emit("fleet", "leave", url, time.perf_counter(), None)
            log.info("%s left the fleet (discovery no longer lists it)", url)

    def start(self) -> None:
        """Refresh every ``FleetPolicy.refresh_interval`` seconds from now on, when there is something to refresh
        (a discovery source, or a server whose catch-up failed). Called by the client; needs a running loop."""
        interval = self._client.config.fleet.refresh_interval
        if self._task is not None or interval is None or not self._wanted():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._task = loop.create_task(self._refreshing(interval))

    def _wanted(self) -> bool:
        """Whether there is something to refresh: a discovery source, or a server whose catch-up failed."""
        return self._client.config.fleet.discovery is not None or "joining" in self._balancer.states

    async def _refreshing(self, interval: float) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # a bug in one refresh must not end the next ones
                log.exception("fleet refresh failed")
            await asyncio.sleep(interval)

    async def _stop(self) -> None:
        """Stop refreshing (the client closes)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                if not task.cancelled():
                    raise
