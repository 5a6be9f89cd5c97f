"""Property-based fuzzing of every route of the gateway: a client's mistake is never a server error.

Each test starts one scripted gateway and sends it a few hundred requests that hypothesis draws: valid bodies of each
API with fields replaced, inserted or deleted at any depth (known field names of the API as well as random ones,
values of every JSON type), bodies that are not JSON at all, odd session ids in the path and in headers, odd query
strings. Every answer must hold to the following, whatever was sent:

- no 5xx, neither as the status nor as a server error inside a 200 event stream;
- a refusal is a 4xx (never 429: no limit is reached here) in the API's own error shape: OpenAI's
  ``{"error": {"message", "type", "param", "code"}}``, Anthropic's ``{"type": "error", "error": {...}}`` under
  ``/v1/messages``;
- a refusal changes nothing: no session is listed that was not, none changes, and nothing reached the engine (a read
  changes nothing whatever it answers; nor does counting tokens);
- the gateway answers the next request.

A mutated body may well be valid and answered 200: that is fine, and such a turn may start a session. A failure names
the request (method, path, headers, body) and the answer. Hypothesis runs derandomized (the same examples every run):
hypothesis draws inside a worker thread (``asyncio.to_thread``) while the test's event loop serves the gateway.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import unicodedata
from typing import Any
from urllib.parse import quote

import attrs
import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

CHAT, RESPONSES, MESSAGES, COUNT = "/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens"
JSON_TYPE = {"content-type": "application/json"}
USER = [{"role": "user", "content": "hi"}]
VALID = {
    CHAT: {"model": "tiny", "messages": USER, "max_tokens": 8},
    RESPONSES: {"model": "tiny", "input": "hi", "max_output_tokens": 8},
    MESSAGES: {"model": "tiny", "messages": USER, "max_tokens": 8},
    COUNT: {"model": "tiny", "messages": USER},
}
#: sessions each gateway holds before the fuzzing starts (requests name them as well as ids of their own)
OPEN, CLOSED = "fuzz-open", "fuzz-closed"
EXAMPLES = 300
#: more than the turns any run answers: the scripted engine answers each with the next one
REPLIES = ["ok<|im_end|>"] * 20_000
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)

# ------------------------------------------------------------------------------------------------ valid fields

PNG_BASE64 = (
    "iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAFklEQVR4nGP4z8DA8J+BkYHh////DAAe9gT9Ce00PgAAAABJRU5ErkJggg=="
)
PNG = f"data:image/png;base64,{PNG_BASE64}"
SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
#: values each route takes for its fields (a body gets a few of them, then is mutated)
VALID_FIELDS: dict[str, dict[str, list[Any]]] = {
    CHAT: {
        "messages": [
            [{"role": "system", "content": "be brief"}, *USER],
            [{"role": "developer", "content": "be brief"}, *USER],
            [*USER, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}],
            [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            [
                *USER,
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "c1", "content": "2"},
            ],
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": PNG}}]}],
        ],
        "tools": [[{"type": "function", "function": {"name": "f", "description": "d", "parameters": SCHEMA}}]],
        "tool_choice": ["auto", "none", "required", {"type": "function", "function": {"name": "f"}}],
        "stream": [True, False],
        "stream_options": [{"include_usage": True}],
        "temperature": [0, 0.7, 2],
        "top_p": [0.5, 1],
        "top_k": [-1, 0, 5],
        "min_p": [0.1],
        "seed": [0, 123],
        "stop": ["x", ["\n", "end"]],
        "presence_penalty": [0.5],
        "frequency_penalty": [-0.5],
        "repetition_penalty": [1.1],
        "logprobs": [True],
        "top_logprobs": [2],
        "logit_bias": [{"100": -100}],
        "response_format": [
            {"type": "text"},
            {"type": "json_object"},
            {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}},
        ],
        "user": ["u"],
        "metadata": [{"k": "v"}],
        "store": [False],
        "n": [1],
        "parallel_tool_calls": [True],
        "max_completion_tokens": [8],
        "max_tokens": [1, 64],
        "min_tokens": [1],
        "ignore_eos": [True],
        "stop_token_ids": [[0]],
        "chat_template_kwargs": [{"enable_thinking": False}, {"enable_thinking": True}],
    },
    RESPONSES: {
        "input": [
            [{"role": "user", "content": "hi"}],
            [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
            [
                {"role": "user", "content": "hi"},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
                {"role": "user", "content": "more"},
            ],
            [
                {"role": "user", "content": "hi"},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'},
                {"type": "function_call_output", "call_id": "c1", "output": "2"},
            ],
            [
                {"type": "reasoning", "summary": [{"type": "summary_text", "text": "hm"}]},
                {"role": "user", "content": "hi"},
            ],
            [{"role": "user", "content": [{"type": "input_image", "image_url": PNG}]}],
        ],
        "instructions": ["be brief"],
        "tools": [[{"type": "function", "name": "f", "description": "d", "parameters": SCHEMA}]],
        "tool_choice": ["auto", "none", "required", {"type": "function", "name": "f"}],
        "stream": [True, False],
        "store": [False, True],
        "text": [{"format": {"type": "text"}}, {"format": {"type": "json_schema", "name": "s", "schema": SCHEMA}}],
        "reasoning": [{"effort": "low"}, {"summary": "auto"}],
        "include": [["reasoning.encrypted_content"]],
        "truncation": ["disabled", "auto"],
        "previous_response_id": [f"resp_{OPEN}_{'0' * 24}"],
        "prompt_cache_key": ["k", OPEN],
        "metadata": [{"k": "v"}],
        "temperature": [0, 1],
        "top_p": [0.9],
        "parallel_tool_calls": [True],
        "user": ["u"],
        "max_output_tokens": [1, 64],
        "top_logprobs": [0],
        "service_tier": ["auto"],
        "background": [False],
        "chat_template_kwargs": [{"enable_thinking": False}],
    },
    MESSAGES: {
        "messages": [
            [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            [*USER, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}],
            [
                *USER,
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "2"}]},
            ],
            [
                *USER,
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hm", "signature": "s"},
                        {"type": "text", "text": "ok"},
                    ],
                },
                {"role": "user", "content": "more"},
            ],
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_BASE64}}
                    ],
                }
            ],
        ],
        "system": [
            "be brief",
            [
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=1"},
                {"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}},
            ],
        ],
        "tools": [[{"name": "f", "description": "d", "input_schema": SCHEMA}]],
        "tool_choice": [{"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "f"}, {"type": "none"}],
        "thinking": [{"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}, {"type": "adaptive"}],
        "temperature": [0, 1],
        "top_p": [0.9],
        "top_k": [5],
        "stop_sequences": [["x"]],
        "stream": [True, False],
        "metadata": [{"user_id": '{"session_id": "s1"}'}, {"user_id": "user_a_account_b_session_s2"}],
        "cache_control": [{"type": "ephemeral"}],
        "chat_template_kwargs": [{"enable_thinking": False}],
        "context_management": [{"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}],
        "output_config": [{"effort": "low"}, {"format": {"type": "json_schema", "schema": SCHEMA}}],
        "service_tier": ["auto"],
        "speed": ["standard"],
        "max_tokens": [1, 2048],
    },
}
VALID_FIELDS[COUNT] = {
    key: VALID_FIELDS[MESSAGES][key]
    for key in ("messages", "system", "tools", "tool_choice", "thinking", "cache_control", "context_management")
}
#: every valid value of a field name, whichever route takes it
VALID_VALUES: dict[str, list[Any]] = {}
for fields in VALID_FIELDS.values():
    for key, values in fields.items():
        VALID_VALUES.setdefault(key, []).extend(values)

# ---------------------------------------------------------------------------------------------------------- values

#: field names of the three APIs (top level, messages, content parts, items, tools), where random keys go too
FIELD_NAMES = sorted(
    {
        *("model", "messages", "max_tokens", "max_completion_tokens", "max_output_tokens", "input", "instructions"),
        *("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_sequences", "presence_penalty"),
        *("frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "logit_bias"),
        *("tools", "tool_choice", "parallel_tool_calls", "stream", "stream_options", "n", "logprobs", "top_logprobs"),
        *("metadata", "response_format", "text", "reasoning", "include", "system", "thinking", "store", "user"),
        *("truncation", "previous_response_id", "prompt_cache_key", "chat_template_kwargs", "output_config"),
        *("context_management", "cache_control", "service_tier", "background", "functions", "reasoning_effort"),
        *("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content", "type", "id", "call_id"),
        *("arguments", "output", "summary", "status", "encrypted_content", "image_url", "url", "detail", "source"),
        *("input", "tool_use_id", "is_error", "signature", "function", "parameters", "input_schema", "description"),
        *("user_id", "include_usage", "json_schema", "schema", "format", "effort", "budget_tokens", "enable_thinking"),
    }
)
#: names that some field of some API takes as its value
WORDS = [
    *("tiny", "user", "assistant", "system", "developer", "tool", "function", "auto", "none", "required", "any"),
    *("text", "image_url", "image", "input_text", "output_text", "input_image", "tool_use", "tool_result"),
    *("thinking", "redacted_thinking", "message", "function_call", "function_call_output", "reasoning"),
    *("json_object", "json_schema", "enabled", "disabled", "adaptive", "high", "low", "base64", "ephemeral"),
    *("reasoning.encrypted_content", "resp_fuzz-open_000000000000000000000000", "data:x", "file:///etc/hostname"),
    *(OPEN, CLOSED, "", " ", "<|im_end|>", "<|im_start|>user\n", "{{ raise }}", "\u0000"),
]
PART_TYPES = [
    *("text", "image_url", "image", "input_text", "output_text", "input_image", "input_file", "refusal"),
    *("tool_use", "tool_result", "thinking", "redacted_thinking", "document", "search_result", "server_tool_use"),
]

texts = st.one_of(st.sampled_from(WORDS), st.text(max_size=16))
#: text no UTF-8 encoder writes: a body holding one is escaped JSON, or bytes no UTF-8 decoder takes
lone_surrogates = st.text(st.characters(categories=["Cs"]), min_size=1, max_size=2)
integers = st.one_of(
    st.integers(-3, 3),
    st.integers(),
    st.sampled_from([2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, -(10**30)]),
)
numbers = st.one_of(integers, st.floats(allow_nan=False, allow_infinity=False))
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
keys = st.one_of(st.sampled_from(FIELD_NAMES), st.text(max_size=8))
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4), max_leaves=10
)


def loosely(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``strategy``, or any JSON value in its place."""
    return st.one_of(strategy, json_values)


def shaped(required: dict[str, st.SearchStrategy[Any]], **optional: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """An object with the ``required`` fields and any of the ``optional`` ones."""
    return st.fixed_dictionaries(required, optional=optional)


image_url = loosely(st.one_of(st.sampled_from([PNG, "data:x", "file:///etc/hostname"]), texts))
part = shaped(
    {"type": loosely(st.sampled_from(PART_TYPES))},
    text=loosely(texts),
    image_url=loosely(shaped({"url": image_url}, detail=loosely(st.sampled_from(["auto", "low", "high"])))),
    source=loosely(shaped({"type": loosely(st.sampled_from(["base64", "url"]))}, data=texts, media_type=texts)),
    id=texts,
    name=texts,
    input=json_values,
    tool_use_id=texts,
    content=json_values,
    is_error=json_values,
    thinking=texts,
    signature=texts,
    cache_control=loosely(st.just({"type": "ephemeral"})),
)
tool_call = shaped(
    {"id": texts, "type": loosely(st.just("function"))},
    function=loosely(shaped({"name": loosely(texts)}, arguments=loosely(st.just("{}")))),
)
message = shaped(
    {"role": loosely(st.sampled_from(["system", "developer", "user", "assistant", "tool"]))},
    content=st.one_of(texts, st.lists(part, max_size=3), json_values),
    tool_calls=loosely(st.lists(tool_call, max_size=2)),
    tool_call_id=texts,
    name=texts,
    reasoning_content=texts,
)
item = shaped(
    {"type": loosely(st.sampled_from(["message", "function_call", "function_call_output", "reasoning"]))},
    role=loosely(st.sampled_from(["user", "system", "developer", "assistant"])),
    content=st.one_of(texts, st.lists(part, max_size=2), json_values),
    call_id=texts,
    name=texts,
    arguments=texts,
    output=loosely(texts),
    summary=json_values,
    id=texts,
    status=texts,
    encrypted_content=texts,
)
schema = loosely(shaped({"type": st.just("object")}, properties=st.dictionaries(texts, json_values, max_size=2)))
tool = shaped(
    {"type": loosely(st.sampled_from(["function", "custom", "web_search", "bash_20250124"]))},
    function=loosely(shaped({"name": loosely(texts)}, parameters=schema, description=texts, strict=json_values)),
    name=loosely(texts),
    description=texts,
    parameters=schema,
    input_schema=schema,
)
named_choice = shaped(
    {"type": loosely(st.sampled_from(["function", "tool", "auto", "any", "none"]))},
    name=texts,
    function=loosely(shaped({"name": texts})),
)
harness_user_ids = st.one_of(
    texts.map(lambda session: json.dumps({"session_id": session})),
    texts.map(lambda session: f"user_a_account_b_session_{session}"),
)
#: values shaped for each known field (any JSON value may come instead)
FIELD_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "messages": st.lists(message, max_size=3),
    "input": st.one_of(texts, st.lists(st.one_of(item, message), max_size=3)),
    "system": st.one_of(texts, st.lists(part, max_size=2)),
    "content": st.one_of(texts, st.lists(part, max_size=3)),
    "tools": st.lists(tool, max_size=2),
    "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required", "any"]), named_choice),
    "stop": st.one_of(texts, st.lists(texts, max_size=3)),
    "stop_sequences": st.lists(texts, max_size=3),
    "stop_token_ids": st.lists(integers, max_size=3),
    "include": st.lists(texts, max_size=2),
    "logit_bias": st.dictionaries(st.one_of(integers.map(str), texts), numbers, max_size=2),
    "metadata": st.dictionaries(st.one_of(st.just("user_id"), texts), st.one_of(harness_user_ids, texts), max_size=2),
    "response_format": shaped(
        {"type": loosely(st.sampled_from(["text", "json_object", "json_schema"]))}, json_schema=json_values
    ),
    "text": shaped({}, format=json_values, verbosity=json_values),
    "reasoning": shaped({}, effort=loosely(st.sampled_from(["low", "high"])), summary=json_values),
    "thinking": shaped({"type": loosely(st.sampled_from(["enabled", "disabled", "adaptive"]))}, budget_tokens=integers),
    "stream_options": shaped({}, include_usage=json_values),
    "chat_template_kwargs": st.dictionaries(st.one_of(st.just("enable_thinking"), texts), json_values, max_size=2),
    "previous_response_id": texts,
    **dict.fromkeys(["stream", "logprobs", "store", "parallel_tool_calls", "ignore_eos", "background"], st.booleans()),
    **dict.fromkeys(
        ["max_tokens", "max_completion_tokens", "max_output_tokens", "top_k", "n", "seed", "min_tokens"], integers
    ),
    **dict.fromkeys(["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"], numbers),
}
#: what a list element of a body may become
elements = st.one_of(json_values, message, part, item, tool)


def value_for(key: str) -> st.SearchStrategy[Any]:
    """What a field named ``key`` may become: a value some route takes for it, one shaped like it, any JSON."""
    valid = [st.sampled_from(VALID_VALUES[key]).map(copy.deepcopy)] if key in VALID_VALUES else []
    return st.one_of(*valid, *([FIELD_VALUES[key]] if key in FIELD_VALUES else []), json_values)


def _containers(value: Any) -> list[Any]:
    """Every object and list in ``value``, itself first."""
    found, pending = [], [value]
    while pending:
        node = pending.pop(0)
        if isinstance(node, dict | list):
            found.append(node)
            pending.extend(node.values() if isinstance(node, dict) else node)
    return found


def _mutate(draw: st.DrawFn, body: Any, value: st.SearchStrategy[Any] | None = None) -> None:
    """Replace, insert or delete one field or element of ``body``, at any depth (``value``: what goes in, else
    what suits the field)."""
    node = draw(st.sampled_from(_containers(body)))
    if isinstance(node, dict):
        if node and value is None and draw(st.booleans()):
            del node[draw(st.sampled_from(sorted(node)))]
        else:
            key = draw(st.one_of(st.sampled_from(sorted(node)), keys) if node else keys)
            node[key] = draw(value_for(key) if value is None else value)
    elif node and draw(st.booleans()):
        index = draw(st.integers(0, len(node) - 1))
        if value is None and draw(st.booleans()):
            del node[index]
        else:
            node[index] = draw(elements if value is None else value)
    else:
        node.insert(draw(st.integers(0, len(node))), draw(elements if value is None else value))


@st.composite
def bodies(draw: st.DrawFn, valid: Any, fields: dict[str, list[Any]] | None = None) -> bytes:
    """``valid`` with a few of the valid ``fields``, then mutated a few times (or not at all), as JSON; now and then
    something else: bytes, any JSON, cut JSON, JSON holding a lone surrogate."""
    kind = draw(st.sampled_from(["mutated"] * 16 + ["bytes", "json", "lone surrogate", "cut"]))
    if kind == "bytes":
        return draw(st.binary(max_size=48))
    if kind == "json":
        return encode(draw(json_values), ascii=draw(st.booleans()))
    chosen = draw(st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True)) if fields else []
    body = copy.deepcopy({**valid, **{key: draw(st.sampled_from(fields[key])) for key in chosen}})
    for _ in range(draw(st.integers(0, 3))):
        _mutate(draw, body)
    if kind == "lone surrogate":
        _mutate(draw, body, lone_surrogates)
    raw = encode(body, ascii=draw(st.booleans()))
    return raw[: draw(st.integers(0, len(raw) - 1))] if kind == "cut" else raw


def encode(value: Any, *, ascii: bool) -> bytes:
    """``value`` as JSON (a lone surrogate escaped, or written as the bytes no UTF-8 decoder takes)."""
    return json.dumps(value, ensure_ascii=ascii, allow_nan=False).encode("utf-8", "surrogatepass")


session_ids = st.one_of(
    st.sampled_from([OPEN, CLOSED]),
    st.from_regex(r"[A-Za-z0-9._:@-]{1,16}", fullmatch=True),
    st.text(max_size=16),
    st.sampled_from([".", "..", "...", "a" * 128, "a" * 129, "%", "a/b", "a?b", "a#b", "\u00e9"]),
)


def header_value(text: str) -> bytes:
    """``text`` as a header may carry it (RFC 9110): no control characters, none of its spaces at either end."""
    return "".join(c for c in text if unicodedata.category(c) != "Cc").strip(" ").encode()


header_values = st.one_of(session_ids, st.text(max_size=24)).map(header_value)
SESSION_HEADERS = [
    *("X-Session-ID", "X-Session-Group", "x-claude-code-session-id", "thread-id", "session-id", "conversation_id"),
    "x-stainless-retry-count",
]
turn_headers = st.one_of(st.just({}), st.dictionaries(st.sampled_from(SESSION_HEADERS), header_values, max_size=3))
#: numbers as a query may spell them, most of which no route takes: other scripts' digits, exponents, signs
NUMERALS = ["1", "0", "10001", "\u00b2", "\u0663", "\U0001d7d9", "1e3", "-1", "+1", " 1", "1_000", "0x1f", "nan", "inf"]
query_values = st.one_of(st.sampled_from(NUMERALS), st.sampled_from(NUMERALS[3:6]), texts)
query_strings = st.one_of(
    st.lists(
        st.tuples(st.sampled_from(["limit", "after", "group", "status", "tokens"]) | texts, query_values),
        min_size=1,
        max_size=3,
    ).map(
        lambda pairs: "&".join(f"{quote(k, safe='', errors='replace')}={quote(v, errors='replace')}" for k, v in pairs)
    ),
    st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="#"), max_size=24),
)


def in_path(session: str) -> str:
    return quote(session, safe="", errors="replace")


# -------------------------------------------------------------------------------------------------------- requests


@attrs.frozen
class Call:
    method: str
    path: str
    headers: dict[str, bytes] = attrs.field(factory=dict)
    body: bytes | None = None

    def __str__(self) -> str:
        body = "" if self.body is None else self.body[:4000].decode("utf-8", "backslashreplace")
        return f"{self.method} {self.path}\nheaders: {self.headers}\nbody: {body}"


def is_messages(path: str) -> bool:
    """Whether ``path`` is under Anthropic's Messages API (its errors come in Anthropic's shape)."""
    return re.fullmatch(r"(/s/[^/]+)?/v1/messages(/.*)?", path) is not None


@st.composite
def turns(draw: st.DrawFn, route: str) -> Call:
    """A POST to ``route``, under a session's path now and then, with session headers."""
    prefix = draw(st.sampled_from(["", "", "", f"/s/{in_path(draw(session_ids))}"]))
    headers = {**draw(turn_headers), **JSON_TYPE}
    return Call("POST", prefix + route, headers, draw(bodies(VALID[route], VALID_FIELDS[route])))


# ------------------------------------------------------------------------------------------------------- the checks


def openai_error(answer: Any) -> bool:
    error = answer.get("error") if isinstance(answer, dict) else None
    return (
        isinstance(error, dict)
        and set(answer) == {"error"}
        and set(error) == {"message", "type", "param", "code"}
        and all(isinstance(error[k], str) and error[k] for k in ("message", "type", "code"))
        and (error["param"] is None or isinstance(error["param"], str))
    )


def anthropic_error(answer: Any) -> bool:
    error = answer.get("error") if isinstance(answer, dict) else None
    return (
        isinstance(error, dict)
        and answer.get("type") == "error"
        and all(isinstance(error.get(k), str) and error[k] for k in ("type", "message", "code"))
        and isinstance(error.get("param", ""), str)
    )


def stream_failure(text: str) -> Any:
    """The first server error event of an event stream, or ``None``."""
    for line in text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        pending = [json.loads(line[6:])]
        while pending:
            node = pending.pop()
            if isinstance(node, dict):
                if node.get("code") == "internal" or node.get("type") in ("server_error", "api_error"):
                    return line
                pending.extend(node.values())
            elif isinstance(node, list):
                pending.extend(node)
    return None


@attrs.define
class Target:
    """A served gateway as the worker thread drives it; ``known``: its state as the last request left it."""

    http: httpx.Client
    served: Any
    known: tuple[int, Any] | None = None

    def state(self, after: Call | None = None) -> tuple[int, Any]:
        """What a refusal must leave as it was: the requests the engine got, the sessions listed."""
        try:
            listing = self.http.get("/v1/sessions", params={"limit": "10000"})
        except httpx.HTTPError as exc:
            raise AssertionError(f"the gateway stopped answering ({exc!r}) after\n{after}") from None
        assert listing.status_code == 200, f"the gateway cannot list its sessions after\n{after}\n-> {listing.text}"
        return len(self.served.script.requests), listing.json()["data"]

    def check(self, call: Call, *, changes_nothing: bool = False) -> None:
        """Send ``call``, and fail naming it and its answer unless the answer holds to the module's rules."""
        before, self.known = self.known or self.state(), None
        try:
            response = self.http.request(call.method, call.path, headers=call.headers, content=call.body)
        except httpx.HTTPError as exc:
            raise AssertionError(f"no answer ({exc!r}) to\n{call}") from None
        status, text, sent = response.status_code, response.text, response.url.path
        said = f"\n{call}\n(sent to {sent})\n-> {status} {text[:3000]}"
        assert status < 500, "a server error for a client's request:" + said
        if status == 200 and response.headers.get("content-type", "").startswith("text/event-stream"):
            failure = stream_failure(text)
            assert failure is None, f"a server error inside a stream: {failure}" + said
        if status >= 400:
            assert status != 429, "429 though no limit is reached:" + said
            if call.method != "HEAD":
                shape = anthropic_error if is_messages(sent) else openai_error
                assert shape(parse(text)), "not the API's error shape:" + said
        after = self.known = self.state(call)
        if status >= 400 or changes_nothing:
            assert after[0] == before[0], "the engine got a request for a refused one:" + said
            assert after[1] == before[1], f"the sessions changed:\n{before[1]}\n!=\n{after[1]}" + said


def parse(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


async def fuzz(served: Any, calls: st.SearchStrategy[Call], **check: Any) -> None:
    """Send every call hypothesis draws from ``calls`` to ``served`` (checked by :meth:`Target.check`), then one
    valid turn, which must be answered."""

    def run() -> None:
        with httpx.Client(base_url=served.url, trust_env=False, timeout=60) as http:
            target = Target(http, served)

            @FUZZ_SETTINGS
            @given(calls)
            def each(call: Call) -> None:
                target.check(call, **check)

            each()
            answered = http.post(CHAT, json=VALID[CHAT])
            assert answered.status_code == 200, f"a valid turn after the fuzzing: {answered.text}"

    await asyncio.to_thread(run)


async def prepared(served: Any) -> None:
    """Hold an open session and a closed one, which the requests name as well as sessions of their own."""
    async with httpx.AsyncClient(base_url=served.url, trust_env=False) as http:
        for session in (OPEN, CLOSED):
            answered = await http.post(f"/s/{session}{CHAT}", json=VALID[CHAT])
            assert answered.status_code == 200, answered.text
        assert (await http.post(f"/v1/sessions/{CLOSED}/close")).status_code == 200


# -------------------------------------------------------------------------------------------------------- the tests


async def test_chat_completions(scripted_gateway: Any) -> None:
    async with scripted_gateway(REPLIES) as served:
        await prepared(served)
        await fuzz(served, turns(CHAT))


async def test_responses(scripted_gateway: Any) -> None:
    async with scripted_gateway(REPLIES) as served:
        await prepared(served)
        await fuzz(served, turns(RESPONSES))


async def test_messages(scripted_gateway: Any) -> None:
    async with scripted_gateway(REPLIES) as served:
        await prepared(served)
        await fuzz(served, turns(MESSAGES))


async def test_count_tokens_changes_nothing(scripted_gateway: Any) -> None:
    async with scripted_gateway(REPLIES) as served:
        await prepared(served)
        await fuzz(served, turns(COUNT), changes_nothing=True)


@st.composite
def session_reads(draw: st.DrawFn) -> Call:
    """A read of the sessions: the list with a query, or one session's summary, trajectory or models."""
    session = in_path(draw(session_ids))
    reads = ["/v1/sessions", f"/v1/sessions/{session}", f"/v1/sessions/{session}/trajectory", "/v1/models"]
    path = draw(st.sampled_from([*reads, "/v1/sessions", "/v1/sessions", f"/s/{session}/v1/models", "/health", "/"]))
    query = draw(query_strings)
    return Call(draw(st.sampled_from(["GET", "HEAD"])), f"{path}?{query}" if query else path, draw(turn_headers))


async def test_reads_change_nothing(scripted_gateway: Any) -> None:
    async with scripted_gateway(REPLIES) as served:
        await prepared(served)
        await fuzz(served, session_reads(), changes_nothing=True)


@st.composite
def session_writes(draw: st.DrawFn) -> Call:
    """A reward (a body ``{"reward": 1.0, "info": {...}}`` mutated) or a close, with a body or none."""
    session = in_path(draw(session_ids))
    if draw(st.booleans()):
        return Call("POST", f"/v1/sessions/{session}/reward", JSON_TYPE, draw(bodies({"reward": 1.0, "info": {}})))
    body = draw(st.one_of(st.none(), bodies({})))
    return Call("POST", f"/v1/sessions/{session}/close", {} if body is None else JSON_TYPE, body)


async def test_rewards_and_closes(scripted_gateway: Any) -> None:
    async with scripted_gateway(REPLIES) as served:
        await prepared(served)
        await fuzz(served, session_writes())


ROUTES = [CHAT, RESPONSES, MESSAGES, COUNT, "/v1/models", "/v1/sessions", "/health", "/", "/ui"]


@st.composite
def any_requests(draw: st.DrawFn) -> Call:
    """Any method on a route, a session's route or a path of random segments, with a JSON body or none."""
    session = in_path(draw(session_ids))
    path = draw(
        st.one_of(
            st.sampled_from(ROUTES + [f"/s/{session}{route}" for route in ROUTES[:5]]),
            st.sampled_from([f"/v1/sessions/{session}", f"/v1/sessions/{session}/trajectory"]),
            st.sampled_from([f"/v1/sessions/{session}/reward", f"/v1/sessions/{session}/close"]),
            st.lists(texts.map(in_path), min_size=1, max_size=4).map(lambda parts: "/" + "/".join(parts)),
        )
    )
    method = draw(st.sampled_from(["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]))
    body = draw(st.one_of(st.none(), bodies({})))
    return Call(method, path, {} if body is None else JSON_TYPE, body)


async def test_any_method_on_any_path(scripted_gateway: Any) -> None:
    async with scripted_gateway(REPLIES) as served:
        await prepared(served)
        await fuzz(served, any_requests())
