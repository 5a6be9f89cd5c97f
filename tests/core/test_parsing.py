"""Completions parsed back into assistant messages: the built-in parsers, parser plugins and their selection,
and the round trip through the chat template."""

from __future__ import annotations

import json
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings

from backends_core import Client, ClientConfig, ConfigError, GenerateResult, ParserNotFoundError, hookimpl
from backends_core.errors import InvalidRequestError
from backends_core.multiturn.messages import normalize_message
from backends_core.multiturn.rendering import encode, load_tokenizer, render_text
from backends_core.parsing import ParsedToolCall

TOOLS = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object", "properties": {}}}}]
USER = [{"role": "user", "content": "list the files"}]


@pytest.fixture
def tok(tiny_models: Any) -> Any:
    return load_tokenizer(str(tiny_models.dense))


@pytest.fixture
def make_client(tiny_models: Any) -> Any:
    def make(tool_parser: str | None = "hermes", reasoning_parser: str | None = "qwen3", **kwargs: Any) -> Client:
        config = ClientConfig(
            backend="reference",
            base_url="http://ref",
            tokenizer=str(tiny_models.dense),
            tool_parser=tool_parser,
            reasoning_parser=reasoning_parser,
        )
        return Client(config, **kwargs)

    return make


def completion(
    tok: Any, text: str, *, prompt: str | None = None, finish: str = "stop", stop_reason: int | None = None
) -> GenerateResult:
    prompt_ids = encode(tok, prompt if prompt is not None else render_text(tok, USER))
    ids = encode(tok, text)
    return GenerateResult(
        prompt_ids=tuple(prompt_ids),
        completion_ids=tuple(ids),
        logprobs=np.zeros(len(ids), np.float32),
        finish_reason=finish,  # type: ignore[arg-type]
        stop_reason=stop_reason,
    )


# -- the built-in parsers -------------------------------------------------------------------------------------


def test_reasoning_content_and_tool_calls_come_back_in_openai_form(make_client: Any, tok: Any) -> None:
    client = make_client()
    text = (
        "<think>\nfirst ls, then cat\n</think>\n\nLet me look.\n"
        '<tool_call>\n{"name": "ls", "arguments": {"path": "src", "deep": {"all": [1, "é"]}}}\n</tool_call>\n'
        '<tool_call>\n{"name": "cat", "arguments": {"file":"a.py"}}\n</tool_call><|im_end|>'
    )
    message = client.parse_completion(completion(tok, text))
    assert message == {
        "role": "assistant",
        "content": "Let me look.",
        "reasoning_content": "first ls, then cat",
        "tool_calls": [
            {
                "id": message["tool_calls"][0]["id"],
                "type": "function",
                "function": {"name": "ls", "arguments": '{"path": "src", "deep": {"all": [1, "é"]}}'},
            },
            {
                "id": message["tool_calls"][1]["id"],
                "type": "function",
                "function": {"name": "cat", "arguments": '{"file":"a.py"}'},  # the model's own JSON text
            },
        ],
    }
    ids = [call["id"] for call in message["tool_calls"]]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
    assert client.parse_completion(completion(tok, text)) == message  # the same completion, the same message


def test_without_reasoning_or_calls_the_fields_are_none(make_client: Any, tok: Any) -> None:
    message = make_client().parse_completion(completion(tok, "Just text.<|im_end|>"))
    assert message == {"role": "assistant", "content": "Just text.", "reasoning_content": None, "tool_calls": None}


def test_without_parsers_the_markup_stays_in_the_content(make_client: Any, tok: Any) -> None:
    client = make_client(tool_parser=None, reasoning_parser=None)
    text = '<think>\nhm\n</think>\n\n<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>'
    message = client.parse_completion(completion(tok, text + "<|im_end|>"))
    assert message == {"role": "assistant", "content": text, "reasoning_content": None, "tool_calls": None}


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "ls", "arguments": {"path": "src"\n</tool_call>',  # malformed JSON
        '<tool_call>\n{"name": "ls", "arguments": "{}"}\n</tool_call>',  # arguments not an object
        '<tool_call>\n{"name": "ls"}\n</tool_call>',  # no arguments
        '<tool_call>\n{"name": "ls", "arguments": {}, "why": "x"}\n</tool_call>',  # a key the format lacks
        '<tool_call>\n["ls", {}]\n</tool_call>',  # not an object
        '<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>\nDone, I think.',  # text after the calls
        '<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call> and <tool_call>\n{"name": "ls", "arguments": '
        "{}}\n</tool_call>",  # text between calls
        '<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "ls", "argu',  # cut
    ],
)
def test_a_tool_call_block_the_parser_cannot_read_leaves_all_the_text_as_content(
    make_client: Any, tok: Any, text: str
) -> None:
    message = make_client(reasoning_parser=None).parse_completion(completion(tok, "Sure.\n" + text + "<|im_end|>"))
    assert message["content"] == "Sure.\n" + text and message["tool_calls"] is None


def test_an_unclosed_last_block_with_complete_json_is_a_call_and_whitespace_may_separate_blocks(
    make_client: Any, tok: Any
) -> None:
    text = (
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n\n  '
        '<tool_call>\n{"name": "b", "arguments": {"x": [1]}}\n'
    )
    message = make_client(reasoning_parser=None).parse_completion(completion(tok, text, finish="length"))
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("a", "{}"),
        ("b", '{"x": [1]}'),
    ]
    assert message["content"] == ""


def test_reasoning_cut_short_is_all_reasoning_and_a_tool_call_ends_it(make_client: Any, tok: Any) -> None:
    client = make_client()
    cut = client.parse_completion(completion(tok, "<think>\nstill think", finish="length"))
    assert (cut["reasoning_content"], cut["content"]) == ("still think", "")
    implicit = client.parse_completion(
        completion(tok, '<think>\nneed ls\n<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call><|im_end|>')
    )
    assert implicit["reasoning_content"] == "need ls" and implicit["tool_calls"][0]["function"]["name"] == "ls"


def test_where_the_completion_starts_is_read_from_the_generation_prompt(make_client: Any, tok: Any) -> None:
    client = make_client()
    opened = render_text(tok, USER) + "<think>\n"  # a template that opens the block in the generation prompt
    inside = client.parse_completion(completion(tok, "weighing it\n</think>\n\nYes.<|im_end|>", prompt=opened))
    assert (inside["reasoning_content"], inside["content"]) == ("weighing it", "Yes.")
    repeated = client.parse_completion(completion(tok, "<think>\nhm\n</think>\n\nNo.<|im_end|>", prompt=opened))
    assert (repeated["reasoning_content"], repeated["content"]) == ("hm", "No.")
    closed = render_text(tok, USER, chat_template_kwargs={"enable_thinking": False})
    assert closed.endswith("<think>\n\n</think>\n\n")
    plain = client.parse_completion(completion(tok, "Yes, </think> is a tag.<|im_end|>", prompt=closed))
    assert (plain["reasoning_content"], plain["content"]) == (None, "Yes, </think> is a tag.")
    without = client.parse_completion(completion(tok, "No think block.<|im_end|>"))
    assert (without["reasoning_content"], without["content"]) == (None, "No think block.")


def test_the_terminator_is_dropped_whichever_stop_ended_the_sample(make_client: Any, tok: Any) -> None:
    client = make_client()
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    on_eos = completion(tok, "Hi.<|endoftext|>", stop_reason=eos)
    assert client.parse_completion(on_eos)["content"] == "Hi."
    stop_id = encode(tok, "!")[0]
    on_stop_id = completion(tok, "Hi!", stop_reason=stop_id)
    assert client.parse_completion(on_stop_id)["content"] == "Hi"
    cut = completion(tok, "Hi!", finish="length")
    assert client.parse_completion(cut)["content"] == "Hi!"  # nothing ended it: nothing is dropped
    full_eot = completion(tok, "Hi.<|im_end|>\n")
    assert client.parse_completion(full_eot)["content"] == "Hi."


def test_parse_completion_takes_a_result_only(make_client: Any) -> None:
    with pytest.raises(InvalidRequestError, match="GenerateResult"):
        make_client().parse_completion({"completion_ids": [1, 2]})


# -- selection and plugins --------------------------------------------------------------------------------------


def test_an_unknown_parser_name_is_a_typed_error_listing_the_installed_ones(make_client: Any) -> None:
    with pytest.raises(ParserNotFoundError) as info:
        make_client(tool_parser="mistral")
    assert info.value.kind == "tool" and info.value.name == "mistral" and info.value.available == ["hermes"]
    assert "installed: 'hermes'" in str(info.value) and "$.tool_parser" in str(info.value)
    assert isinstance(info.value, ConfigError)
    with pytest.raises(ParserNotFoundError, match=r"no reasoning parser named 'deepseek_r1'.*'qwen3'"):
        make_client(reasoning_parser="deepseek_r1")


@pytest.mark.parametrize("bad", ["", "  ", 3])
def test_a_parser_name_that_is_not_a_name_is_refused_by_the_config(bad: Any) -> None:
    with pytest.raises(ConfigError, match="tool_parser"):
        ClientConfig(backend="reference", base_url="http://ref", tool_parser=bad)
    with pytest.raises(ConfigError, match=r"reasoning_parser"):
        ClientConfig.from_mapping({"backend": "reference", "base_url": "http://ref", "reasoning_parser": bad})


def test_config_files_select_parsers_by_name() -> None:
    config = ClientConfig.from_mapping(
        {"backend": "reference", "base_url": "http://ref", "tool_parser": "hermes", "reasoning_parser": "qwen3"}
    )
    assert (config.tool_parser, config.reasoning_parser) == ("hermes", "qwen3")
    assert ClientConfig.from_mapping(config.to_mapping()) == config


class PipeToolParser:
    """A third party's format: ``CALL name|{json}`` lines after the content."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        content, sep, rest = text.partition("CALL ")
        if not sep:
            return text, []
        name, _, arguments = rest.partition("|")
        return content.rstrip("\n"), [ParsedToolCall(name=name, arguments=arguments)]


class AcmeParsers:
    @hookimpl
    def tool_parsers(self) -> dict[str, Any]:
        return {"acme_pipe": PipeToolParser}


def test_a_third_party_parser_plugs_in_through_the_hook(make_client: Any, tok: Any) -> None:
    client = make_client(tool_parser="acme_pipe", reasoning_parser="qwen3", plugins=[AcmeParsers()])
    assert set(client.driver.tool_parsers) == {"hermes", "acme_pipe"}
    message = client.parse_completion(completion(tok, 'Looking.\nCALL ls|{"path": "src"}<|im_end|>'))
    assert message["content"] == "Looking."
    assert message["tool_calls"][0]["function"] == {"name": "ls", "arguments": '{"path": "src"}'}
    with pytest.raises(ParserNotFoundError, match="'acme_pipe', 'hermes'"):
        make_client(tool_parser="acme", plugins=[AcmeParsers()])


def test_two_plugins_claiming_one_parser_name_is_a_config_error(make_client: Any) -> None:
    class Clash:
        @hookimpl
        def tool_parsers(self) -> dict[str, Any]:
            return {"hermes": PipeToolParser}

    with pytest.raises(ConfigError, match="two plugins provide a tool parser named 'hermes'"):
        make_client(plugins=[Clash()])


# -- "auto": parsers chosen from the chat template ---------------------------------------------------------------

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
THINK_CALL = '<think>\nhm\n</think>\n\nok\n<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call><|im_end|>'


def test_by_default_the_parsers_are_chosen_from_the_chat_template(tiny_models: Any, tok: Any) -> None:
    client = Client(ClientConfig(backend="reference", base_url="http://ref", tokenizer=str(tiny_models.dense)))
    assert (client.config.tool_parser, client.config.reasoning_parser) == ("auto", "auto")
    assert client.parsers == {"tool": "hermes", "reasoning": "qwen3"}  # the Qwen3 template's <tool_call>, <think>
    message = client.parse_completion(completion(tok, THINK_CALL))
    assert (message["reasoning_content"], message["content"]) == ("hm", "ok")
    assert message["tool_calls"][0]["function"] == {"name": "ls", "arguments": "{}"}


def test_a_template_without_a_known_convention_keeps_the_text_and_says_so_once(
    make_client: Any, tok: Any, caplog: pytest.LogCaptureFixture
) -> None:
    client = make_client(tool_parser="auto", reasoning_parser="auto")
    client._tokenizer = WithTemplate(tok, CHATML)
    with caplog.at_level("INFO", logger="backends_core.client"):
        assert client.parsers == {"tool": None, "reasoning": None}
        message = client.parse_completion(completion(tok, THINK_CALL))
        client.parse_completion(completion(tok, THINK_CALL))
    assert message["content"] == THINK_CALL.removesuffix("<|im_end|>") and message["tool_calls"] is None
    said = [r.getMessage() for r in caplog.records if "'auto'" in r.getMessage()]
    assert len(said) == 2 and "tool-call text stays in the content" in said[0]
    assert "reasoning text stays in the content" in said[1]


def test_explicit_names_override_auto_and_none_opts_out(make_client: Any, tok: Any) -> None:
    assert make_client(tool_parser="none", reasoning_parser="auto").parsers == {"tool": None, "reasoning": "qwen3"}
    assert make_client(tool_parser="hermes", reasoning_parser="none").parsers == {"tool": "hermes", "reasoning": None}
    message = make_client(tool_parser="none", reasoning_parser="none").parse_completion(completion(tok, THINK_CALL))
    assert message["content"] == THINK_CALL.removesuffix("<|im_end|>")
    with pytest.raises(ParserNotFoundError, match="no tool parser named 'hermse'"):
        make_client(tool_parser="hermse")  # when the client is built, not at the first parse


def test_a_third_party_parser_declaring_its_template_markers_is_chosen_by_auto(make_client: Any, tok: Any) -> None:
    class Marked(PipeToolParser):
        template_markers = ("CALL ",)

    class Plugin:
        @hookimpl
        def tool_parsers(self) -> dict[str, Any]:
            return {"acme_pipe": Marked}

    client = make_client(tool_parser="auto", plugins=[Plugin()])
    client._tokenizer = WithTemplate(tok, CHATML.replace("{{ m.content }}", "{{ m.content }}CALL "))
    assert client.parsers["tool"] == "acme_pipe"


class WithTemplate:
    """The tiny tokenizer with another chat template."""

    def __init__(self, tok: Any, template: str) -> None:
        self._tok = tok
        self.chat_template = template

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)


# -- property: the parsed message renders back to the sampled ids ----------------------------------------------

# no "<": markup (<think>, <tool_call>, <|im_end|>...) appears only where the template writes it
chars = st.characters(codec="utf-8", exclude_categories=("Cs",), exclude_characters="<\r")
text = st.text(alphabet=chars, max_size=24)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(alphabet=chars, max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(alphabet=chars, max_size=6), inner, max_size=3),
    max_leaves=8,
)
arguments = st.dictionaries(st.text(alphabet=chars, max_size=6), json_values, max_size=4)


@st.composite
def assistant_turns(draw: Any) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """A history, an assistant message the template renders as it is, and template variables."""
    history: list[dict[str, Any]] = [{"role": "user", "content": draw(text) or "hi"}]
    if draw(st.booleans()):
        history.insert(0, {"role": "system", "content": draw(text) or "be brief"})
    thinking = draw(st.booleans())
    message: dict[str, Any] = {"role": "assistant", "content": draw(text).lstrip("\n")}
    if thinking and draw(st.booleans()):
        message["reasoning_content"] = draw(text).strip("\n")
    calls = []
    for _ in range(draw(st.integers(0, 3))):
        args = draw(arguments)
        # a caller's dict (the template writes it as JSON) or the JSON text a model wrote, any spacing
        separators = draw(st.sampled_from([(", ", ": "), (",", ":"), (" ,  ", " :")]))
        written = args if draw(st.booleans()) else json.dumps(args, ensure_ascii=False, separators=separators)
        name = draw(st.from_regex(r"[a-z_][a-z0-9_]{0,11}", fullmatch=True))
        calls.append({"type": "function", "function": {"name": name, "arguments": written}})
    if calls:
        message["tool_calls"] = calls
    return history, message, {} if thinking else {"enable_thinking": False}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=assistant_turns(), tools=st.booleans())
def test_the_parsed_message_renders_back_to_the_sampled_ids(make_client: Any, tok: Any, case: Any, tools: bool) -> None:
    history, message, kwargs = case
    schemas = TOOLS if tools else None
    prompt = encode(tok, render_text(tok, history, tools=schemas, chat_template_kwargs=kwargs))
    full = encode(
        tok,
        render_text(tok, [*history, message], tools=schemas, add_generation_prompt=False, chat_template_kwargs=kwargs),
    )
    assume(full[: len(prompt)] == prompt)  # the generation prompt's tail tokenizes alike before the reply
    eot = encode(tok, "<|im_end|>\n")
    assert full[-len(eot) :] == eot
    sampled = full[len(prompt) : -1]  # the model stops on <|im_end|>; the template's "\n" after it is not sampled
    result = GenerateResult(
        prompt_ids=tuple(prompt),
        completion_ids=tuple(sampled),
        logprobs=np.zeros(len(sampled), np.float32),
        finish_reason="stop",
    )
    client = make_client()
    parsed = client.parse_completion(result)
    back = encode(
        tok,
        render_text(tok, [*history, parsed], tools=schemas, add_generation_prompt=False, chat_template_kwargs=kwargs),
    )
    assert back == full
    expected = dict(message)
    if "enable_thinking" not in kwargs:  # the template always writes a think block for this turn
        expected.setdefault("reasoning_content", "")
    assert normalize_message(parsed) == normalize_message(expected)
    for call, original in zip(parsed["tool_calls"] or [], message.get("tool_calls", []), strict=True):
        written = original["function"]["arguments"]
        if isinstance(written, str):
            assert call["function"]["arguments"] == written  # the exact text, spacing included
