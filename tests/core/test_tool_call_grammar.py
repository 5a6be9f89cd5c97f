"""The grammar that honours a forced tool choice writes exactly the markup the tool parser reads back: expanded
with each tool's name and the smallest arguments, every sentence of it parses as that call."""

from __future__ import annotations

import json
import re

import pytest

from backends_core.parsing import CompletionParser, HermesToolParser, Qwen3ReasoningParser

_TOKEN = re.compile(r'"((?:[^"\\]|\\.)*)"|([A-Za-z_]+)')


def rules(grammar: str) -> dict[str, str]:
    return dict(line.split(" ::= ", 1) for line in grammar.splitlines())


def unescape(literal: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "t": "\t"}.get(m[1], m[1]), literal)


def expand(grammar: dict[str, str], rule: str, choose: dict[str, str]) -> str:
    """The sentence of ``rule`` made of its literals, each named rule expanded (or taken from ``choose``)."""
    out = []
    for literal, name in _TOKEN.findall(grammar[rule]):
        if name:
            out.append(choose[name] if name in choose else expand(grammar, name, choose))
        else:
            out.append(unescape(literal))
    return "".join(out)


@pytest.mark.parametrize("name", ["run", "Bash", "multi.tool", 'we"ird\\name', "ünï"])
def test_every_tool_name_the_grammar_allows_parses_back_as_that_call(name: str) -> None:
    grammar = rules(HermesToolParser(None).call_grammar(["other", name], single=True))
    names = [unescape(literal) for literal, _ in _TOKEN.findall(grammar["name"])]
    assert [json.loads(n) for n in names] == ["other", name]
    sentence = expand(grammar, "call", {"name": names[1], "object": "{}"})
    assert sentence == "<tool_call>\n" + json.dumps({"name": name, "arguments": {}}) + "\n</tool_call>"
    content, calls = HermesToolParser(None)(sentence)
    assert content == "" and [(c.name, c.arguments) for c in calls] == [(name, "{}")]


def test_several_calls_or_one() -> None:
    assert rules(HermesToolParser(None).call_grammar(["a"], single=True))["root"] == "call"
    assert rules(HermesToolParser(None).call_grammar(["a"], single=False))["root"] == 'call ("\\n" call)*'


def test_a_reasoning_block_may_come_first() -> None:
    parser = CompletionParser(None, tool_parser=HermesToolParser, reasoning_parser=Qwen3ReasoningParser)
    grammar = parser.call_grammar(["a"], single=True)
    assert grammar is not None and rules(grammar)["root"].startswith('( "<think>" [^<]* "</think>"')
    assert CompletionParser(None, tool_parser=None, reasoning_parser=None).call_grammar(["a"], single=True) is None
