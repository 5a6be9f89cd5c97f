"""Which server gets the next request: sticky-least-loaded with health tracking.

* Requests without a session go to the healthy server with the fewest requests in flight (ties rotate).
* A new session goes to the healthy server with the fewest requests in flight; ties go to the server that
  holds the fewest sessions, then rotate. Only fresh picks move the rotation: the turns of a sticky session
  do not, so however many turns each session sends, new sessions spread evenly.
* A session (a conversation, an agent trajectory) sticks to its server, so its prefix cache keeps hitting,
  unless that server is down or carries more than ``slack`` requests above the least-loaded one: then the
  session moves, once, to the least-loaded server (not plain hashing, which pins sessions to a thrashing
  engine).
* A server whose request could not even be sent is taken out for ``cooldown`` seconds; after that it gets
  one probe request (half-open) and is back on its first success. In-flight counts are exact: every
  :meth:`Balancer.acquire` has a matching :meth:`Balancer.release`.
* Membership is elastic (``client.fleet``): every server ever added keeps its index for good (requests in flight
  hold it); only servers in the ``serving`` state are picked. A server ``joining`` is not picked until it is
  admitted; a ``gone`` one is never picked again, and :attr:`Balancer.on_idle` hears when its last request ends.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Generic, Literal, TypeVar

import attrs

__all__ = ["Balancer", "MemberState", "ServerLoad"]

S = TypeVar("S")

#: Where a server stands in the fleet: picked, being caught up before it is picked, or removed.
MemberState = Literal["serving", "joining", "gone"]


@attrs.define
class ServerLoad:
    """Live accounting of one server."""

    in_flight: int = 0
    completed: int = 0
    failures: int = 0
    down_until: float = 0.0

    def up(self, now: float) -> bool:
        return self.down_until <= now


class Balancer(Generic[S]):
    """Picks servers for requests.

    :param servers: the candidates, in config order (none yet is allowed: :meth:`pick` then raises
        ``LookupError`` until one is added).
    :param slack: how many more in-flight requests than the least-loaded server a sticky server may carry.
    :param cooldown: seconds a server that failed to accept a request stays out.
    :param max_sessions: sessions remembered (least recently used are forgotten).
    :param clock: monotonic clock (injectable for tests).
    """

    def __init__(
        self,
        servers: Sequence[S],
        *,
        slack: int = 8,
        cooldown: float = 5.0,
        max_sessions: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.servers = list(servers)
        self.load = [ServerLoad() for _ in self.servers]
        self.slack = slack
        self.cooldown = cooldown
        self.max_sessions = max_sessions
        self._clock = clock
        self._rotation = 0
        self._sessions: OrderedDict[str, int] = OrderedDict()
        #: How many remembered sessions stick to each server.
        self.session_counts = [0] * len(self.servers)
        #: Each server's membership: the one record of which servers are in the fleet.
        self.states: list[MemberState] = ["serving"] * len(self.servers)
        #: Called with the index of a ``gone`` server whose last request in flight just ended.
        self.on_idle: Callable[[int], None] | None = None

    def add(self, server: S, *, state: MemberState = "joining") -> int:
        """A new server's index (it is never reused)."""
        self.servers.append(server)
        self.load.append(ServerLoad())
        self.session_counts.append(0)
        self.states.append(state)
        return len(self.servers) - 1

    def admit(self, index: int) -> None:
        """Server ``index`` serves from now on."""
        if self.states[index] == "joining":
            self.states[index] = "serving"

    def retire(self, index: int) -> None:
        """Server ``index`` gets no new request; those in flight end as they would."""
        self.states[index] = "gone"
        if self.load[index].in_flight == 0 and self.on_idle is not None:
            self.on_idle(index)

    def serving(self) -> list[int]:
        """Indices of the servers requests may go to."""
        return [i for i, state in enumerate(self.states) if state == "serving"]

    def exhausted(self, tried: set[int]) -> bool:
        """Whether every serving server is in ``tried``."""
        return all(i in tried for i in self.serving())

    def _candidates(self, exclude: frozenset[int], now: float) -> tuple[list[int], bool]:
        """The servers a request may go to, and whether they are healthy (else all are down)."""
        order = [i for i in self.serving() if i not in exclude]
        if not order:
            if not self.serving():
                raise LookupError("no server is serving: every member is joining or gone")
            raise LookupError("every server has been tried")
        healthy = [i for i in order if self.load[i].up(now)]
        return (healthy, True) if healthy else (order, False)

    def _least_loaded(self, *, exclude: frozenset[int], now: float, new_session: bool) -> int:
        candidates, healthy = self._candidates(exclude, now)
        if not healthy:  # all down: probe the one back soonest
            return min(candidates, key=lambda i: self.load[i].down_until)
        n = len(self.servers)
        start = self._rotation % n
        self._rotation += 1

        def rank(i: int) -> tuple[int, int, int]:
            sessions = self.session_counts[i] if new_session else 0
            return (self.load[i].in_flight, sessions, (i - start) % n)

        return min(candidates, key=rank)

    def pick(self, *, session: str | None = None, exclude: frozenset[int] = frozenset()) -> int:
        """Index of the server for the next request of ``session`` (or of no session)."""
        now = self._clock()
        if session is not None:
            current = self._sessions.get(session)
            if (
                current is not None
                and current not in exclude
                and self.states[current] == "serving"
                and self.load[current].up(now)
            ):
                candidates, _ = self._candidates(exclude, now)
                lightest = min(self.load[i].in_flight for i in candidates)
                if self.load[current].in_flight <= lightest + self.slack:
                    self._sessions.move_to_end(session)
                    return current
        best = self._least_loaded(exclude=exclude, now=now, new_session=session is not None)
        if session is not None:
            self._stick(session, best)
        return best

    def _stick(self, session: str, index: int) -> None:
        previous = self._sessions.pop(session, None)
        if previous is not None:
            self.session_counts[previous] -= 1
        self._sessions[session] = index
        self.session_counts[index] += 1
        while len(self._sessions) > self.max_sessions:
            _, forgotten = self._sessions.popitem(last=False)
            self.session_counts[forgotten] -= 1

    def session_server(self, session: str) -> int | None:
        """Where ``session`` currently sticks, if anywhere."""
        return self._sessions.get(session)

    def acquire(self, index: int) -> None:
        self.load[index].in_flight += 1

    def release(self, index: int, *, ok: bool, reachable: bool = True) -> None:
        """Account for a finished request; ``reachable=False`` takes the server out for the cooldown."""
        load = self.load[index]
        load.in_flight -= 1
        if load.in_flight == 0 and self.states[index] == "gone" and self.on_idle is not None:
            self.on_idle(index)
        if ok:
            load.completed += 1
            load.failures = 0
            load.down_until = 0.0
        elif not reachable:
            load.failures += 1
            load.down_until = self._clock() + self.cooldown

    def take_out(self, index: int) -> None:
        """Take a server out for the cooldown without a request (it was found unfit to serve)."""
        load = self.load[index]
        load.failures += 1
        load.down_until = self._clock() + self.cooldown

    def healthy(self) -> list[bool]:
        now = self._clock()
        return [load.up(now) for load in self.load]
