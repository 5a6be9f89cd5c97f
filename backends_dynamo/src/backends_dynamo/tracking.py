"""What this client knows about a Dynamo frontend that Dynamo 1.6.1 does not report, kept per server in
``Server.cache``.

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
"""

from __future__ import annotations

import asyncio
import uuid

import attrs

from backends_core import Server

__all__ = ["REQUEST_ID_HEADER", "Flight", "Tracker", "dynamo_request_id", "tracker"]

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
