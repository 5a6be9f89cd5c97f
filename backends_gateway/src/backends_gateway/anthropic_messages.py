"""Anthropic's Messages wire: a request body checked field by field into a :class:`Turn` request (its messages
converted to the OpenAI-shaped messages the chat template renders), and the answer (one message, or the event
stream the official ``anthropic`` SDK accumulates) built from a served turn.

Every field the Messages API defines is either honoured or refused by name; nothing is dropped. The conversion:

* ``system`` (a string or text blocks) is a system message first;
* an assistant message's blocks are one assistant message: ``thinking`` blocks its ``reasoning_content``, ``text``
  blocks its ``content``, ``tool_use`` blocks its ``tool_calls`` (in that order: the template writes the calls
  after the text);
* a user message's ``tool_result`` blocks are ``tool`` messages in order, its text blocks one user message after
  them.

One text block is its text (Anthropic's shorthand, both ways); several stay text parts, rendered as the core renders
OpenAI's text parts. So a session may mix this API and OpenAI's chat completions on one history and keep bridging
on its exact ids.
"""

from __future__ import annotations

import base64
import hashlib
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import orjson

from backends_core import GenerateResult, JsonSchema
from backends_gateway.errors import GatewayError
from backends_gateway.fields import (
    CompletionLimit,
    ToolChoice,
    bad,
    boolean,
    check_image,
    completion_tokens,
    integer,
    number,
    sampling_params,
    tool_choice,
)
from backends_gateway.sessions import TurnRequest

__all__ = [
    "MessageStream",
    "MessagesCall",
    "error_body",
    "error_event",
    "is_messages_path",
    "message_body",
    "parse_messages_request",
]

# what the gateway cannot do faithfully, refused rather than ignored
_REFUSED = {
    "container": "containers (server-side code execution)",
    "mcp_servers": "MCP servers (run the tools in the harness and send their results)",
    "service_tier": "service tiers",
    "speed": "speed modes",
    "inference_geo": "inference regions",
    "diagnostics": "diagnostics",
}
_IGNORED_WHEN_DEFAULT: dict[str, Any] = {"service_tier": "auto", "speed": "standard"}
_KNOWN = frozenset(
    {
        "model",
        "max_tokens",
        "messages",
        "system",
        "tools",
        "tool_choice",
        "thinking",
        "temperature",
        "top_p",
        "top_k",
        "stop_sequences",
        "stream",
        "metadata",
        # prompt caching is the engine's prefix cache: a cache breakpoint changes nothing here
        "cache_control",
        # vLLM's extension, as on the chat-completions route
        "chat_template_kwargs",
        "context_management",
        "output_config",
        *_REFUSED,
    }
)
_COUNT_KNOWN = frozenset(
    {
        "model",
        "messages",
        "system",
        "tools",
        "tool_choice",
        "thinking",
        "cache_control",
        "context_management",
        "output_config",
    }
)
# keys a block may carry that change nothing here when null (what the SDK sends back of a block it parsed)
_CACHE = ("cache_control",)
_BLOCK_KEYS = {
    "text": ("text", "citations", *_CACHE),
    "thinking": ("thinking", "signature", *_CACHE),
    "tool_use": ("id", "name", "input", "caller", *_CACHE),
    "tool_result": ("tool_use_id", "content", "is_error", *_CACHE),
    "image": ("source", *_CACHE),
}
_REFUSED_BLOCKS = {
    "document": "documents are not supported: the gateway renders text only",
    "search_result": "search results are not supported: send their text",
    "redacted_thinking": "redacted thinking is encrypted reasoning only Anthropic can read: it cannot be rendered",
    "server_tool_use": "server tools are not supported: the harness runs the tools",
    "web_search_tool_result": "server tools are not supported: the harness runs the tools",
    "container_upload": "containers are not supported",
}
_TOOL_KEYS = frozenset(
    {
        "name",
        "description",
        "input_schema",
        "type",
        "cache_control",
        "strict",
        "input_examples",
        "defer_loading",
        "eager_input_streaming",
        "allowed_callers",
    }
)
_MESSAGES_PATH = re.compile(r"(?:/s/[^/]+)?/v1/messages(?:/.*)?")
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "abort": "pause_turn"}


@attrs.frozen(kw_only=True)
class MessagesCall:
    """One checked Messages request."""

    turn: TurnRequest
    model: str
    stream: bool


def is_messages_path(path: str) -> bool:
    """Whether ``path`` is under the Messages API (its errors are answered in Anthropic's shape)."""
    return _MESSAGES_PATH.fullmatch(path) is not None


def _refuse_block(kind: Any, where: str) -> GatewayError:
    why = _REFUSED_BLOCKS.get(kind) if isinstance(kind, str) else None
    if why is not None:
        return bad(f"{where} is a {kind!r} block: {why}", where, "unsupported_content")
    return bad(f"{where} is a {kind!r} block, which this route does not take here", where, "unsupported_content")


def _check_block(block: Any, where: str, allowed: Sequence[str]) -> tuple[str, Mapping[str, Any]]:
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(block, dict) or not isinstance(kind, str) or kind not in allowed:
        raise _refuse_block(kind, where)
    keys = _BLOCK_KEYS[kind]
    for key, value in block.items():
        if key != "type" and key not in keys:
            raise bad(f"{where}.{key} is not a field of a {kind} block", f"{where}.{key}", "unknown_parameter")
        if key == "citations" and value is not None:
            raise bad(f"{where}.citations are not supported", f"{where}.citations", "unsupported_parameter")
        if key == "caller" and value is not None and (not isinstance(value, dict) or value.get("type") != "direct"):
            raise bad(f"{where}.caller: only direct tool calls are supported", f"{where}.caller")
    return kind, block


def _text_of(block: Mapping[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise bad(f"{where}.text must be a string", f"{where}.text", "invalid_type")
    return text


def _texts(texts: list[str]) -> str | list[dict[str, str]]:
    """One text is the string (Anthropic's shorthand); several stay text parts."""
    if len(texts) == 1:
        return texts[0]
    return [{"type": "text", "text": t} for t in texts]


def _text_content(value: Any, where: str) -> str | list[dict[str, str]]:
    """A string, or a list of text blocks."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad(f"{where} must be a string or a list of text blocks", where, "invalid_type")
    texts = []
    for j, block in enumerate(value):
        _, block = _check_block(block, f"{where}[{j}]", ("text",))
        texts.append(_text_of(block, f"{where}[{j}]"))
    return _texts(texts) if texts else ""


def _tool_result(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise bad(f"{where}.tool_use_id must be a non-empty string", f"{where}.tool_use_id", "invalid_type")
    content = block.get("content")
    message: dict[str, Any] = {
        "role": "tool",
        "tool_call_id": call_id,
        "content": "" if content is None else _text_content(content, f"{where}.content"),
    }
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise bad(f"{where}.is_error must be a boolean", f"{where}.is_error", "invalid_type")
    if is_error:
        # kept on the tool message: a template that reads is_error renders it, the trajectory keeps it (OpenAI's
        # tool messages have no such field, so common templates render the result alone)
        message["is_error"] = True
    return message


def _image(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    """An image block as the OpenAI image part the client reads, its image checked (whether the backend and model
    take images is the gateway's check, answered as the route's error)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source, dict):
        media, data = source.get("media_type"), source.get("data")
        if not isinstance(media, str) or not isinstance(data, str):
            raise bad(f"{where}.source needs string media_type and data", f"{where}.source", "invalid_type")
        url = f"data:{media};base64,{data}"
        check_image(url, f"{where}.source")
        return {"type": "image_url", "image_url": {"url": url}}
    if kind == "url" and isinstance(source, dict) and isinstance(source.get("url"), str):
        check_image(source["url"], f"{where}.source.url")
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise bad(f"{where}.source must be a base64 or url image source", f"{where}.source", "invalid_type")


def _user(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list) or not content:
        raise bad(f"{where}.content must be a string or a non-empty list of blocks", f"{where}.content", "invalid_type")
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, raw in enumerate(content):
        at = f"{where}.content[{j}]"
        kind, block = _check_block(raw, at, ("text", "tool_result", "image"))
        if kind == "tool_result":
            if parts:
                raise bad(f"{at}: tool_result blocks must come before any text in a user message", at)
            out.append(_tool_result(block, at))
        elif kind == "image":
            parts.append(_image(block, at))
        else:
            parts.append({"type": "text", "text": _text_of(block, at)})
    if parts:
        images = any(p["type"] == "image_url" for p in parts)
        out.append({"role": "user", "content": parts if images else _texts([p["text"] for p in parts])})
    return out


def _assistant(content: Any, where: str) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise bad(f"{where}.content must be a string or a list of blocks", f"{where}.content", "invalid_type")
    order = {"thinking": 0, "text": 1, "tool_use": 2}
    last = 0
    thinking: list[str] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, raw in enumerate(content):
        at = f"{where}.content[{j}]"
        kind, block = _check_block(raw, at, tuple(order))
        if order[kind] < last:
            raise bad(
                f"{at}: a {kind} block after a {next(k for k, v in order.items() if v == last)} block cannot be "
                "rendered: an assistant turn is its thinking, then its text, then its tool calls",
                at,
            )
        last = order[kind]
        if kind == "thinking":
            text = block.get("thinking")
            if not isinstance(text, str):
                raise bad(f"{at}.thinking must be a string", f"{at}.thinking", "invalid_type")
            # the signature is not checked: the gateway's own are digests, not attestations
            thinking.append(text)
        elif kind == "text":
            texts.append(_text_of(block, at))
        else:
            ident, name, args = block.get("id"), block.get("name"), block.get("input")
            if not isinstance(ident, str) or not ident:
                raise bad(f"{at}.id must be a non-empty string", f"{at}.id", "invalid_type")
            if not isinstance(name, str) or not name:
                raise bad(f"{at}.name must be a non-empty string", f"{at}.name", "invalid_type")
            if not isinstance(args, dict):
                raise bad(f"{at}.input must be an object", f"{at}.input", "invalid_type")
            arguments = orjson.dumps(args).decode()
            calls.append({"id": ident, "type": "function", "function": {"name": name, "arguments": arguments}})
    message: dict[str, Any] = {"role": "assistant", "content": _texts(texts) if texts else ""}
    if thinking:
        message["reasoning_content"] = "\n".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return message


def _messages(value: Any, system: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise bad("messages must be a non-empty list of messages", "messages", "invalid_type")
    out: list[dict[str, Any]] = []
    if system is not None:
        content = _text_content(system, "system")
        if content:
            out.append({"role": "system", "content": content})
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(f"{where} must be an object, got {type(message).__name__}", where, "invalid_type")
        extra = sorted(set(message) - {"role", "content"})
        if extra:
            raise bad(f"{where}.{extra[0]} is not a field of a message", f"{where}.{extra[0]}", "unknown_parameter")
        role = message.get("role")
        if role == "user":
            out.extend(_user(message.get("content"), where))
        elif role == "assistant":
            out.append(_assistant(message.get("content"), where))
        elif role == "system":  # a system message within the conversation (Anthropic's mid-conversation system)
            out.append({"role": "system", "content": _text_content(message.get("content"), f"{where}.content")})
        else:
            raise bad(f"{where}.role must be 'user', 'assistant' or 'system', got {role!r}", f"{where}.role")
    if value[-1].get("role") == "assistant":
        raise bad(
            f"messages[{len(value) - 1}]: a last assistant message (prefill) is not supported: the gateway renders "
            "a new assistant turn after the messages",
            f"messages[{len(value) - 1}]",
            "unsupported_content",
        )
    return out


def _image_parts(value: list[dict[str, Any]]) -> tuple[str, ...]:
    """Where each image block of the (checked) messages is, in the order the prompt holds them."""
    return tuple(
        f"messages[{i}].content[{j}]"
        for i, message in enumerate(value)
        if message.get("role") == "user" and isinstance(message.get("content"), list)
        for j, block in enumerate(message["content"])
        if block.get("type") == "image"
    )


def _tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise bad("tools must be a list", "tools", "invalid_type")
    out = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad(f"{where} must be an object", where, "invalid_type")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise bad(
                f"{where} is a {kind!r} tool: server tools are not supported (send custom tools, run them in the "
                "harness)",
                f"{where}.type",
                "unsupported_parameter",
            )
        unknown = sorted(set(tool) - _TOOL_KEYS)
        if unknown:
            raise bad(f"{where}.{unknown[0]} is not a field of a tool", f"{where}.{unknown[0]}", "unknown_parameter")
        for key in ("input_examples", "defer_loading", "eager_input_streaming", "allowed_callers"):
            if tool.get(key) not in (None, False):
                raise bad(f"{where}.{key} is not supported by this gateway", f"{where}.{key}", "unsupported_parameter")
        if tool.get("strict"):
            raise bad(f"{where}.strict cannot be enforced by the gateway", f"{where}.strict", "unsupported_parameter")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise bad(f"{where}.name must be a non-empty string", f"{where}.name", "invalid_type")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise bad(f"{where}.input_schema must be a JSON schema object", f"{where}.input_schema", "invalid_type")
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise bad(f"{where}.description must be a string", f"{where}.description", "invalid_type")
        function: dict[str, Any] = {"name": name}
        if description is not None:
            function["description"] = description
        function["parameters"] = schema
        out.append({"type": "function", "function": function})
    return out or None


def _tool_choice(value: Any, tools: list[dict[str, Any]] | None) -> ToolChoice | None:
    """Anthropic's tool choice: ``auto``, ``any`` (a call is required), ``tool`` (that tool), ``none`` (no
    tools sent); ``disable_parallel_tool_use`` with ``any`` or ``tool`` (one call)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if not isinstance(value, dict) or kind not in ("auto", "any", "tool", "none"):
        raise bad("tool_choice.type must be auto, any, tool or none", "tool_choice")
    extra = sorted(set(value) - {"type", "name", "disable_parallel_tool_use"})
    if extra:
        raise bad(
            f"tool_choice.{extra[0]} is not a field of a tool choice", f"tool_choice.{extra[0]}", "unknown_parameter"
        )
    single = value.get("disable_parallel_tool_use")
    if single is not None and not isinstance(single, bool):
        raise bad("tool_choice.disable_parallel_tool_use must be a boolean", "tool_choice.disable_parallel_tool_use")
    choice = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}[kind]
    name = value.get("name")
    if kind == "tool" and not isinstance(name, str):
        raise bad("tool_choice.name must name a tool", "tool_choice.name", "invalid_type")
    parallel = None if single is None else not single
    if kind in ("auto", "none") and single:
        raise bad(
            "tool_choice.disable_parallel_tool_use can only be enforced with tool_choice any or tool",
            "tool_choice.disable_parallel_tool_use",
            "unsupported_parameter",
        )
    return tool_choice(choice, None if kind in ("auto", "none") else parallel, tools=tools, named=name)


def _thinking(value: Any, max_tokens: int | None) -> bool | None:
    """The template's reasoning switch (``enable_thinking``) the request asks for, ``None``: the template's default.

    ``budget_tokens`` is checked as Anthropic checks it but not enforced: a template's switch has no budget, and
    ``max_tokens`` bounds the whole reply, reasoning included.
    """
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if not isinstance(value, dict) or kind not in ("enabled", "disabled", "adaptive"):
        raise bad("thinking must be {'type': 'enabled', 'budget_tokens': n}, disabled or adaptive", "thinking")
    extra = sorted(set(value) - {"type", "budget_tokens", "display"})
    if extra:
        raise bad(f"thinking.{extra[0]} is not supported", f"thinking.{extra[0]}", "unknown_parameter")
    if value.get("display") is not None:
        raise bad(
            "thinking.display is not supported: the reasoning is returned as sampled",
            "thinking.display",
            "unsupported_parameter",
        )
    if kind == "enabled":
        budget = value.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1024:
            raise bad(f"thinking.budget_tokens must be an integer >= 1024, got {budget!r}", "thinking.budget_tokens")
        if max_tokens is not None and budget >= max_tokens:
            raise bad(
                f"thinking.budget_tokens ({budget}) must be less than max_tokens ({max_tokens})",
                "thinking.budget_tokens",
            )
    elif "budget_tokens" in value:
        raise bad(f"thinking.budget_tokens goes with type 'enabled', not {kind!r}", "thinking.budget_tokens")
    return bool(kind != "disabled")


def _template_kwargs(body: Mapping[str, Any], max_tokens: int | None) -> dict[str, Any] | None:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad("chat_template_kwargs must be an object", "chat_template_kwargs", "invalid_type")
    thinking = _thinking(body.get("thinking"), max_tokens)
    if thinking is None:
        return kwargs
    kwargs = dict(kwargs or {})
    if kwargs.setdefault("enable_thinking", thinking) != thinking:
        raise bad("thinking and chat_template_kwargs.enable_thinking disagree", "thinking")
    return kwargs


def _stop_sequences(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, list) and all(isinstance(s, str) and s for s in value):
        return tuple(value)
    raise bad("stop_sequences must be a list of non-empty strings", "stop_sequences", "invalid_type")


def _metadata(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad("metadata must be an object", "metadata", "invalid_type")
    extra = sorted(set(value) - {"user_id"})
    if extra:
        raise bad(f"metadata.{extra[0]} is not a metadata field", f"metadata.{extra[0]}", "unknown_parameter")
    if value.get("user_id") is not None and not isinstance(value["user_id"], str):
        raise bad("metadata.user_id must be a string", "metadata.user_id", "invalid_type")
    # user_id changes nothing about the turn: it is kept with the turn's request, as OpenAI's metadata is
    return value


#: the system block Claude Code puts first: its version and entry point, for Anthropic's billing (it changes with
#: each release). It is addressed to the API, not the model: kept with the turn's request, not rendered.
_BILLING_HEADER = "x-anthropic-billing-header:"
#: the context-management edits that change nothing for a harness that sends its whole history: keeping all
#: thinking blocks is what the gateway does anyway
_NO_OP_EDITS = {"clear_thinking_20251015": {"keep": "all"}}
_EFFORTS = ("low", "medium", "high", "max", "xhigh")


def _billing_header(system: Any) -> tuple[Any, str | None]:
    """``system`` without Claude Code's billing block, and that block's text (``None``: none sent)."""
    if not isinstance(system, list) or not system:
        return system, None
    first = system[0]
    text = first.get("text") if isinstance(first, dict) and first.get("type") == "text" else None
    if isinstance(text, str) and text.startswith(_BILLING_HEADER):
        return system[1:], text
    return system, None


def _context_management(value: Any) -> None:
    """Accept the edits that change nothing here; refuse, by name, any that would drop history server-side."""
    if value is None:
        return
    if not isinstance(value, dict) or set(value) - {"edits"} or not isinstance(value.get("edits"), list):
        raise bad('context_management must be {"edits": [...]}', "context_management", "invalid_type")
    for i, edit in enumerate(value["edits"]):
        kind = edit.get("type") if isinstance(edit, dict) else None
        keep = _NO_OP_EDITS.get(kind) if isinstance(kind, str) else None
        settings = {k: v for k, v in edit.items() if k != "type"} if isinstance(edit, dict) else None
        if keep is None or settings != keep:
            raise bad(
                f"context_management.edits[{i}] ({kind!r}) would clear history server-side, which the gateway does "
                f"not do (the harness keeps its history; accepted: {_NO_OP_EDITS})",
                f"context_management.edits[{i}]",
                "unsupported_parameter",
            )


def _output_config(value: Any) -> tuple[str | None, JsonSchema | None]:
    """The effort asked for (recorded with the turn: a chat template has no effort setting, so it changes nothing
    on the served model) and the output format (a JSON schema the engine constrains the reply to)."""
    if value is None:
        return None, None
    if not isinstance(value, dict):
        raise bad("output_config must be an object", "output_config", "invalid_type")
    extra = sorted(set(value) - {"effort", "format"})
    if extra:
        raise bad(f"output_config.{extra[0]} is not supported", f"output_config.{extra[0]}", "unknown_parameter")
    effort = value.get("effort")
    if effort is not None and effort not in _EFFORTS:
        raise bad(f"output_config.effort must be one of {list(_EFFORTS)}, got {effort!r}", "output_config.effort")
    fmt = value.get("format")
    if fmt is None:
        return effort, None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad(
            'output_config.format must be {"type": "json_schema", "schema": {...}}',
            "output_config.format",
            "invalid_value",
        )
    return effort, JsonSchema(fmt["schema"])


def parse_messages_request(body: Any, *, limit: CompletionLimit, counting: bool = False) -> MessagesCall:
    """Check a Messages body (decoded JSON) and turn it into a :class:`MessagesCall`.

    :param limit: the gateway's bound on a turn's completion (``max_tokens`` past it is refused, saying which
        bound and how to raise it).
    :param counting: the body of ``/v1/messages/count_tokens`` (no sampling fields; the turn's sampling is a
        placeholder).
    :raises GatewayError: naming the field (400), before anything is sent.
    """
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object", "body", "invalid_type")
    unknown = sorted(set(body) - (_COUNT_KNOWN if counting else _KNOWN))
    if unknown:
        raise bad(f"unknown parameter {unknown[0]!r}", unknown[0], "unknown_parameter")
    for key, why in _REFUSED.items():
        if body.get(key) is not None and body[key] != _IGNORED_WHEN_DEFAULT.get(key, object()):
            raise bad(f"{key} is not supported by this gateway: {why}", key, "unsupported_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model must be a non-empty string", "model", "invalid_type")
    if not counting and body.get("max_tokens") is None:
        raise bad("max_tokens is required", "max_tokens", "missing_parameter")
    max_tokens = completion_tokens(body, "max_tokens", limit)
    system, billing = _billing_header(body.get("system"))
    messages = _messages(body.get("messages"), system)
    effort, structured = _output_config(body.get("output_config"))
    _context_management(body.get("context_management"))
    tools = _tools(body.get("tools"))
    forced = _tool_choice(body.get("tool_choice"), tools)
    kwargs = _template_kwargs(body, max_tokens)
    stream = boolean(body, "stream")
    metadata = _metadata(body.get("metadata"))
    top_k = integer(body, "top_k", low=0)
    temperature = number(body, "temperature", low=0.0, high=1.0)
    top_p = number(body, "top_p", low=0.0, high=1.0)
    sampling = sampling_params(
        {"stop": "stop_sequences"},
        max_tokens=max_tokens or limit.tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=-1 if top_k in (None, 0) else top_k,
        stop=_stop_sequences(body.get("stop_sequences")),
        structured=structured,
    )
    turn = TurnRequest(
        messages=messages,
        tools=tools,
        sampling=sampling,
        chat_template_kwargs=kwargs,
        metadata={
            k: v for k, v in (("metadata", metadata), ("effort", effort), ("billing_header", billing)) if v is not None
        },
        image_parts=_image_parts(body["messages"]),
        tool_choice=forced,
    )
    return MessagesCall(turn=turn, model=model, stream=bool(stream))


# -- answers ----------------------------------------------------------------------------------------------------

_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def error_body(exc: GatewayError) -> dict[str, Any]:
    """Anthropic's error shape (its type from the status), with the gateway's ``code`` and ``param``."""
    kind = _ERROR_TYPES.get(exc.status, "api_error" if exc.status >= 500 else "invalid_request_error")
    error: dict[str, Any] = {"type": kind, "message": exc.message, "code": exc.code}
    if exc.param is not None:
        error["param"] = exc.param
    return {"type": "error", "error": error}


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def signature(thinking: str) -> str:
    """A thinking block's signature: a digest of its text, not an attestation (the gateway checks none it is
    sent); it lets a client carry the block back as it carries Anthropic's."""
    return base64.b64encode(hashlib.blake2b(thinking.encode(), digest_size=24).digest()).decode()


def _tool_use(call: Mapping[str, Any]) -> dict[str, Any]:
    fn = call["function"]
    arguments = fn.get("arguments") or "{}"
    try:
        value = orjson.loads(arguments) if isinstance(arguments, str) else arguments
    except orjson.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise GatewayError(
            502,
            f"the model's call of {fn.get('name')!r} has arguments that are not a JSON object: {arguments!r:.200}",
            kind="server_error",
            code="tool_arguments",
        )
    ident = str(call.get("id") or uuid.uuid4().hex)
    return {"type": "tool_use", "id": "toolu_" + ident.removeprefix("call_"), "name": fn["name"], "input": value}


def content_blocks(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The reply's blocks: its thinking, its text, its tool calls (each only when there is one)."""
    out: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content")
    if reasoning:
        out.append({"type": "thinking", "thinking": reasoning, "signature": signature(reasoning)})
    if message.get("content"):
        out.append({"type": "text", "text": message["content"]})
    out.extend(_tool_use(call) for call in message.get("tool_calls") or ())
    return out


def stop_of(message: Mapping[str, Any], result: GenerateResult, stop: Sequence[str]) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence``: ``tool_use`` when the reply calls tools, ``stop_sequence``
    when one of the request's ended it, ``pause_turn`` for a generation the engine aborted (the partial turn is
    kept)."""
    if result.finish_reason == "stop":
        if message.get("tool_calls"):
            return "tool_use", None
        if isinstance(result.stop_reason, str) and result.stop_reason in stop:
            return "stop_sequence", result.stop_reason
    return _STOP_REASONS[result.finish_reason], None


def _usage(result: GenerateResult) -> dict[str, int]:
    return {"input_tokens": len(result.prompt_ids), "output_tokens": len(result.completion_ids)}


def message_body(
    *, id: str, model: str, message: Mapping[str, Any], result: GenerateResult, stop: Sequence[str]
) -> dict[str, Any]:
    """A whole ``message`` body."""
    reason, sequence = stop_of(message, result, stop)
    return {
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content_blocks(message),
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": _usage(result),
    }


def _event(kind: str, body: Mapping[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **body}) + b"\n\n"


def error_event(exc: GatewayError) -> bytes:
    """A stream's ``error`` event (the SDK raises it as the status's error)."""
    return b"event: error\ndata: " + orjson.dumps(error_body(exc)) + b"\n\n"


class MessageStream:
    """A streamed turn's events, in the order the SDK's accumulator reads them: ``message_start``, each block's
    ``content_block_start``/``_delta``/``_stop`` (thinking and text as they stream, then the tool calls once the
    turn is parsed), ``message_delta`` (the stop reason and usage) and ``message_stop``."""

    def __init__(self, *, id: str, model: str, stop: Sequence[str]) -> None:
        self.id = id
        self.model = model
        self.stop = tuple(stop)
        self.index = -1
        self.open: str | None = None  # the kind of the block being streamed
        self.thinking = ""

    def start(self) -> bytes:
        message: dict[str, Any] = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},  # the prompt's length comes with message_delta
        }
        return _event("message_start", {"message": message})

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        out = b""
        if self.open == "thinking":
            delta = {"type": "signature_delta", "signature": signature(self.thinking)}
            out += _event("content_block_delta", {"index": self.index, "delta": delta})
        self.open = None
        return out + _event("content_block_stop", {"index": self.index})

    def _open(self, block: Mapping[str, Any]) -> bytes:
        out = self._close()
        self.index += 1
        return out + _event("content_block_start", {"index": self.index, "content_block": dict(block)})

    def text(self, kind: str, text: str) -> bytes:
        """A streamed piece of the reply (``kind``: ``"reasoning"`` or ``"content"``)."""
        out = b""
        if kind == "reasoning":
            if self.open != "thinking":
                self.thinking = ""
                out += self._open({"type": "thinking", "thinking": "", "signature": ""})
                self.open = "thinking"
            self.thinking += text
            delta = {"type": "thinking_delta", "thinking": text}
        else:
            if self.open != "text":
                out += self._open({"type": "text", "text": ""})
                self.open = "text"
            delta = {"type": "text_delta", "text": text}
        return out + _event("content_block_delta", {"index": self.index, "delta": delta})

    def finish(self, served: Any) -> bytes:
        """The rest, once the turn is durable: its tool calls, the stop reason and usage, ``message_stop``."""
        message, result = served.message, served.result
        out = self._close()
        for call in message.get("tool_calls") or ():
            block = _tool_use(call)
            out += self._open({**block, "input": {}})
            delta = {"type": "input_json_delta", "partial_json": orjson.dumps(block["input"]).decode()}
            out += _event("content_block_delta", {"index": self.index, "delta": delta})
            out += _event("content_block_stop", {"index": self.index})
        reason, sequence = stop_of(message, result, self.stop)
        out += _event(
            "message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": _usage(result)}
        )
        return out + _event("message_stop", {})

    def error(self, exc: GatewayError) -> bytes:
        """The stream's ``error`` event (the SDK raises it as the status's error)."""
        return error_event(exc)
