"""The SQLite store: what goes in comes out, concurrent turns are each durable, one bad write fails alone."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3

import numpy as np
import pytest

from backends_core import MessageSpan, RoutedExperts, WeightVersionSpan
from backends_gateway import Branch, SessionRecord, SQLiteStore, TurnRecord
from backends_gateway.migrations import migrations


def record(session: str, turn: int, *, experts: bool = False) -> TurnRecord:
    rng = np.random.default_rng(turn)
    prompt = rng.integers(0, 2000, 40 + turn)
    completion = rng.integers(0, 2000, 7)
    return TurnRecord(
        session=session,
        turn=turn,
        branch=0,
        parent=None if turn == 0 else turn - 1,
        created=1000.0 + turn,
        messages=[{"role": "user", "content": f"m{turn}"}],
        tools=[{"type": "function", "function": {"name": "f"}}] if turn % 2 else None,
        chat_template_kwargs={"enable_thinking": False} if turn % 3 == 0 else None,
        reply={"role": "assistant", "content": "ok", "reasoning_content": None, "tool_calls": None},
        prompt_ids=prompt,
        completion_ids=completion,
        logprobs=-rng.random(7).astype(np.float32),
        finish_reason="stop",
        weight_version="v3",
        weight_versions=(WeightVersionSpan(version="v3", start=0, end=7),),
        message_spans=(MessageSpan(message=0, role="user", start=0, end=40 + turn, sampled=False),),
        server="http://a",
        reused_ids=0,
        routed_experts=RoutedExperts(experts=rng.integers(0, 8, (47, 2, 2)).astype(np.uint8), start=0)
        if experts
        else None,
        request={"model": "m", "sampling": {"max_tokens": 7}},
    )


def same(a: TurnRecord, b: TurnRecord) -> bool:
    fields = (
        *("session", "turn", "branch", "parent", "created", "messages", "tools", "chat_template_kwargs", "reply"),
        *("finish_reason", "weight_version", "weight_versions", "message_spans", "server", "reused_ids", "request"),
    )
    arrays = ("prompt_ids", "completion_ids", "logprobs")
    experts_equal = (a.routed_experts is None) == (b.routed_experts is None) and (
        a.routed_experts is None or a.routed_experts == b.routed_experts
    )
    return (
        all(getattr(a, f) == getattr(b, f) for f in fields)
        and all(np.array_equal(getattr(a, f), getattr(b, f)) for f in arrays)
        and experts_equal
    )


async def test_a_turn_comes_back_as_it_went_in_routed_experts_included(tmp_path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    await store.open()
    try:
        session = SessionRecord(id="s", group="g")
        await store.create_session(session)
        turns = [record("s", 0, experts=True), record("s", 1)]
        branch = Branch(session="s", branch=0, parent_branch=None, parent_turn=None, reason="first", created=1.0)
        session.counts["turns"] = 2
        await store.record_turn(turns[0], session, branch)
        await store.record_turn(turns[1], session, None)
        back = await store.turns("s")
        assert len(back) == 2 and all(same(a, b) for a, b in zip(turns, back, strict=True))
        assert await store.branches("s") == [branch]
        assert (await store.get_session("s")).counts["turns"] == 2
    finally:
        await store.aclose()


async def test_concurrent_sessions_each_get_their_turn_durably(tmp_path) -> None:
    path = tmp_path / "c.db"
    store = SQLiteStore(path)
    await store.open()
    sessions = [SessionRecord(id=f"s{i}") for i in range(256)]
    await asyncio.gather(*(store.create_session(s) for s in sessions))
    await asyncio.gather(*(store.record_turn(record(s.id, 0), s, None) for s in sessions))
    # read through another connection while the writer is still open: committed means visible
    with contextlib.closing(sqlite3.connect(path)) as db:
        assert db.execute("SELECT count(*) FROM turns").fetchone()[0] == 256
    await store.aclose()


async def test_one_bad_write_in_a_batch_fails_alone(tmp_path) -> None:
    store = SQLiteStore(tmp_path / "b.db")
    await store.open()
    try:
        session = SessionRecord(id="s")
        await store.create_session(session)
        good = [record("s", i) for i in range(1, 5)]
        writes = [store.record_turn(t, session, None) for t in good] + [
            store.record_turn(record("s", 1), session, None)
        ]
        outcomes = await asyncio.gather(*writes, return_exceptions=True)
        assert [type(o).__name__ for o in outcomes] == ["NoneType"] * 4 + ["IntegrityError"]
        assert [t.turn for t in await store.turns("s")] == [1, 2, 3, 4]
        with pytest.raises(sqlite3.IntegrityError):
            await store.create_session(SessionRecord(id="s"))
    finally:
        await store.aclose()


async def test_the_reader_pages_through_sessions_closed_at_the_same_instant(tmp_path) -> None:
    from backends_gateway import Trajectories

    store = SQLiteStore(tmp_path / "p.db")
    await store.open()
    for i in range(7):
        await store.create_session(SessionRecord(id=f"s{i}", status="closed", created=5.0, closed=9.0))
    await store.aclose()
    read = [t.session for t in Trajectories(tmp_path / "p.db").sessions(status="closed", page=2)]
    assert read == [f"s{i}" for i in range(7)]


_FIRST_SCHEMA = """
CREATE TABLE sessions (id TEXT PRIMARY KEY, grp TEXT, status TEXT NOT NULL, reward REAL, reward_info BLOB,
    created REAL NOT NULL, closed REAL, counts BLOB NOT NULL);
CREATE TABLE branches (session TEXT NOT NULL, branch INTEGER NOT NULL, parent_branch INTEGER, parent_turn INTEGER,
    reason TEXT NOT NULL, created REAL NOT NULL, PRIMARY KEY (session, branch));
CREATE TABLE turns (session TEXT NOT NULL, turn INTEGER NOT NULL, branch INTEGER NOT NULL, parent INTEGER,
    created REAL NOT NULL, messages BLOB NOT NULL, tools BLOB, template_kwargs BLOB, reply BLOB NOT NULL,
    prompt_ids BLOB NOT NULL, completion_ids BLOB NOT NULL, logprobs BLOB NOT NULL, finish_reason TEXT NOT NULL,
    weight_version TEXT, weight_versions BLOB NOT NULL, message_spans BLOB NOT NULL, server TEXT,
    reused_ids INTEGER NOT NULL, routed_experts BLOB, routed_start INTEGER, request BLOB NOT NULL,
    PRIMARY KEY (session, turn));
INSERT INTO sessions VALUES ('old', 'g', 'closed', 1.0, NULL, 5.0, 6.0, '{"turns": 0}');
"""


async def test_a_store_written_before_numbered_migrations_is_brought_forward(tmp_path) -> None:
    path = tmp_path / "old.db"
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.executescript(_FIRST_SCHEMA)
    store = SQLiteStore(path)
    await store.open()
    try:
        old = await store.get_session("old")
        assert old is not None and (old.group, old.reward, old.owner) == ("g", 1.0, None)
        await store.create_session(SessionRecord(id="new", owner="team-a"))
        assert [s.id for s in await store.list_sessions(owner="team-a")] == ["new"]
    finally:
        await store.aclose()
    with contextlib.closing(sqlite3.connect(path)) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == len(migrations("sqlite"))
    again = SQLiteStore(path)  # applying nothing twice
    await again.open()
    await again.aclose()
