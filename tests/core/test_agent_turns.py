"""Agent loops as real harnesses send them: the assistant message comes back the way OpenAI-style clients hold it,
the history is the harness's own (``previous=``, no state in the client), and every prompt says which ids belong to
which message and which were sampled (``message_spans``, ``loss_mask``). Checked on two chat templates: the tiny
models' Qwen3-style one (reasoning, tool calls) and a Qwen2.5-style one (tool calls, no reasoning)."""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from backends_core import (
    BridgeError,
    Client,
    ClientConfig,
    GenerateResult,
    InvalidRequestError,
    SamplingParams,
    SyncClient,
    loss_mask,
)
from backends_core.config import StatelessPolicy
from backends_core.multiturn.extension import clear_template_cache
from backends_core.multiturn.rendering import load_tokenizer, render_text
from backends_core.multiturn.spans import rendered_spans
from backends_testkit._chat_template import CHAT_TEMPLATE
from backends_testkit.engine import ReferenceEngine
from backends_testkit.reference.emulator import ReferenceEmulator
from scripted_backend import ScriptedBackend

TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}
    for name in ("ls", "cat", "grep")
]
SAMPLING = SamplingParams(max_tokens=64)
EOT = "<|im_end|>\n"

#: A Qwen2.5-style template: ChatML, tools in the system turn, ``<tool_call>`` blocks after the content, tool
#: results grouped into one user turn; reasoning is not rendered.
QWEN25_TEMPLATE = (
    CHAT_TEMPLATE.replace("{%- if message.reasoning_content is string -%}", "{%- if false -%}")
    .replace("{%- elif '</think>' in content -%}", "{%- elif false -%}")
    .replace("{%- if loop.index0 > state.last_query and (loop.last or reasoning) -%}", "{%- if false -%}")
    .replace(
        r"{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' -}}"
        "{%- endif -%}",
        "",
    )
)
TEMPLATES = ("qwen3", "qwen25")


@pytest.fixture(autouse=True)
def _fresh_verdicts() -> Any:
    clear_template_cache()
    yield
    clear_template_cache()


@pytest.fixture(scope="module")
def model_dirs(tiny_models: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The tiny model's tokenizer under each template (the Qwen2.5-style one in a copy of its directory)."""
    copy = tmp_path_factory.mktemp("qwen25-tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json"):
        if (Path(tiny_models.dense) / name).exists():
            shutil.copy(Path(tiny_models.dense) / name, copy / name)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN25_TEMPLATE
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    return {"qwen3": str(tiny_models.dense), "qwen25": str(copy)}


@pytest.fixture
async def scripted(model_dirs: dict[str, str]) -> AsyncIterator[Callable[..., Client]]:
    """A client whose completions are the given texts, on a template, with the default ("auto") parsers."""
    clients: list[Client] = []

    def make(template: str, replies: list[str], **config: Any) -> Client:
        tok = load_tokenizer(model_dirs[template])
        cfg = ClientConfig(backend="scripted", base_url="http://scripted", tokenizer=model_dirs[template], **config)
        client = Client(cfg, plugin=ScriptedBackend(tok, replies))
        clients.append(client)
        return client

    yield make
    for c in clients:
        await c.aclose()


def as_sampled(client: Client, message: dict[str, Any], before: list[dict[str, Any]]) -> str:
    """The completion text a model writes for ``message`` after ``before``: what the template renders for it after
    the generation prompt, up to and including its end-of-turn token."""
    tok = client.tokenizer
    prompt = render_text(tok, before, tools=TOOLS, add_generation_prompt=True)
    whole = render_text(tok, [*before, message], tools=TOOLS, add_generation_prompt=False)
    assert whole.startswith(prompt), (prompt, whole)
    return whole[len(prompt) :].removesuffix("\n")


# -- generated assistant messages, their benign variants and their substantive edits ------------------------------

words = st.text(alphabet=st.sampled_from("abcdefgh xyz.,!?é0123"), min_size=1, max_size=16).map(str.strip).filter(bool)
arg_values = st.one_of(st.integers(-50, 50), st.booleans(), words, st.lists(st.integers(0, 9), max_size=3))
arguments = st.dictionaries(st.sampled_from(["path", "all", "n", "pattern", "depth"]), arg_values, max_size=3)
calls = st.lists(st.tuples(st.sampled_from(["ls", "cat", "grep"]), arguments), max_size=2)


@st.composite
def assistant_messages(draw: st.DrawFn, template: str) -> dict[str, Any]:
    content = draw(st.one_of(st.just(""), words))
    tool_calls = draw(calls)
    if not content and not tool_calls:
        content = draw(words)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if template == "qwen3":
        message["reasoning_content"] = draw(st.one_of(st.just(""), words))
    if tool_calls:
        message["tool_calls"] = [
            {"type": "function", "function": {"name": name, "arguments": json.dumps(args)}} for name, args in tool_calls
        ]
    return message


def reformatted(arguments: str, seed: int) -> str:
    """The same JSON object with other spacing and key order."""
    value = json.loads(arguments)
    keys = sorted(value, reverse=bool(seed % 2))
    return json.dumps({k: value[k] for k in keys}, separators=(", ", ": ") if seed % 3 else (",", ":"), indent=seed % 2)


def benign_variants(parsed: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """How OpenAI-style harnesses hold the same reply."""
    out: list[tuple[str, dict[str, Any]]] = []
    without = {k: v for k, v in parsed.items() if k != "reasoning_content"}
    out.append(("reasoning absent", without))
    out.append(("reasoning empty", {**parsed, "reasoning_content": ""}))
    out.append(("reasoning None", {**parsed, "reasoning_content": None}))
    if parsed.get("reasoning"):
        out.append(("reasoning as 'reasoning'", {**without, "reasoning": parsed["reasoning_content"]}))
    if parsed["content"] == "":
        out.append(("content None", {**parsed, "content": None}))
    if parsed.get("tool_calls"):
        for name, strip in (("no type", ("type",)), ("no id", ("id",)), ("no id, no type", ("id", "type"))):
            call_list = [{k: v for k, v in c.items() if k not in strip} for c in parsed["tool_calls"]]
            out.append((f"tool calls {name}", {**without, "tool_calls": call_list}))
        indexed = [{"index": i, **c} for i, c in enumerate(parsed["tool_calls"])]
        out.append(("tool calls with a streamed index", {**without, "tool_calls": indexed}))
        for seed in range(3):
            call_list = [
                {**c, "function": {**c["function"], "arguments": reformatted(c["function"]["arguments"], seed + i)}}
                for i, c in enumerate(parsed["tool_calls"])
            ]
            out.append((f"arguments reformatted {seed}", {**parsed, "tool_calls": call_list}))
    return out


def substantive_edits(parsed: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """What was said, changed."""
    out = [("content", {**parsed, "content": (parsed["content"] or "") + " really"})]
    if parsed.get("reasoning_content"):
        out.append(("reasoning", {**parsed, "reasoning_content": parsed["reasoning_content"] + " hm"}))
    if parsed.get("tool_calls"):
        first, *rest = parsed["tool_calls"]
        renamed = {**first, "function": {**first["function"], "name": first["function"]["name"] + "x"}}
        out.append(("tool name", {**parsed, "tool_calls": [renamed, *rest]}))
        args = json.loads(first["function"]["arguments"])
        args["extra"] = 1
        edited = {**first, "function": {**first["function"], "arguments": json.dumps(args)}}
        out.append(("tool arguments", {**parsed, "tool_calls": [edited, *rest]}))
        out.append(("a tool call dropped", {**parsed, "tool_calls": rest or None}))
    return out


@pytest.mark.parametrize("template", TEMPLATES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
async def test_a_reply_held_the_way_harnesses_hold_it_extends_the_turn_and_an_edited_one_is_refused(
    scripted: Callable[..., Client], template: str, data: st.DataObject
) -> None:
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "look around"}]
    probe = scripted(template, [])
    sampled = as_sampled(probe, data.draw(assistant_messages(template), label="assistant"), first)
    parsed_once = None
    for stateless in (True, False):
        for name, variant in [("as parsed", None), *benign_variants_of(probe, sampled, first)]:
            client = scripted(template, [sampled, "done<|im_end|>"], stateless=StatelessPolicy(enabled=stateless))
            r1 = await client.generate(messages=first, sampling=SAMPLING, tools=TOOLS, session="s")
            parsed = client.parse_completion(r1)
            parsed_once = parsed_once or parsed
            reply = parsed if variant is None else variant
            messages = [*first, reply, {"role": "tool", "content": "a.py"}, {"role": "user", "content": "and?"}]
            how = {"session": "s"} if stateless else {"previous": r1}
            r2 = await client.generate(messages=messages, sampling=SAMPLING, tools=TOOLS, **how)
            assert r2.prompt_ids[: len(r1.token_ids)] == r1.token_ids, name
            assert r2.reused_ids == len(r1.token_ids)
            assert client.bridge_stats.successes == 1 and client.bridge_stats.failed == 0, name
    assert parsed_once is not None
    for name, edit in substantive_edits(parsed_once):
        client = scripted(template, [sampled, "done<|im_end|>"])
        r1 = await client.generate(messages=first, sampling=SAMPLING, tools=TOOLS)
        messages = [*first, edit, {"role": "user", "content": "and?"}]
        with pytest.raises(BridgeError) as info:
            await client.generate(messages=messages, sampling=SAMPLING, tools=TOOLS, previous=r1)
        assert info.value.reason == "assistant_mismatch", name
        assert client.bridge_stats.failures == {"assistant_mismatch": 1}, name


def benign_variants_of(client: Client, sampled: str, first: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """The benign variants of the parse of ``sampled`` after ``first``."""
    tok = client.tokenizer
    prompt = tuple(tok.encode(render_text(tok, first, tools=TOOLS), add_special_tokens=False))
    ids = tuple(tok.encode(sampled, add_special_tokens=False))
    result = GenerateResult(
        prompt_ids=prompt, completion_ids=ids, logprobs=np.zeros(len(ids), np.float32), finish_reason="stop"
    )
    return benign_variants(client.parse_completion(result))


# -- message spans and the loss mask ----------------------------------------------------------------------------

tails = st.sampled_from(["tool", "tool-tool", "user", "tool-user"])


def tail_messages(kind: str, turn: int) -> list[dict[str, Any]]:
    return [
        {"role": "tool", "content": f"out {turn}.{i}"} if part == "tool" else {"role": "user", "content": f"q {turn}"}
        for i, part in enumerate(kind.split("-"))
    ]


def check_spans(client: Client, result: GenerateResult, messages: list[dict[str, Any]]) -> None:
    """The spans cover the prompt contiguously and in order, every message has its content in its own spans, the
    trailing generation prompt is the template's, and the loss mask is 1 exactly on sampled ids."""
    spans = result.message_spans
    assert spans and spans[0].start == 0 and spans[-1].end == len(result.prompt_ids)
    assert all(a.end == b.start for a, b in itertools.pairwise(spans))
    indices = [s.message for s in spans if s.message is not None]
    assert indices == sorted(indices) and set(indices) == set(range(len(messages)))
    tok = client.tokenizer
    text_of: dict[int, str] = {}
    for s in spans:
        if s.message is not None:
            assert s.role == messages[s.message]["role"]
            text_of[s.message] = text_of.get(s.message, "") + tok.decode(list(result.prompt_ids[s.start : s.end]))
    for i, m in enumerate(messages):
        if m["role"] != "assistant" and m["content"]:
            assert m["content"] in text_of[i], (i, m, text_of[i])
    assert spans[-1].message is None
    assert tok.decode(list(result.prompt_ids[spans[-1].start :])) == "<|im_start|>assistant\n"
    mask = loss_mask(result)
    expected = np.zeros(len(result.token_ids), np.uint8)
    for s in spans:
        if s.sampled:
            expected[s.start : s.end] = 1
    expected[len(result.prompt_ids) :] = 1
    assert mask.dtype == np.uint8 and np.array_equal(mask, expected)


def ids_of(spans: Any, ids: Any, message: int) -> list[int]:
    return [t for s in spans if s.message == message for t in ids[s.start : s.end]]


@pytest.mark.parametrize("template", TEMPLATES)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
async def test_spans_and_loss_masks_are_exact_over_generated_agent_conversations(
    scripted: Callable[..., Client], template: str, data: st.DataObject
) -> None:
    turns = data.draw(st.integers(2, 4), label="turns")
    system = data.draw(st.booleans(), label="system")
    messages: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}] if system else []
    messages.append({"role": "user", "content": "look around"})
    probe = scripted(template, [])
    replies, history = [], list(messages)
    for turn in range(turns):
        reply = data.draw(assistant_messages(template), label=f"reply {turn}")
        replies.append(as_sampled(probe, reply, history))
        history = [*history, reply, *tail_messages(data.draw(tails, label=f"tail {turn}"), turn)]
    client = scripted(template, replies)
    results: list[GenerateResult] = []
    previous = None
    for turn in range(turns):
        result = await client.generate(messages=messages, sampling=SAMPLING, tools=TOOLS, previous=previous)
        check_spans(client, result, messages)
        sampled = [s for s in result.message_spans if s.sampled]
        assert [result.prompt_ids[s.start : s.end] for s in sampled] == [r.completion_ids for r in results]
        assert [s.message for s in sampled] == [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if previous is not None:
            assert result.prompt_ids[: len(previous.token_ids)] == previous.token_ids
            # the template's own attribution of the same messages rendered whole: every message that is not a
            # reused reply has the same ids in both
            whole = client.render(messages, tools=TOOLS)
            spans = rendered_spans(
                client.tokenizer, messages, whole, tools=TOOLS, chat_template_kwargs=None, end_of_turn=EOT
            )
            assert spans is not None
            for i, m in enumerate(messages):
                if m["role"] != "assistant":
                    assert ids_of(result.message_spans, result.prompt_ids, i) == ids_of(spans, whole, i), (i, m)
        results.append(result)
        previous = result
        start = len(messages)
        messages = [*messages, client.parse_completion(result)]
        messages += tail_messages(data.draw(tails, label=f"tail {turn}"), turn) if turn < turns - 1 else []
        assert len(messages) > start
    assert client.bridge_stats.successes == turns - 1


def test_a_prompt_rendered_whole_is_attributed_by_the_template(scripted: Callable[..., Client]) -> None:
    client = scripted("qwen3", [])
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "look"},
        {"role": "assistant", "content": "ok", "tool_calls": [{"function": {"name": "ls", "arguments": "{}"}}]},
        {"role": "tool", "content": "a.py"},
        {"role": "tool", "content": "b.py"},
    ]
    ids = client.render(messages, tools=TOOLS)
    spans = rendered_spans(client.tokenizer, messages, ids, tools=TOOLS, chat_template_kwargs=None, end_of_turn=EOT)
    assert spans is not None
    tok = client.tokenizer
    texts = [(s.message, tok.decode(ids[s.start : s.end])) for s in spans]
    assert texts[1] == (1, "<|im_start|>user\nlook<|im_end|>\n")
    assert texts[2] == (
        2,
        '<|im_start|>assistant\nok\n<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call><|im_end|>\n',
    )
    # the template groups the tool results into one turn: the first ends where the second's block begins
    assert texts[3] == (3, "<|im_start|>user\n<tool_response>\na.py\n</tool_response>")
    assert texts[4] == (4, "\n<tool_response>\nb.py\n</tool_response><|im_end|>\n")
    assert texts[5] == (None, "<|im_start|>assistant\n")
    assert texts[0][1].startswith("<|im_start|>system\nbe brief") and "<tools>" in texts[0][1]


# -- previous=: the stateless extension ----------------------------------------------------------------------------

LS = '<tool_call>\n{"name": "ls", "arguments": {"path": "src"}}\n</tool_call><|im_end|>'


async def test_previous_as_a_result_or_an_id_pair_extends_without_keeping_state(
    scripted: Callable[..., Client],
) -> None:
    client = scripted("qwen3", [LS, "two files<|im_end|>", "two files<|im_end|>"])
    first = [{"role": "user", "content": "look"}]
    r1 = await client.generate(messages=first, tools=TOOLS, sampling=SAMPLING)
    messages = [*first, client.parse_completion(r1), {"role": "tool", "content": "a.py b.py"}]
    by_result = await client.generate(messages=messages, tools=TOOLS, sampling=SAMPLING, previous=r1)
    by_pair = await client.generate(
        messages=messages, tools=TOOLS, sampling=SAMPLING, previous=(list(r1.prompt_ids), list(r1.completion_ids))
    )
    assert by_result.prompt_ids == by_pair.prompt_ids and by_result.prompt_ids[: len(r1.token_ids)] == r1.token_ids
    assert by_result.reused_ids == by_pair.reused_ids == len(r1.token_ids)
    assert client._turns.turns("anything") == [] and len(client._turns) == 0  # nothing remembered
    assert client.bridge_stats.successes == 2
    assert [s.sampled for s in by_result.message_spans].count(True) == 1
    assert by_pair.message_spans == ()  # an id pair carries no spans to extend...
    with pytest.raises(InvalidRequestError, match="pass the previous GenerateResult"):
        loss_mask(by_pair)  # ...so the mask cannot tell the sampled ids, and says so


async def test_previous_on_groups_and_streams(tiny_models: Any) -> None:
    config = ClientConfig(backend="reference", base_url="http://ref", tokenizer=str(tiny_models.dense))
    sampling = SamplingParams(max_tokens=8, seed=4)
    first = [{"role": "user", "content": "look"}]
    engine = ReferenceEngine(tiny_models.dense, seed=0)
    try:
        async with Client(config, transport=ReferenceEmulator(engine).transport()) as client:
            r1 = await client.generate(messages=first, sampling=sampling)
            messages = [*first, client.parse_completion(r1), {"role": "user", "content": "more"}]
            group = await client.generate_group(n=3, messages=messages, sampling=sampling, previous=r1)
            assert all(g.prompt_ids[: len(r1.token_ids)] == r1.token_ids for g in group)
            assert len({g.message_spans for g in group}) == 1 and group[0].message_spans
            async with client.stream(messages=messages, sampling=sampling, previous=r1) as s:
                async for _ in s:
                    pass
            assert s.result.prompt_ids == group[0].prompt_ids and s.result.message_spans == group[0].message_spans
            assert len(client._turns) == 0
    finally:
        await engine.aclose()


def test_previous_on_the_sync_client(model_dirs: dict[str, str]) -> None:
    tok = load_tokenizer(model_dirs["qwen3"])
    config = ClientConfig(backend="scripted", base_url="http://scripted", tokenizer=model_dirs["qwen3"])
    first = [{"role": "user", "content": "look"}]
    with SyncClient(config, plugin=ScriptedBackend(tok, [LS, "done<|im_end|>"])) as sync:
        s1 = sync.generate(messages=first, tools=TOOLS, sampling=SAMPLING)
        later = [*first, sync.parse_completion(s1), {"role": "tool", "content": "a.py"}]
        s2 = sync.generate(messages=later, tools=TOOLS, sampling=SAMPLING, previous=s1)
    assert s2.prompt_ids[: len(s1.token_ids)] == s1.token_ids and s2.reused_ids == len(s1.token_ids)
    assert [s.message for s in s2.message_spans if s.sampled] == [1]


@pytest.mark.parametrize(
    ("previous", "message"),
    [
        ("ids", "previous must be the previous turn's GenerateResult or a pair"),
        (([1, 2], [3], [4]), "previous must be the previous turn's GenerateResult or a pair"),
        (([1, "x"], [3]), "previous: "),
    ],
)
async def test_a_bad_previous_is_refused_before_sending(
    scripted: Callable[..., Client], previous: Any, message: str
) -> None:
    backend_calls: list[Any] = []
    client = scripted("qwen3", backend_calls)
    messages = [{"role": "user", "content": "look"}, {"role": "assistant", "content": "x"}]
    with pytest.raises(InvalidRequestError, match=message):
        await client.generate(messages=messages, sampling=SAMPLING, previous=previous)
    with pytest.raises(InvalidRequestError, match="previous= extends a conversation given as messages="):
        await client.generate(prompt_ids=[1, 2], sampling=SAMPLING, previous=([1], [2]))


async def test_previous_without_a_reply_or_with_an_edited_one_is_a_counted_break(
    scripted: Callable[..., Client],
) -> None:
    client = scripted("qwen3", [LS, "x<|im_end|>"])
    first = [{"role": "user", "content": "look"}]
    r1 = await client.generate(messages=first, tools=TOOLS, sampling=SAMPLING)
    with pytest.raises(BridgeError) as info:
        await client.generate(messages=[*first, {"role": "user", "content": "?"}], sampling=SAMPLING, previous=r1)
    assert info.value.reason == "no_prefix" and "no assistant message" in str(info.value)
    edited = {**client.parse_completion(r1), "content": "I will look."}
    with pytest.raises(BridgeError) as info:
        await client.generate(
            messages=[*first, edited, {"role": "tool", "content": "a"}], sampling=SAMPLING, previous=r1
        )
    assert info.value.reason == "assistant_mismatch" and "content" in str(info.value)
    assert client.bridge_stats.failures == {"no_prefix": 1, "assistant_mismatch": 1}


# -- max_tokens has no default -------------------------------------------------------------------------------------


async def test_max_tokens_is_required_and_a_generation_without_sampling_is_refused_before_sending(
    scripted: Callable[..., Client],
) -> None:
    with pytest.raises(TypeError, match="max_tokens"):
        SamplingParams()  # type: ignore[call-arg]
    sent: list[Any] = []
    client = scripted("qwen3", sent)
    with pytest.raises(InvalidRequestError, match=r"sampling=SamplingParams\(max_tokens=...\) is required"):
        await client.generate(messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        await client.generate_group(n=2, prompt_ids=[1, 2])
    with pytest.raises(InvalidRequestError, match="must be a SamplingParams"):
        await client.generate(prompt_ids=[1, 2], sampling={"max_tokens": 3})  # type: ignore[arg-type]
    assert client.driver.pm.get_plugin("scripted").requests == []  # type: ignore[union-attr]
