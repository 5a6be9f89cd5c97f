"""The stores (SQLite, and PostgreSQL on a server of the test session's own): what goes in comes out, concurrent
turns are each durable, one bad write fails alone, the reader pages and filters; SQLite's own migration path."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3

import numpy as np
import psycopg
import pytest

from backends_core import BridgeError, ImageSpan, MessageSpan, RoutedExperts, WeightVersionSpan
from backends_gateway import Branch, SessionRecord, SQLiteStore, Store, Trajectories, TurnRecord, open_store
from backends_gateway.migrations import migrations
from backends_gateway.store import SyncReads, _turn_row

# a 2x2 PNG
PNG_URL = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAFklEQVR4nGP4z8DA8J+BkYHh////DAAe9gT9Ce00"
    "PgAAAABJRU5ErkJggg=="
)


@pytest.fixture(params=["sqlite", "postgres"])
def spec(request: pytest.FixtureRequest, tmp_path) -> str:
    """A new store's ``--store`` value: a SQLite file, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return str(tmp_path / "store.db")
    dsn: str = request.getfixturevalue("postgres_dsn")
    return dsn


#: what each store raises for a row whose primary key is taken
CONFLICT = {"sqlite": sqlite3.IntegrityError, "postgres": psycopg.errors.UniqueViolation}


def kind(spec: str) -> str:
    return "postgres" if spec.startswith("postgresql://") else "sqlite"


@contextlib.asynccontextmanager
async def opened(spec: str):
    store: Store = open_store(spec)
    await store.open()
    try:
        yield store
    finally:
        await store.aclose()


def record(session: str, turn: int, *, experts: bool = False) -> TurnRecord:
    """A turn; an odd one's prompt holds an image, widened at ids 3 to 7."""
    rng = np.random.default_rng(turn)
    image = {"type": "image_url", "image_url": {"url": PNG_URL}}
    prompt = rng.integers(0, 2000, 40 + turn)
    completion = rng.integers(0, 2000, 7)
    return TurnRecord(
        session=session,
        turn=turn,
        branch=0,
        parent=None if turn == 0 else turn - 1,
        created=1000.0 + turn,
        messages=[
            {"role": "user", "content": [{"type": "text", "text": f"m{turn}"}, image] if turn % 2 else f"m{turn}"}
        ],
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
        image_spans=(ImageSpan(3, 7),) if turn % 2 else (),
    )


def same(a: TurnRecord, b: TurnRecord) -> bool:
    fields = (
        *("session", "turn", "branch", "parent", "created", "messages", "tools", "chat_template_kwargs", "reply"),
        *("finish_reason", "weight_version", "weight_versions", "message_spans", "server", "reused_ids", "request"),
        "image_spans",
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


async def test_a_turn_comes_back_as_it_went_in_routed_experts_and_image_spans_included(spec) -> None:
    async with opened(spec) as store:
        session = SessionRecord(id="s", group="g")
        await store.create_session(session)
        turns = [record("s", 0, experts=True), record("s", 1)]
        branch = Branch(session="s", branch=0, parent_branch=None, parent_turn=None, reason="first", created=1.0)
        session.counts["turns"] = 2
        await store.record_turn(turns[0], session, branch)
        await store.record_turn(turns[1], session, None)
        back = await store.turns("s")
        assert len(back) == 2 and all(same(a, b) for a, b in zip(turns, back, strict=True))
        assert back[1].image_spans == (ImageSpan(3, 7),) and back[1].images() == turns[1].images()
        assert back[1].result().images == turns[1].images() and back[1].result().image_spans == (ImageSpan(3, 7),)
        assert await store.branches("s") == [branch]
        assert (await store.get_session("s")).counts["turns"] == 2
        assert await store.get_session("missing") is None


async def test_concurrent_sessions_each_get_their_turn_durably(spec) -> None:
    async with opened(spec) as store:
        sessions = [SessionRecord(id=f"s{i}") for i in range(256)]
        await asyncio.gather(*(store.create_session(s) for s in sessions))
        for s in sessions:
            s.counts = {**s.counts, "turns": 1}
        await asyncio.gather(*(store.record_turn(record(s.id, 0), s, None) for s in sessions))
        # read through another store's connections while the writer is still open: committed means visible
        other = open_store(spec)
        assert isinstance(other, SyncReads)
        assert sum(len(other.turns_sync(s.id)) for s in sessions) == 256
        assert {other.get_session_sync(s.id).counts["turns"] for s in sessions} == {1}
        if hasattr(other, "close_readers"):
            other.close_readers()


async def test_one_bad_write_in_a_batch_fails_alone(spec) -> None:
    conflict = CONFLICT[kind(spec)]
    async with opened(spec) as store:
        session = SessionRecord(id="s")
        await store.create_session(session)
        good = [record("s", i) for i in range(1, 5)]
        writes = [store.record_turn(t, session, None) for t in good] + [
            store.record_turn(record("s", 1), session, None)
        ]
        outcomes = await asyncio.gather(*writes, return_exceptions=True)
        assert outcomes[:4] == [None] * 4 and isinstance(outcomes[4], conflict)
        assert [t.turn for t in await store.turns("s")] == [1, 2, 3, 4]
        with pytest.raises(conflict):
            await store.create_session(SessionRecord(id="s"))
        branch = Branch(session="s", branch=0, parent_branch=None, parent_turn=None, reason="first", created=1.0)
        await store.record_turn(record("s", 5), session, branch)
        with pytest.raises(conflict):  # the branch is taken: the turn is not kept either
            await store.record_turn(record("s", 6), session, branch)
        assert [t.turn for t in await store.turns("s")] == [1, 2, 3, 4, 5]


async def test_the_reader_pages_through_sessions_closed_at_the_same_instant(spec) -> None:
    async with opened(spec) as store:
        for i in range(7):
            await store.create_session(SessionRecord(id=f"s{i}", status="closed", created=5.0, closed=9.0))
        await store.create_session(SessionRecord(id="later", status="closed", created=5.0, closed=10.0))
        await store.create_session(SessionRecord(id="open", created=4.0))
    reader = Trajectories(spec)
    read = [t.session for t in reader.sessions(status="closed", page=2)]
    assert read == [*(f"s{i}" for i in range(7)), "later"]
    assert [t.session for t in reader.closed(after=9.0)] == ["later"]
    # by creation time, then id
    assert [t.session for t in reader.sessions(page=3)] == ["open", "later", *(f"s{i}" for i in range(7))]


async def test_sessions_are_listed_by_owner_and_group(spec) -> None:
    async with opened(spec) as store:
        await store.create_session(SessionRecord(id="a1", group="g", owner="team-a", created=1.0))
        await store.create_session(SessionRecord(id="b1", group="g", owner="team-b", created=2.0))
        await store.create_session(SessionRecord(id="a2", group="h", owner="team-a", created=3.0))
        await store.create_session(SessionRecord(id="none", created=4.0))
        assert [s.id for s in await store.list_sessions(owner="team-a")] == ["a1", "a2"]
        assert [s.id for s in await store.list_sessions(owner="team-a", group="g")] == ["a1"]
        assert [s.id for s in await store.list_sessions(group="g")] == ["a1", "b1"]
        assert [s.id for s in await store.list_sessions(after=1.5, limit=2)] == ["b1", "a2"]
        closed = SessionRecord(id="b1", group="g", owner="team-b", created=2.0, status="closed", closed=5.0)
        closed.reward, closed.reward_info = 0.5, {"why": "test"}
        await store.update_session(closed)
        back = await store.get_session("b1")
        assert back == closed
        assert [s.id for s in await store.list_sessions(status="closed")] == ["b1"]


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
    kept = record("old", 1)  # a turn with an image, kept before image spans were
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.executescript(_FIRST_SCHEMA)
        db.execute(f"INSERT INTO turns VALUES ({','.join('?' * 21)})", _turn_row(kept)[:21])
        db.commit()
    store = SQLiteStore(path)
    await store.open()
    try:
        old = await store.get_session("old")
        assert old is not None and (old.group, old.reward, old.owner) == ("g", 1.0, None)
        (turn,) = await store.turns("old")
        assert turn.image_spans == () and len(turn.images()) == 1
        with pytest.raises(BridgeError, match="1 images but 0 image spans") as refused:
            turn.result()  # its ids hold a widened image at an unknown place: a next turn starts a new branch
        assert refused.value.reason == "image_spans_missing"
        await store.create_session(SessionRecord(id="new", owner="team-a"))
        assert [s.id for s in await store.list_sessions(owner="team-a")] == ["new"]
    finally:
        await store.aclose()
    with contextlib.closing(sqlite3.connect(path)) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == len(migrations("sqlite"))
    again = SQLiteStore(path)  # applying nothing twice
    await again.open()
    await again.aclose()
