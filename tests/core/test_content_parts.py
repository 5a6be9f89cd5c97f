"""OpenAI content parts: the template sees what the engine's chat route would hand it (vLLM's rule: text parts
joined with "\\n" for templates that read content as a string, the text parts for templates that iterate over
content), on the stateless and multi-turn paths too; media parts are refused before anything is sent. Never an
empty turn."""

from __future__ import annotations

import copy
from typing import Any

import httpx
import pytest

from backends_core import Client, ClientConfig, SamplingParams
from backends_core.errors import InvalidRequestError
from backends_core.multiturn.extension import clear_template_cache
from backends_core.multiturn.messages import normalize_message
from backends_core.multiturn.rendering import content_format, load_tokenizer, render_text
from backends_testkit.engine import ReferenceEngine
from backends_testkit.reference.emulator import ReferenceEmulator

HELLO = [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}]


@pytest.fixture(autouse=True)
def _fresh_verdicts():
    clear_template_cache()
    yield
    clear_template_cache()


@pytest.fixture
def tokenizer(tiny_models) -> Any:
    return load_tokenizer(str(tiny_models.dense))


@pytest.fixture
async def client(tiny_models):
    engine = ReferenceEngine(tiny_models.dense, seed=0)
    emulator = ReferenceEmulator(engine)
    sent: list[httpx.Request] = []

    async def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("generate"):
            sent.append(request)
        return await emulator.handle(request)

    config = ClientConfig(
        backend="reference", base_url="http://ref", model="tiny-qwen3", tokenizer=str(tiny_models.dense)
    )
    async with Client(config, transport=httpx.MockTransport(handle)) as c:
        c.sent = sent  # type: ignore[attr-defined]
        yield c
    await engine.aclose()


def test_a_text_part_renders_its_words_not_an_empty_turn(tokenizer) -> None:
    text = render_text(tokenizer, HELLO)
    assert text == render_text(tokenizer, [{"role": "user", "content": "hello there"}])
    assert "hello there" in text


def test_parts_are_joined_with_newlines_for_a_string_template_as_vllm_does(tokenizer) -> None:
    assert content_format(tokenizer) == "string"
    parts = [
        "plain",
        {"type": "text", "text": "a"},
        {"type": "text", "text": None},  # skipped, as vLLM skips a text part without text
        {"type": "input_text", "text": "b"},
        {"type": "output_text", "text": "c"},
        {"type": "refusal", "refusal": "d"},
        {"type": "thinking", "thinking": "e"},
    ]
    text = render_text(tokenizer, [{"role": "user", "content": parts}])
    assert "<|im_start|>user\nplain\na\nb\nc\nd\ne<|im_end|>" in text
    system = render_text(
        tokenizer,
        [
            {
                "role": "system",
                "content": [{"type": "text", "text": "be brief"}],
            },
            *HELLO,
        ],
    )
    assert system.startswith("<|im_start|>system\nbe brief<|im_end|>")


def test_a_template_that_iterates_over_content_gets_the_text_parts(tokenizer) -> None:
    iterating = copy.copy(tokenizer)
    iterating.chat_template = (
        "{% for m in messages %}{% if m.content is string %}<{{ m.content }}>"
        "{% else %}{% for part in m.content %}[{{ part.type }}:{{ part.text }}]{% endfor %}{% endif %}{% endfor %}"
    )
    assert content_format(iterating) == "openai"
    parts = [{"type": "input_text", "text": "a"}, {"type": "text", "text": "b"}]
    assert render_text(iterating, [{"role": "user", "content": parts}]) == "[text:a][text:b]"
    tool = [{"role": "tool", "content": parts}]  # tool results are flattened for every template, as vLLM does
    assert render_text(iterating, tool) == "<a\nb>"
    macro = copy.copy(tokenizer)
    macro.chat_template = (
        "{% macro show(content) %}{% for item in content %}{{ item.text }}{% endfor %}{% endmacro %}"
        "{% for m in messages %}{{ show(m.content) }}{% endfor %}"
    )
    assert content_format(macro) == "openai"
    with_generation = copy.copy(tokenizer)
    with_generation.chat_template = (
        "{% for m in messages %}{% generation %}{% for p in m['content'] %}{{ p.text }}{% endfor %}"
        "{% endgeneration %}{% endfor %}"
    )
    assert content_format(with_generation) == "openai"


@pytest.mark.parametrize(
    ("part", "message"),
    [
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}, "not an encoded image"),
        ({"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}}, "part of type 'input_audio'"),
        ({"type": "video_url", "video_url": {"url": "x"}}, "part of type 'video_url'"),
        ({"text": "no type"}, "has no string 'type'"),
        (7, "must be a content part object, got int"),
        ({"type": "text", "text": 3}, "whose 'text' is not a string"),
    ],
)
async def test_parts_that_cannot_reach_the_template_as_text_are_refused_before_sending(
    client: Client, part: Any, message: str
) -> None:
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]
    with pytest.raises(InvalidRequestError, match=rf"messages\[1\]\.content\[1\][ .].*{message}"):
        await client.generate(messages=messages, sampling=SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match=r"messages\[1\]\.content\[1\]"):
        await client.check_tokenizer(messages)
    with pytest.raises(InvalidRequestError, match=r"messages\[1\]\.content\[1\]"):
        await client.generate(messages=messages, session="s", sampling=SamplingParams(max_tokens=16))
    assert client.sent == []  # type: ignore[attr-defined]


async def test_generate_sends_the_words_of_the_parts(client: Client) -> None:
    result = await client.generate(messages=HELLO, sampling=SamplingParams(max_tokens=2, seed=1))
    assert list(result.prompt_ids) == client.render([{"role": "user", "content": "hello there"}])
    assert "hello there" in client.tokenizer.decode(list(result.prompt_ids))
    check = await client.check_tokenizer(HELLO)  # the reference server renders parts as the client does
    assert check.match


def test_the_normal_form_of_text_parts_is_one_canonical_part_list() -> None:
    a = normalize_message({"role": "user", "content": [{"type": "input_text", "text": "x"}, "y"]})
    b = normalize_message({"role": "user", "content": ({"text": "x", "type": "text"}, {"type": "text", "text": "y"})})
    assert a == b == {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}
    with pytest.raises(InvalidRequestError, match="part of type 'input_audio'"):
        normalize_message({"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AA=="}}]})
    with pytest.raises(InvalidRequestError, match=r"content\[0\]\.image_url\.url has an image URL that is not"):
        normalize_message({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]})


async def test_the_stateless_path_reuses_a_turn_whose_parts_are_resent_in_another_text_form(client: Client) -> None:
    sampling = SamplingParams(max_tokens=4, seed=3)
    first = await client.generate(messages=HELLO, sampling=sampling, session="s")
    reply = {
        "role": "assistant",
        "content": client.tokenizer.decode(list(first.completion_ids), skip_special_tokens=True),
    }
    resent = [{"role": "user", "content": [{"type": "input_text", "text": "hello there"}]}]
    follow_up = {"role": "user", "content": [{"type": "text", "text": "and"}, {"type": "text", "text": "then?"}]}
    second = await client.generate(messages=[*resent, reply, follow_up], sampling=sampling, session="s")
    assert second.prompt_ids[: len(first.token_ids)] == first.token_ids
    assert "and\nthen?" in client.tokenizer.decode(list(second.prompt_ids[len(first.token_ids) :]))
    assert client.bridge_stats.successes == 1


async def test_a_conversation_sends_parts_on_every_turn(client: Client) -> None:
    conv = client.conversation()
    sampling = SamplingParams(max_tokens=4, seed=5)
    first = await conv.send(HELLO, sampling=sampling)
    second = await conv.send(
        [{"role": "user", "content": [{"type": "text", "text": "more please"}]}], sampling=sampling
    )
    assert second.prompt_ids[: len(first.token_ids)] == first.token_ids
    assert "more please" in client.tokenizer.decode(list(second.prompt_ids[len(first.token_ids) :]))
