"""Completions parsed back into assistant messages: reasoning, content and tool calls.

An agent loop needs the sampled ids as the assistant message the chat template would render back to them.
:meth:`Client.parse_completion <backends_core.Client.parse_completion>` does that in three steps:

1. **Text.** The completion's terminator is dropped (the template's end-of-turn ids the model generated, else an
   EOS or the stop token that ended the sample), and the rest is decoded with the client's tokenizer, special
   tokens kept (markers such as ``<think>`` are special tokens in some tokenizers).
2. **Reasoning**, by the reasoning parser named by ``ClientConfig.reasoning_parser``: ``(reasoning, rest)``.
3. **Tool calls**, by the tool parser named by ``ClientConfig.tool_parser``, on the rest: ``(content, calls)``.

Parsers are plugins: the hooks :func:`~backends_core.hookspecs.tool_parsers` and
:func:`~backends_core.hookspecs.reasoning_parsers` return ``{name: factory}``, every implementation is asked,
and a factory takes the tokenizer and returns the parser. The names are vLLM's (``--tool-call-parser``,
``--reasoning-parser``). The core's own: the ``hermes`` tool parser and the ``qwen3`` reasoning parser (the
Qwen3 family's ``<tool_call>{json}</tool_call>`` and ``<think>...</think>``).

Both built-ins give the message the chat template renders back to the same text: the newlines the template
itself writes around reasoning, between content and the first tool call and between tool calls are markup, not
part of the fields; each call's ``arguments`` is the exact JSON text the model wrote. Where the text is not in
the form the template writes, nothing is dropped: a malformed tool-call block leaves the whole text as content
(as vLLM's ``hermes`` parser does), and so does text after or between tool-call blocks (vLLM drops it).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import attrs
import numpy as np

from backends_core.errors import BridgeError, ConfigError, ParserNotFoundError
from backends_core.types import GenerateResult

__all__ = [
    "CompletionParser",
    "HermesToolParser",
    "ParsedToolCall",
    "ParserNotFoundError",
    "Qwen3ReasoningParser",
    "ReasoningParser",
    "ReasoningParserFactory",
    "ToolParser",
    "ToolParserFactory",
]


@attrs.frozen
class ParsedToolCall:
    """One tool call as a tool parser found it: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


class ReasoningParser(Protocol):
    """Splits a completion's text into reasoning and the rest."""

    def __call__(self, text: str, *, prompt_ids: Sequence[int]) -> tuple[str | None, str]:
        """``(reasoning, rest)``: ``reasoning`` is ``None`` when the completion holds none.

        :param text: the decoded completion, terminator dropped.
        :param prompt_ids: the prompt the completion continues (a template may open the reasoning block there).
        """
        ...


class ToolParser(Protocol):
    """Splits what follows the reasoning into content and tool calls."""

    def __call__(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        """``(content, calls)``; ``calls`` is empty when the text holds none (then ``content`` is ``text``)."""
        ...


#: Builds a reasoning parser for a tokenizer (what :func:`~backends_core.hookspecs.reasoning_parsers` maps to).
ReasoningParserFactory = Callable[[Any], ReasoningParser]
#: Builds a tool parser for a tokenizer (what :func:`~backends_core.hookspecs.tool_parsers` maps to).
ToolParserFactory = Callable[[Any], ToolParser]


# -- the core's parsers ---------------------------------------------------------------------------------------

_TURN_START = "<|im_start|>"
_THINK, _END_THINK = "<think>", "</think>"
_TOOL_CALL, _END_TOOL_CALL = "<tool_call>", "</tool_call>"
#: Prompt tokens looked at for a reasoning block the template opened (the generation prompt's tail).
_PROMPT_TAIL_TOKENS = 64


class Qwen3ReasoningParser:
    """``<think>...</think>`` reasoning, as the Qwen3 family writes it (vLLM's ``qwen3``).

    Where the completion starts is read from the prompt's last turn (the generation prompt): a ``<think>`` the
    template opened there and did not close means the completion starts inside the reasoning; a closed one
    (``enable_thinking=False`` renders an empty block) means it is all content. Otherwise a completion that
    starts with ``<think>`` opens it (after an opening in the prompt, a repeated ``<think>`` is markup).
    Inside, reasoning runs to ``</think>``, or, like vLLM 0.32, to a ``<tool_call>`` (an implicit end); with
    neither the sample was cut short and all of it is reasoning.

    The template's markup is not part of the fields: one newline after ``<think>`` and before ``</think>``, and
    up to two after ``</think>``.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def _prompt_state(self, prompt_ids: Sequence[int]) -> str:
        """``"open"``, ``"closed"`` or ``"none"``: the reasoning block the prompt's last turn leaves."""
        tail = self._tokenizer.decode(list(prompt_ids[-_PROMPT_TAIL_TOKENS:]), skip_special_tokens=False)
        turn = tail[tail.rfind(_TURN_START) + len(_TURN_START) :] if _TURN_START in tail else tail
        opened, closed = turn.rfind(_THINK), turn.rfind(_END_THINK)
        if opened < 0 and closed < 0:
            return "none"
        return "open" if opened > closed else "closed"

    #: the reasoning a reply constrained by a grammar may start with (an EBNF rule body): a whole block, text
    #: without ``<`` in it
    grammar_prefix = '"<think>" [^<]* "</think>" [\\n]*'

    def __call__(self, text: str, *, prompt_ids: Sequence[int]) -> tuple[str | None, str]:
        state = self._prompt_state(prompt_ids)
        if state == "closed":
            return None, text
        if state == "none" and not text.startswith(_THINK):
            return None, text
        text = text.removeprefix(_THINK)  # opens the block, or repeats the prompt's opening (as vLLM absorbs it)
        end = text.find(_END_THINK)
        call = text.find(_TOOL_CALL)
        if end >= 0 and (call < 0 or end < call):
            reasoning, rest = text[:end], text[end + len(_END_THINK) :]
        elif call >= 0:
            reasoning, rest = text[:call], text[call:]
        else:
            reasoning, rest = text, ""
        reasoning = reasoning.removeprefix("\n").removesuffix("\n")
        if end >= 0 and (call < 0 or end < call):
            rest = rest.removeprefix("\n").removeprefix("\n")
        return reasoning, rest


_WS = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


def _member_spans(text: str) -> dict[str, tuple[int, int]]:
    """Where each member's value of the JSON object ``text`` (already known to be valid) is written."""
    spans: dict[str, tuple[int, int]] = {}
    i = _WS.match(text, 0).end() + 1  # type: ignore[union-attr]  # after "{"
    i = _WS.match(text, i).end()  # type: ignore[union-attr]
    if text[i] == "}":
        return spans
    while True:
        key, i = _DECODER.raw_decode(text, i)
        i = _WS.match(text, i).end() + 1  # type: ignore[union-attr]  # after ":"
        i = _WS.match(text, i).end()  # type: ignore[union-attr]
        _, end = _DECODER.raw_decode(text, i)
        spans[key] = (i, end)
        i = _WS.match(text, end).end()  # type: ignore[union-attr]
        if text[i] == "}":
            return spans
        i = _WS.match(text, i + 1).end()  # type: ignore[union-attr]  # after ","


def _tool_call(body: str) -> ParsedToolCall | None:
    """The call in one block's JSON (``{"name": str, "arguments": {...}}``, nothing else), ``None`` if it is not."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if (
        not isinstance(value, dict)
        or set(value) != {"name", "arguments"}
        or not isinstance(value["name"], str)
        or not isinstance(value["arguments"], dict)
    ):
        return None
    start, end = _member_spans(body)["arguments"]
    return ParsedToolCall(name=value["name"], arguments=body[start:end])


class HermesToolParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (vLLM's ``hermes``).

    Content is the text before the first block, without the newline the template puts between content and a
    call. Every block must hold one JSON object with exactly a string ``name`` and an object ``arguments``; the
    last block may be unclosed when its JSON is complete (as in vLLM). Blocks may be separated and followed by
    whitespace only. Anything else (a malformed block, text between or after blocks) leaves the whole text as
    content, with no calls: nothing is dropped.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        first = text.find(_TOOL_CALL)
        if first < 0:
            return text, []
        calls: list[ParsedToolCall] = []
        at = first
        while at < len(text):
            if not text.startswith(_TOOL_CALL, at):
                return text, []  # text between or after the blocks
            body_at = at + len(_TOOL_CALL)
            close = text.find(_END_TOOL_CALL, body_at)
            body = text[body_at:] if close < 0 else text[body_at:close]
            call = _tool_call(body)
            if call is None:
                return text, []
            calls.append(call)
            if close < 0:
                break
            at = _WS.match(text, close + len(_END_TOOL_CALL)).end()  # type: ignore[union-attr]
        return text[:first].removesuffix("\n"), calls

    def call_grammar(self, names: Sequence[str], *, single: bool) -> str:
        """An EBNF grammar (xgrammar's dialect, which vLLM and SGLang take) of replies that are only tool calls,
        as the template writes them: one block (``single``) or several, each calling one of ``names`` with a
        JSON object of arguments. The engine constrained to it honours ``tool_choice`` "required" or a named
        function."""
        calls = "call" if single else 'call ("\\n" call)*'
        return (
            f"root ::= {calls}\n"
            # the name rule's literals hold the name's JSON string, quotes and all
            'call ::= "<tool_call>\\n{\\"name\\": " name ", \\"arguments\\": " object "}\\n</tool_call>"\n'
            f"name ::= {' | '.join(_ebnf_literal(name) for name in names)}\n" + _JSON_GRAMMAR
        )


#: Generic JSON values in EBNF, the rules a tool-call grammar's ``object`` names.
_JSON_GRAMMAR = "\n".join(
    [
        'object ::= "{" ws ( member ( ws "," ws member )* )? ws "}"',
        'member ::= string ws ":" ws value',
        'array ::= "[" ws ( value ( ws "," ws value )* )? ws "]"',
        'value ::= object | array | string | number | "true" | "false" | "null"',
        'string ::= "\\"" char* "\\""',
        'char ::= [^"\\\\] | "\\\\" escape',
        'escape ::= ["\\\\/bfnrt] | "u" hex hex hex hex',
        "hex ::= [0-9a-fA-F]",
        'number ::= "-"? int frac? exp?',
        'int ::= "0" | [1-9] [0-9]*',
        'frac ::= "." [0-9]+',
        "exp ::= [eE] [-+]? [0-9]+",
        "ws ::= [ \\t\\n]*",
    ]
)


def _ebnf_literal(text: str) -> str:
    """``text`` as an EBNF string literal: the JSON string of a name, quotes included, written inside one."""
    quoted = json.dumps(text)
    return '"' + quoted.replace("\\", "\\\\").replace('"', '\\"') + '"'


#: What ``"auto"`` looks for in a chat template: a parser factory's ``template_markers`` attribute, the strings a
#: template that writes its convention contains (a third-party factory sets it to be chosen the same way).
HermesToolParser.template_markers = (_TOOL_CALL, _END_TOOL_CALL)  # type: ignore[attr-defined]
Qwen3ReasoningParser.template_markers = (_THINK, _END_THINK)  # type: ignore[attr-defined]

BUILTIN_TOOL_PARSERS: Mapping[str, ToolParserFactory] = {"hermes": HermesToolParser}
BUILTIN_REASONING_PARSERS: Mapping[str, ReasoningParserFactory] = {"qwen3": Qwen3ReasoningParser}


# -- the client's parser ----------------------------------------------------------------------------------------


def _call_id(prompt_ids: Sequence[int], completion_ids: Sequence[int], index: int) -> str:
    """A tool call's id, derived from the whole sequence, prompt and completion: the same turn always parses to
    the same message, and the same call made again later in a conversation (its prompt is longer by then) gets
    another id, as harnesses that key their tool results by id need."""
    h = hashlib.blake2b(digest_size=12)
    h.update(np.asarray(prompt_ids, dtype="<i8").tobytes())
    h.update(b"|")
    h.update(np.asarray(completion_ids, dtype="<i8").tobytes())
    h.update(index.to_bytes(4, "little"))
    return f"call_{h.hexdigest()}"


class CompletionParser:
    """Parses completions of one tokenizer with the selected parsers (``None``: not parsed for that kind).

    :param tokenizer: the client's chat-template tokenizer.
    :param tool_parser: the tool parser factory, or ``None`` (tool-call markup stays in the content).
    :param reasoning_parser: the reasoning parser factory, or ``None`` (reasoning stays in the content).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        tool_parser: ToolParserFactory | None,
        reasoning_parser: ReasoningParserFactory | None,
    ) -> None:
        self.tokenizer = tokenizer
        self.tool_parser = tool_parser(tokenizer) if tool_parser is not None else None
        self.reasoning_parser = reasoning_parser(tokenizer) if reasoning_parser is not None else None
        self._eot_ids: tuple[int, ...] | None = None

    def _end_of_turn_ids(self) -> tuple[int, ...]:
        if self._eot_ids is None:
            from backends_core.multiturn.extension import _end_of_turn
            from backends_core.multiturn.rendering import encode

            try:
                eot = _end_of_turn(self.tokenizer, {})
            except BridgeError:
                self._eot_ids = ()
            else:
                self._eot_ids = tuple(encode(self.tokenizer, eot))
        return self._eot_ids

    def body_ids(self, result: GenerateResult) -> list[int]:
        """The completion without its terminator: the template's end-of-turn ids the model generated (however
        many of them), else an EOS or the stop token id that ended the sample."""
        ids = list(result.completion_ids)
        eot = self._end_of_turn_ids()
        for k in range(min(len(eot), len(ids)), 0, -1):
            if tuple(ids[-k:]) == eot[:k]:
                return ids[:-k]
        if ids and result.finish_reason == "stop":
            eos = getattr(self.tokenizer, "eos_token_id", None)
            if ids[-1] == eos or ids[-1] == result.stop_reason:
                return ids[:-1]
        return ids

    def text(self, result: GenerateResult) -> str:
        """The decoded completion, terminator dropped, special tokens kept."""
        return str(
            self.tokenizer.decode(self.body_ids(result), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        )

    def call_grammar(self, names: Sequence[str], *, single: bool) -> str | None:
        """A grammar of replies that only call tools named ``names`` (after a reasoning block where the reasoning
        parser allows one), ``None`` when the tool parser offers none (a parser without ``call_grammar``)."""
        make = getattr(self.tool_parser, "call_grammar", None)
        if make is None:
            return None
        grammar = str(make(names, single=single))
        prefix = getattr(self.reasoning_parser, "grammar_prefix", None)
        if prefix:
            grammar = grammar.replace("root ::= ", f"root ::= ( {prefix} )? ", 1)
        return grammar

    def parse(self, result: GenerateResult) -> dict[str, Any]:
        """The assistant message of ``result``: ``role``, ``content`` (a string), ``reasoning_content`` (``None``
        without reasoning) and ``tool_calls`` (OpenAI form, ``None`` without calls)."""
        text = self.text(result)
        reasoning: str | None = None
        if self.reasoning_parser is not None:
            reasoning, text = self.reasoning_parser(text, prompt_ids=result.prompt_ids)
        calls: list[ParsedToolCall] = []
        if self.tool_parser is not None:
            text, calls = self.tool_parser(text)
        return {
            "role": "assistant",
            "content": text,
            "reasoning_content": reasoning,
            "tool_calls": [
                {
                    "id": _call_id(result.prompt_ids, result.completion_ids, i),
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for i, call in enumerate(calls)
            ]
            or None,
        }


#: ``ClientConfig.tool_parser`` / ``reasoning_parser`` values that name no parser.
AUTO, NONE = "auto", "none"


def chosen_parser(kind: str, name: str | None, installed: Mapping[str, Any], chat_template: Any) -> str | None:
    """The ``kind`` (``"tool"`` / ``"reasoning"``) parser a config value selects for a chat template: an installed
    name as it is, ``"none"`` (or
    ``None``) no parser, and ``"auto"`` the first installed parser (by name) whose ``template_markers`` all occur
    in the template, ``None`` when no installed parser knows its convention.

    :raises ParserNotFoundError: a name no installed parser has.
    """
    if name is None or name == NONE:
        return None
    if name != AUTO:
        if name not in installed:
            raise ParserNotFoundError(kind, name, list(installed))
        return name
    template = chat_template if isinstance(chat_template, str) else json.dumps(chat_template, default=str)
    for candidate in sorted(installed):
        markers = getattr(installed[candidate], "template_markers", None)
        if markers and all(marker in template for marker in markers):
            return candidate
    return None


def merge_parsers(kind: str, contributions: Sequence[Mapping[str, Any] | None]) -> dict[str, Any]:
    """One name -> factory mapping from every plugin's answer.

    :raises ConfigError: two plugins provide the same name, or an answer is not a mapping of names to callables.
    """
    merged: dict[str, Any] = {}
    for answer in contributions:
        if answer is None:
            continue
        if not isinstance(answer, Mapping):
            raise ConfigError([f"a {kind}_parsers hook returned {type(answer).__name__}, expected a mapping"])
        for name, factory in answer.items():
            if not isinstance(name, str) or not name or not callable(factory):
                raise ConfigError([f"{kind}_parsers: {name!r} -> {factory!r} is not a name and a parser factory"])
            if name in merged and merged[name] is not factory:
                raise ConfigError([f"two plugins provide a {kind} parser named {name!r}"])
            merged[name] = factory
    return merged
