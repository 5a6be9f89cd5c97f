"""The gateway in front of a real server, driven as an unmodified harness drives it: the official ``openai`` SDK on
``{gateway}/s/{session}/v1``, each turn appending the assistant message the SDK returned and a new user message,
streamed and whole turns alternating. The trajectory the gateway keeps is then checked id by id against what the
SDK answered and against the engine's own teacher scoring of the whole sequence. Shared by the vLLM, router-front,
SGLang and Dynamo live suites (each passes a :class:`~backends_core.Client` configured for its server).
:func:`check_anthropic_rollout` is the same rollout over the Messages API, through the official ``anthropic`` SDK."""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import anthropic
import attrs
import httpx
import numpy as np
import numpy.typing as npt
from openai import AsyncOpenAI
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion

from backends_core import Client, StatelessPolicy
from backends_gateway import Gateway, GatewayLimits, SQLiteStore, serve
from backends_testkit.live import async_probe_client

#: A gateway's client leaves the turns to the gateway (its own stateless cache off).
GATEWAY_TURNS = StatelessPolicy(enabled=False)

#: One request's bound (a turn of a few ids; generous on a loaded two-core machine).
TIMEOUT = httpx.Timeout(300.0, connect=10.0)
#: Largest accepted |Δ logprob| between a sampled id's logprob and the engine's teacher score of it: the bound the
#: other live multi-turn suites hold sampling and scoring to (generation and scoring batch differently).
TEACHER_ATOL = 1e-4
MAX_TOKENS = 12
SEED = 11
USER_TURNS = ("Name a color.", "And another one?", "Why that one?")


@attrs.frozen(kw_only=True)
class Figures:
    """What one rollout through the gateway measured."""

    name: str
    turns: int
    reused_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    sequence: int
    teacher_max_abs_diff: float | None
    seconds: float

    def line(self) -> str:
        diff = "n/a" if self.teacher_max_abs_diff is None else f"{self.teacher_max_abs_diff:.3g}"
        return (
            f"[gateway] {self.name}: {self.turns} turns, reused ids {list(self.reused_ids)}, completion ids "
            f"{list(self.completion_ids)}, sequence {self.sequence} ids, max |Δ logprob| vs teacher {diff}, "
            f"harness {self.seconds:.1f}s"
        )


def openai_client(base_url: str) -> AsyncOpenAI:
    """The harness's SDK client (no retries: a retried turn would be a second turn; probe HTTP underneath)."""
    return AsyncOpenAI(
        base_url=base_url, api_key="x", max_retries=0, timeout=TIMEOUT, http_client=async_probe_client(TIMEOUT)
    )


def reply_of(completion: ChatCompletion) -> dict[str, Any]:
    """The assistant message as a harness appends it to its history: what the SDK parsed, Nones dropped."""
    return completion.choices[0].message.model_dump(exclude_none=True)


async def chat(
    oai: AsyncOpenAI, model: str, messages: Sequence[dict[str, Any]], *, stream: bool, max_tokens: int = MAX_TOKENS
) -> ChatCompletion:
    """One turn; ``stream``: streamed, the chunks accumulated into a completion by the SDK's stream state."""
    fields: dict[str, Any] = {
        "model": model,
        "messages": list(messages),
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "seed": SEED,
        "logprobs": True,
    }
    if not stream:
        return await oai.chat.completions.create(**fields)
    state: ChatCompletionStreamState[Any] = ChatCompletionStreamState()
    chunks = await oai.chat.completions.create(**fields, stream=True)
    async with chunks:
        async for chunk in chunks:
            state.handle_chunk(chunk)
    # the SDK's own accumulation of the chunks (its final parse refuses finish_reason "length": a short turn)
    return ChatCompletion.model_validate(state.current_completion_snapshot.model_dump())


async def harness(
    url: str, session: str, model: str, *, turns: int, history: list[dict[str, Any]] | None = None, first: int = 0
) -> tuple[list[ChatCompletion], list[dict[str, Any]]]:
    """``turns`` turns of a session on the gateway at ``url`` (turn ``first`` onwards of :data:`USER_TURNS`'s
    cycle, even turns streamed): the completions, and the history after the last reply."""
    messages = list(history or [{"role": "system", "content": "Be brief."}])
    completions = []
    async with openai_client(f"{url}/s/{session}/v1") as oai:
        for index in range(first, first + turns):
            if completions:
                messages.append(reply_of(completions[-1]))
            messages.append({"role": "user", "content": USER_TURNS[index % len(USER_TURNS)]})
            completions.append(await chat(oai, model, messages, stream=index % 2 == 0))
    messages.append(reply_of(completions[-1]))
    return completions, messages


async def get_json(url: str) -> Any:
    async with async_probe_client(TIMEOUT) as http:
        response = await http.get(url)
    assert response.status_code == 200, f"GET {url} -> {response.status_code}: {response.text[:2000]}"
    return response.json()


async def trajectory(url: str, session: str) -> dict[str, Any]:
    return dict(await get_json(f"{url}/v1/sessions/{session}/trajectory"))


def sampled_logprobs(completion: ChatCompletion) -> list[float]:
    """The per-id logprobs the SDK returned for a turn."""
    content = completion.choices[0].logprobs
    assert content is not None and content.content is not None, "the gateway answered no logprobs"
    return [entry.logprob for entry in content.content]


def check_extends(before: dict[str, Any], after: dict[str, Any]) -> int:
    """``after`` continues ``before`` on its branch, its prompt starting with ``before``'s exact ids, all of them
    reused (never re-rendered); returns how many."""
    exact = before["prompt_ids"] + before["completion_ids"]
    assert after["prompt_ids"][: len(exact)] == exact, f"turn {after['turn']} does not extend turn {before['turn']}"
    assert after["reused_ids"] == len(exact), (after["turn"], after["reused_ids"], len(exact))
    assert after["parent"] == before["turn"] and after["branch"] == before["branch"]
    return len(exact)


def check_trajectory(
    body: dict[str, Any], completions: Sequence[ChatCompletion]
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.bool_], npt.NDArray[np.float32]]:
    """One branch whose turns extend each other's exact ids, its loss mask 1 exactly on the sampled ids and its
    logprobs theirs, every turn on one server, each turn what the SDK answered. Returns the branch's ids, mask and
    logprobs."""
    turns = body["turns"]
    assert [t["turn"] for t in turns] == list(range(len(completions)))
    assert turns[0]["parent"] is None and turns[0]["reused_ids"] == 0
    for before, after in itertools.pairwise(turns):
        check_extends(before, after)
    assert (body["bridged"], body["branched"], body["rerendered"]) == (len(turns) - 1, 0, 0), body

    for turn, completion in zip(turns, completions, strict=True):
        assert len(turn["logprobs"]) == len(turn["completion_ids"]) > 0
        np.testing.assert_allclose(sampled_logprobs(completion), turn["logprobs"], rtol=0, atol=1e-6)
        assert completion.choices[0].message.content == (turn["reply"].get("content") or "")
        # the prompt's sampled spans are the earlier turns' completions, verbatim
        prompt = turn["prompt_ids"]
        sampled = [prompt[s["start"] : s["end"]] for s in turn["message_spans"] if s["sampled"]]
        assert sampled == [t["completion_ids"] for t in turns[: turn["turn"]]]

    servers = {t["server"] for t in turns}
    assert len(servers) == 1 and None not in servers, f"the session's turns ran on {servers}"

    (branch,) = body["branches"]
    last = turns[-1]
    ids = np.asarray(branch["input_ids"], dtype=np.int32)
    assert branch["branch"] == 0 and branch["turns"] == [t["turn"] for t in turns]
    assert ids.tolist() == last["prompt_ids"] + last["completion_ids"]
    want = np.zeros(len(ids), dtype=np.uint8)
    for turn in turns:
        start = len(turn["prompt_ids"])
        want[start : start + len(turn["completion_ids"])] = 1
    mask = np.asarray(branch["loss_mask"], dtype=np.uint8)
    np.testing.assert_array_equal(mask, want)
    logprobs = np.asarray(branch["logprobs"], dtype=np.float32)
    for turn in turns:
        start = len(turn["prompt_ids"])
        np.testing.assert_array_equal(
            logprobs[start : start + len(turn["completion_ids"])], np.asarray(turn["logprobs"], dtype=np.float32)
        )
    assert not logprobs[mask == 0].any()
    return ids, mask.astype(bool), logprobs


async def teacher_diff(client: Client, ids: npt.NDArray[np.int32], mask: npt.NDArray[np.bool_], logprobs: Any) -> float:
    """Largest |Δ| between the branch's sampled logprobs and the engine's teacher scores at those positions."""
    teacher = await client.teacher_logprobs(ids.tolist())
    scored = np.asarray(teacher.logprobs, dtype=np.float64)
    assert scored.shape == ids.shape
    return float(np.max(np.abs(scored[mask] - np.asarray(logprobs, dtype=np.float64)[mask])))


async def check_gateway_rollout(
    client: Client,
    store: Path,
    *,
    name: str,
    teacher: bool = True,
    turns: int = 3,
    around: Callable[[Callable[[], Awaitable[Any]]], Awaitable[Any]] | None = None,
) -> Figures:
    """A gateway over the open ``client`` (store at ``store``), served for the check only: a harness session of
    ``turns`` turns through the ``openai`` SDK, its trajectory checked exactly, and (``teacher``) the sampled
    logprobs against the engine's teacher scores. ``around(run)``, when given, runs the harness loop (to count
    what it did on the servers)."""
    model = client.config.model
    assert model is not None
    session = f"gw-{name}-{int(time.time() * 1000)}"
    limits = GatewayLimits(max_completion_tokens=64)
    async with Gateway(client, SQLiteStore(store), limits=limits) as gateway, serve(gateway, port=0) as url:
        started = time.monotonic()

        async def run() -> list[ChatCompletion]:
            completions, _ = await harness(url, session, model, turns=turns)
            return completions

        completions = await (around(run) if around is not None else run())
        seconds = time.monotonic() - started
        body = await trajectory(url, session)
        ids, mask, logprobs = check_trajectory(body, completions)
        diff = await teacher_diff(client, ids, mask, logprobs) if teacher else None
        closed = await close(url, session)
        assert closed["status"] == "closed" and closed["turns"] == turns
    figures = Figures(
        name=name,
        turns=len(body["turns"]),
        reused_ids=tuple(t["reused_ids"] for t in body["turns"]),
        completion_ids=tuple(len(t["completion_ids"]) for t in body["turns"]),
        sequence=len(ids),
        teacher_max_abs_diff=diff,
        seconds=seconds,
    )
    sys.stderr.write("\n" + figures.line() + "\n")
    if diff is not None:
        assert diff <= TEACHER_ATOL, figures.line()
    return figures


async def anthropic_harness(url: str, session: str, model: str, *, turns: int) -> list[anthropic.types.Message]:
    """``turns`` turns of a session over the Messages API through the official ``anthropic`` SDK (even turns
    streamed, accumulated by the SDK's own stream), each appending the content blocks the SDK answered."""
    messages: list[dict[str, Any]] = []
    answers: list[anthropic.types.Message] = []
    # the SDK's own HTTP client (it brings its own httpx fork, not the probe client's httpx), no retries
    async with anthropic.AsyncAnthropic(
        base_url=f"{url}/s/{session}", api_key="x", max_retries=0, timeout=300.0
    ) as sdk:
        for index in range(turns):
            if answers:
                messages.append({"role": "assistant", "content": answers[-1].content})
            messages.append({"role": "user", "content": USER_TURNS[index % len(USER_TURNS)]})
            fields: dict[str, Any] = {
                "model": model,
                "max_tokens": MAX_TOKENS,
                "system": "Be brief.",
                "messages": list(messages),
            }
            if index % 2 == 0:
                async with sdk.messages.stream(**fields) as events:
                    answers.append(await events.get_final_message())
            else:
                answers.append(await sdk.messages.create(**fields))
    return answers


async def check_anthropic_rollout(client: Client, store: Path, *, name: str, turns: int = 3) -> Figures:
    """:func:`check_gateway_rollout` over Anthropic's Messages API: one exact branch whose turns each reuse the
    previous turn's whole sequence, each reply what the SDK answered, the loss mask 1 exactly on the sampled ids,
    and their logprobs (which the Messages API does not answer: the trajectory's) the engine's teacher scores."""
    model = client.config.model
    assert model is not None
    session = f"gw-anthropic-{name}-{int(time.time() * 1000)}"
    limits = GatewayLimits(max_completion_tokens=64)
    async with Gateway(client, SQLiteStore(store), limits=limits) as gateway, serve(gateway, port=0) as url:
        started = time.monotonic()
        answers = await anthropic_harness(url, session, model, turns=turns)
        seconds = time.monotonic() - started
        body = await trajectory(url, session)
        body_turns = body["turns"]
        for before, after in itertools.pairwise(body_turns):
            check_extends(before, after)
        assert (body["bridged"], body["branched"], body["rerendered"]) == (turns - 1, 0, 0), body
        for turn, answer in zip(body_turns, answers, strict=True):
            text = "".join(block.text for block in answer.content if block.type == "text")
            assert text == (turn["reply"].get("content") or "")
            assert answer.usage.output_tokens == len(turn["completion_ids"]) > 0
            assert answer.usage.input_tokens == len(turn["prompt_ids"])
        (branch,) = body["branches"]
        ids = np.asarray(branch["input_ids"], dtype=np.int32)
        mask = np.asarray(branch["loss_mask"], dtype=bool)
        assert int(mask.sum()) == sum(len(t["completion_ids"]) for t in body_turns)
        diff = await teacher_diff(client, ids, mask, np.asarray(branch["logprobs"], dtype=np.float32))
        closed = await close(url, session)
        assert closed["status"] == "closed" and closed["turns"] == turns
    figures = Figures(
        name=f"{name} (anthropic)",
        turns=len(body_turns),
        reused_ids=tuple(t["reused_ids"] for t in body_turns),
        completion_ids=tuple(len(t["completion_ids"]) for t in body_turns),
        sequence=len(ids),
        teacher_max_abs_diff=diff,
        seconds=seconds,
    )
    sys.stderr.write("\n" + figures.line() + "\n")
    assert diff <= TEACHER_ATOL, figures.line()
    return figures


async def close(url: str, session: str) -> dict[str, Any]:
    async with async_probe_client(TIMEOUT) as http:
        response = await http.post(f"{url}/v1/sessions/{session}/close")
    assert response.status_code == 200, response.text[:2000]
    return dict(response.json())
