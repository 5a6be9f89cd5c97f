"""Conversations through the client, on the reference engine: exact ids across turns, counted failures."""

from __future__ import annotations

import itertools

import attrs
import numpy as np
import pytest

from backends_core import BridgeError, Client, ClientConfig, Event, SamplingParams, hookimpl
from backends_core.multiturn.extension import clear_template_cache
from backends_core.multiturn.rendering import load_tokenizer
from backends_testkit.engine import ReferenceEngine
from backends_testkit.reference.emulator import ReferenceEmulator
from scripted_backend import ScriptedBackend

TOOLS = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object", "properties": {}}}}]


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


async def test_an_assistant_message_as_a_new_turn_is_refused_counted_and_nothing_is_sent(client: Client) -> None:
    conv = client.conversation()
    await conv.send([{"role": "user", "content": "x"}], sampling=SamplingParams(max_tokens=4, seed=1))
    generated = [e for e in client.recorder.events if e.kind == "generate"]  # type: ignore[attr-defined]
    injected = [{"role": "assistant", "content": "words never sampled"}, {"role": "user", "content": "y"}]
    with pytest.raises(BridgeError) as info:
        await conv.send(injected)
    assert info.value.reason == "history_rewritten" and "new_messages[0]" in str(info.value)
    assert client.bridge_stats.failures == {"history_rewritten": 1} and client.bridge_stats.attempts == 1
    assert [e for e in client.recorder.events if e.kind == "generate"] == generated  # type: ignore[attr-defined]
    bridge = [e for e in client.recorder.events if e.kind == "bridge"]  # type: ignore[attr-defined]
    assert [e.detail.get("reason") for e in bridge] == ["history_rewritten"]
    assert len(conv.turns) == 1 and len(conv.messages) == 1


@pytest.fixture
async def scripted_client(tiny_models):
    tok = load_tokenizer(str(tiny_models.dense))
    replies = [
        '<think>\nthe user wants files\n</think>\n\n<tool_call>\n{"name": "ls", "arguments": {"path": "src"}}\n'
        "</tool_call><|im_end|>",
        "<think>\n\n</think>\n\nTwo files.<|im_end|>",
        "unused<|im_end|>",
    ]
    config = ClientConfig(
        backend="scripted",
        base_url="http://scripted",
        tokenizer=str(tiny_models.dense),
        tool_parser="hermes",
        reasoning_parser="qwen3",
    )
    async with Client(config, plugin=ScriptedBackend(tok, replies)) as c:
        yield c


async def test_each_reply_is_recorded_as_the_parse_of_its_completion(scripted_client: Client) -> None:
    conv = scripted_client.conversation(tools=TOOLS)
    first = await conv.send([{"role": "user", "content": "list the files"}], sampling=SamplingParams(max_tokens=16))
    second = await conv.send([{"role": "tool", "content": "a.py b.py"}], sampling=SamplingParams(max_tokens=16))
    await conv.send([{"role": "user", "content": "thanks"}], sampling=SamplingParams(max_tokens=16))
    assert conv.messages[1] == scripted_client.parse_completion(first)
    assert conv.messages[1]["reasoning_content"] == "the user wants files" and conv.messages[1]["content"] == ""
    assert conv.messages[1]["tool_calls"][0]["function"] == {"name": "ls", "arguments": '{"path": "src"}'}
    assert conv.messages[3] == {
        "role": "assistant",
        "content": "Two files.",
        "reasoning_content": "",
        "tool_calls": None,
    }
    assert conv.messages[3] == scripted_client.parse_completion(second)
    # the recorded reply renders to exactly the ids sampled (before a later user query, where the template drops
    # earlier reasoning)
    assert tuple(scripted_client.render(conv.messages[:3], tools=TOOLS)) == conv.turns[1].prompt_ids


async def test_an_assistant_message_given_for_the_previous_turn_must_be_its_parse(scripted_client: Client) -> None:
    conv = scripted_client.conversation(tools=TOOLS)
    first = await conv.send([{"role": "user", "content": "list the files"}], sampling=SamplingParams(max_tokens=16))
    edited = {**scripted_client.parse_completion(first), "reasoning_content": "something else"}
    with pytest.raises(BridgeError) as info:
        await conv.send(
            [{"role": "tool", "content": "a.py"}], assistant_message=edited, sampling=SamplingParams(max_tokens=16)
        )
    assert info.value.reason == "assistant_mismatch" and "reasoning_content" in str(info.value)
    assert scripted_client.bridge_stats.failures == {"assistant_mismatch": 1}
    same = {**scripted_client.parse_completion(first), "reasoning_content": "the user wants files"}
    same["tool_calls"] = [{**call, "id": "mine"} for call in same["tool_calls"]]  # call ids are the caller's
    second = await conv.send(
        [{"role": "tool", "content": "a.py"}], assistant_message=same, sampling=SamplingParams(max_tokens=16)
    )
    assert second.prompt_ids[: len(first.token_ids)] == first.token_ids
