"""The default render's prefix cache: a batch's shared prefix is tokenized once, and the ids are always those of
the whole text tokenized in one piece (the render without the cache)."""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from backends_core import Client, ClientConfig, RenderError
from backends_core.hookspecs import hookimpl
from backends_core.multiturn.prefix_cache import PrefixRenderCache
from backends_core.multiturn.rendering import encode, render_text

TOOLS = [
    {
        "type": "function",
        "function": {"name": "ls", "description": "list files", "parameters": {"type": "object", "properties": {}}},
    }
]

# Llama-3 style: a BOS, a system block that always exists and carries today's date and the tools, headers
# glued to the previous turn's end (no newline between turns)
LLAMA_STYLE = (
    "{{- bos_token if bos_token else '<|endoftext|>' -}}"
    "{%- if messages[0].role == 'system' -%}{%- set system = messages[0].content -%}"
    "{%- set rest = messages[1:] -%}{%- else -%}{%- set system = '' -%}{%- set rest = messages -%}{%- endif -%}"
    r"{{- '<|im_start|>system\n\nCutting Knowledge Date: December 2023\nToday Date: ' -}}"
    "{{- date_string if date_string is defined else strftime_now('%d %b %Y') -}}"
    r"{%- if tools -%}{{- '\nYou can call: ' + (tools | map(attribute='function.name') | join(', ')) -}}"
    "{%- endif -%}"
    r"{{- '\n\n' + system + '<|im_end|>' -}}"
    r"{%- for m in rest -%}{{- '<|im_start|>' + m.role + '\n\n' + (m.content | trim) + '<|im_end|>' -}}"
    "{%- endfor -%}"
    r"{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n\n' -}}{%- endif -%}"
)
# the system block says how long the last message is: the prefix depends on the last message's content
LAST_LENGTH = (
    r"{{- '<|im_start|>system\n' + messages[0].content + ' ('"
    r" + (messages[-1].content | length | string) + ')<|im_end|>\n' -}}"
    r"{%- for m in messages[1:] -%}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}{%- endfor -%}"
    r"{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)
# the system block carries the time to the microsecond: no two renders share it
CLOCK = (
    r"{{- '<|im_start|>system\nnow ' + strftime_now('%H:%M:%S.%f') + '<|im_end|>\n' -}}"
    r"{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}{%- endfor -%}"
    r"{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)


@pytest.fixture(scope="module")
def tok(tiny_models: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_models.dense), local_files_only=True)


@pytest.fixture(scope="module")
def templated(tiny_models: Any) -> Any:
    """A fresh copy of the tiny tokenizer with another chat template (the shared one is never changed)."""
    from transformers import AutoTokenizer

    made: dict[str, Any] = {}

    def make(template: str) -> Any:
        if template not in made:
            made[template] = AutoTokenizer.from_pretrained(str(tiny_models.dense), local_files_only=True)
            made[template].chat_template = template
        return made[template]

    return make


class Counting:
    """A tokenizer that counts its renders and encodes (everything else is the tiny tokenizer's); ``lead``
    puts an id before every encoded text, as a tokenizer that marks the start of each piece would."""

    def __init__(self, tok: Any, *, lead: list[int] | None = None, added: bool = True) -> None:
        self._tok = tok
        self.chat_template = tok.chat_template
        if added:
            self.added_tokens_decoder = tok.added_tokens_decoder
        self.lead = lead or []
        self.renders = 0
        self.encodes: list[str] = []

    def apply_chat_template(self, messages: Any, **kw: Any) -> Any:
        self.renders += 1
        return self._tok.apply_chat_template(messages, **kw)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.encodes.append(text)
        return [*self.lead, *self._tok.encode(text, add_special_tokens=add_special_tokens)]


def full(tokenizer: Any, messages: Any, **kw: Any) -> list[int]:
    return encode(tokenizer, render_text(tokenizer, messages, **kw))


def rows(prefix: list[dict[str, Any]], lasts: list[Any]) -> list[list[dict[str, Any]]]:
    return [[*prefix, {"role": "user", "content": last}] for last in lasts]


SYSTEM = {"role": "system", "content": "You are a careful assistant. Answer in one line."}
FEW_SHOT = [
    SYSTEM,
    {"role": "user", "content": "2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "3 * 3?"},
    {"role": "assistant", "content": "9"},
]
LASTS = ["What is 7 + 5?", "  padded question  ", "Why?\n\nExplain.", "<|im_end|> in the text", "日本語で答えて", "x"]
SHAPES = {
    "system_user": ([SYSTEM], None, None),
    "system_user_tools": ([SYSTEM], TOOLS, None),
    "user_tools": ([], TOOLS, None),
    "few_shot": (FEW_SHOT, None, None),
    "few_shot_no_thinking": (FEW_SHOT, None, {"enable_thinking": False}),
}


@pytest.mark.parametrize("template", ["tiny", "llama_style"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_ids_equal_the_whole_text_tokenized_and_the_prefix_is_tokenized_once(
    tok: Any, templated: Any, template: str, shape: str
) -> None:
    tokenizer = tok if template == "tiny" else templated(LLAMA_STYLE)
    prefix, tools, kwargs = SHAPES[shape]
    cache = PrefixRenderCache()
    for messages in rows(prefix, LASTS):
        ids = cache.render(tokenizer, messages, tools=tools, chat_template_kwargs=kwargs)
        assert ids == full(tokenizer, messages, tools=tools, chat_template_kwargs=kwargs), messages[-1]
    assert cache.stats.full_renders == {"verify": 1}
    assert cache.stats.prefix_renders == len(LASTS) - 1


def test_the_bench_chat_shares_its_five_first_messages(tok: Any) -> None:
    chat = [*FEW_SHOT, {"role": "user", "content": "Last question?"}]
    cache = PrefixRenderCache()
    counting = Counting(tok)
    first = cache.render(counting, chat)
    assert first == full(tok, chat)
    assert counting.renders == 2  # the prompt, and once the probe that finds the prefix
    counting.renders, counting.encodes = 0, []
    for last in LASTS:
        messages = [*FEW_SHOT, {"role": "user", "content": last}]
        assert cache.render(counting, messages) == full(tok, messages)
    assert counting.renders == len(LASTS)  # one render per prompt
    # only the last user turn and the generation prompt are tokenized
    assert counting.encodes == [f"user\n{last}<|im_end|>\n<|im_start|>assistant\n" for last in LASTS]


def test_no_generation_prompt_and_an_assistant_last_message(tok: Any) -> None:
    cache = PrefixRenderCache()
    for answer in ("4", "four", "<think>\nsum\n</think>\n\n4"):
        messages = [SYSTEM, {"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": answer}]
        for gen in (True, False):
            ids = cache.render(tok, messages, add_generation_prompt=gen)
            assert ids == full(tok, messages, add_generation_prompt=gen)
    # the first answers share the template's empty think block; a reasoning answer shortens the prefix once
    assert cache.stats.full_renders == {"verify": 2, "prefix_changed": 2}
    assert cache.stats.prefix_renders == 2
    for answer in ("5", "<think>\nagain\n</think>\n\n5"):
        messages = [SYSTEM, {"role": "user", "content": "2 + 3?"}, {"role": "assistant", "content": answer}]
        assert cache.render(tok, messages) == full(tok, messages)
    assert cache.stats.prefix_renders == 2  # another user question: another prefix
    for answer in ("6", "<think>\nonce more\n</think>\n\n6"):
        messages = [SYSTEM, {"role": "user", "content": "2 + 3?"}, {"role": "assistant", "content": answer}]
        assert cache.render(tok, messages) == full(tok, messages)
    assert cache.stats.prefix_renders == 4 and cache.stats.full_renders["prefix_changed"] == 3


def test_content_parts_tool_results_and_tool_calls_render_as_without_the_cache(tok: Any) -> None:
    call = {"type": "function", "function": {"name": "ls", "arguments": {}}}
    head = [SYSTEM, {"role": "user", "content": "files?"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    cache = PrefixRenderCache()
    for i in range(4):
        for last in (
            {"role": "tool", "content": f"a{i}.py"},
            {"role": "user", "content": [{"type": "text", "text": f"part {i}"}, {"type": "text", "text": "two"}]},
        ):
            messages = [*head, last]
            assert cache.render(tok, messages, tools=TOOLS) == full(tok, messages, tools=TOOLS)
    assert cache.stats.prefix_renders == 6


_text = st.lists(
    st.sampled_from([*"ab \n\t.é日", "<|im_end|>", "<|im_start|>", "<think>", "</think>", "  "]), max_size=12
).map("".join)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(system=_text, shots=st.lists(_text, max_size=4), lasts=st.lists(_text, min_size=1, max_size=4))
def test_any_contents_give_the_ids_of_the_whole_text(
    tok: Any, templated: Any, system: str, shots: list[str], lasts: list[str]
) -> None:
    prefix: list[dict[str, Any]] = [{"role": "system", "content": system}]
    prefix += [{"role": ("user", "assistant")[i % 2], "content": s} for i, s in enumerate(shots)]
    if len(prefix) % 2 == 0:
        prefix.append({"role": "assistant", "content": "ok"})
    for tokenizer, kwargs in ((tok, None), (templated(LLAMA_STYLE), {"date_string": "01 Jan 2026"})):
        cache = PrefixRenderCache()
        for messages in rows(prefix, lasts * 2):
            expected = full(tokenizer, messages, chat_template_kwargs=kwargs)
            assert cache.render(tokenizer, messages, chat_template_kwargs=kwargs) == expected


def test_a_tokenizer_that_cannot_be_split_is_found_once_per_shape_then_tokenized_whole(tok: Any) -> None:
    leading = Counting(tok, lead=[1888])  # every encoded piece starts with an extra id
    cache = PrefixRenderCache()
    for messages in rows([SYSTEM], LASTS):
        assert cache.render(leading, messages) == [1888, *full(tok, messages)]
    assert cache.stats.full_renders == {"mismatch": 1, "not_splittable": len(LASTS) - 1}
    assert cache.stats.prefix_renders == 0 and len(cache) == 0
    # the verdict is per shape: another shape is tried once
    cache.render(leading, rows(FEW_SHOT, ["q"])[0])
    assert cache.stats.full_renders["mismatch"] == 2
    leading.renders = 0
    cache.render(leading, rows(FEW_SHOT, ["r"])[0])
    assert leading.renders == 1  # no probe for a shape known not to split


def _metaspace_tokenizer() -> Any:
    """A sentencepiece-style tokenizer (Metaspace, ``prepend_scheme="first"``): only the start of the whole text
    gets the word marker, so a piece tokenized on its own starts differently."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list("abcdefghijklmnopqrstuvwxyz?.!\n:0123456789")
    vocab = {"<unk>": 0}
    for piece in ["\u2581", *chars, *("\u2581" + ch for ch in chars)]:
        vocab.setdefault(piece, len(vocab))
    model = models.BPE(vocab=vocab, merges=[("\u2581", ch) for ch in chars], unk_token="<unk>")
    backend = Tokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in ("<|im_start|>", "<|im_end|>")])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    tok.chat_template = (
        r"{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}{%- endfor -%}"
        r"{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
    )
    return tok


def test_a_sentencepiece_style_tokenizer_is_found_not_splittable_and_tokenized_whole() -> None:
    tok = _metaspace_tokenizer()
    cache = PrefixRenderCache()
    for last in ("hi there", "what now?", "a"):
        messages = [{"role": "system", "content": "be nice"}, {"role": "user", "content": last}]
        assert cache.render(tok, messages) == full(tok, messages)
    assert cache.stats.full_renders == {"mismatch": 1, "not_splittable": 2}


def test_a_prefix_that_depends_on_the_last_message_is_tokenized_whole_and_counted(templated: Any) -> None:
    tokenizer = templated(LAST_LENGTH)
    cache = PrefixRenderCache()
    for last in ("short", "a longer one", "same length!", "a longer two"):
        messages = [SYSTEM, {"role": "user", "content": last}]
        assert cache.render(tokenizer, messages) == full(tokenizer, messages)
    # cut before the system content: the rest is tokenized, the length is in it
    assert cache.stats.prefix_renders == 3


def test_a_template_that_renders_the_time_is_never_split_and_counted(templated: Any) -> None:
    tokenizer = templated(CLOCK)
    cache = PrefixRenderCache()
    for last in LASTS:
        messages = [{"role": "user", "content": "fixed"}, {"role": "assistant", "content": "ok"}]
        messages.append({"role": "user", "content": last})
        ids = cache.render(tokenizer, messages)
        assert tokenizer.decode(ids).startswith("<|im_start|>system\nnow ")
    # the prefix is what every render shares (the probe's clock differs already): the clock is always tokenized
    assert cache.stats.full_renders["verify"] == 1
    assert cache.stats.full_renders["verify"] + cache.stats.full_renders["prefix_changed"] < len(LASTS)
    [entry] = next(iter(cache._tokenizers.values())).entries.values()
    assert entry.text == "<|im_start|>"


def test_templates_dates_tools_and_variables_key_separate_prefixes(templated: Any, tok: Any) -> None:
    llama = templated(LLAMA_STYLE)
    cache = PrefixRenderCache()
    for kwargs in ({"date_string": "01 Jan 2026"}, {"date_string": "02 Jan 2026"}, None):
        for tools in (None, TOOLS):
            for messages in rows([SYSTEM], LASTS[:2]):
                expected = full(llama, messages, tools=tools, chat_template_kwargs=kwargs)
                assert cache.render(llama, messages, tools=tools, chat_template_kwargs=kwargs) == expected
    assert cache.stats.full_renders == {"verify": 6} and cache.stats.prefix_renders == 6
    # the same messages with another tokenizer's template: its own prefix
    for messages in rows([SYSTEM], LASTS[:2]):
        assert cache.render(tok, messages) == full(tok, messages)
    assert cache.stats.full_renders == {"verify": 7}


def test_what_cannot_be_keyed_or_cut_is_tokenized_whole_and_counted(tok: Any) -> None:
    cache = PrefixRenderCache()
    messages = rows([SYSTEM], ["q"])[0]
    opaque = object()  # a template variable the template ignores, but not JSON
    assert cache.render(tok, messages, chat_template_kwargs={"unused": opaque}) == full(tok, messages)
    no_added = Counting(tok, added=False)  # no added tokens to cut at
    assert cache.render(no_added, messages) == full(tok, messages)
    assert cache.stats.full_renders == {"uncacheable": 1, "no_boundary": 1}


def test_the_cache_is_bounded_least_recently_used_first(tok: Any) -> None:
    cache = PrefixRenderCache(max_entries=2)
    systems = [{"role": "system", "content": f"System prompt number {i}."} for i in range(3)]
    for system in (systems[0], systems[1], systems[0], systems[2]):  # systems[1] is the least recently used
        for messages in rows([system], ["q1", "q2"]):
            assert cache.render(tok, messages) == full(tok, messages)
    assert len(cache) == 2
    assert cache.stats.full_renders == {"verify": 3}
    cache.render(tok, rows([systems[1]], ["q3"])[0])
    assert cache.stats.full_renders == {"verify": 4}
    cache.clear()
    assert len(cache) == 0
    with pytest.raises(ValueError, match="max_entries"):
        PrefixRenderCache(max_entries=0)


def test_the_cache_keeps_none_of_the_callers_objects_and_returns_fresh_lists(tok: Any) -> None:
    cache = PrefixRenderCache()
    system = dict(SYSTEM)
    messages = [system, {"role": "user", "content": "q"}]
    first = cache.render(tok, messages)
    first.append(-1)
    system["content"] = "Changed after the call."
    changed = [system, {"role": "user", "content": "q"}]
    assert cache.render(tok, changed) == full(tok, changed)
    assert cache.render(tok, rows([SYSTEM], ["q"])[0]) == full(tok, rows([SYSTEM], ["q"])[0])
    assert cache.stats.full_renders == {"verify": 2} and cache.stats.prefix_renders == 1


def test_the_switch_turns_it_off_and_errors_are_the_renders(tok: Any) -> None:
    cache = PrefixRenderCache(enabled=False)
    messages = rows([SYSTEM], ["q"])[0]
    assert cache.render(tok, messages) == full(tok, messages)
    assert cache.stats.full_renders == {"disabled": 1} and len(cache) == 0
    cache.enabled = True
    cache.render(tok, messages)
    with pytest.raises(RenderError, match="messages is empty"):
        cache.render(tok, [])
    with pytest.raises(RenderError, match=r"messages\[1\] must be a mapping"):
        cache.render(tok, [SYSTEM, "q"])  # type: ignore[list-item]


class Tiny:
    @hookimpl
    async def post_generate(self, server: Any, request: Any) -> Any:
        raise NotImplementedError

    @hookimpl
    def parse_response(self, raw: Any, request: Any, server_url: str) -> Any:
        raise NotImplementedError


class OwnRender(Tiny):
    @hookimpl
    def render(self, messages: Any) -> list[int]:
        return [len(messages)]


async def test_the_client_renders_through_its_cache_unless_the_backend_renders(tok: Any) -> None:
    config = ClientConfig(backend="tiny", base_url="http://s1")
    async with Client(config, plugin=Tiny(), tokenizer=tok) as client:
        for messages in rows([SYSTEM], LASTS):
            assert client.render(messages) == full(tok, messages)
        assert client.render_cache.stats.prefix_renders == len(LASTS) - 1
        client.render_cache.enabled = False
        assert client.render(messages) == full(tok, messages)
        assert client.render_cache.stats.full_renders == {"verify": 1, "disabled": 1}
    async with Client(config, plugin=OwnRender(), tokenizer=tok) as client:
        assert client.render(rows([SYSTEM], ["q"])[0]) == [2]
        assert client.render_cache.stats.as_dict() == {"prefix_renders": 0, "full_renders": {}}
