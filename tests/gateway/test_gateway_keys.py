"""Keys: a harness key sees only its own sessions (another's is answered as absent, never with its data), the
trainer key sees everything and alone reads trajectories, rewards and closes; no key or an unknown one is 401; a
key is never written anywhere."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends_gateway import Keys, KeysError

TRAINER = "tk-0123456789abcdef-trainer"
TEAM_A = "hk-0123456789abcdef-team-a"
TEAM_B = "hk-0123456789abcdef-team-b"
KEYS = Keys(trainer={"trainer": TRAINER}, harness={"team-a": TEAM_A, "team-b": TEAM_B})
REPLIES = [f"answer {i}<|im_end|>" for i in range(8)]


def http(url: str, key: str | None, *, header: str = "Authorization") -> httpx.AsyncClient:
    headers = {} if not key else {header: f"Bearer {key}" if header == "Authorization" else key}
    return httpx.AsyncClient(base_url=url, trust_env=False, timeout=60, headers=headers)


@contextlib.asynccontextmanager
async def keyed(url: str) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient, httpx.AsyncClient]]:
    """Clients of team A's key, team B's and the trainer's."""
    async with http(url, TEAM_A) as a, http(url, TEAM_B) as b, http(url, TRAINER) as trainer:
        yield a, b, trainer


async def chat(client: httpx.AsyncClient, messages: list[Any], path: str = "/v1") -> httpx.Response:
    return await client.post(f"{path}/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 8})


def message(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    return {k: v for k, v in response.json()["choices"][0]["message"].items() if v is not None}


def assert_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["error"]["code"] == code, body
    assert "turns" not in response.text and "prompt_ids" not in response.text


async def test_two_harness_keys_never_see_each_others_sessions(scripted_gateway) -> None:
    async with scripted_gateway(list(REPLIES), keys=KEYS) as served, keyed(served.url) as (a, b, trainer):
        first = [{"role": "user", "content": "the secret task"}]
        r1 = await chat(a, first, "/s/a-run/v1")
        history = [*first, message(r1), {"role": "user", "content": "go on"}]
        r2 = await chat(a, history)  # joins a-run by its history
        assert r2.headers["X-Session-ID"] == "a-run" and r2.headers["X-Turn"] == "1"

        # B: nothing of A's under that name, for reads; a turn naming it is B's own a-run, from its first turn
        assert_error(await b.get("/v1/sessions/a-run"), 404, "not_found")
        listed = await b.get("/v1/sessions")
        assert listed.status_code == 200 and listed.json()["data"] == []
        r3 = await chat(b, [*history, message(r2)], "/s/a-run/v1")
        assert r3.headers["X-Session-ID"] == "a-run" and r3.headers["X-Turn"] == "0"
        # the same history without an id starts B's own session: it never joins A's
        r4 = await chat(b, history)
        assert r4.status_code == 200 and r4.headers["X-Session-ID"] != "a-run" and r4.headers["X-Turn"] == "0"

        # A reads its own summary but not trajectories; rewards and closing are the trainer's
        own = await a.get("/v1/sessions/a-run")
        assert own.status_code == 200 and own.json()["owner"] == "team-a" and own.json()["turns"] == 2
        assert [s["session"] for s in (await a.get("/v1/sessions")).json()["data"]] == ["a-run"]
        assert_error(await a.get("/v1/sessions/a-run/trajectory"), 403, "trainer_key_required")
        assert_error(await a.post("/v1/sessions/a-run/reward", json={"reward": 1.0}), 403, "trainer_key_required")
        assert_error(await a.post("/v1/sessions/a-run/close"), 403, "trainer_key_required")

        # the trainer sees both keys' sessions, each in its key's names, and A's turns unchanged by B
        everything = {s["session"]: s["owner"] for s in (await trainer.get("/v1/sessions")).json()["data"]}
        r4_session = f"team-b~{r4.headers['X-Session-ID']}"
        assert everything == {"team-a~a-run": "team-a", "team-b~a-run": "team-b", r4_session: "team-b"}
        trajectory = (await trainer.get("/v1/sessions/team-a~a-run/trajectory")).json()
        assert [t["turn"] for t in trajectory["turns"]] == [0, 1]
        assert (await trainer.post("/v1/sessions/team-a~a-run/reward", json={"reward": 1.0})).status_code == 200


async def test_a_key_learns_nothing_of_the_names_another_uses(scripted_gateway) -> None:
    async with scripted_gateway(list(REPLIES), keys=KEYS) as served, keyed(served.url) as (a, b, _):
        assert message(await chat(a, [{"role": "user", "content": "hi"}], "/s/used/v1"))
        # B's answers for a name A uses and for one nobody uses differ by the name alone
        used, unused = await b.get("/v1/sessions/used"), await b.get("/v1/sessions/never-used")
        assert used.status_code == unused.status_code == 404
        assert used.text.replace("used", "NAME") == unused.text.replace("never-used", "NAME")
        assert (await b.get("/v1/sessions", params={"group": "used"})).json()["data"] == []
        # and a turn naming either starts B's own session
        for name in ("used", "never-used"):
            answered = await chat(b, [{"role": "user", "content": "hi"}], f"/s/{name}/v1")
            assert answered.headers["X-Session-ID"] == name and answered.headers["X-Turn"] == "0"


async def test_a_key_cannot_take_a_name_another_key_will_use(scripted_gateway) -> None:
    async with scripted_gateway(list(REPLIES), keys=KEYS) as served, keyed(served.url) as (a, b, trainer):
        squatted = await chat(b, [{"role": "user", "content": "mine now"}], "/s/rollout-7/v1")
        assert squatted.headers["X-Session-ID"] == "rollout-7"
        # A's rollout under that name is A's own session, as if B had never used it
        answered = await chat(a, [{"role": "user", "content": "the real task"}], "/s/rollout-7/v1")
        assert answered.headers["X-Session-ID"] == "rollout-7" and answered.headers["X-Turn"] == "0"
        assert (await a.get("/v1/sessions/rollout-7")).json()["turns"] == 1
        trajectory = (await trainer.get("/v1/sessions/team-a~rollout-7/trajectory")).json()
        assert "the real task" in json.dumps(trajectory["turns"][0]) and "mine now" not in json.dumps(trajectory)
        # a key's names are its own: naming another key's session in a key's names is no name at all
        sent = len(served.script.requests)
        assert_error(await chat(b, [{"role": "user", "content": "x"}], "/s/team-a~rollout-7/v1"), 400, "session_id")
        # and not even the trainer starts a session in a key's names
        assert_error(await chat(trainer, [{"role": "user", "content": "x"}], "/s/team-a~later/v1"), 404, "not_found")
        assert len(served.script.requests) == sent


async def test_groups_are_per_key(scripted_gateway) -> None:
    async with scripted_gateway(list(REPLIES), keys=KEYS) as served, keyed(served.url) as (a, b, trainer):
        for client, session in ((a, "a1"), (a, "a2"), (b, "b1")):
            response = await client.post(
                f"/s/{session}/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": session}], "max_tokens": 8},
                headers={"X-Session-Group": "step-1"},
            )
            assert response.status_code == 200, response.text
        # each key's step-1 holds its own sessions: B added nothing to A's GRPO group
        a_group = (await a.get("/v1/sessions", params={"group": "step-1"})).json()["data"]
        assert [(s["session"], s["group"]) for s in a_group] == [("a1", "step-1"), ("a2", "step-1")]
        b_group = (await b.get("/v1/sessions", params={"group": "step-1"})).json()["data"]
        assert [(s["session"], s["group"]) for s in b_group] == [("b1", "step-1")]
        groups = await trainer.get("/v1/sessions", params={"group": "team-a~step-1"})
        assert [s["session"] for s in groups.json()["data"]] == ["team-a~a1", "team-a~a2"]


async def test_a_responses_harness_continues_by_its_ids_and_no_other_key_can(scripted_gateway) -> None:
    import openai

    async with scripted_gateway(list(REPLIES), keys=KEYS) as served:
        async with openai.AsyncOpenAI(base_url=f"{served.url}/s/r-run/v1", api_key=TEAM_A) as a:
            first = await a.responses.create(model="tiny", input="hi", max_output_tokens=8)
            assert first.id.startswith("resp_r-run_")
            second = await a.responses.create(
                model="tiny", input="more", previous_response_id=first.id, max_output_tokens=8
            )
            assert second.output_text == "answer 1"
        async with openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key=TEAM_B) as b:
            with pytest.raises(openai.NotFoundError):
                await b.responses.create(model="tiny", input="x", previous_response_id=first.id, max_output_tokens=8)
        assert len(served.script.requests) == 2


async def test_no_key_or_an_unknown_one_is_401_and_health_needs_none(scripted_gateway) -> None:
    async with scripted_gateway(list(REPLIES), keys=KEYS) as served:
        for key in (None, "hk-not-a-key-of-this-gateway"):
            async with http(served.url, key) as client:
                for response in (
                    await chat(client, [{"role": "user", "content": "hi"}]),
                    await client.get("/v1/sessions"),
                    await client.get("/v1/models"),
                    await client.get("/v1/sessions/x/trajectory"),
                ):
                    assert_error(response, 401, "invalid_api_key")
                    assert response.headers["WWW-Authenticate"] == "Bearer"
                assert (await client.get("/health")).status_code == 200
        async with httpx.AsyncClient(base_url=served.url, trust_env=False) as client:
            for header in (f"Basic {TEAM_A}", "Bearer", TEAM_A):  # a key only counts as a bearer token
                response = await client.get("/v1/models", headers={"Authorization": header})
                assert_error(response, 401, "invalid_api_key")
        assert served.script.requests == []
        # Anthropic's SDKs send the key as x-api-key
        async with http(served.url, TEAM_A, header="x-api-key") as client:
            assert (await client.get("/v1/models")).status_code == 200


async def test_no_key_is_written_to_the_logs_or_any_answer(scripted_gateway, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    async with scripted_gateway(list(REPLIES), keys=KEYS) as served:
        wrong = TEAM_A + "x"
        answers: list[str] = []
        for key in (TEAM_A, wrong, TRAINER):
            async with http(served.url, key) as client:
                for response in (
                    await chat(client, [{"role": "user", "content": "hi"}]),
                    await client.get("/v1/sessions/nope"),
                    await client.post("/v1/chat/completions", content=b"{not json"),
                ):
                    answers.append(response.text + str(response.headers))
    for secret in (TRAINER, TEAM_A, TEAM_B, wrong):
        assert secret not in caplog.text
        assert not any(secret in answer for answer in answers)


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ('[trainer]\nt = "short"\n', "at least 16 characters"),
        ("[harness]\na = 'hk-0123456789abcdef'\n", "at least one trainer key"),
        (
            "[trainer]\nt = 'tk-0123456789abcdef'\n[harness]\nt = 'hk-0123456789abcdef'\n",
            "'t': the name is given twice",
        ),
        ("[trainer]\nt = 'tk-0123456789abcdef'\n[harness]\na = 'tk-0123456789abcdef'\n", "the same key as 't'"),
        ("[trainer]\nt = 'tk-0123456789abcdef'\n[admins]\nx = 'y'\n", "found ['admins']"),
        ("[trainer]\n'bad name' = 'tk-0123456789abcdef'\n", "'bad name': a name is"),
        ("[trainer\nt = 'tk-0123456789abcdef-secret'\n", "is not valid TOML"),
    ],
)
def test_a_keys_file_that_cannot_be_used_is_refused_naming_the_entry_never_the_key(
    tmp_path: Path, text: str, names: str
) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(text)
    with pytest.raises(KeysError, match=names.replace("[", r"\[").replace("]", r"\]")) as caught:
        Keys.from_file(path)
    assert "0123456789abcdef" not in str(caught.value)


async def test_anthropic_harnesses_send_their_key_as_x_api_key_and_meet_the_same_walls(scripted_gateway) -> None:
    import anthropic

    async with scripted_gateway(list(REPLIES), keys=KEYS) as served:
        ask = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
        async with anthropic.AsyncAnthropic(base_url=f"{served.url}/s/a-run", api_key=TEAM_A) as a:
            answer = await a.messages.create(**ask)
            assert answer.content and answer.role == "assistant"
        async with anthropic.AsyncAnthropic(base_url=f"{served.url}/s/a-run", api_key=TEAM_B) as b:
            await b.messages.create(**ask)  # B's own a-run, never A's
        async with http(served.url, TEAM_B, header="x-api-key") as b_reads:
            listed = (await b_reads.get("/v1/sessions")).json()["data"]
            assert [(s["session"], s["owner"], s["turns"]) for s in listed] == [("a-run", "team-b", 1)]
        async with anthropic.AsyncAnthropic(base_url=served.url, api_key=TEAM_A + "x") as wrong:
            with pytest.raises(anthropic.AuthenticationError):
                await wrong.messages.create(**ask)
        assert len(served.script.requests) == 2


async def test_an_empty_x_api_key_beside_a_bearer_key_is_no_key_and_two_different_keys_are_refused(
    scripted_gateway,
) -> None:
    async with scripted_gateway(list(REPLIES), keys=KEYS) as served, http(served.url, None) as client:
        empty_beside = {"x-api-key": "", "Authorization": f"Bearer {TEAM_A}"}
        answered = await client.post(
            "/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
            headers=empty_beside,
        )
        assert message(answered)["content"] == "answer 0"
        two = {"x-api-key": TEAM_B, "Authorization": f"Bearer {TEAM_A}"}
        assert_error(await client.get("/v1/sessions", headers=two), 401, "invalid_api_key")
        same = {"x-api-key": TEAM_A, "Authorization": f"Bearer {TEAM_A}"}
        assert (await client.get("/v1/sessions", headers=same)).status_code == 200


@pytest.mark.parametrize("session", [".", "..", "..."])
async def test_a_session_id_of_only_dots_is_refused(scripted_gateway, session: str) -> None:
    async with scripted_gateway(list(REPLIES)) as served, http(served.url, None) as client:
        response = await client.post(
            "/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
            headers={"X-Session-ID": session},
        )
        assert_error(response, 400, "session_id")
        assert served.script.requests == []
