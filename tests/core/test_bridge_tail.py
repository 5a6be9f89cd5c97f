"""Tail rendering in the multi-turn bridge: only the new messages are rendered once a template's tail render has
been verified against a full one for the turn's shape; anything unverifiable is rendered in full and counted."""

from __future__ import annotations

import json
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from backends_core import BridgeError, BridgeStats, GenerateResult, extend_prompt
from backends_core.config import StatelessPolicy
from backends_core.multiturn.extension import clear_template_cache
from backends_core.multiturn.messages import normalize_messages
from backends_core.multiturn.rendering import encode, load_tokenizer, render_text
from backends_core.multiturn.turn_cache import TurnCache
from backends_core.parsing import CompletionParser

TOOLS = [
    {
        "type": "function",
        "function": {"name": "ls", "description": "list files", "parameters": {"type": "object", "properties": {}}},
    }
]
CALL = {"type": "function", "function": {"name": "ls", "arguments": {}}}
CALL_TEXT = '<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>'
# pieces of the small custom templates below
TURN_BODY = r"{{- m.content + '<|im_end|>\n' -}}"
TURN = r"{{- '<|im_start|>' + m.role + '\n' -}}" + TURN_BODY
GENERATION_PROMPT = r"{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"


@pytest.fixture(autouse=True)
def _fresh_verdicts():
    clear_template_cache()
    yield
    clear_template_cache()


@pytest.fixture(scope="module")
def tok(tiny_models):
    return load_tokenizer(str(tiny_models.dense))


class WithTemplate:
    """The tiny tokenizer with another chat template (the shared tokenizer is never mutated)."""

    def __init__(self, tok: Any, template: str) -> None:
        self._tok = tok
        self.chat_template = template
        self.unk_token_id = tok.unk_token_id
        self.rendered: list[list[str]] = []  # the roles of each rendered message list

    def apply_chat_template(self, messages: Any, **kw: Any) -> Any:
        self.rendered.append([m["role"] for m in messages])
        return self._tok.apply_chat_template(messages, chat_template=self.chat_template, **kw)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def convert_tokens_to_ids(self, token: str) -> Any:
        return self._tok.convert_tokens_to_ids(token)


def result(prompt: list[int], completion: list[int], finish: str = "stop") -> GenerateResult:
    return GenerateResult(
        prompt_ids=tuple(prompt),
        completion_ids=tuple(completion),
        logprobs=np.zeros(len(completion), np.float32),
        finish_reason=finish,
    )


class Chat:
    """Drives a conversation turn by turn through the bridge, with the assistant's completions given as text."""

    def __init__(self, tok: Any, first: list[dict[str, Any]], *, tools: Any = None, kwargs: Any = None) -> None:
        self.tok, self.tools, self.kwargs = tok, tools, kwargs
        self.history = list(first)  # every message before the previous assistant turn
        self.previous: GenerateResult | None = None
        self.assistant: dict[str, Any] | None = None
        self.stats = BridgeStats()
        self.first = encode(tok, render_text(tok, first, tools=tools, chat_template_kwargs=kwargs))

    def answer(self, completion_text: str, message: dict[str, Any], finish: str = "stop") -> None:
        prompt = self.first if self.previous is None else self.ids
        self.previous = result(prompt, encode(self.tok, completion_text), finish)
        self.assistant = message

    def send(self, new: list[dict[str, Any]], **kw: Any) -> list[int]:
        assert self.previous is not None and self.assistant is not None
        args = {
            "history": self.history,
            "previous": self.previous,
            "new_messages": new,
            "assistant_message": self.assistant,
            "tools": self.tools,
            "chat_template_kwargs": self.kwargs,
        }
        self.ids = extend_prompt(self.tok, **args, stats=self.stats, **kw)
        self.full_method = extend_prompt(self.tok, **args, tail_render=False)
        assert self.ids[: len(self.previous.token_ids)] == list(self.previous.token_ids)
        self.history += [self.assistant, *new]
        return self.ids

    def full_render(self) -> list[int]:
        text = render_text(self.tok, self.history, tools=self.tools, chat_template_kwargs=self.kwargs)
        return encode(self.tok, text)


def plain_turns(chat: Chat, n: int) -> None:
    for i in range(n):
        body = f"Answer number {i}."
        chat.answer(body + "<|im_end|>", {"role": "assistant", "content": body})
        chat.send([{"role": "user", "content": f"Question {i + 1}?"}])
        assert chat.ids == chat.full_method == chat.full_render()


def test_the_tail_is_verified_once_then_rendered_alone_and_equals_a_full_render(tok) -> None:
    chat = Chat(tok, [{"role": "user", "content": "Question 0?"}])
    plain_turns(chat, 6)
    # turn 2: the history is too short to tell positions apart; turn 3: verified against the full render
    assert chat.stats.full_renders == {"short_history": 1, "verify": 1}
    assert chat.stats.tail_renders == 4


def test_system_tools_think_blocks_and_grouped_tool_results_tail_render_like_the_full_method(tok) -> None:
    chat = Chat(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "files?"}], tools=TOOLS)
    turns = [
        (CALL_TEXT, {"role": "assistant", "content": "", "tool_calls": [CALL]}, [{"role": "tool", "content": "a"}]),
        (
            "<think>\nlook again\n</think>\n\n" + CALL_TEXT,
            {"role": "assistant", "content": "", "reasoning_content": "look again", "tool_calls": [CALL]},
            [{"role": "tool", "content": "a.py"}, {"role": "tool", "content": "b.py"}],
        ),
        ("<think>\ndone\n</think>\n\nTwo files.", {"role": "assistant", "content": "Two files."}, None),
        ("Sure.", {"role": "assistant", "content": "Sure."}, None),
        (CALL_TEXT, {"role": "assistant", "content": "", "tool_calls": [CALL]}, [{"role": "tool", "content": "c"}]),
        (
            CALL_TEXT,
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            [{"role": "tool", "content": "a.py"}, {"role": "tool", "content": "b.py"}],
        ),
        ("<think>\nok\n</think>\n\nDone.", {"role": "assistant", "content": "Done."}, None),
        ("Fine.", {"role": "assistant", "content": "Fine."}, None),
    ]
    for cycle in range(3):  # the cycle adds an even number of messages: its shapes recur
        for i, (completion, message, new) in enumerate(turns):
            chat.answer(completion + "<|im_end|>", message)
            chat.send(new or [{"role": "user", "content": f"next {cycle}.{i}"}])
            assert chat.ids == chat.full_method, (cycle, i)
        if cycle == 0:
            assert chat.stats.tail_renders < len(turns) and chat.stats.full_renders["verify"] > 0
        if cycle == 1:
            tail_before_last_cycle = chat.stats.tail_renders
    assert chat.stats.tail_renders == tail_before_last_cycle + len(turns)  # every shape is verified by now
    assert set(chat.stats.full_renders) <= {"short_history", "verify"}
    # the grouped tool results of the last tool turn, rendered alone, are the template's grouping
    assert "<tool_response>\na.py\n</tool_response>\n<tool_response>\nb.py" in tok.decode(chat.ids)


def _numbering_template() -> str:
    return (
        r"{%- for m in messages -%}{{- '<|im_start|>' + m.role + ' ' + loop.index | string + '\n' -}}"
        + TURN_BODY
        + "{%- endfor -%}"
        + r"{%- if add_generation_prompt -%}{{- '<|im_start|>assistant ' + (messages | length + 1) | string + '\n' -}}"
        + "{%- endif -%}"
    )


def test_a_template_that_numbers_turns_is_detected_and_rendered_in_full_every_turn(tok) -> None:
    numbered = WithTemplate(tok, _numbering_template())
    chat = Chat(numbered, [{"role": "user", "content": "Question 0?"}])
    plain_turns(chat, 6)
    assert chat.stats.tail_renders == 0
    assert chat.stats.full_renders == {"short_history": 1, "verify": 1, "position_dependent": 4}
    assert "<|im_start|>user 13\nQuestion 6?" in numbered._tok.decode(chat.ids)


def test_the_new_messages_alone_are_rendered_when_that_is_verified(tok) -> None:
    plain = WithTemplate(tok, "{%- for m in messages -%}" + TURN + "{%- endfor -%}" + GENERATION_PROMPT)
    chat = Chat(plain, [{"role": "user", "content": "Question 0?"}])
    plain_turns(chat, 5)
    assert chat.stats.full_renders == {"short_history": 1, "verify": 1} and chat.stats.tail_renders == 3
    plain.rendered.clear()
    chat.answer("Fine.<|im_end|>", {"role": "assistant", "content": "Fine."})
    chat.send([{"role": "user", "content": "Last one?"}])
    # the bridge rendered one message (the new one); the full method, for comparison, all 13 around a sentinel
    assert plain.rendered == [["user"], [*["user", "assistant"] * 6, "user"]]


def test_a_template_requiring_alternating_roles_gets_the_stand_in_user_context(tok) -> None:
    # user turns after the first are marked: the new message alone (a first message) renders differently, and
    # the sentinel turn first breaks the alternation; a stand-in user message before it satisfies both
    alternating = WithTemplate(
        tok,
        "{%- for m in messages -%}{%- if (m.role == 'user') != (loop.index0 % 2 == 0) -%}"
        "{{- raise_exception('roles must alternate user/assistant') -}}{%- endif -%}"
        r"{{- '<|im_start|>' + m.role + (' again' if m.role == 'user' and not loop.first else '') + '\n' -}}"
        + TURN_BODY
        + "{%- endfor -%}"
        + GENERATION_PROMPT,
    )
    chat = Chat(alternating, [{"role": "user", "content": "Question 0?"}])
    plain_turns(chat, 5)
    assert chat.stats.full_renders == {"short_history": 1, "verify": 1} and chat.stats.tail_renders == 3
    alternating.rendered.clear()
    chat.answer("Fine.<|im_end|>", {"role": "assistant", "content": "Fine."})
    chat.send([{"role": "user", "content": "Last one?"}])
    assert alternating.rendered[0] == ["user", "assistant", "user"]  # stand-in, sentinel, the new message
    assert "<|im_start|>user again\nLast one?" in tok.decode(chat.ids)


def test_a_verified_context_that_fails_on_some_content_falls_back_to_the_full_render_counted(tok) -> None:
    # the template refuses "boom" in a conversation of one message: the verified context (the new message alone)
    picky = WithTemplate(
        tok,
        "{%- if messages | length == 1 and messages[-1].content == 'boom' -%}"
        "{{- raise_exception('boom') -}}{%- endif -%}"
        "{%- for m in messages -%}" + TURN + "{%- endfor -%}" + GENERATION_PROMPT,
    )
    chat = Chat(picky, [{"role": "user", "content": "Question 0?"}])
    plain_turns(chat, 3)
    chat.answer("ok<|im_end|>", {"role": "assistant", "content": "ok"})
    chat.send([{"role": "user", "content": "boom"}])
    assert chat.ids == chat.full_method == chat.full_render()
    assert chat.stats.full_renders["tail_error"] == 1


def test_a_new_shape_is_verified_before_its_tail_is_used(tok) -> None:
    chat = Chat(tok, [{"role": "user", "content": "Question 0?"}], tools=TOOLS)
    plain_turns(chat, 3)  # user turns verified
    verified = chat.stats.full_renders["verify"]
    chat.answer(CALL_TEXT + "<|im_end|>", {"role": "assistant", "content": "", "tool_calls": [CALL]})
    chat.send([{"role": "tool", "content": "a.py"}])
    assert chat.stats.full_renders["verify"] == verified + 1  # a tool turn after a tool call: a new shape
    assert chat.ids == chat.full_method


def test_a_verdict_for_user_turns_is_not_reused_for_tool_turns(tok) -> None:
    # tool results are numbered by position, user turns are not: only the tool turn depends on the history
    numbered_tools = WithTemplate(
        tok,
        "{%- for m in messages -%}{%- if m.role == 'tool' -%}"
        r"{{- '<|im_start|>tool ' + loop.index | string + '\n' -}}"
        + TURN_BODY
        + "{%- else -%}"
        + TURN
        + "{%- endif -%}{%- endfor -%}"
        + GENERATION_PROMPT,
    )
    chat = Chat(numbered_tools, [{"role": "user", "content": "Question 0?"}])
    plain_turns(chat, 4)
    assert chat.stats.tail_renders == 2
    chat.answer("Let me look.<|im_end|>", {"role": "assistant", "content": "Let me look."})
    chat.send([{"role": "tool", "content": "a.py"}])
    assert chat.ids == chat.full_method == chat.full_render()
    assert chat.stats.tail_renders == 2 and chat.stats.full_renders["verify"] == 2


def test_unkeyable_template_variables_render_in_full_counted(tok) -> None:
    chat = Chat(tok, [{"role": "user", "content": "Question 0?"}], kwargs={"unused": object()})
    plain_turns(chat, 4)
    assert chat.stats.full_renders == {"uncacheable": 4} and chat.stats.tail_renders == 0


def test_tail_render_false_always_renders_in_full(tok) -> None:
    chat = Chat(tok, [{"role": "user", "content": "Question 0?"}])
    plain_turns(chat, 4)
    chat.answer("More.<|im_end|>", {"role": "assistant", "content": "More."})
    chat.send([{"role": "user", "content": "Again?"}], tail_render=False)
    assert chat.stats.full_renders["disabled"] == 1


def test_errors_stay_typed_on_the_tail_path(tok) -> None:
    chat = Chat(tok, [{"role": "user", "content": "Question 0?"}])
    plain_turns(chat, 4)  # verified: the next user turn is rendered alone
    chat.answer("bye<|endoftext|>", {"role": "assistant", "content": "bye"})
    with pytest.raises(BridgeError) as info:
        chat.send([{"role": "user", "content": "x"}])
    assert info.value.reason == "foreign_stop_token"
    chat.answer("bye<|im_end|>", {"role": "assistant", "content": "bye"})
    with pytest.raises(BridgeError) as info:
        chat.send(["not a message"])  # type: ignore[list-item]
    assert info.value.reason == "template_error" and "must be a mapping" in info.value.detail
    with pytest.raises(BridgeError, match="empty_turn"):
        chat.send([])


def test_a_template_error_in_the_tail_and_the_full_render_is_a_typed_template_error(tok) -> None:
    strict = WithTemplate(
        tok,
        "{%- for m in messages -%}{%- if m.content == 'bad' -%}{{- raise_exception('bad content') -}}{%- endif -%}"
        + TURN
        + "{%- endfor -%}"
        + GENERATION_PROMPT,
    )
    chat = Chat(strict, [{"role": "user", "content": "Question 0?"}])
    plain_turns(chat, 4)
    chat.answer("ok<|im_end|>", {"role": "assistant", "content": "ok"})
    with pytest.raises(BridgeError) as info:
        chat.send([{"role": "user", "content": "bad"}])
    assert info.value.reason == "template_error" and "bad content" in info.value.detail


def test_boundary_drift_is_still_detected_after_verification(tok) -> None:
    class Merging(WithTemplate):
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            ids = super().encode(text)
            if text.startswith("<|im_end|>\n<|im_start|>user\nmerge"):  # "\n" and "<|im_start|>" become one token
                return [ids[0], 0, *ids[3:]]
            return ids

    chat = Chat(Merging(tok, tok.chat_template), [{"role": "user", "content": "Question 0?"}])
    plain_turns(chat, 4)
    chat.answer("ok<|im_end|>", {"role": "assistant", "content": "ok"})
    with pytest.raises(BridgeError) as info:
        chat.send([{"role": "user", "content": "merge"}])
    assert info.value.reason == "boundary_drift"


def test_the_stateless_cache_counts_tail_renders(tok) -> None:
    cache = TurnCache(StatelessPolicy(), parse=CompletionParser(tok, tool_parser=None, reasoning_parser=None).parse)
    stats = BridgeStats()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Question 0?"}]
    prompt = encode(tok, render_text(tok, messages))
    for i in range(5):
        completion = encode(tok, f"Answer {i}.<|im_end|>")
        cache.remember("s", normalize_messages(messages), result(prompt, completion))
        messages = [*messages, {"role": "assistant", "content": f"Answer {i}."}, {"role": "user", "content": f"Q{i}"}]
        extension = cache.prompt_ids(tok, "s", messages, tools=None, chat_template_kwargs=None, stats=stats)
        assert extension is not None
        ids = extension.ids
        assert ids == encode(tok, render_text(tok, messages))
        prompt = ids
    assert stats.tail_renders == 3 and stats.full_renders == {"short_history": 1, "verify": 1}


# -- property: tail rendering never differs from the full method ------------------------------------------

words = st.from_regex(r"[A-Za-z][A-Za-z0-9 .,!?]{0,11}", fullmatch=True)


@st.composite
def conversations(draw: Any) -> dict[str, Any]:
    system = draw(st.booleans())
    turns = []
    for _ in range(draw(st.integers(3, 9))):
        kind = draw(st.sampled_from(["plain", "think", "tool", "tools2"]))
        body = draw(words)
        user = draw(words)
        turns.append((kind, body, user))
    return {"system": system, "tools": draw(st.booleans()), "turns": turns}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=conversations())
def test_tail_renders_equal_the_full_method_on_random_conversations(tok, case) -> None:
    clear_template_cache()
    first = [{"role": "user", "content": "Start."}]
    if case["system"]:
        first.insert(0, {"role": "system", "content": "You are terse."})
    tools = TOOLS if case["tools"] else None
    chat = Chat(tok, first, tools=tools)
    for kind, body, user in case["turns"]:
        if kind == "plain":
            chat.answer(body + "<|im_end|>", {"role": "assistant", "content": body})
            new = [{"role": "user", "content": user}]
        elif kind == "think":
            chat.answer(f"<think>\n{user}\n</think>\n\n{body}<|im_end|>", {"role": "assistant", "content": body})
            new = [{"role": "user", "content": user}]
        else:
            chat.answer(CALL_TEXT + "<|im_end|>", {"role": "assistant", "content": "", "tool_calls": [CALL]})
            new = [{"role": "tool", "content": body}] + (
                [{"role": "tool", "content": user}] if kind == "tools2" else []
            )
        try:
            chat.send(new)
        except BridgeError as exc:  # only a boundary the tokenizer merges; the full method must agree
            assert exc.reason == "boundary_drift", exc  # noqa: PT017 - hypothesis needs the branch
            with pytest.raises(BridgeError, match="boundary_drift"):
                extend_prompt(
                    tok,
                    history=chat.history,
                    previous=chat.previous,  # type: ignore[arg-type]
                    new_messages=new,
                    assistant_message=chat.assistant,
                    tools=tools,
                    tail_render=False,
                )
            return
        assert chat.ids == chat.full_method, json.dumps(case)
    assert sum(chat.stats.full_renders.values()) + chat.stats.tail_renders == len(case["turns"])
