"""Where sessions, branches and turns are kept: one :class:`Store` interface, and :class:`SQLiteStore`, the
embedded default (one file, write-ahead log).

A turn is durable when :meth:`Store.record_turn` returns: the gateway answers the harness only after that, so a
gateway killed at any moment loses no answered turn. Writes from many sessions are committed together (one
transaction, one sync, for every turn waiting), which keeps the durable path fast under concurrency.
"""

from __future__ import annotations

import abc
import asyncio
import io
import os
import queue
import sqlite3
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np
import orjson

from backends_core import MessageSpan, RoutedExperts, WeightVersionSpan
from backends_core.images import ImageSpan, json_default
from backends_gateway.migrations import migrations
from backends_gateway.sessions import Branch, SessionRecord, TurnRecord

__all__ = ["SQLiteStore", "Store", "SyncReads"]


class Store(abc.ABC):
    """The gateway's storage. Every method is safe to call concurrently; ``record_turn`` is durable on return."""

    async def open(self) -> None:  # noqa: B027  (a store may need no set-up)
        """Create or migrate the schema."""

    async def aclose(self) -> None:  # noqa: B027
        """Flush and release everything."""

    @property
    def where(self) -> str:
        """Where the store is, fit to print or log (a DSN without its password)."""
        return type(self).__name__

    @abc.abstractmethod
    async def create_session(self, session: SessionRecord) -> None:
        """Insert a new session (its id is new)."""

    @abc.abstractmethod
    async def record_turn(self, turn: TurnRecord, session: SessionRecord, branch: Branch | None) -> None:
        """Keep an answered turn, the session's new counts and, when the turn started one, its branch, in one
        durable transaction."""

    @abc.abstractmethod
    async def update_session(self, session: SessionRecord) -> None:
        """Keep a session's status, reward and counts."""

    @abc.abstractmethod
    async def set_delivered(self, turn: TurnRecord, session: SessionRecord) -> None:
        """Keep whether ``turn``'s answer reached its harness (``turn.delivered``) and the session's counts, in one
        durable transaction."""

    @abc.abstractmethod
    async def get_session(self, session: str) -> SessionRecord | None: ...

    @abc.abstractmethod
    async def list_sessions(
        self,
        *,
        group: str | None = None,
        status: str | None = None,
        owner: str | None = None,
        limit: int = 1000,
        after: float | None = None,
    ) -> list[SessionRecord]:
        """Sessions by creation time (closed ones by closing time when ``status="closed"``), after ``after``;
        ``owner``: only the sessions of that harness key."""

    @abc.abstractmethod
    async def branches(self, session: str) -> list[Branch]: ...

    @abc.abstractmethod
    async def turns(self, session: str) -> list[TurnRecord]: ...


@runtime_checkable
class SyncReads(Protocol):
    """The blocking reads of a store, which the trainer's reader (:class:`~backends_gateway.Trajectories`) and
    ``backends gateway export`` use while gateways write it."""

    @property
    def where(self) -> str: ...

    def get_session_sync(self, session: str) -> SessionRecord | None: ...

    def list_sessions_sync(
        self,
        *,
        group: str | None = None,
        status: str | None = None,
        owner: str | None = None,
        limit: int = 1000,
        after: float | None = None,
        after_id: str | None = None,
    ) -> list[SessionRecord]: ...

    def branches_sync(self, session: str) -> list[Branch]: ...

    def turns_sync(self, session: str) -> list[TurnRecord]: ...


_SESSION_COLUMNS = "id, grp, status, reward, reward_info, created, closed, counts, owner"
_TURN_COLUMNS = (
    "session, turn, branch, parent, created, messages, tools, template_kwargs, reply, prompt_ids, completion_ids, "
    "logprobs, finish_reason, weight_version, weight_versions, message_spans, server, reused_ids, routed_experts, "
    "routed_start, request, image_spans, delivered, stop_reason"
)
#: how many columns a turn's row has
_TURN_WIDTH = _TURN_COLUMNS.count(",") + 1


def _json(value: Any) -> bytes | None:
    return None if value is None else orjson.dumps(value, default=json_default)


def _loads(value: bytes | None) -> Any:
    return None if value is None else orjson.loads(value)


def _session_row(s: SessionRecord) -> tuple[Any, ...]:
    return (
        s.id,
        s.group,
        s.status,
        s.reward,
        _json(s.reward_info),
        s.created,
        s.closed,
        orjson.dumps(s.counts),
        s.owner,
    )


def _session(row: Sequence[Any]) -> SessionRecord:
    return SessionRecord(
        id=row[0],
        group=row[1],
        status=row[2],
        reward=row[3],
        reward_info=_loads(row[4]),
        created=row[5],
        closed=row[6],
        counts=orjson.loads(row[7]),
        owner=row[8],
    )


def _turn_row(t: TurnRecord) -> tuple[Any, ...]:
    experts = None
    if t.routed_experts is not None:
        buffer = io.BytesIO()
        np.save(buffer, t.routed_experts.experts, allow_pickle=False)
        experts = buffer.getvalue()
    return (
        t.session,
        t.turn,
        t.branch,
        t.parent,
        t.created,
        orjson.dumps(list(t.messages), default=json_default),
        _json(t.tools),
        _json(t.chat_template_kwargs),
        orjson.dumps(dict(t.reply)),
        t.prompt_ids.astype("<i4").tobytes(),
        t.completion_ids.astype("<i4").tobytes(),
        t.logprobs.astype("<f4").tobytes(),
        t.finish_reason,
        t.weight_version,
        orjson.dumps([[s.version, s.start, s.end] for s in t.weight_versions]),
        orjson.dumps([[s.message, s.role, s.start, s.end, s.sampled] for s in t.message_spans]),
        t.server,
        t.reused_ids,
        experts,
        None if t.routed_experts is None else t.routed_experts.start,
        orjson.dumps(dict(t.request), default=json_default),
        orjson.dumps([[s.start, s.end] for s in t.image_spans]),
        int(t.delivered),
        _json(t.stop_reason),
    )


def _turn(row: Sequence[Any]) -> TurnRecord:
    experts = None
    if row[18] is not None:
        experts = RoutedExperts(experts=np.load(io.BytesIO(row[18]), allow_pickle=False), start=row[19])
    return TurnRecord(
        session=row[0],
        turn=row[1],
        branch=row[2],
        parent=row[3],
        created=row[4],
        messages=orjson.loads(row[5]),
        tools=_loads(row[6]),
        chat_template_kwargs=_loads(row[7]),
        reply=orjson.loads(row[8]),
        prompt_ids=np.frombuffer(row[9], dtype="<i4"),
        completion_ids=np.frombuffer(row[10], dtype="<i4"),
        logprobs=np.frombuffer(row[11], dtype="<f4").astype(np.float32),
        finish_reason=row[12],
        weight_version=row[13],
        weight_versions=tuple(WeightVersionSpan(version=v, start=s, end=e) for v, s, e in orjson.loads(row[14])),
        message_spans=tuple(
            MessageSpan(message=m, role=r, start=s, end=e, sampled=x) for m, r, s, e, x in orjson.loads(row[15])
        ),
        server=row[16],
        reused_ids=row[17],
        routed_experts=experts,
        request=orjson.loads(row[20]),
        # NULL: a turn kept before image spans were (a text turn, or one that cannot be extended)
        image_spans=() if row[21] is None else tuple(ImageSpan(s, e) for s, e in orjson.loads(row[21])),
        delivered=bool(row[22]),
        stop_reason=_loads(row[23]),
    )


def _branch(row: Sequence[Any]) -> Branch:
    return Branch(
        session=row[0], branch=row[1], parent_branch=row[2], parent_turn=row[3], reason=row[4], created=row[5]
    )


_BRANCH_COLUMNS = "session, branch, parent_branch, parent_turn, reason, created"


def _branch_row(b: Branch) -> tuple[Any, ...]:
    return (b.session, b.branch, b.parent_branch, b.parent_turn, b.reason, b.created)


def _sessions_query(
    mark: str,
    *,
    group: str | None,
    status: str | None,
    owner: str | None,
    limit: int,
    after: float | None,
    after_id: str | None,
) -> tuple[str, list[Any]]:
    """The query listing sessions (see :meth:`SQLiteStore.list_sessions_sync`) and its parameters; ``mark`` is the
    driver's placeholder."""
    where: list[str] = []
    args: list[Any] = []
    if group is not None:
        where.append(f"grp = {mark}")
        args.append(group)
    if status is not None:
        where.append(f"status = {mark}")
        args.append(status)
    if owner is not None:
        where.append(f"owner = {mark}")
        args.append(owner)
    order = "closed" if status == "closed" else "created"
    if after is not None and after_id is not None:
        where.append(f"({order} > {mark} OR ({order} = {mark} AND id > {mark}))")
        args += [after, after, after_id]
    elif after is not None:
        where.append(f"{order} > {mark}")
        args.append(after)
    clause = f"WHERE {' AND '.join(where)}" if where else ""
    return f"SELECT {_SESSION_COLUMNS} FROM sessions {clause} ORDER BY {order}, id LIMIT {mark}", [*args, limit]


def _session_query(mark: str, session: str) -> tuple[str, tuple[Any, ...]]:
    return f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE id = {mark}", (session,)


def _branches_query(mark: str, session: str) -> tuple[str, tuple[Any, ...]]:
    return f"SELECT {_BRANCH_COLUMNS} FROM branches WHERE session = {mark} ORDER BY branch", (session,)


def _turns_query(mark: str, session: str) -> tuple[str, tuple[Any, ...]]:
    return f"SELECT {_TURN_COLUMNS} FROM turns WHERE session = {mark} ORDER BY turn", (session,)


class _BlockingReads:
    """The blocking reads (:class:`SyncReads`) of a SQL store, over its one way of running a query: ``_MARK`` is
    its driver's placeholder, ``_rows_sync`` runs a query on the calling thread's connection."""

    _MARK: ClassVar[str]

    def _rows_sync(self, sql: str, params: Sequence[Any]) -> list[Any]:
        raise NotImplementedError

    def get_session_sync(self, session: str) -> SessionRecord | None:
        rows = self._rows_sync(*_session_query(self._MARK, session))
        return _session(rows[0]) if rows else None

    def list_sessions_sync(
        self,
        *,
        group: str | None = None,
        status: str | None = None,
        owner: str | None = None,
        limit: int = 1000,
        after: float | None = None,
        after_id: str | None = None,
    ) -> list[SessionRecord]:
        """Sessions ordered by creation (closing, for ``status="closed"``) time then id, after ``(after,
        after_id)`` (a page's last session: sessions of the same time are not skipped)."""
        query, args = _sessions_query(
            self._MARK, group=group, status=status, owner=owner, limit=limit, after=after, after_id=after_id
        )
        return [_session(r) for r in self._rows_sync(query, args)]

    def branches_sync(self, session: str) -> list[Branch]:
        return [_branch(r) for r in self._rows_sync(*_branches_query(self._MARK, session))]

    def turns_sync(self, session: str) -> list[TurnRecord]:
        return [_turn(r) for r in self._rows_sync(*_turns_query(self._MARK, session))]


class SQLiteStore(_BlockingReads, Store):
    """Sessions in one SQLite file in write-ahead-log mode.

    One writer thread commits whatever writes are waiting in one transaction (``synchronous=FULL``: durable
    against a crash of the machine too, not only of the gateway); reads run on their own connections beside it.
    The file can be read while a gateway writes it (:class:`~backends_gateway.Trajectories`, ``backends gateway
    export``).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._writes: queue.Queue[tuple[Callable[[sqlite3.Connection], object], asyncio.Future[None]] | None] = (
            queue.Queue()
        )
        self._writer: threading.Thread | None = None
        self._local = threading.local()
        self._lock = threading.Lock()

    @property
    def where(self) -> str:
        return str(self.path.resolve())

    # -- connections ---------------------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=60.0, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("PRAGMA busy_timeout=60000")
        return db

    def _reader(self) -> sqlite3.Connection:
        db: sqlite3.Connection | None = getattr(self._local, "db", None)
        if db is None:
            db = self._connect()
            self._local.db = db
        return db

    async def open(self) -> None:
        self.open_sync()

    def open_sync(self) -> None:
        """Create the file and schema if needed, and start the writer."""
        with self._lock:
            if self._writer is not None:
                return
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = self._connect()
            _migrate(db)
            self._writer = threading.Thread(target=self._write_loop, args=(db,), name="gateway-store", daemon=True)
            self._writer.start()

    async def aclose(self) -> None:
        writer = self._writer
        if writer is not None:
            self._writes.put(None)
            await asyncio.to_thread(writer.join)
            self._writer = None

    def _write_loop(self, db: sqlite3.Connection) -> None:
        try:
            while True:
                first = self._writes.get()
                if first is None:
                    break
                batch = [first]
                while True:
                    try:
                        more = self._writes.get_nowait()
                    except queue.Empty:
                        break
                    if more is None:
                        self._writes.put(None)
                        break
                    batch.append(more)
                error: BaseException | None = None
                try:
                    db.execute("BEGIN IMMEDIATE")
                    for write, _ in batch:
                        write(db)
                    db.execute("COMMIT")
                except BaseException as exc:
                    error = exc
                    if db.in_transaction:
                        db.execute("ROLLBACK")
                    if len(batch) > 1:  # one bad write must not fail the others: each on its own
                        for write, future in batch:
                            self._one(db, write, future)
                        continue
                for _, future in batch:
                    _settle(future, error)
        finally:
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            db.close()

    def _one(self, db: sqlite3.Connection, write: Callable[[sqlite3.Connection], object], future: Any) -> None:
        try:
            db.execute("BEGIN IMMEDIATE")
            write(db)
            db.execute("COMMIT")
        except BaseException as exc:
            if db.in_transaction:
                db.execute("ROLLBACK")
            _settle(future, exc)
        else:
            _settle(future, None)

    async def _write(self, write: Callable[[sqlite3.Connection], object]) -> None:
        if self._writer is None:
            self.open_sync()
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._writes.put((write, future))
        await future

    # -- writes --------------------------------------------------------------------------------------

    async def create_session(self, session: SessionRecord) -> None:
        row = _session_row(session)
        await self._write(
            lambda db: db.execute(f"INSERT INTO sessions ({_SESSION_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?)", row)
        )

    async def record_turn(self, turn: TurnRecord, session: SessionRecord, branch: Branch | None) -> None:
        row = _turn_row(turn)
        counts = orjson.dumps(session.counts)
        branch_row = None if branch is None else tuple(branch.as_json().values())

        def write(db: sqlite3.Connection) -> None:
            if branch_row is not None:
                db.execute("INSERT INTO branches VALUES (?,?,?,?,?,?)", branch_row)
            db.execute(f"INSERT INTO turns ({_TURN_COLUMNS}) VALUES ({','.join('?' * _TURN_WIDTH)})", row)
            db.execute("UPDATE sessions SET counts = ? WHERE id = ?", (counts, session.id))

        await self._write(write)

    async def set_delivered(self, turn: TurnRecord, session: SessionRecord) -> None:
        counts = orjson.dumps(session.counts)

        def write(db: sqlite3.Connection) -> None:
            db.execute(
                "UPDATE turns SET delivered = ? WHERE session = ? AND turn = ?",
                (int(turn.delivered), turn.session, turn.turn),
            )
            db.execute("UPDATE sessions SET counts = ? WHERE id = ?", (counts, session.id))

        await self._write(write)

    async def update_session(self, session: SessionRecord) -> None:
        row = _session_row(session)
        await self._write(
            lambda db: db.execute(
                "UPDATE sessions SET grp=?, status=?, reward=?, reward_info=?, created=?, closed=?, counts=?, "
                "owner=? WHERE id=?",
                (*row[1:], row[0]),
            )
        )

    # -- reads (sync: the trainer's reader and export use them directly) -------------------------------

    _MARK = "?"

    def _rows_sync(self, sql: str, params: Sequence[Any]) -> list[Any]:
        return self._reader().execute(sql, params).fetchall()

    async def get_session(self, session: str) -> SessionRecord | None:
        return await asyncio.to_thread(self.get_session_sync, session)

    async def list_sessions(
        self,
        *,
        group: str | None = None,
        status: str | None = None,
        owner: str | None = None,
        limit: int = 1000,
        after: float | None = None,
    ) -> list[SessionRecord]:
        return await asyncio.to_thread(
            lambda: self.list_sessions_sync(group=group, status=status, owner=owner, limit=limit, after=after)
        )

    async def branches(self, session: str) -> list[Branch]:
        return await asyncio.to_thread(self.branches_sync, session)

    async def turns(self, session: str) -> list[TurnRecord]:
        return await asyncio.to_thread(self.turns_sync, session)


def _migrate(db: sqlite3.Connection) -> None:
    """Apply the numbered migrations past the file's ``user_version``, each with its version in one transaction."""
    current = db.execute("PRAGMA user_version").fetchone()[0]
    for migration in migrations("sqlite"):
        if migration.version > current:
            db.execute("BEGIN IMMEDIATE")
            try:
                for statement in _statements(migration.sql):
                    db.execute(statement)
                db.execute(f"PRAGMA user_version = {migration.version}")
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise


def _statements(sql: str) -> list[str]:
    """A migration file's statements (``executescript`` would commit on its own; these run in the caller's
    transaction)."""
    text = "\n".join(line for line in sql.splitlines() if not line.lstrip().startswith("--"))
    return [s.strip() for s in text.split(";") if s.strip()]


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    loop = future.get_loop()

    def settle() -> None:
        if future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    loop.call_soon_threadsafe(settle)
