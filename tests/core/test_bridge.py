"""Multi-turn bridging on the tiny Qwen3-like template: exact ids reused, only new messages rendered."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from backends_core import BridgeError, GenerateResult, extend_prompt
from backends_core.multiturn.rendering import encode, load_tokenizer, render_text

TOOLS = [
    {
        "type": "function",
        "function": {"name": "ls", "description": "list files", "parameters": {"type": "object", "properties": {}}},
    }
]


@pytest.fixture(scope="module")
def tok(tiny_models):
    return load_tokenizer(str(tiny_models.dense))


def turn(tok, messages, completion_text, *, finish="stop", tools=None, kwargs=None) -> tuple[list, GenerateResult]:
    prompt = encode(tok, render_text(tok, messages, tools=tools, chat_template_kwargs=kwargs))
    completion = encode(tok, completion_text)
    result = GenerateResult(
        prompt_ids=tuple(prompt),
        completion_ids=tuple(completion),
        logprobs=np.zeros(len(completion), np.float32),
        finish_reason=finish,
    )
    return list(messages), result


def full_render(tok, messages, tools=None) -> list[int]:
    return encode(tok, render_text(tok, messages, tools=tools))


def test_a_plain_turn_extends_exactly_like_a_full_render(tok) -> None:
    history, prev = turn(tok, [{"role": "user", "content": "hello there"}], "Hi! How can I help?<|im_end|>")
    new = [{"role": "user", "content": "Tell me a joke."}]
    ids = extend_prompt(tok, history=history, previous=prev, new_messages=new)
    assert ids[: len(prev.token_ids)] == list(prev.token_ids)
    assert (
        tok.decode(ids[len(prev.token_ids) :])
        == "\n<|im_start|>user\nTell me a joke.<|im_end|>\n<|im_start|>assistant\n"
    )
    # with nothing for a re-render to lose, the bridge agrees with rendering everything from scratch
    assert ids == full_render(tok, [*history, {"role": "assistant", "content": "Hi! How can I help?"}, *new])


def test_reasoning_is_kept_verbatim_where_a_re_render_would_drop_it(tok) -> None:
    history, prev = turn(tok, [{"role": "user", "content": "2+2?"}], "<think>\nadd them\n</think>\n\n4<|im_end|>")
    new = [{"role": "user", "content": "and 3+3?"}]
    ids = extend_prompt(tok, history=history, previous=prev, new_messages=new)
    assert ids[: len(prev.token_ids)] == list(prev.token_ids)
    rerender = full_render(tok, [*history, {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"}, *new])
    assert "add them" in tok.decode(ids) and "add them" not in tok.decode(rerender)


def test_tool_results_are_grouped_by_the_template(tok) -> None:
    calls = [{"type": "function", "function": {"name": "ls", "arguments": {}}}]
    history, prev = turn(
        tok,
        [{"role": "user", "content": "files?"}],
        '<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call><|im_end|>',
        tools=TOOLS,
    )
    new = [{"role": "tool", "content": "a.py"}, {"role": "tool", "content": "b.py"}]
    ids = extend_prompt(
        tok,
        history=history,
        previous=prev,
        new_messages=new,
        tools=TOOLS,
        assistant_message={"role": "assistant", "content": "", "tool_calls": calls},
    )
    delta = tok.decode(ids[len(prev.token_ids) :])
    assert delta == (
        "\n<|im_start|>user\n<tool_response>\na.py\n</tool_response>\n<tool_response>\nb.py\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_truncated_turn_is_closed_with_the_templates_end_of_turn(tok) -> None:
    history, prev = turn(tok, [{"role": "user", "content": "essay"}], "Once upon a", finish="length")
    ids = extend_prompt(tok, history=history, previous=prev, new_messages=[{"role": "user", "content": "go on"}])
    assert tok.decode(ids[len(prev.token_ids) :]).startswith("<|im_end|>\n<|im_start|>user\ngo on")


def test_a_turn_truncated_inside_think_closes_the_think_block_first(tok) -> None:
    history, prev = turn(tok, [{"role": "user", "content": "hard"}], "<think>\nlet me see", finish="length")
    ids = extend_prompt(tok, history=history, previous=prev, new_messages=[{"role": "user", "content": "answer?"}])
    assert tok.decode(ids[len(prev.token_ids) :]).startswith("\n</think>\n\n<|im_end|>\n<|im_start|>user\n")


def test_a_foreign_stop_token_is_refused_not_papered_over(tok) -> None:
    history, prev = turn(tok, [{"role": "user", "content": "hi"}], "bye<|endoftext|>")
    with pytest.raises(BridgeError) as info:
        extend_prompt(tok, history=history, previous=prev, new_messages=[{"role": "user", "content": "x"}])
    assert info.value.reason == "foreign_stop_token"
    assert "<|endoftext|>" in tok.decode([prev.completion_ids[-1]])


def test_a_turn_stopped_on_the_models_second_end_token_is_closed_and_extended(tok) -> None:
    # Qwen checkpoints end samples on <|endoftext|> as well as <|im_end|>: the engine says which token stopped it
    history, prev = turn(tok, [{"role": "user", "content": "hi"}], "bye<|endoftext|>")
    stopped = attrs.evolve(prev, stop_reason=prev.completion_ids[-1])
    ids = extend_prompt(tok, history=history, previous=stopped, new_messages=[{"role": "user", "content": "x"}])
    assert ids[: len(prev.token_ids)] == list(prev.token_ids)  # the sampled stop token stays
    assert (
        tok.decode(ids[len(prev.token_ids) :]) == "<|im_end|>\n<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
    )


def test_an_empty_new_turn_is_refused(tok) -> None:
    history, prev = turn(tok, [{"role": "user", "content": "hi"}], "yo<|im_end|>")
    with pytest.raises(BridgeError, match="empty_turn"):
        extend_prompt(tok, history=history, previous=prev, new_messages=[])


def test_a_template_that_does_not_render_assistant_content_cannot_be_bridged(tok) -> None:
    class Forgetful:
        chat_template = "x"

        def apply_chat_template(self, messages, **kw):
            return "".join(m["role"] for m in messages if m["role"] != "assistant")

        def encode(self, text, add_special_tokens=False):
            return tok.encode(text, add_special_tokens=False)

    history, prev = turn(tok, [{"role": "user", "content": "hi"}], "yo<|im_end|>")
    with pytest.raises(BridgeError) as info:
        extend_prompt(Forgetful(), history=history, previous=prev, new_messages=[{"role": "user", "content": "x"}])
    assert info.value.reason == "sentinel_missing"


def test_boundary_drift_is_detected(tok) -> None:
    class Merging:
        """A tokenizer whose encoding of the boundary differs from the pieces' (a BPE merge across it)."""

        chat_template = "x"

        def apply_chat_template(self, messages, **kw):
            return tok.apply_chat_template(messages, **kw)

        def encode(self, text, add_special_tokens=False):
            ids = tok.encode(text, add_special_tokens=False)
            if text.startswith("<|im_end|>\n<|im_start|>"):  # "\n" and "<|im_start|>" become one token
                return [ids[0], 0, *ids[3:]]
            return ids

    history, prev = turn(tok, [{"role": "user", "content": "hi"}], "yo<|im_end|>")
    with pytest.raises(BridgeError) as info:
        extend_prompt(Merging(), history=history, previous=prev, new_messages=[{"role": "user", "content": "x"}])
    assert info.value.reason == "boundary_drift"
