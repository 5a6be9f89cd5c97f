"""Conversations through the client, on the reference engine: exact ids across turns, counted failures."""

from __future__ import annotations

import itertools

import attrs
import numpy as np
import pytest

from backends_core import BridgeError, Client, ClientConfig, Event, SamplingParams, hookimpl
from backends_core.multiturn.extension import clear_template_cache
from backends_testkit.engine import ReferenceEngine
from backends_testkit.reference.emulator import ReferenceEmulator


class Recorder:
    def __init__(self) -> None:
        self.events: list[Event] = []

    @hookimpl
    def observe(self, event: Event) -> None:
        self.events.append(event)


@pytest.fixture(autouse=True)
def _fresh_verdicts():
    clear_template_cache()  # the tokenizer is shared between tests: start without cached tail verdicts
    yield
    clear_template_cache()


@pytest.fixture
async def client(tiny_models):
    engine = ReferenceEngine(tiny_models.dense, seed=0)
    recorder = Recorder()
    config = ClientConfig(
        backend="reference", base_url="http://ref", model="tiny-qwen3", tokenizer=str(tiny_models.dense)
    )
    async with Client(config, transport=ReferenceEmulator(engine).transport(), plugins=[recorder]) as c:
        c.recorder = recorder  # type: ignore[attr-defined]
        yield c
    await engine.aclose()


async def test_three_turns_each_extend_the_previous_exact_ids(client: Client) -> None:
    conv = client.conversation()
    sampling = SamplingParams(max_tokens=12, seed=3)
    turns = [await conv.send([{"role": "user", "content": "hi"}], sampling=sampling)]
    for text in ("more", "and more"):
        turns.append(await conv.send([{"role": "user", "content": text}], sampling=sampling))
    for before, after in itertools.pairwise(turns):
        assert after.prompt_ids[: len(before.token_ids)] == before.token_ids
    assert conv.token_ids == turns[-1].token_ids
    assert [m["role"] for m in conv.messages] == ["user", "assistant", "user", "assistant", "user"]
    assert client.bridge_stats.as_dict() == {
        "attempts": 2,
        "successes": 2,
        "failures": {},
        "rerendered": 0,
        "tail_renders": 0,  # turn 2: history too short to verify a tail render; turn 3: verified against a full one
        "full_renders": {"short_history": 1, "verify": 1},
    }
    bridge_events = [e for e in client.recorder.events if e.kind == "bridge"]  # type: ignore[attr-defined]
    assert len(bridge_events) == 2 and all(e.ok for e in bridge_events)


async def test_later_turns_render_only_the_new_messages_and_count_it(client: Client) -> None:
    conv = client.conversation()
    sampling = SamplingParams(max_tokens=6, seed=5)
    turns = [await conv.send([{"role": "user", "content": "hi"}], sampling=sampling)]
    for i in range(5):
        turns.append(await conv.send([{"role": "user", "content": f"more {i}"}], sampling=sampling))
    for before, after in itertools.pairwise(turns):
        assert after.prompt_ids[: len(before.token_ids)] == before.token_ids
    stats = client.bridge_stats
    assert stats.tail_renders == 3 and stats.full_renders == {"short_history": 1, "verify": 1}
    assert stats.successes == 5 and stats.as_dict()["tail_renders"] == 3


async def test_a_truncated_turn_is_closed_and_the_next_turn_continues(client: Client) -> None:
    conv = client.conversation()
    first = await conv.send(
        [{"role": "user", "content": "long"}], sampling=SamplingParams(max_tokens=3, ignore_eos=True)
    )
    assert first.finish_reason == "length"
    second = await conv.send([{"role": "user", "content": "go on"}], sampling=SamplingParams(max_tokens=3))
    closing = client.tokenizer.decode(list(second.prompt_ids[len(first.token_ids) :]))
    assert closing.startswith("<|im_end|>\n<|im_start|>user\ngo on")


async def test_a_failed_bridge_raises_counts_and_sends_nothing(client: Client) -> None:
    conv = client.conversation()
    first = await conv.send([{"role": "user", "content": "x"}], sampling=SamplingParams(max_tokens=4, seed=1))
    # the previous turn ended on <|endoftext|>, a stop token the template never puts at the end of a turn
    eot = client.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    conv.turns[-1] = attrs.evolve(
        first,
        completion_ids=(*first.completion_ids, eot),
        finish_reason="stop",
        logprobs=np.append(first.logprobs, np.float32(-1.0)),
    )
    generated = [e for e in client.recorder.events if e.kind == "generate"]  # type: ignore[attr-defined]
    with pytest.raises(BridgeError) as info:
        await conv.send([{"role": "user", "content": "y"}])
    assert info.value.reason == "foreign_stop_token"
    assert client.bridge_stats.failures == {"foreign_stop_token": 1} and client.bridge_stats.successes == 0
    assert [e for e in client.recorder.events if e.kind == "generate"] == generated  # type: ignore[attr-defined]
    assert len(conv.turns) == 1
