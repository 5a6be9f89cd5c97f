"""The PostgreSQL store on a real server (the test session's own): migrations applied once under an advisory lock,
the DSN's password never shown, and two ``backends gateway`` replicas over one database: sessions pinned to either,
one replica killed mid-turn, its sessions going on on the other on their exact ids."""

from __future__ import annotations

import asyncio
import json
import signal
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import psycopg
import pytest
from test_gateway_cli import start, stop

from backends_core import cli
from backends_gateway import SessionRecord, Trajectories, open_store
from backends_gateway.migrations import migrations
from backends_gateway.store_postgres import PostgresStore, StoreUnavailable, _migrate, redact_dsn

MIGRATIONS = len(migrations("postgres"))


def recorded(dsn: str) -> list[tuple[int, str, float]]:
    with psycopg.connect(dsn) as db:
        return db.execute("SELECT version, name, applied FROM schema_migrations ORDER BY version").fetchall()


async def test_migrations_are_applied_once_and_a_reopened_store_applies_nothing(postgres_dsn) -> None:
    store = open_store(postgres_dsn)
    assert isinstance(store, PostgresStore)
    await store.open()
    await store.create_session(SessionRecord(id="kept"))
    await store.aclose()
    first = recorded(postgres_dsn)
    assert [(v, n) for v, n, _ in first] == [(m.version, m.name) for m in migrations("postgres")]
    again = open_store(postgres_dsn)
    await again.open()
    try:
        assert await again.get_session("kept") is not None
    finally:
        await again.aclose()
    assert recorded(postgres_dsn) == first
    async with await psycopg.AsyncConnection.connect(postgres_dsn, autocommit=True) as db:
        assert await _migrate(db) == []


async def test_replicas_opening_one_empty_database_at_once_apply_each_migration_once(postgres_dsn) -> None:
    connections = [await psycopg.AsyncConnection.connect(postgres_dsn, autocommit=True) for _ in range(4)]
    try:
        applied = await asyncio.gather(*(_migrate(db) for db in connections))
    finally:
        for db in connections:
            await db.close()
    assert sorted(applied, key=len) == [[]] * 3 + [list(range(1, MIGRATIONS + 1))]
    stores = [open_store(postgres_dsn) for _ in range(3)]
    await asyncio.gather(*(s.open() for s in stores))
    try:
        await asyncio.gather(*(s.create_session(SessionRecord(id=f"r{i}")) for i, s in enumerate(stores)))
        assert [s.id for s in await stores[0].list_sessions()] == ["r0", "r1", "r2"]
    finally:
        await asyncio.gather(*(s.aclose() for s in stores))
    assert len(recorded(postgres_dsn)) == MIGRATIONS


async def test_a_database_with_a_newer_schema_is_refused_naming_the_versions(postgres_dsn) -> None:
    store = open_store(postgres_dsn)
    await store.open()
    await store.aclose()
    with psycopg.connect(postgres_dsn) as db:
        db.execute("INSERT INTO schema_migrations VALUES (99, '0099_future.sql', 0)")
    with pytest.raises(RuntimeError, match=r"migrations \[99\] this gateway does not know"):
        await open_store(postgres_dsn).open()


@pytest.mark.parametrize(
    ("dsn", "shown"),
    [
        ("postgresql://u:s3cr%40t@db.example:5432/x?sslmode=require", "postgresql://u:***@db.example:5432/x?sslmode=require"),
        ("postgres://u@db/x?password=s3cr&sslmode=disable", "postgres://u@db/x?password=***&sslmode=disable"),
        ("host=db user=u password='s3 cr' dbname=x", "host=db user=u password=*** dbname=x"),
        ("postgresql://u@db/x", "postgresql://u@db/x"),
    ],
)  # fmt: skip
def test_a_dsn_is_shown_without_its_password(dsn, shown) -> None:
    assert redact_dsn(dsn) == shown
    if "://" in dsn:  # --store takes URLs only
        assert open_store(dsn).where == shown


async def test_a_refused_connection_names_the_database_but_never_the_password(postgres_server, postgres_dsn) -> None:
    wrong = postgres_dsn.replace(postgres_server.password, "Wr0ngPassw0rd")
    with pytest.raises(StoreUnavailable) as refused:
        await open_store(wrong).open()
    message = str(refused.value)
    assert "password authentication failed" in message and ":***@127.0.0.1" in message
    assert "Wr0ngPassw0rd" not in message and postgres_server.password not in message
    with pytest.raises(StoreUnavailable, match="no password supplied"):
        await open_store(postgres_server.dsn(postgres_dsn.rsplit("/", 1)[1], password=False)).open()


def test_the_reader_of_a_database_no_gateway_wrote_says_so(postgres_dsn) -> None:
    with pytest.raises(LookupError, match="no gateway store in postgresql://postgres:\\*\\*\\*@"):
        list(Trajectories(postgres_dsn).sessions())


def test_the_gateway_command_refused_by_the_database_exits_2_without_showing_the_password(
    postgres_server, postgres_dsn, capsys
) -> None:
    wrong = postgres_dsn.replace(postgres_server.password, "Wr0ngPassw0rd")
    argv = ["gateway", "--backend", "vllm", "--url", "http://127.0.0.1:9", "--port", "0", "--store", wrong]
    assert cli.main(argv) == 2  # the --store given cannot be used (the CLI's status for an unusable input)
    err = capsys.readouterr().err
    assert "password authentication failed" in err and "Wr0ngPassw0rd" not in err


# -- two gateway replicas over one database -----------------------------------------------------------------


def chat(http: httpx.Client, session: str, messages: list[Any], **extra: Any) -> httpx.Response:
    body = {"model": "tiny-qwen3", "messages": messages, "max_tokens": 6, "seed": len(messages), **extra}
    return http.post(f"/s/{session}/v1/chat/completions", json=body)


def answered(http: httpx.Client, session: str, messages: list[Any], user: str) -> None:
    """One turn of ``session``, answered; ``messages`` grows by the reply and the next user message."""
    reply = chat(http, session, messages)
    assert reply.status_code == 200, reply.text
    messages += [reply.json()["choices"][0]["message"], {"role": "user", "content": user}]


def exact_ids(trajectory: dict[str, Any]) -> list[tuple[int, list[int], list[int]]]:
    return [(t["turn"], t["prompt_ids"], t["completion_ids"]) for t in trajectory["turns"]]


def stored_ids(dsn: str, session: str) -> list[tuple[int, list[int], list[int]]]:
    store = open_store(dsn)
    assert isinstance(store, PostgresStore)
    try:
        return [(t.turn, t.prompt_ids.tolist(), t.completion_ids.tolist()) for t in store.turns_sync(session)]
    finally:
        store.close_readers()


def test_two_gateways_share_one_database_and_one_killed_mid_turn_loses_no_answered_turn(
    tiny_models, postgres_server, postgres_dsn, tmp_path
) -> None:
    engine, ready = start(["serve", "--backend", "vllm", "--port", "0", "--models-dir", str(tiny_models.root)])
    argv = [
        "gateway", "--backend", "vllm", "--url", ready["url"], "--model", ready["model"],
        "--tokenizer", ready["tokenizer"], "--port", "0", "--store", postgres_dsn,
    ]  # fmt: skip
    replicas: list[Any] = []
    try:
        # both started at once on the empty database: the advisory lock orders their migrations
        with ThreadPoolExecutor(2) as pool:
            starting = [pool.submit(start, argv) for _ in range(2)]
            replicas = [f.result() for f in starting]
        (a, up_a), (b, up_b) = replicas
        for up in (up_a, up_b):
            assert up["store"] == postgres_dsn.replace(postgres_server.password, "***")
        chats: dict[str, list[Any]] = {}
        with (
            httpx.Client(base_url=up_a["url"], trust_env=False, timeout=120) as on_a,
            httpx.Client(base_url=up_b["url"], trust_env=False, timeout=120) as on_b,
        ):
            pinned = {**{f"a{i}": on_a for i in range(3)}, **{f"b{i}": on_b for i in range(3)}}
            for session in pinned:
                chats[session] = [{"role": "user", "content": f"hello from {session}"}]
            for k in range(2):
                for session, http in pinned.items():
                    answered(http, session, chats[session], f"{session}: next {k}")
            reader = Trajectories(postgres_dsn)
            seen = {t.session: t for t in reader.sessions(status="open")}
            assert sorted(seen) == sorted(pinned)
            assert all(t.counts["turns"] == 2 and [s.turns for s in t.samples] == [(0, 1)] for t in seen.values())
            before = {s: exact_ids(pinned[s].get(f"/v1/sessions/{s}/trajectory").json()) for s in pinned}

            # a streamed turn of a0 in flight on A when A is killed; B answers before, during and after
            with on_a.stream(
                "POST",
                "/s/a0/v1/chat/completions",
                json={"model": "tiny-qwen3", "messages": chats["a0"], "max_tokens": 200, "stream": True},
            ) as streaming:
                assert streaming.status_code == 200
                next(streaming.iter_lines())
                answered(on_b, "b0", chats["b0"], "b0: during")
                assert stop(a, signal.SIGKILL) == -signal.SIGKILL
            answered(on_b, "b1", chats["b1"], "b1: after")

            # every answered turn is kept with its exact ids; the killed replica's sessions go on on B by id
            for session in pinned:
                assert stored_ids(postgres_dsn, session)[:2] == before[session]
            for session in ("a0", "a1", "a2"):
                went_on = chat(on_b, session, chats[session])
                assert went_on.status_code == 200, went_on.text
                assert went_on.headers["X-Branch"] == "0"
                traj = on_b.get(f"/v1/sessions/{session}/trajectory").json()
                assert exact_ids(traj)[:2] == before[session]
                third, second = traj["turns"][2], traj["turns"][1]
                ids = second["prompt_ids"] + second["completion_ids"]
                assert third["parent"] == 1 and third["branch"] == 0 and third["reused_ids"] > 0
                assert third["prompt_ids"][: len(ids)] == ids
                assert traj["bridged"] == 2 and traj["branched"] == 0
                assert on_b.post(f"/v1/sessions/{session}/close").status_code == 200
        assert stop(b) == 0

        closed = {t.session: t for t in Trajectories(postgres_dsn).closed()}
        assert sorted(closed) == ["a0", "a1", "a2"]
        assert all([s.turns for s in t.samples] == [(0, 1, 2)] for t in closed.values())
        out = tmp_path / "rows.jsonl"
        assert cli.main(["gateway", "export", "--store", postgres_dsn, "-o", str(out)]) == 0
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        assert [(r["session"], r["turns"]) for r in rows] == [(s, [0, 1, 2]) for s in closed]
        assert rows[0]["input_ids"] == closed[rows[0]["session"]].samples[0].input_ids.tolist()
    finally:
        for proc, _ in replicas:
            stop(proc, signal.SIGKILL)
        stop(engine)
