"""Admin operations over every server of a client: concurrent, per-server outcomes, deadlines, retries.

An operation succeeds only if it succeeded on every server; otherwise :class:`~backends_core.errors.AdminError`
carries every server's outcome, successes included, so the caller knows exactly where it stands.

Each server's call runs under the operation's deadline (``AdminPolicy.deadlines``, else ``timeouts.admin``),
so one silent server can never hang the fleet. The requests of idempotent operations are declared safe to repeat
(:func:`~backends_core.server.idempotent_requests`): :meth:`~backends_core.server.Server.request` retries them
after a transport failure or a 5xx with the admin plane's policy (``AdminPolicy.retries`` and ``backoff``).
:meth:`Admin.weight_sync` is the whole update choreography with resume guaranteed on every server it paused.

The ``backends_core.fleet`` logger reports each operation on each server (INFO when it changed something,
WARNING when it failed; the read-only ``health``, ``ready`` and ``state`` only when they fail) and each phase of a
weight sync (INFO, WARNING when it failed somewhere).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

import attrs

from backends_core.config import AdminPolicy
from backends_core.errors import (
    AdminError,
    InvalidRequestError,
    MembershipError,
    RequestTimeout,
    TransferError,
    WeightVersionMismatch,
)
from backends_core.server import idempotent_requests
from backends_core.types import (
    PAUSE_MODES,
    DistributedGroup,
    LoraAdapter,
    PauseMode,
    ServerState,
    TensorSpec,
    TransferPlan,
    text,
)

if TYPE_CHECKING:
    from backends_core.driver import BackendDriver
    from backends_core.server import Server

__all__ = [
    "IDEMPOTENT_OPERATIONS",
    "Admin",
    "AdminOutcomes",
    "FleetState",
    "FleetRecord",
    "ServedVersions",
    "ServerOutcome",
    "ServerReport",
    "SyncReport",
    "WeightsRecord",
]

T = TypeVar("T")

log = logging.getLogger("backends_core.fleet")

#: Operations that only read: not logged when they succeed (membership and version checks run them often).
_READS = frozenset({"health", "ready", "state"})


def _base_url(server: Server) -> str:
    return server.base_url


def _serving(_server: Server) -> str:
    return "serving"


#: Operations that change which weights a server serves.
_CHANGES_WEIGHTS = frozenset({"update_weights", "update_weights_distributed"})

#: Operations safe to repeat: their requests are retried after a transport failure or a 5xx.
IDEMPOTENT_OPERATIONS = frozenset({"health", "ready", "state", "pause", "resume", "flush_cache", "wake"})


@attrs.frozen(kw_only=True)
class ServerOutcome(Generic[T]):
    """What one server answered: ``value`` on success, ``error`` on failure (never both)."""

    server: str
    value: T | None = None
    error: BaseException | None = None
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


@attrs.frozen(kw_only=True)
class ServerReport:
    """One server in :meth:`Admin.fleet_state`: what could be learned, and the error of what could not."""

    server: str
    reachable: bool
    ready: bool | None = None
    state: ServerState | None = None
    error: BaseException | None = None
    #: Its membership: ``"serving"``, or ``"joining"`` (not caught up yet, or reported unhealthy by a front).
    member: str = "serving"


@attrs.frozen
class FleetState(Sequence[ServerReport]):
    """:meth:`Admin.fleet_state`: one :class:`ServerReport` per member (a sequence of them), and whether the
    members agree.

    :ivar reports: the reports, in member order.
    """

    reports: tuple[ServerReport, ...]

    def __len__(self) -> int:
        return len(self.reports)

    @overload
    def __getitem__(self, index: int) -> ServerReport: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[ServerReport]: ...
    def __getitem__(self, index: int | slice) -> ServerReport | Sequence[ServerReport]:
        return self.reports[index]

    @property
    def versions(self) -> dict[str | None, list[str]]:
        """Weight version -> the members serving it that reported one (``None``: reported no version)."""
        out: dict[str | None, list[str]] = {}
        for r in self.reports:
            if r.state is not None and r.member == "serving":
                out.setdefault(r.state.weight_version, []).append(r.server)
        return out

    @property
    def disagreement(self) -> list[str]:
        """What the serving members disagree on, in words (empty when they agree): two weight versions serving
        at once, or some paused while others run. Members that could not report are not counted."""
        problems = []
        versions = {v: servers for v, servers in self.versions.items() if v is not None}
        if len(versions) > 1:
            problems.append(
                "weight versions " + "; ".join(f"{v!r} on {', '.join(servers)}" for v, servers in versions.items())
            )
        paused = {
            r.state.paused
            for r in self.reports
            if r.member == "serving" and r.state is not None and r.state.paused is not None
        }
        if len(paused) > 1:
            stopped = [r.server for r in self.reports if r.state is not None and r.state.paused]
            problems.append(f"paused on {', '.join(stopped)} only")
        return problems


@attrs.frozen(kw_only=True)
class SyncReport:
    """What :meth:`Admin.weight_sync` did, phase by phase, per server."""

    version: str
    phases: dict[str, list[ServerOutcome[Any]]]
    duration_s: float

    @property
    def ok(self) -> bool:
        return all(o.ok for outcomes in self.phases.values() for o in outcomes)


@attrs.frozen(kw_only=True)
class WeightsRecord:
    """The last weight update that reached every server: a checkpoint ``path``, or a broadcast over
    ``group_name`` (which a server joining later cannot be sent)."""

    version: str | None
    path: str | None = None
    group_name: str | None = None


class FleetRecord:
    """What this client's admin operations made the fleet serve, for servers that join later
    (``client.fleet``): the last weight update that reached every server and the adapters loaded on every
    server, in load order.

    :ivar weights: the last weight update that succeeded everywhere, ``None`` before any.
    :ivar mixed: the last weight update reached some servers only: the fleet's weights are not one version.
    :ivar adapters: name → the adapter as last loaded on every server.
    """

    def __init__(self) -> None:
        self.weights: WeightsRecord | None = None
        self.mixed = False
        self.adapters: dict[str, LoraAdapter] = {}

    def updated(self, outcomes: Sequence[ServerOutcome[Any]], weights: WeightsRecord) -> None:
        """Record a weight update's outcomes: every server switched, some did, or none did (nothing changed)."""
        switched = sum(o.ok for o in outcomes)
        if switched == len(outcomes):
            self.weights, self.mixed = weights, False
        elif switched:
            self.mixed = True

    def lora(
        self, outcomes: Sequence[ServerOutcome[Any]], *, loaded: LoraAdapter | None = None, unloaded: str = ""
    ) -> None:
        if not all(o.ok for o in outcomes):
            return
        if loaded is not None:
            self.adapters.pop(loaded.name, None)
            self.adapters[loaded.name] = attrs.evolve(loaded, replace=False)
        else:
            self.adapters.pop(unloaded, None)


class ServedVersions:
    """The weight version each server serves, as far as this client knows: what the server reported (a state
    check, a generation answer) or what this client set on it. Requests are salted with it.

    A server is in doubt after a weight change on it failed or it could not be reached: it is asked for its
    version before it serves again. ``None`` means the server does not report a version.
    """

    def __init__(self) -> None:
        self._known: dict[int, str | None] = {}
        self._doubt: set[int] = set()

    def known(self, server: Server) -> bool:
        return id(server) in self._known

    def get(self, server: Server) -> str | None:
        return self._known.get(id(server))

    def set(self, server: Server, version: str | None) -> None:
        """Record what ``server`` reports; a server in doubt stays so until the client's check passes."""
        self._known[id(server)] = version

    def forget(self, server: Server) -> None:
        """What ``server`` serves is no longer known: ask it before it serves again."""
        self._known.pop(id(server), None)
        self._doubt.add(id(server))

    def doubt(self, server: Server) -> None:
        """Check ``server`` again before it serves (it was found on other weights than the fleet)."""
        self._doubt.add(id(server))

    def trust(self, server: Server) -> None:
        """``server`` passed the check: it serves without being asked first."""
        self._doubt.discard(id(server))

    def in_doubt(self, server: Server) -> bool:
        return id(server) in self._doubt


class Admin:
    """``client.admin``: every admin hook, fanned out over the client's servers.

    Each method returns the per-server values (in server order) and raises
    :class:`~backends_core.errors.AdminError` if any server failed, or
    :class:`~backends_core.errors.UnsupportedOperationError` (before sending anything) if the backend lacks
    the operation.
    """

    def __init__(
        self,
        driver: BackendDriver,
        servers: Sequence[Server],
        *,
        policy: AdminPolicy | None = None,
        default_deadline: float | None = None,
        on_version: Callable[[str], None] | None = None,
        versions: ServedVersions | None = None,
        on_swap: Callable[[str], None] | None = None,
        members: Callable[[], Sequence[Server]] | None = None,
        sync: Callable[[bool], Awaitable[None]] | None = None,
        everyone: Callable[[], Sequence[Server]] | None = None,
        label: Callable[[Server], str] | None = None,
        standing: Callable[[Server], str] | None = None,
    ) -> None:
        self._driver = driver
        fixed = list(servers)
        self._members = members if members is not None else lambda: fixed
        #: Brings the membership up to date before each operation (behind a front: reads its replicas).
        self._sync_members = sync
        #: Every member, serving or joining (what :meth:`fleet_state` reports on).
        self._everyone = everyone if everyone is not None else self._members
        self._label = label if label is not None else _base_url
        self._standing = standing if standing is not None else _serving
        #: What the weight and adapter operations made the whole fleet serve (replayed to servers that join).
        self.record = FleetRecord()
        #: Held by every operation that changes weights or adapters, and by a joining server's catch-up: a
        #: server joins either before such an operation (and gets it) or after it (and is caught up to it).
        self.changes = asyncio.Lock()
        #: What each server serves, refreshed by every successful state check and weight update.
        self.versions = versions if versions is not None else ServedVersions()
        self._policy = policy or AdminPolicy()
        self._default_deadline = default_deadline if default_deadline is not None else driver.config.timeouts.admin
        self._on_version = on_version
        self._on_swap = on_swap

    @property
    def _servers(self) -> list[Server]:
        """The servers serving now (``client.fleet``'s members)."""
        return list(self._members())

    async def _refresh_members(self, *, strict: bool = True) -> None:
        """Bring the membership up to date; ``strict``: a member that cannot be caught up fails the operation."""
        if self._sync_members is not None:
            await self._sync_members(strict)

    def deadline(self, operation: str) -> float | None:
        """Seconds one server gets for ``operation``, retries included (``None``: no limit)."""
        return self._policy.deadlines.get(operation, self._default_deadline)

    async def _one(
        self, operation: str, server: Server, call: Callable[[Server], Awaitable[T]], version: str | None
    ) -> ServerOutcome[T]:
        started = time.perf_counter()
        deadline = self.deadline(operation)
        try:
            # retries happen per request in Server.request, by the admin plane's policy (AdminPolicy.retries)
            with idempotent_requests(operation in IDEMPOTENT_OPERATIONS):
                async with asyncio.timeout(deadline):
                    value = await call(server)
        except TimeoutError as exc:
            error = RequestTimeout(
                f"admin_{operation} exceeded its {deadline} s deadline", method="admin", url=server.admin_url
            )
            error.__cause__ = exc
            log.warning("admin_%s on %s: %s", operation, server.base_url, error)
            return ServerOutcome(server=server.base_url, error=error, duration_s=time.perf_counter() - started)
        except Exception as exc:
            if operation in _CHANGES_WEIGHTS:  # it may have switched before failing: look again before salting
                self.versions.forget(server)
            duration = time.perf_counter() - started
            log.warning(
                "admin_%s on %s failed after %.2f s: %s: %s",
                operation,
                server.base_url,
                duration,
                type(exc).__name__,
                exc,
            )
            return ServerOutcome(server=server.base_url, error=exc, duration_s=duration)
        if operation == "state" and isinstance(value, ServerState):
            self.versions.set(server, value.weight_version)
        elif operation in _CHANGES_WEIGHTS:
            if version is None:
                self.versions.forget(server)
            else:
                self.versions.set(server, version)
        duration = time.perf_counter() - started
        if operation not in _READS:
            log.info("admin_%s on %s: done in %.2f s", operation, server.base_url, duration)
        return ServerOutcome(server=server.base_url, value=value, duration_s=duration)

    def outcomes(self, servers: Sequence[Server] | None = None) -> AdminOutcomes:
        """The same operations on every server (or ``servers``), returning each server's
        :class:`ServerOutcome` instead of raising for a server's failure."""
        return AdminOutcomes(self, self._servers if servers is None else list(servers))

    async def _fan(
        self,
        operation: str,
        servers: Sequence[Server],
        call: Callable[[Server], Awaitable[T]],
        version: str | None = None,
    ) -> list[ServerOutcome[T]]:
        self._driver.require(f"admin_{operation}")
        if not servers:  # an operation on no server would report success for nothing
            raise MembershipError(
                f"admin_{operation}: no server serves (behind a front, the replicas are listed by the first admin "
                "operation or client.fleet.refresh())"
            )
        return list(await asyncio.gather(*(self._one(operation, s, call, version) for s in servers)))

    @staticmethod
    def _values(
        operation: str, outcomes: list[ServerOutcome[T]], left: Callable[[list[str]], str] | None = None
    ) -> list[T]:
        """Every server's value; on any failure :class:`AdminError`, whose message ends with ``left(servers where
        it took effect)`` when those servers now need the caller's attention."""
        if any(o.error is not None for o in outcomes):
            done = [o.server for o in outcomes if o.ok]
            raise AdminError(f"admin_{operation}", outcomes, state=left(done) if left and done else None)
        return [o.value for o in outcomes]  # type: ignore[misc]  # no error: every value is set

    async def health(self) -> list[bool]:
        await self._refresh_members()
        return self._values("health", await self.outcomes().health())

    async def ready(self) -> list[bool]:
        await self._refresh_members()
        return self._values("ready", await self.outcomes().ready())

    async def pause(self, mode: PauseMode = "abort", *, clear_cache: bool = False) -> list[bool]:
        """Pause every server; if any fails, the :class:`AdminError` names the servers left paused."""
        _check_mode(mode)
        await self._refresh_members()
        return self._values("pause", await self.outcomes().pause(mode, clear_cache=clear_cache), _left_paused)

    async def resume(self) -> list[bool]:
        await self._refresh_members()
        return self._values("resume", await self.outcomes().resume(), lambda done: f"resumed: {', '.join(done)}")

    async def flush_cache(self) -> list[bool]:
        await self._refresh_members()
        return self._values("flush_cache", await self.outcomes().flush_cache())

    async def update_weights(self, path: str, *, version: str | None = None) -> list[bool]:
        """Load the checkpoint at ``path`` on every server; ``version`` is recorded only if all succeed.

        :raises InvalidRequestError: ``path`` or ``version`` is empty or blank (nothing is sent).
        :raises AdminError: a server failed; the message names the servers now on the new weights.
        """
        self._driver.require("admin_update_weights")
        text(path, "path")
        if version is not None:
            text(version, "version")
        await self._refresh_members()
        async with self.changes:
            outcomes = await self.outcomes().update_weights(path, version=version)
            self.record.updated(outcomes, WeightsRecord(version=version, path=path))
        values = self._values("update_weights", outcomes, _mixed_weights(path))
        self._remember(version)
        return values

    async def init_weight_transfer(self, group: DistributedGroup) -> list[bool]:
        self._driver.require("admin_init_weight_transfer")
        if not isinstance(group, DistributedGroup):
            raise InvalidRequestError(f"group must be a DistributedGroup, got {type(group).__name__}")
        await self._refresh_members()
        return self._values(
            "init_weight_transfer",
            await self.outcomes().init_weight_transfer(group),
            lambda done: f"joined {group.group_name!r} on {', '.join(done)}: leave with destroy_weight_transfer",
        )

    async def destroy_weight_transfer(self, group_name: str = "weight_sync") -> list[bool]:
        """Every server leaves the transfer group ``group_name`` joined with :meth:`init_weight_transfer`.

        Not idempotent, so never retried: a destroy that landed before a lost answer would be repeated on a
        group that is gone (SGLang refuses that). It runs under ``AdminPolicy.deadlines["destroy_weight_transfer"]``
        (else ``timeouts.admin``).

        :param group_name: ``DistributedGroup.group_name`` of the group (its default).
        :raises InvalidRequestError: ``group_name`` is not a non-empty string (nothing is sent).
        :raises AdminError: a server refused (e.g. it has no such group) or failed; successes are listed too.
        """
        self._driver.require("admin_destroy_weight_transfer")
        text(group_name, "group_name")
        await self._refresh_members()
        return self._values("destroy_weight_transfer", await self.outcomes().destroy_weight_transfer(group_name))

    def transfer_plan(self, tensors: Sequence[TensorSpec], *, bucket_bytes: int | None = None) -> TransferPlan:
        """How the engines receive ``tensors`` over a transfer group joined with ``bucket_bytes``
        (``DistributedGroup.bucket_bytes``): the order and buckets a trainer broadcasts them in. Sends nothing.

        :raises InvalidRequestError: ``tensors`` is empty or holds something other than :class:`TensorSpec`,
            ``bucket_bytes`` is not a positive int, or the engine cannot receive them so.
        :raises UnsupportedOperationError: the backend does not receive distributed updates.
        """
        tensors = _tensor_list(tensors)
        if bucket_bytes is not None and (
            not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes < 1
        ):
            raise InvalidRequestError(f"bucket_bytes must be a positive int or None, got {bucket_bytes!r}")
        return self._driver.weight_transfer_plan(tensors, bucket_bytes=bucket_bytes)

    async def update_weights_distributed(
        self,
        group_name: str,
        tensors: Sequence[TensorSpec],
        *,
        version: str | None = None,
        plan: TransferPlan | None = None,
    ) -> list[bool]:
        """Receive ``tensors`` broadcast by the trainer over ``group_name`` on every server.

        :param plan: the buckets the trainer sends (:meth:`transfer_plan`); ``None``: one broadcast per tensor.
        :raises InvalidRequestError: ``group_name`` or ``version`` is blank, ``tensors`` is empty or holds
            something other than :class:`TensorSpec`, or ``plan`` does not hold them (nothing is sent).
        :raises AdminError: a server failed; the message names the servers now on the new weights.
        """
        self._driver.require("admin_update_weights_distributed")
        text(group_name, "group_name")
        if version is not None:
            text(version, "version")
        tensors = _tensor_list(tensors)
        _check_plan(plan, tensors)
        await self._refresh_members()
        async with self.changes:
            outcomes = await self.outcomes().update_weights_distributed(group_name, tensors, version=version, plan=plan)
            self.record.updated(outcomes, WeightsRecord(version=version, group_name=group_name))
        values = self._values(
            "update_weights_distributed", outcomes, _mixed_weights(f"the tensors broadcast over {group_name!r}")
        )
        self._remember(version)
        return values

    async def load_lora(self, adapter: LoraAdapter) -> list[bool]:
        """Load (or, with ``adapter.replace``, hot-swap) ``adapter`` on every server.

        A hot swap keeps the adapter's name, and engines key prefix-cache blocks by that name (vLLM #42125): so
        after a swap the prefix cache is flushed on every server (where the backend can), and this client's
        requests for the adapter get a new cache salt.

        :raises AdminError: a server failed; the message names the servers where the adapter is now loaded,
            or, if the swap worked but a flush did not, the servers that may reuse blocks of the old adapter.
        """
        self._driver.require("admin_load_lora")
        if not isinstance(adapter, LoraAdapter):
            raise InvalidRequestError(f"adapter must be a LoraAdapter, got {type(adapter).__name__}")
        await self._refresh_members()
        async with self.changes:
            outcomes = await self.outcomes().load_lora(adapter)
            self.record.lora(outcomes, loaded=adapter)
        values = self._values(
            "load_lora",
            outcomes,
            lambda done: (
                f"adapter {adapter.name!r} from {adapter.path} is loaded on {', '.join(done)} only: "
                "retry load_lora with replace=True, or unload_lora"
            ),
        )
        if adapter.replace:
            if self._on_swap is not None:
                self._on_swap(adapter.name)
            if "admin_flush_cache" in self._driver.capabilities:
                outcomes = await self.outcomes().flush_cache()
                if not all(o.ok for o in outcomes):
                    stale = ", ".join(o.server for o in outcomes if not o.ok)
                    raise AdminError(
                        f"admin_load_lora {adapter.name!r}: flush_cache after the hot swap",
                        outcomes,
                        state=(
                            f"the adapter was swapped on every server, but {stale} may still reuse prefix-cache "
                            f"blocks computed with the old adapter (this client re-salts {adapter.name!r}): "
                            "retry admin.flush_cache()"
                        ),
                    )
        return values

    async def unload_lora(self, name: str) -> list[bool]:
        self._driver.require("admin_unload_lora")
        text(name, "adapter name")
        await self._refresh_members()
        async with self.changes:
            outcomes = await self.outcomes().unload_lora(name)
            self.record.lora(outcomes, unloaded=name)
        return self._values(
            "unload_lora",
            outcomes,
            lambda done: f"adapter {name!r} is unloaded on {', '.join(done)} only: retry unload_lora",
        )

    async def state(self) -> list[ServerState]:
        await self._refresh_members()
        return self._values("state", await self.outcomes().state())

    async def sleep(self, level: int = 1) -> list[bool]:
        if level not in (1, 2):
            raise InvalidRequestError(f"sleep level must be 1 or 2, got {level!r}")
        await self._refresh_members()
        return self._values("sleep", await self.outcomes().sleep(level), lambda done: f"left asleep: {', '.join(done)}")

    async def wake(self) -> list[bool]:
        await self._refresh_members()
        return self._values("wake", await self.outcomes().wake())

    async def abort(self, request_ids: Sequence[str] | None = None) -> list[int]:
        self._driver.require("admin_abort")
        if request_ids is not None:
            if isinstance(request_ids, str):
                raise InvalidRequestError("request_ids must be a list of request ids, not one string")
            request_ids = [text(r, "request id") for r in request_ids]
        await self._refresh_members()
        return self._values("abort", await self.outcomes().abort(request_ids))

    def _remember(self, version: str | None) -> None:
        if version is not None and self._on_version is not None:
            self._on_version(version)

    async def fleet_state(self) -> FleetState:
        """One view of the fleet: per member (behind a front: per replica it lists) reachable, ready, and its
        state where the backend exposes them, and whether the members disagree (two weight versions serving at
        once, some paused and some not). Never raises for a member's failure: its report says what failed.

        :raises FrontError: behind a front, the front cannot list its replicas.
        """
        caps = self._driver.capabilities
        await self._refresh_members(strict=False)

        async def report(server: Server) -> ServerReport:
            name = self._label(server)
            member = self._standing(server)
            try:
                if "admin_health" in caps:
                    (health,) = await self.outcomes([server]).health()
                    if not health.ok:
                        return ServerReport(server=name, member=member, reachable=False, error=health.error)
                ready = state = None
                if "admin_ready" in caps:
                    (r,) = await self.outcomes([server]).ready()
                    ready = r.value if r.ok else None
                if "admin_state" in caps:
                    (st,) = await self.outcomes([server]).state()
                    if not st.ok:
                        return ServerReport(server=name, member=member, reachable=True, ready=ready, error=st.error)
                    state = st.value
                return ServerReport(server=name, member=member, reachable=True, ready=ready, state=state)
            except Exception as exc:  # a backend bug in one server's report must not hide the others
                return ServerReport(server=name, member=member, reachable=False, error=exc)

        return FleetState(reports=tuple(await asyncio.gather(*(report(s) for s in self._everyone()))))

    async def weight_sync(
        self,
        *,
        version: str,
        path: str | None = None,
        group_name: str | None = None,
        tensors: Sequence[TensorSpec] = (),
        plan: TransferPlan | None = None,
        sender: Callable[[], Awaitable[None]] | None = None,
        mode: PauseMode = "wait",
        flush_cache: bool = True,
    ) -> SyncReport:
        """Pause → update → set the version → flush (or rely on re-salting) → resume, on every server.

        Resume runs in ``finally`` on every server that was paused, whatever failed. After its resume each
        server's version is checked in its state (the version only) where the backend exposes
        it, and requests of this client are salted with it.

        :param version: the new weight version.
        :param path: checkpoint directory on the servers (exclusive with ``group_name``).
        :param group_name: a transfer group set up with :meth:`init_weight_transfer`; ``tensors`` lists what
            the trainer broadcasts.
        :param plan: with ``group_name``: the buckets the trainer broadcasts in (:meth:`transfer_plan`);
            ``None``: one broadcast per tensor.
        :param sender: with ``group_name``: the trainer's half, started once every server paused and run
            concurrently with the servers' receive; the update phase fails on every server if it fails (a
            server waiting on a broadcast that will not come is released by its group's timeout), and a server
            whose receive fails cancels it and abandons the other servers' receive.
        :param mode: pause mode for in-flight requests.
        :param flush_cache: flush the prefix cache while paused (with ``"keep"`` the cache is not flushed:
            kept requests need it; re-salting isolates new requests instead).
        :raises AdminError: any phase failed on any server (the report of every phase is attached).
        """
        _check_mode(mode)
        text(version, "version")
        if (path is None) == (group_name is None):
            raise InvalidRequestError("weight_sync needs exactly one of path= or group_name=")
        if path is not None:
            text(path, "path")
            source = path
            if plan is not None or sender is not None:
                raise InvalidRequestError("plan= and sender= go with group_name=, not with path=")
        else:
            text(group_name, "group_name")
            tensors = _tensor_list(tensors)
            _check_plan(plan, tensors)
            source = f"the tensors broadcast over {group_name!r}"
        await self._refresh_members()
        async with self.changes:
            return await self._sync(
                version, path, _Broadcast(group_name, tensors, plan, sender), source, mode, flush_cache
            )

    async def _sync(
        self,
        version: str,
        path: str | None,
        broadcast: _Broadcast,
        source: str,
        mode: PauseMode,
        flush_cache: bool,
    ) -> SyncReport:
        """:meth:`weight_sync` over the servers serving when it starts (servers joining wait for its end).

        Pause and update are fleet-wide phases: nothing is updated unless every server paused, and nothing is
        flushed or resumed before every server was updated (a failed update leaves no server flushed). After
        the update each server goes on by itself: flush, resume, then its version check, so a server never
        waits for another's flush or resume. Resume runs on every paused server whatever failed or was
        cancelled; the version check counts only when every server was flushed and resumed.
        """
        started = time.perf_counter()
        servers = self._servers
        phases: dict[str, list[ServerOutcome[Any]]] = {}
        paused: list[Server] = []
        run = _SyncRun()
        failure: _Failure | None = None
        log.info("weight_sync to %r on %d server(s): pause (%s)", version, len(servers), mode)
        try:
            phases["pause"] = await self.outcomes(servers).pause(mode, clear_cache=False)
            _log_phase(version, "pause", phases["pause"])
            paused = [s for s, o in zip(servers, phases["pause"], strict=True) if o.ok]
            if len(paused) < len(servers):
                failure = ("pause", phases["pause"], "nothing was updated; the paused servers were resumed")
            else:
                failure = await self._apply(servers, phases, run, version, path, broadcast, source, mode, flush_cache)
        finally:
            if paused:
                rest = [s for s in paused if id(s) not in run.resumed]
                if rest:  # not resumed by their own sequence (a phase failed, or the sync was cancelled)
                    for server, outcome in zip(rest, await self.outcomes(rest).resume(), strict=True):
                        run.resumed[id(server)] = outcome
                phases["resume"] = [run.resumed[id(s)] for s in paused]
                _log_phase(version, "resume", phases["resume"])
        stuck = [o.server for o in phases.get("resume", ()) if not o.ok]
        if stuck:
            note = f"left paused: {', '.join(stuck)} (resume them with admin.resume())"
            failure = ("resume", phases["resume"], note) if failure is None else (*failure[:2], f"{failure[2]}; {note}")
        if failure is None and "admin_state" in self._driver.capabilities:
            phases["verify"] = outcomes = [_check_version(run.checked[id(s)], version) for s in servers]
            _log_phase(version, "verify", outcomes)
            if not all(o.ok for o in outcomes):
                failure = ("verify", outcomes, f"the servers that failed the check may not serve {version!r}")
        duration = time.perf_counter() - started
        if failure is not None:
            phase, outcomes, state = failure
            log.warning("weight_sync to %r failed in its %s phase after %.2f s: %s", version, phase, duration, state)
            raise AdminError(f"weight_sync: {phase}", outcomes, phases=phases, state=state)
        log.info("weight_sync to %r done on %d server(s) in %.2f s", version, len(servers), duration)
        return SyncReport(version=version, phases=phases, duration_s=duration)

    async def _apply(
        self,
        servers: list[Server],
        phases: dict[str, list[ServerOutcome[Any]]],
        run: _SyncRun,
        version: str,
        path: str | None,
        broadcast: _Broadcast,
        source: str,
        mode: PauseMode,
        flush_cache: bool,
    ) -> _Failure | None:
        """The paused part of :meth:`weight_sync`: update, record the version, then per server flush, resume
        and check (into ``run``). Returns what failed before the resume."""
        group_name = broadcast.group_name
        if path is not None:
            phases["update"] = await self.outcomes(servers).update_weights(path, version=version)
        else:
            assert group_name is not None
            phases["update"] = await self._receive(servers, broadcast, version)
        _log_phase(version, "update", phases["update"])
        self.record.updated(phases["update"], WeightsRecord(version=version, path=path, group_name=group_name))
        done = [o.server for o in phases["update"] if o.ok]
        if len(done) < len(phases["update"]):
            return ("update", phases["update"], _mixed_weights(source)(done) if done else "nothing was updated")
        self._remember(version)
        driver = self._driver
        caps = driver.capabilities
        flushing = flush_cache and mode != "keep" and "admin_flush_cache" in caps
        checking = "admin_state" in caps
        driver.require("admin_resume")

        async def check(server: Server) -> ServerState:
            return await driver.admin_state(server, fields=_SYNC_FIELDS)

        async def finish(server: Server) -> ServerOutcome[bool] | None:
            """Flush, resume, check one server; its flush outcome (``None`` without a flush)."""
            flushed = await self._one("flush_cache", server, driver.admin_flush_cache, None) if flushing else None
            resumed = run.resumed[id(server)] = await self._one("resume", server, driver.admin_resume, None)
            if checking and resumed.ok and (flushed is None or flushed.ok):
                run.checked[id(server)] = await self._one("state", server, check, None)
            return flushed

        flushed = await asyncio.gather(*(finish(s) for s in servers))
        if flushing:
            phases["flush"] = [o for o in flushed if o is not None]
            _log_phase(version, "flush", phases["flush"])
            if not all(o.ok for o in phases["flush"]):
                return (
                    "flush_cache",
                    phases["flush"],
                    f"every server serves {version!r}; the failed servers may keep prefix-cache entries of the old "
                    "weights (this client's requests are salted with the new version)",
                )
        return None

    async def _receive(self, servers: list[Server], broadcast: _Broadcast, version: str) -> list[ServerOutcome[Any]]:
        """The update phase of a broadcast weight sync: every server receives while the trainer's ``sender``
        (if any) sends. A sender that fails abandons the servers' receive (they are waiting on a broadcast
        that will not come); a server whose receive fails abandons the sender and the other servers' receive
        at once (a collective cannot complete without one of its ranks, so they would wait for the group's
        timeout)."""
        group_name = broadcast.group_name
        assert group_name is not None

        async def receive(server: Server) -> ServerOutcome[Any]:
            (outcome,) = await self.outcomes([server]).update_weights_distributed(
                group_name, broadcast.tensors, version=version, plan=broadcast.plan
            )
            return outcome

        if broadcast.sender is None:
            return list(await asyncio.gather(*(receive(s) for s in servers)))
        started = time.perf_counter()
        receiving = [asyncio.ensure_future(receive(s)) for s in servers]
        sending = asyncio.ensure_future(broadcast.sender())
        try:
            pending: set[asyncio.Future[Any]] = {*receiving, sending}
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if sending in done and (sending.cancelled() or sending.exception() is not None):
                    break
                if any(not task.result().ok for task in done if task is not sending):
                    break
        finally:
            for task in (*receiving, sending):
                if not task.done():
                    task.cancel()
            await asyncio.gather(*receiving, sending, return_exceptions=True)
        duration = time.perf_counter() - started
        if sending.done() and not sending.cancelled() and sending.exception() is not None:
            error = sending.exception()
            for server in servers:
                self.versions.forget(server)
            return [
                ServerOutcome(
                    server=server.base_url,
                    error=TransferError(
                        f"the trainer's broadcast failed ({type(error).__name__}: {error}): this server's receive "
                        "was abandoned and it may hold part of the new tensors until the next update"
                    ),
                    duration_s=duration,
                )
                for server in servers
            ]
        failed = [task.result().server for task in receiving if not task.cancelled() and not task.result().ok]
        reason = (
            f"{', '.join(failed)} failed to receive, so the broadcast cannot complete"
            if failed
            else "the trainer's sender was cancelled"
        )
        outcomes: list[ServerOutcome[Any]] = []
        for server, task in zip(servers, receiving, strict=True):
            if not task.cancelled():
                outcomes.append(task.result())
                continue
            self.versions.forget(server)
            outcomes.append(
                ServerOutcome(
                    server=server.base_url,
                    error=TransferError(
                        f"abandoned: {reason}; this server may hold part of the new tensors until the next update"
                    ),
                    duration_s=duration,
                )
            )
        return outcomes


#: What a weight sync's check reads of each server's state: the version, which proves the update (the resume
#: is proven by its own answer).
_SYNC_FIELDS = frozenset({"weight_version"})


@attrs.frozen
class _Broadcast:
    """A weight sync's broadcast source: the group, what goes through it, in which buckets, and the trainer's
    half (``None``: the trainer sends by itself)."""

    group_name: str | None
    tensors: Sequence[TensorSpec]
    plan: TransferPlan | None
    sender: Callable[[], Awaitable[None]] | None


@attrs.define
class _SyncRun:
    """Per-server results of a weight sync's last steps, by ``id(server)``: each resume outcome (whether by the
    server's own sequence or by the sync's ``finally``), and each version check."""

    resumed: dict[int, ServerOutcome[Any]] = attrs.Factory(dict)
    checked: dict[int, ServerOutcome[Any]] = attrs.Factory(dict)


class AdminOutcomes:
    """:meth:`Admin.outcomes`: each admin operation on a set of servers, concurrently, under the operation's
    deadline and retries, returning every server's :class:`ServerOutcome` (a server's failure is its outcome's
    ``error``). Arguments are not validated here: :class:`Admin`'s methods do that before sending."""

    def __init__(self, admin: Admin, servers: Sequence[Server]) -> None:
        self._admin = admin
        self._driver = admin._driver
        self._servers = servers

    async def health(self) -> list[ServerOutcome[bool]]:
        return await self._admin._fan("health", self._servers, self._driver.admin_health)

    async def ready(self) -> list[ServerOutcome[bool]]:
        return await self._admin._fan("ready", self._servers, self._driver.admin_ready)

    async def pause(self, mode: PauseMode, *, clear_cache: bool) -> list[ServerOutcome[bool]]:
        pause = self._driver.admin_pause
        return await self._admin._fan("pause", self._servers, lambda s: pause(s, mode=mode, clear_cache=clear_cache))

    async def resume(self) -> list[ServerOutcome[bool]]:
        return await self._admin._fan("resume", self._servers, self._driver.admin_resume)

    async def flush_cache(self) -> list[ServerOutcome[bool]]:
        return await self._admin._fan("flush_cache", self._servers, self._driver.admin_flush_cache)

    async def update_weights(self, path: str, *, version: str | None) -> list[ServerOutcome[bool]]:
        update = self._driver.admin_update_weights
        return await self._admin._fan(
            "update_weights", self._servers, lambda s: update(s, path=path, version=version), version
        )

    async def init_weight_transfer(self, group: DistributedGroup) -> list[ServerOutcome[bool]]:
        init = self._driver.admin_init_weight_transfer
        return await self._admin._fan("init_weight_transfer", self._servers, lambda s: init(s, group=group))

    async def destroy_weight_transfer(self, group_name: str) -> list[ServerOutcome[bool]]:
        destroy = self._driver.admin_destroy_weight_transfer
        return await self._admin._fan(
            "destroy_weight_transfer", self._servers, lambda s: destroy(s, group_name=group_name)
        )

    async def update_weights_distributed(
        self, group_name: str, tensors: Sequence[TensorSpec], *, version: str | None, plan: TransferPlan | None = None
    ) -> list[ServerOutcome[bool]]:
        update = self._driver.admin_update_weights_distributed
        items = list(tensors)
        return await self._admin._fan(
            "update_weights_distributed",
            self._servers,
            lambda s: update(s, group_name=group_name, tensors=items, version=version, plan=plan),
            version,
        )

    async def load_lora(self, adapter: LoraAdapter) -> list[ServerOutcome[bool]]:
        load = self._driver.admin_load_lora
        return await self._admin._fan("load_lora", self._servers, lambda s: load(s, adapter=adapter))

    async def unload_lora(self, name: str) -> list[ServerOutcome[bool]]:
        unload = self._driver.admin_unload_lora
        return await self._admin._fan("unload_lora", self._servers, lambda s: unload(s, name=name))

    async def state(self) -> list[ServerOutcome[ServerState]]:
        return await self._admin._fan("state", self._servers, self._driver.admin_state)

    async def sleep(self, level: int) -> list[ServerOutcome[bool]]:
        sleep = self._driver.admin_sleep
        return await self._admin._fan("sleep", self._servers, lambda s: sleep(s, level=level))

    async def wake(self) -> list[ServerOutcome[bool]]:
        return await self._admin._fan("wake", self._servers, self._driver.admin_wake)

    async def abort(self, request_ids: Sequence[str] | None) -> list[ServerOutcome[int]]:
        abort = self._driver.admin_abort
        return await self._admin._fan("abort", self._servers, lambda s: abort(s, request_ids=request_ids))


#: A failed phase of a weight sync: its name, its outcomes, and the state it left.
_Failure = tuple[str, list[ServerOutcome[Any]], str]


def _log_phase(version: str, phase: str, outcomes: Sequence[ServerOutcome[Any]]) -> None:
    """One line for a weight sync's phase: INFO when it succeeded everywhere, else WARNING naming where it failed."""
    failed = [o for o in outcomes if not o.ok]
    if failed:
        log.warning(
            "weight_sync to %r: %s failed on %d of %d server(s): %s",
            version,
            phase,
            len(failed),
            len(outcomes),
            "; ".join(f"{o.server}: {type(o.error).__name__}: {o.error}" for o in failed),
        )
    else:
        log.info("weight_sync to %r: %s ok on %d server(s)", version, phase, len(outcomes))


def _check_version(outcome: ServerOutcome[Any], version: str) -> ServerOutcome[Any]:
    """A state outcome whose reported version is neither ``version`` nor unknown becomes a failure."""
    state = outcome.value
    if outcome.ok and state is not None and state.weight_version not in (version, None):
        error = WeightVersionMismatch(outcome.server, expected=version, reported=state.weight_version)
        return attrs.evolve(outcome, error=error)
    return outcome


def _left_paused(done: list[str]) -> str:
    return f"left paused: {', '.join(done)} (resume them with admin.resume())"


def _mixed_weights(source: str) -> Callable[[list[str]], str]:
    def state(done: list[str]) -> str:
        return (
            f"mixed weights: {', '.join(done)} switched to {source}, the others did not; no version was recorded; "
            "retry the update (servers that have it reload it) or roll back to the previous checkpoint"
        )

    return state


def _tensor_list(tensors: Sequence[TensorSpec]) -> list[TensorSpec]:
    items = list(tensors)
    if not items:
        raise InvalidRequestError("tensors must list at least one TensorSpec")
    for item in items:
        if not isinstance(item, TensorSpec):
            raise InvalidRequestError(f"tensors must hold TensorSpec objects, got {type(item).__name__}")
    return items


def _check_plan(plan: TransferPlan | None, tensors: Sequence[TensorSpec]) -> None:
    if plan is None:
        return
    if not isinstance(plan, TransferPlan):
        raise InvalidRequestError(f"plan must be a TransferPlan, got {type(plan).__name__}")
    if plan.tensors != list(tensors):
        raise InvalidRequestError("plan must hold the tensors announced, in the same order")


def _check_mode(mode: str) -> None:
    if mode not in PAUSE_MODES:
        raise InvalidRequestError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
