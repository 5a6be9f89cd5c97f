"""vLLM's ``admin_state`` with ``fields``: one GET per field asked for, the same values and errors
as the full read, and the weight sync's check reading only the version."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from backends_core import Client, ClientConfig, ResponseParseError, ServerState
from backends_testkit.fakes import FakeServer

CAPTURES = Path(__file__).resolve().parents[2] / "fixtures" / "wire" / "vllm"
FIELDS = ("paused", "sleeping", "weight_version", "in_flight", "loras")
ROUTES = {
    "paused": "/is_paused",
    "sleeping": "/is_sleeping",
    "weight_version": "/weight_info",
    "in_flight": "/metrics",
    "loras": "/v1/models",
}


def capture(name: str) -> Any:
    return json.loads((CAPTURES / f"{name}.json").read_text())["response"]["body"]


def fake_server(**answers: Any) -> FakeServer:
    fake = FakeServer()
    fake.add("GET", "/is_paused", json=answers.get("is_paused", capture("is_paused_1")))
    fake.add("GET", "/is_sleeping", json=capture("is_sleeping_0"))
    fake.add("GET", "/weight_info", json=answers.get("weight_info", capture("weight_info")))
    fake.add("GET", "/v1/models", json=capture("models_with_lora"))
    fake.add("GET", "/metrics", content=(CAPTURES / "metrics.txt").read_bytes())
    for path, name in [
        ("/pause", "pause_abort_idle"),
        ("/resume", "resume"),
        ("/reset_prefix_cache", "reset_prefix_cache"),
        ("/update_weight_version", "update_weight_version"),
        ("/collective_rpc", "collective_rpc_reload_weights"),
    ]:
        fake.add("POST", path, json=capture(name))
    fake.add("POST", "/reset_encoder_cache", content=capture("images_reset_encoder_cache").encode())
    return fake


def client(fake: FakeServer) -> Client:
    return Client(ClientConfig(backend="vllm", base_url="http://v", model="tiny-qwen3"), transport=fake.transport())


async def test_a_state_with_fields_reads_only_their_routes_and_equals_the_full_state_on_them() -> None:
    fake = fake_server()
    async with client(fake) as c:
        (server,) = c.servers
        full = await c.driver.admin_state(server)
        assert None not in (full.paused, full.sleeping, full.weight_version, full.in_flight, full.loras)
        for n in range(len(FIELDS) + 1):
            for fields in itertools.combinations(FIELDS, n):
                fake.requests.clear()
                part = await c.driver.admin_state(server, fields=frozenset(fields))
                expected = ServerState(**{f: getattr(full, f) if f in fields else None for f in FIELDS})
                assert part == expected
                assert sorted(r.path for r in fake.requests if r.path != "/list_workers") == sorted(
                    ROUTES[f] for f in fields
                )


@pytest.mark.parametrize(
    ("answers", "fields"),
    [
        ({"weight_info": None}, {"weight_version"}),  # a null answer is read, not taken for "not asked"
        ({"weight_info": {"version": "v1"}}, {"weight_version", "paused"}),
        ({"is_paused": {"is_paused": "no"}}, {"paused"}),
        ({"is_paused": None}, {"paused", "weight_version"}),
    ],
)
async def test_a_bad_answer_to_a_field_asked_for_raises_what_the_full_read_raises(
    answers: dict[str, Any], fields: set[str]
) -> None:
    async with client(fake_server(**answers)) as c:
        (server,) = c.servers
        with pytest.raises(ResponseParseError) as full:
            await c.driver.admin_state(server)
        with pytest.raises(ResponseParseError) as part:
            await c.driver.admin_state(server, fields=frozenset(fields))
    assert str(part.value) == str(full.value)


async def test_the_weight_sync_check_reads_the_version_only() -> None:
    fake = fake_server(is_paused=capture("is_paused_0"), weight_info={"weight_version": "step-2"})
    async with client(fake) as c:
        report = await c.admin.weight_sync(path="/ckpt/step-2", version="step-2")
        assert c.weight_version == "step-2"
    (check,) = report.phases["verify"]
    assert check.ok and check.value == ServerState(weight_version="step-2")
    paths = [r.path for r in fake.requests if r.path != "/list_workers"]
    assert paths[:7] == [
        "/pause",
        "/collective_rpc",
        "/reset_encoder_cache",
        "/update_weight_version",
        "/reset_prefix_cache",
        "/reset_encoder_cache",
        "/resume",
    ]
    assert paths[7:] == ["/weight_info"]


async def test_a_weight_sync_whose_check_shows_another_version_fails_its_verify_phase() -> None:
    from backends_core import AdminError, WeightVersionMismatch

    fake = fake_server(is_paused=capture("is_paused_0"), weight_info={"weight_version": "old"})
    async with client(fake) as c:
        with pytest.raises(AdminError) as info:
            await c.admin.weight_sync(path="/ckpt/step-3", version="step-3")
    assert list(info.value.phases) == ["pause", "update", "flush", "resume", "verify"]
    assert isinstance(info.value.results[0].error, WeightVersionMismatch) and "'old'" in str(info.value)
