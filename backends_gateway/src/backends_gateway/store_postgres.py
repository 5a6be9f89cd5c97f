"""A PostgreSQL store (``--store postgresql://user@host/db``): one store written by several gateway replicas.

Rows are the SQLite store's (the same converters): JSON as the exact bytes the gateway wrote, id arrays and
logprobs as little-endian bytes, all ``bytea``. A turn is durable when :meth:`PostgresStore.record_turn` returns:
its branch, the turn and the session's counts are committed in one transaction. Writes waiting at once are
committed together (one transaction, one WAL flush, statements pipelined), so many concurrent sessions cost few
commits; a batch that fails is retried write by write, so one bad write fails alone.

Replicas never overwrite each other: a turn (or branch, or session) another process already wrote fails on the
primary key (:class:`psycopg.errors.UniqueViolation`), and the gateway drops the turn it could not keep.

The schema is ``migrations/postgres/``'s numbered files, applied on :meth:`~PostgresStore.open` past the versions
recorded in ``schema_migrations``, each in its own transaction, under an advisory lock: replicas starting at once
apply each file once.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import orjson
import psycopg
from psycopg import conninfo
from psycopg_pool import AsyncConnectionPool

from backends_gateway.migrations import migrations
from backends_gateway.sessions import Branch, SessionRecord, TurnRecord
from backends_gateway.store import (
    _BRANCH_COLUMNS,
    _SESSION_COLUMNS,
    _TURN_COLUMNS,
    _TURN_WIDTH,
    Store,
    _BlockingReads,
    _branch,
    _branch_row,
    _branches_query,
    _session,
    _session_query,
    _session_row,
    _sessions_query,
    _turn,
    _turn_row,
    _turns_query,
)

__all__ = ["PostgresStore", "StoreUnavailable", "redact_dsn"]

#: the advisory lock key the migrations are applied under (any constant unlikely to be another application's)
MIGRATION_LOCK = 0x6261636B656E6473 & 0x7FFFFFFFFFFFFFFF  # "backends"

_Statement = tuple[str, Sequence[Any]]
_INSERT_SESSION = f"INSERT INTO sessions ({_SESSION_COLUMNS}) VALUES ({', '.join(['%s'] * 9)})"
_INSERT_BRANCH = f"INSERT INTO branches ({_BRANCH_COLUMNS}) VALUES ({', '.join(['%s'] * 6)})"
_SET_DELIVERED = "UPDATE turns SET delivered = %s WHERE session = %s AND turn = %s"
_INSERT_TURN = f"INSERT INTO turns ({_TURN_COLUMNS}) VALUES ({', '.join(['%s'] * _TURN_WIDTH)})"
_UPDATE_COUNTS = "UPDATE sessions SET counts = %s WHERE id = %s"
_UPDATE_SESSION = (
    "UPDATE sessions SET grp=%s, status=%s, reward=%s, reward_info=%s, created=%s, closed=%s, counts=%s, owner=%s "
    "WHERE id=%s"
)
_URL_PASSWORD = re.compile(r"(://[^/?#@:]*:)[^/?#@]*(@)")
_PARAM_PASSWORD = re.compile(r"((?:^|[?&\s])password\s*=\s*)('(?:[^'\\]|\\.)*'|[^&\s]*)", re.IGNORECASE)


class StoreUnavailable(ConnectionError):
    """The database cannot be reached, or refused the gateway (the message names it without its password)."""


def redact_dsn(dsn: str) -> str:
    """``dsn`` with its password replaced by ``***`` (URL or ``key=value`` form)."""
    return _PARAM_PASSWORD.sub(r"\1***", _URL_PASSWORD.sub(r"\1***\2", dsn))


def _password(dsn: str) -> str | None:
    try:
        value = conninfo.conninfo_to_dict(dsn).get("password")
    except psycopg.Error:
        return None
    return None if value is None else str(value)


class PostgresStore(_BlockingReads, Store):
    """Sessions in a PostgreSQL database, shared by every gateway given the same DSN.

    :param dsn: a libpq connection string or ``postgresql://`` URL (never logged or shown with its password).
    :param pool_size: connections kept for reads beside the writer's.
    :param connect_timeout_s: how long opening may wait for the database.
    :param max_batch: writes committed in one transaction at most.
    """

    def __init__(self, dsn: str, *, pool_size: int = 4, connect_timeout_s: float = 30.0, max_batch: int = 1024) -> None:
        self._dsn = dsn
        self._secret = _password(dsn)
        self.pool_size = pool_size
        self.connect_timeout_s = connect_timeout_s
        self.max_batch = max_batch
        self._pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] | None = None
        self._writes: asyncio.Queue[tuple[list[_Statement], asyncio.Future[None]] | None] = asyncio.Queue()
        self._writer: asyncio.Task[None] | None = None
        self._opening = asyncio.Lock()
        self._local = threading.local()
        self._readers: list[psycopg.Connection[Any]] = []
        self._readers_lock = threading.Lock()
        # a reader (Trajectories, export) may drop the store without closing it: its connections close with it
        weakref.finalize(self, _close_all, self._readers)

    @property
    def where(self) -> str:
        return redact_dsn(self._dsn)

    def __repr__(self) -> str:
        return f"PostgresStore({self.where!r})"

    def _unavailable(self, exc: BaseException) -> StoreUnavailable:
        message = str(exc).strip() or type(exc).__name__
        if self._secret:
            message = message.replace(self._secret, "***")
        return StoreUnavailable(f"PostgreSQL store {self.where}: {message}")

    # -- life ------------------------------------------------------------------------------------------------

    async def open(self) -> None:
        """Apply the migrations the database lacks, open the connection pool and start the writer.

        :raises StoreUnavailable: the database cannot be reached or refuses the connection.
        """
        async with self._opening:
            if self._writer is not None:
                return
            try:
                async with await psycopg.AsyncConnection.connect(
                    self._dsn, autocommit=True, connect_timeout=max(1, int(self.connect_timeout_s))
                ) as conn:
                    await _migrate(conn)
            except psycopg.OperationalError as exc:
                raise self._unavailable(exc) from None
            pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] = AsyncConnectionPool(
                self._dsn,
                min_size=1,
                max_size=self.pool_size + 1,
                kwargs={"autocommit": True},
                open=False,
                name="gateway-store",
                timeout=self.connect_timeout_s,
            )
            try:
                await pool.open(wait=True, timeout=self.connect_timeout_s)
            except Exception as exc:
                await pool.close()
                raise self._unavailable(exc) from None
            self._pool = pool
            self._writer = asyncio.create_task(self._write_loop(), name="gateway-store")

    async def aclose(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            await self._writes.put(None)
            await writer
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()
        self.close_readers()

    def close_readers(self) -> None:
        """Close the blocking reads' connections (every thread's)."""
        with self._readers_lock:
            _close_all(self._readers)

    # -- writes --------------------------------------------------------------------------------------------

    async def _write_loop(self) -> None:
        stopping = False
        while not stopping:
            first = await self._writes.get()
            if first is None:
                break
            batch = [first]
            while len(batch) < self.max_batch and not self._writes.empty():
                more = self._writes.get_nowait()
                if more is None:
                    stopping = True
                    break
                batch.append(more)
            try:
                await self._commit([s for statements, _ in batch for s in statements])
            except Exception as exc:
                if len(batch) == 1:
                    _settle(batch[0][1], exc)
                    continue
                for statements, future in batch:  # one bad write must not fail the others: each on its own
                    try:
                        await self._commit(statements)
                    except Exception as one:
                        _settle(future, one)
                    else:
                        _settle(future, None)
                continue
            for _, future in batch:
                _settle(future, None)

    async def _commit(self, statements: Sequence[_Statement]) -> None:
        """``statements`` in one transaction, sent without waiting for each answer, committed."""
        assert self._pool is not None
        async with self._pool.connection() as conn, conn.transaction():
            failed: psycopg.Error | None = None
            try:
                async with conn.pipeline():
                    try:
                        for sql, params in statements:
                            await conn.execute(sql, params)
                    except psycopg.Error as exc:  # an answer read early: the pipeline still has to end cleanly
                        failed = exc
            except psycopg.errors.PipelineAborted:
                if failed is None:
                    raise
            if failed is not None:
                raise failed

    async def _write(self, statements: list[_Statement]) -> None:
        if self._writer is None:
            await self.open()
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        await self._writes.put((statements, future))
        await future

    async def create_session(self, session: SessionRecord) -> None:
        await self._write([(_INSERT_SESSION, _session_row(session))])

    async def record_turn(self, turn: TurnRecord, session: SessionRecord, branch: Branch | None) -> None:
        statements: list[_Statement] = []
        if branch is not None:
            statements.append((_INSERT_BRANCH, _branch_row(branch)))
        statements.append((_INSERT_TURN, _turn_row(turn)))
        statements.append((_UPDATE_COUNTS, (orjson.dumps(session.counts), session.id)))
        await self._write(statements)

    async def update_session(self, session: SessionRecord) -> None:
        row = _session_row(session)
        await self._write([(_UPDATE_SESSION, (*row[1:], row[0]))])

    async def set_delivered(self, turn: TurnRecord, session: SessionRecord) -> None:
        await self._write(
            [
                (_SET_DELIVERED, (int(turn.delivered), turn.session, turn.turn)),
                (_UPDATE_COUNTS, (orjson.dumps(session.counts), session.id)),
            ]
        )

    # -- reads ---------------------------------------------------------------------------------------------

    async def _rows(self, sql: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        if self._pool is None:
            await self.open()
        assert self._pool is not None
        async with self._pool.connection() as conn:
            cursor = await conn.execute(sql, params, binary=True)
            return await cursor.fetchall()

    async def get_session(self, session: str) -> SessionRecord | None:
        rows = await self._rows(*_session_query(self._MARK, session))
        return _session(rows[0]) if rows else None

    async def list_sessions(
        self,
        *,
        group: str | None = None,
        status: str | None = None,
        owner: str | None = None,
        limit: int = 1000,
        after: float | None = None,
    ) -> list[SessionRecord]:
        query, args = _sessions_query(
            self._MARK, group=group, status=status, owner=owner, limit=limit, after=after, after_id=None
        )
        return [_session(r) for r in await self._rows(query, args)]

    async def branches(self, session: str) -> list[Branch]:
        return [_branch(r) for r in await self._rows(*_branches_query(self._MARK, session))]

    async def turns(self, session: str) -> list[TurnRecord]:
        return [_turn(r) for r in await self._rows(*_turns_query(self._MARK, session))]

    # -- reads (blocking: the trainer's reader and export use them directly) ---------------------------------

    def _reader(self) -> psycopg.Connection[Any]:
        db: psycopg.Connection[Any] | None = getattr(self._local, "db", None)
        if db is None or db.closed:
            try:
                db = psycopg.connect(self._dsn, autocommit=True, connect_timeout=max(1, int(self.connect_timeout_s)))
            except psycopg.OperationalError as exc:
                raise self._unavailable(exc) from None
            found = db.execute("SELECT to_regclass('schema_migrations') IS NOT NULL").fetchone()
            if not (found and found[0]):
                db.close()
                raise LookupError(f"no gateway store in {self.where} (no schema_migrations table): a gateway given "
                                  "this --store creates it")  # fmt: skip
            self._local.db = db
            with self._readers_lock:
                self._readers.append(db)
        return db

    _MARK = "%s"

    def _rows_sync(self, sql: str, params: Sequence[Any]) -> list[Any]:
        return self._reader().execute(sql, params, binary=True).fetchall()


async def _migrate(conn: psycopg.AsyncConnection[Any]) -> list[int]:
    """Apply the migrations past those ``schema_migrations`` records, each with its record in one transaction,
    holding the advisory lock :data:`MIGRATION_LOCK` throughout (another process applying them waits, then finds
    them applied); the versions applied.

    :raises RuntimeError: the database records a version this gateway does not know (a newer gateway's schema).
    """
    known = migrations("postgres")
    await conn.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK,))
    try:
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, name TEXT NOT NULL, "
            "applied DOUBLE PRECISION NOT NULL)"
        )
        cursor = await conn.execute("SELECT version FROM schema_migrations")
        recorded = {row[0] for row in await cursor.fetchall()}
        unknown = sorted(recorded - {m.version for m in known})
        if unknown:
            raise RuntimeError(
                f"the store's schema has migrations {unknown} this gateway does not know (it knows 1..{len(known)}): "
                "run a gateway at least as new as the one that wrote it"
            )
        applied = []
        for migration in known:
            if migration.version in recorded:
                continue
            async with conn.transaction():
                await conn.execute(migration.sql)  # several statements: sent whole (no parameters)
                await conn.execute(
                    "INSERT INTO schema_migrations (version, name, applied) VALUES (%s, %s, %s)",
                    (migration.version, migration.name, time.time()),
                )
            applied.append(migration.version)
        return applied
    finally:
        await conn.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK,))


def _close_all(connections: list[psycopg.Connection[Any]]) -> None:
    while connections:
        connections.pop().close()


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
