"""OpenAI's Responses wire (``POST /v1/responses``, what Codex CLI and the OpenAI Agents SDK's default model speak):
a request body checked field by field into a :class:`TurnRequest`, and the answer (one ``response`` object, or the
event stream the official SDK accumulates) built from a served turn.

Input items become the chat-shaped messages the core renders: a user/system/developer/assistant message as
itself, the reasoning, assistant message and ``function_call`` items of one reply as one assistant message
(``reasoning_content``, ``content``, ``tool_calls``), a ``function_call_output`` as a ``tool`` message. A harness
resending its whole history and one naming ``previous_response_id`` thus send the same messages, and both extend
the previous turn's exact ids.

A response id names its session and a suffix kept with the turn (``resp_<session>_<hex>``): the gateway keeps
every turn, so ``previous_response_id`` is answered from the store whatever ``store`` says.

Every field OpenAI defines is either honoured or refused by name; nothing is dropped.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import orjson
from aiohttp import web

from backends_core import JsonSchema, SamplingParams
from backends_gateway.errors import GatewayError
from backends_gateway.fields import (
    CompletionLimit,
    ToolChoice,
    bad,
    boolean,
    check_image,
    check_image_detail,
    completion_tokens,
    number,
    one_of,
    sampling_params,
    tool_choice,
)
from backends_gateway.gateway import Gateway, Served, Started
from backends_gateway.openai_chat import error_body
from backends_gateway.routing import (
    check_model,
    gateway_of,
    group_of,
    harness_session_of,
    is_retry,
    json_response,
    owner_of,
    read_json,
    scoped,
    session_of,
    shown,
    turn_headers,
)
from backends_gateway.sessions import TurnRecord, TurnRequest
from backends_gateway.streaming import deliver, stream_turn

__all__ = ["ResponsesCall", "create_response", "input_messages", "parse_responses_request", "response_object"]

_MESSAGE_ROLES = frozenset({"user", "system", "developer", "assistant"})
# what the gateway cannot do faithfully, refused rather than ignored (a value equal to the default is accepted)
_REFUSED = {
    "background": ("background responses", False),
    "conversation": ("conversations (send previous_response_id, or the whole input)", None),
    "prompt": ("stored prompt templates", None),
    "max_tool_calls": ("a bound on built-in tool calls", None),
    "service_tier": ("service tiers", "auto"),
    "safety_identifier": ("safety identifiers", None),
    "prompt_cache_retention": ("prompt cache retention", None),
    "prompt_cache_options": ("prompt cache options", None),
    "context_management": ("server-side context management (compaction)", None),
    "moderation": ("moderation", None),
    "top_logprobs": ("logprobs on the Responses route (the chat route has them)", 0),
}
_KNOWN = frozenset(
    {
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "max_output_tokens",
        "temperature",
        "top_p",
        "stream",
        "stream_options",
        "metadata",
        "user",
        "store",
        "text",
        "reasoning",
        "include",
        "truncation",
        "previous_response_id",
        "prompt_cache_key",
        "client_metadata",
        # vLLM's extension, as on the chat route
        "chat_template_kwargs",
        *_REFUSED,
    }
)
# the plain-text reasoning the gateway answers with is what a harness sends back to carry reasoning across stateless
# turns, which is what encrypted reasoning is for: asking for it is honoured by the content the gateway sends
_INCLUDABLE = frozenset({"reasoning.encrypted_content"})
_TOOL_KEYS = frozenset({"type", "name", "description", "parameters", "strict"})
_ITEM_KEYS = {
    "message": frozenset({"type", "role", "content", "id", "status", "phase"}),
    "function_call": frozenset({"type", "call_id", "name", "arguments", "id", "status"}),
    "function_call_output": frozenset({"type", "call_id", "output", "id", "status"}),
    "reasoning": frozenset({"type", "id", "summary", "content", "encrypted_content", "status"}),
}
_PART_KEYS = {
    "input_text": frozenset({"type", "text"}),
    "output_text": frozenset({"type", "text", "annotations", "logprobs"}),
}
_IMAGE_KEYS = frozenset({"type", "image_url", "detail", "file_id"})
_RESPONSE_ID = re.compile(r"resp_([A-Za-z0-9._:@~-]{1,193})_([0-9a-f]{24})")


@attrs.frozen(kw_only=True)
class ResponsesCall:
    """One checked Responses request: the new input as chat messages (after ``instructions``, and after the
    previous response's turn once :meth:`turn` is given it), and what the response echoes."""

    model: str
    stream: bool
    instructions: str | None
    messages: Sequence[Mapping[str, Any]]
    tools: Sequence[Mapping[str, Any]] | None
    sampling: SamplingParams
    chat_template_kwargs: Mapping[str, Any] | None
    previous_response_id: str | None
    metadata: Mapping[str, Any]
    echo: Mapping[str, Any]
    #: where each input_image part of ``input`` is (``input[2].content[1]``), in order
    image_parts: tuple[str, ...] = ()
    #: no max_output_tokens named: the turn may use what its prompt leaves of the model's context
    fit_context: bool = False
    tool_choice: ToolChoice | None = None

    def turn(self, suffix: str, previous: TurnRecord | None = None) -> TurnRequest:
        """The turn to generate: the previous response's messages and reply (its instructions replaced by this
        request's, as OpenAI does), then ``instructions`` (when there is no previous response) and the input."""
        if previous is None:
            head = [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
            messages = [*head, *self.messages]
        else:
            history = list(previous.messages)
            if previous.request.get("responses", {}).get("instructions"):
                history = history[1:]
            if self.instructions is not None:
                history.insert(0, {"role": "system", "content": self.instructions})
            messages = [*history, dict(previous.reply), *self.messages]
        if not messages:
            raise bad("input must hold at least one item", "input")
        responses = {"id": suffix, "instructions": self.instructions is not None}
        if self.previous_response_id is not None:
            responses["previous_response_id"] = self.previous_response_id
        # the previous response's images come first in the prompt
        earlier = () if previous is None else ("previous_response_id",) * len(previous.image_spans)
        return TurnRequest(
            messages=messages,
            tools=self.tools,
            sampling=self.sampling,
            chat_template_kwargs=self.chat_template_kwargs,
            metadata={**self.metadata, "responses": responses},
            image_parts=(*earlier, *self.image_parts),
            fit_context=self.fit_context,
            tool_choice=self.tool_choice,
        )


def _text_parts(content: Any, where: str, *, kinds: Mapping[str, frozenset[str]]) -> str | list[dict[str, str]]:
    """A message's content as chat content: a string, or the text parts (one part becomes its text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or a list of content parts", where, "invalid_type")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if not one_of(kind, kinds) or not isinstance(part.get("text"), str):
            raise bad(
                f"{where}[{j}] is a {kind!r} part: this gateway takes {' and '.join(sorted(kinds))} parts only",
                f"{where}[{j}]",
                "unsupported_content",
            )
        extra = sorted(set(part) - kinds[str(kind)])
        if extra:
            raise bad(f"unknown parameter {where}[{j}].{extra[0]}", f"{where}[{j}].{extra[0]}", "unknown_parameter")
        texts.append(part["text"])
    return texts[0] if len(texts) == 1 else [{"type": "text", "text": t} for t in texts]


def _image_part(part: Mapping[str, Any], where: str) -> dict[str, Any]:
    """An ``input_image`` part as the chat image part the client reads, its image checked."""
    extra = sorted(set(part) - _IMAGE_KEYS)
    if extra:
        raise bad(f"unknown parameter {where}.{extra[0]}", f"{where}.{extra[0]}", "unknown_parameter")
    if part.get("file_id") is not None:
        raise bad(
            f"{where}.file_id: this gateway has no files: send the image as image_url (a data: or http(s) URL)",
            f"{where}.file_id",
            "unsupported_parameter",
        )
    check_image_detail(part.get("detail"), f"{where}.detail")
    check_image(part.get("image_url"), f"{where}.image_url")
    return {"type": "image_url", "image_url": {"url": part["image_url"]}}


def _user_content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A user message's content as chat content: as :func:`_text_parts` gives it, or, when it holds images, its
    text and image parts in order."""
    if not isinstance(content, list) or not any(
        isinstance(p, dict) and p.get("type") == "input_image" for p in content
    ):
        return _text_parts(content, where, kinds=_PART_KEYS)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            parts.append(_image_part(part, at))
            continue
        if not one_of(kind, _PART_KEYS) or not isinstance(part.get("text"), str):
            raise bad(
                f"{at} is a {kind!r} part: this gateway takes input_image, input_text and output_text parts only",
                at,
                "unsupported_content",
            )
        extra = sorted(set(part) - _PART_KEYS[str(kind)])
        if extra:
            raise bad(f"unknown parameter {at}.{extra[0]}", f"{at}.{extra[0]}", "unknown_parameter")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _image_parts(value: Any) -> tuple[str, ...]:
    """Where each ``input_image`` part of the (checked) ``input`` is, in order."""
    if not isinstance(value, list):
        return ()
    return tuple(
        f"input[{i}].content[{j}]"
        for i, item in enumerate(value)
        if item.get("role") == "user" and isinstance(item.get("content"), list)
        for j, part in enumerate(item["content"])
        if part.get("type") == "input_image"
    )


def _item_kind(item: Mapping[str, Any], where: str) -> str:
    kind = item.get("type")
    if kind is None and "role" in item:
        return "message"
    if not one_of(kind, _ITEM_KEYS):
        raise bad(
            f"{where} is a {kind!r} item: this gateway takes message, function_call, function_call_output and "
            "reasoning items",
            f"{where}.type",
            "unsupported_parameter",
        )
    extra = sorted(set(item) - _ITEM_KEYS[kind])
    if extra:
        raise bad(f"unknown parameter {where}.{extra[0]}", f"{where}.{extra[0]}", "unknown_parameter")
    return str(kind)


def _string(item: Mapping[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad(f"{where}.{key} must be a string", f"{where}.{key}", "invalid_type")
    return value


def _reasoning_text(item: Mapping[str, Any], where: str) -> str | None:
    """A reasoning item's text (its ``content``); a summary alone is not what the model sampled, so it is not
    rendered as its reasoning."""
    if item.get("encrypted_content") is not None:
        raise bad(
            f"{where}.encrypted_content cannot be read by this gateway: send the reasoning as content "
            "(as the gateway answers it)",
            f"{where}.encrypted_content",
            "unsupported_parameter",
        )
    summary = item.get("summary", [])
    if not isinstance(summary, list):
        raise bad(f"{where}.summary must be a list", f"{where}.summary", "invalid_type")
    content = item.get("content")
    if content is None:
        return None
    if not isinstance(content, list):
        raise bad(f"{where}.content must be a list of reasoning_text parts", f"{where}.content", "invalid_type")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "reasoning_text" or not isinstance(part.get("text"), str):
            raise bad(f"{where}.content[{j}] must be a reasoning_text part", f"{where}.content[{j}]")
        texts.append(part["text"])
    return "".join(texts)


def _tool_output(item: Mapping[str, Any], where: str) -> str | list[dict[str, str]]:
    output = item.get("output")
    if isinstance(output, str):
        return output
    return _text_parts(output, f"{where}.output", kinds={"input_text": _PART_KEYS["input_text"]})


def input_messages(value: Any) -> list[dict[str, Any]]:
    """``input`` (a string or a list of items) as chat messages: consecutive reasoning, assistant message and
    ``function_call`` items (in the order a reply has them) are one assistant message."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise bad("input must be a string or a list of items", "input", "invalid_type")
    messages: list[dict[str, Any]] = []
    reply: dict[str, Any] | None = None  # the assistant message the items being read belong to
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(f"{where} must be an object, got {type(item).__name__}", where, "invalid_type")
        kind = _item_kind(item, where)
        if kind == "message":
            role = item.get("role")
            if not one_of(role, _MESSAGE_ROLES):
                raise bad(f"{where}.role must be one of {sorted(_MESSAGE_ROLES)}, got {role!r}", f"{where}.role")
            if role == "user":
                messages.append({"role": role, "content": _user_content(item.get("content"), f"{where}.content")})
                reply = None
                continue
            content = _text_parts(item.get("content"), f"{where}.content", kinds=_PART_KEYS)
            if role != "assistant":
                messages.append({"role": role, "content": content})
                reply = None
                continue
            if reply is None or reply.get("content") or reply.get("tool_calls"):
                reply = {"role": "assistant"}
                messages.append(reply)
            reply["content"] = content
        elif kind == "reasoning":
            text = _reasoning_text(item, where)
            if reply is None or "reasoning_content" in reply or reply.get("content") or reply.get("tool_calls"):
                reply = {"role": "assistant"}
                messages.append(reply)
            if text is not None:
                reply["reasoning_content"] = text
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)},
            }
            if reply is None:
                reply = {"role": "assistant"}
                messages.append(reply)
            reply.setdefault("tool_calls", []).append(call)
        else:
            tool_call_id = _string(item, "call_id", where)
            messages.append({"role": "tool", "tool_call_id": tool_call_id, "content": _tool_output(item, where)})
            reply = None
    for message in messages:
        if message["role"] == "assistant":
            message.setdefault("content", None if message.get("tool_calls") else "")
    return messages


#: tools the gateway does not offer to the model, each turn recording them (``request.tools_not_offered``): a
#: hosted web search runs on OpenAI's servers (nothing here can run it), and a namespace's tools (Codex's
#: sub-agents) have no rendering in a chat template, which takes function tools only
_NOT_OFFERED = {
    "web_search": "a hosted tool: OpenAI runs it, no local engine can",
    "web_search_preview": "a hosted tool: OpenAI runs it, no local engine can",
    "namespace": "a namespace of tools: the chat template renders function tools only",
}


def _tools(value: Any) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]], list[dict[str, Any]]]:
    """The function tools as the chat template takes them, as the response echoes them, and the tools not
    offered to the model (:data:`_NOT_OFFERED`, with why)."""
    if value is None:
        return None, [], []
    if not isinstance(value, list):
        raise bad("tools must be a list", "tools", "invalid_type")
    chat, echo, skipped = [], [], []
    for i, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind in _NOT_OFFERED:
            assert isinstance(tool, dict)
            skipped.append({"tool": dict(tool), "why": _NOT_OFFERED[kind]})
            continue
        if kind != "function":
            raise bad(
                f"tools[{i}] is a {kind!r} tool: this gateway serves function tools only (the harness runs them)",
                f"tools[{i}].type",
                "unsupported_parameter",
            )
        extra = sorted(set(tool) - _TOOL_KEYS)
        if extra:
            raise bad(f"unknown parameter tools[{i}].{extra[0]}", f"tools[{i}].{extra[0]}", "unknown_parameter")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad(f"tools[{i}].name must be a non-empty string", f"tools[{i}].name")
        if tool.get("parameters") is not None and not isinstance(tool["parameters"], dict):
            raise bad(f"tools[{i}].parameters must be a JSON schema object", f"tools[{i}].parameters")
        function = {k: v for k, v in tool.items() if k != "type" and v is not None}
        chat.append({"type": "function", "function": function})
        echo.append(
            {
                "type": "function",
                "name": tool["name"],
                "description": tool.get("description"),
                "parameters": tool.get("parameters"),
                "strict": tool.get("strict"),
            }
        )
    return chat or None, echo, skipped


def _text_format(value: Any) -> JsonSchema | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad("text must be an object", "text", "invalid_type")
    extra = sorted(set(value) - {"format", "verbosity"})
    if extra:
        raise bad(f"unknown parameter text.{extra[0]}", f"text.{extra[0]}", "unknown_parameter")
    if value.get("verbosity") not in (None, "medium"):
        raise bad("text.verbosity is not supported by this gateway", "text.verbosity", "unsupported_parameter")
    fmt = value.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return JsonSchema({"type": "object"})
    if kind == "json_schema":
        assert isinstance(fmt, dict)
        if not isinstance(fmt.get("schema"), dict):
            raise bad("text.format.schema must be an object", "text.format.schema")
        return JsonSchema(fmt["schema"])
    raise bad(f"text.format.type must be text, json_object or json_schema, got {kind!r}", "text.format")


def _check_reasoning(value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise bad("reasoning must be an object", "reasoning", "invalid_type")
    extra = sorted(set(value) - {"effort", "summary", "generate_summary"})
    if extra:
        raise bad(f"unknown parameter reasoning.{extra[0]}", f"reasoning.{extra[0]}", "unknown_parameter")
    for key in ("summary", "generate_summary"):
        if value.get(key) not in (None, "auto", "concise", "detailed"):
            raise bad(
                f"reasoning.{key} must be auto, concise or detailed, got {value[key]!r}",
                f"reasoning.{key}",
                "invalid_value",
            )
    for key, why in (("effort", "reasoning effort (pass chat_template_kwargs, e.g. enable_thinking)"),):
        if value.get(key) is not None:
            raise bad(
                f"reasoning.{key} is not supported by this gateway: {why}", f"reasoning.{key}", "unsupported_parameter"
            )


def _check_include(value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, list):
        raise bad("include must be a list", "include", "invalid_type")
    for i, name in enumerate(value):
        if not one_of(name, _INCLUDABLE):
            raise bad(
                f"include[{i}] {name!r} is not supported by this gateway (it answers {sorted(_INCLUDABLE)})",
                f"include[{i}]",
                "unsupported_parameter",
            )


def parse_response_id(value: Any, where: str = "previous_response_id") -> tuple[str, str]:
    """The session and suffix a response id names."""
    match = _RESPONSE_ID.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        raise GatewayError(
            404,
            f"no response {value!r}: this gateway's response ids are resp_<session>_<24 hex digits>",
            kind="not_found_error",
            param=where,
            code="not_found",
        )
    return match[1], match[2]


def parse_responses_request(body: Any, *, limit: CompletionLimit) -> ResponsesCall:
    """Check a Responses body (decoded JSON) and turn it into a :class:`ResponsesCall`.

    :param limit: the gateway's bound on a turn's completion; a request naming no ``max_output_tokens`` may use
        what its prompt leaves of the model's context.
    :raises GatewayError: naming the field (400), before anything is sent.
    """
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object", "body", "invalid_type")
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise bad(f"unknown parameter {unknown[0]!r}", unknown[0], "unknown_parameter")
    for key, (why, default) in _REFUSED.items():
        if body.get(key) is not None and body[key] != default:
            raise bad(f"{key} is not supported by this gateway: {why}", key, "unsupported_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model must be a non-empty string", "model", "invalid_type")
    if "input" not in body and body.get("previous_response_id") is None:
        raise bad("input is required", "input", "invalid_type")
    messages = input_messages(body.get("input", []))
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("instructions must be a string", "instructions", "invalid_type")
    tools, tools_echo, not_offered = _tools(body.get("tools"))
    choice = body.get("tool_choice")
    named = choice.get("name") if isinstance(choice, dict) and choice.get("type") == "function" else None
    forced = tool_choice(
        choice, body.get("parallel_tool_calls"), tools=tools, named=named if isinstance(named, str) else None
    )
    stream = boolean(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise bad("stream_options is only allowed with stream=true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_obfuscation"}:
            raise bad("stream_options takes include_obfuscation only", "stream_options", "unsupported_parameter")
    max_tokens = completion_tokens(body, "max_output_tokens", limit)
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad("chat_template_kwargs must be an object", "chat_template_kwargs", "invalid_type")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise bad("metadata must be an object", "metadata", "invalid_type")
    for key in ("user", "prompt_cache_key"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise bad(f"{key} must be a string", key, "invalid_type")
    boolean(body, "store")
    if body.get("truncation") not in (None, "disabled"):
        raise bad(
            "truncation 'auto' is not supported: the gateway never drops input (a prompt past the context fails)",
            "truncation",
            "unsupported_parameter",
        )
    _check_reasoning(body.get("reasoning"))
    _check_include(body.get("include"))
    structured = _text_format(body.get("text"))
    previous = body.get("previous_response_id")
    if previous is not None:
        parse_response_id(previous)
    temperature = number(body, "temperature", low=0.0, high=2.0)
    top_p = number(body, "top_p", low=0.0, high=1.0)
    sampling = sampling_params(
        {"max_tokens": "max_output_tokens"},
        max_tokens=max_tokens or limit.tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        structured=structured,
    )
    echo = {
        "instructions": instructions,
        "max_output_tokens": max_tokens,
        "metadata": metadata or {},
        "parallel_tool_calls": True,
        "previous_response_id": previous,
        "reasoning": {"effort": None, "summary": None},
        "store": body.get("store", True),
        "temperature": sampling.temperature,
        "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
        "tool_choice": choice or "auto",
        "tools": tools_echo,
        "top_p": sampling.top_p,
        "truncation": "disabled",
        "user": body.get("user"),
    }
    client_metadata = body.get("client_metadata")
    if client_metadata is not None and not isinstance(client_metadata, dict):
        raise bad("client_metadata must be an object", "client_metadata", "invalid_type")
    recorded = {
        k: body[k] for k in ("user", "metadata", "prompt_cache_key", "client_metadata") if body.get(k) is not None
    }
    if not_offered:
        recorded["tools_not_offered"] = not_offered
    return ResponsesCall(
        model=model,
        stream=bool(stream),
        instructions=instructions,
        messages=messages,
        tools=tools,
        sampling=sampling,
        chat_template_kwargs=kwargs,
        previous_response_id=previous,
        metadata=recorded,
        echo=echo,
        image_parts=_image_parts(body.get("input")),
        fit_context=max_tokens is None,
        tool_choice=forced,
    )


# -- the answer ----------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class _Ids:
    """The ids of one response and its items, fixed before the stream starts so every event agrees."""

    response: str
    suffix: str

    @property
    def reasoning(self) -> str:
        return f"rs_{self.suffix}"

    @property
    def message(self) -> str:
        return f"msg_{self.suffix}"

    def call(self, i: int) -> str:
        return f"fc_{self.suffix}_{i}"


def _reasoning_item(ids: _Ids, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": ids.reasoning,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def _message_item(ids: _Ids, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status != "in_progress" else []
    return {"type": "message", "id": ids.message, "role": "assistant", "status": status, "content": content}


def _call_item(ids: _Ids, i: int, call: Mapping[str, Any], arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": ids.call(i),
        "call_id": call.get("id") or ids.call(i),
        "name": call["function"]["name"],
        "arguments": arguments,
        "status": status,
    }


def _arguments(call: Mapping[str, Any]) -> str:
    arguments = call["function"].get("arguments", "")
    return arguments if isinstance(arguments, str) else orjson.dumps(arguments).decode()


def output_items(ids: _Ids, message: Mapping[str, Any], finish: str) -> list[dict[str, Any]]:
    """The reply as output items: its reasoning, its text (always a message when it calls no tool), its calls."""
    status = "incomplete" if finish == "length" else "completed"
    items = []
    if message.get("reasoning_content"):
        items.append(_reasoning_item(ids, message["reasoning_content"], status))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append(_message_item(ids, message.get("content") or "", status))
    items.extend(_call_item(ids, i, call, _arguments(call), status) for i, call in enumerate(calls))
    return items


def _usage(gateway: Gateway, served: Served) -> dict[str, Any]:
    result = served.result
    prompt, completion = len(result.prompt_ids), len(result.completion_ids)
    cached = result.usage.cached_tokens if result.usage is not None else None
    reasoning = served.message.get("reasoning_content") or ""
    # the reasoning's length in tokens as the tokenizer reads it back (the completion's split is not kept)
    reasoning_tokens = min(completion, len(gateway.client.tokenizer.encode(reasoning))) if reasoning else 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached or 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt + completion,
    }


def response_object(
    call: ResponsesCall,
    ids: _Ids,
    created: int,
    *,
    served: Served | None = None,
    gateway: Gateway | None = None,
) -> dict[str, Any]:
    """The ``response`` object: in progress (``served=None``) or answered."""
    body: dict[str, Any] = {
        "id": ids.response,
        "object": "response",
        "created_at": created,
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "model": call.model,
        "output": [],
        "usage": None,
        **call.echo,
    }
    if served is not None:
        assert gateway is not None
        finish = served.result.finish_reason
        body["output"] = output_items(ids, served.message, finish)
        body["usage"] = _usage(gateway, served)
        if finish == "length":
            body["status"], body["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
        else:
            body["status"] = "completed"
            body["completed_at"] = int(time.time())
    return body


# -- the route -------------------------------------------------------------------------------------------------


async def _previous(request: web.Request, call: ResponsesCall, session: str | None) -> TurnRecord:
    ident = call.previous_response_id
    assert ident is not None
    shown_as, suffix = parse_response_id(ident)
    named = scoped(request, shown_as, "previous_response_id")
    if session is not None and session != named:
        raise bad(
            f"previous_response_id {ident!r} is a response of session {shown_as!r}, not of {shown(request, session)!r}",
            "previous_response_id",
        )
    missing = GatewayError(
        404, f"no response {ident!r}", kind="not_found_error", param="previous_response_id", code="not_found"
    )
    try:
        turn = await gateway_of(request).find_turn(
            named, lambda t: t.request.get("responses", {}).get("id") == suffix, owner=owner_of(request)
        )
    except GatewayError as exc:
        if exc.status == 404:  # no such session (or another key's): no such response
            raise missing from None
        raise
    if turn is None:
        raise missing
    return turn


async def create_response(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses``: a turn, answered as a ``response`` object or its event stream."""
    gateway = gateway_of(request)
    body = await read_json(request)
    call = parse_responses_request(body, limit=gateway.completion_limit)
    check_model(gateway, call.model)
    session = session_of(request)
    owner = owner_of(request)
    previous = None
    if call.previous_response_id is not None:
        previous = await _previous(request, call, session)
        session = previous.session
    suffix = uuid.uuid4().hex[:24]
    turn = call.turn(suffix, previous)
    group = group_of(request)
    harness = harness_session_of(request, body)
    retry = is_retry(request)
    created = int(time.time())
    if call.stream:
        return await _stream(
            request,
            gateway,
            call,
            turn,
            suffix,
            created,
            session=session,
            harness_session=harness,
            group=group,
            retry=retry,
        )
    served = await gateway.turn(turn, session=session, harness_session=harness, group=group, owner=owner, retry=retry)
    kept = _suffix_of(served.record, suffix)
    ids = _Ids(response=f"resp_{shown(request, served.session)}_{kept}", suffix=kept)
    answer = json_response(
        response_object(call, ids, created, served=served, gateway=gateway), headers=turn_headers(request, served)
    )
    return await deliver(request, gateway, served, answer)


class _Events:
    """The Responses event stream of one turn: items opened as their text arrives, closed in order."""

    def __init__(self, call: ResponsesCall, ids: _Ids, created: int, gateway: Gateway) -> None:
        self.out: list[bytes] = []
        self.gateway = gateway
        self.call = call
        self.ids = ids
        self.created = created
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # items sent, the open one last
        self.open: str | None = None  # "reasoning" or "message": the item text is being sent to
        self.streamed = ""

    def send(self, kind: str, **fields: Any) -> None:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.out.append(b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(body) + b"\n\n")
        self.sequence += 1

    def _flush(self) -> bytes:
        out, self.out = b"".join(self.out), []
        return out

    def start(self) -> bytes:
        body = response_object(self.call, self.ids, self.created)
        self.send("response.created", response=body)
        self.send("response.in_progress", response=body)
        return self._flush()

    def _open(self, kind: str) -> None:
        self.close()
        index = len(self.items)
        if kind == "reasoning":
            item = _reasoning_item(self.ids, "", "in_progress")
            item["content"] = []
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            item = _message_item(self.ids, "", "in_progress")
            part = {"type": "output_text", "text": "", "annotations": []}
        self.items.append(item)
        self.open, self.streamed = kind, ""
        self.send("response.output_item.added", output_index=index, item=item)
        self.send("response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=part)

    def text(self, kind: str, text: str) -> bytes:
        self._text(kind, text)
        return self._flush()

    def _text(self, kind: str, text: str) -> None:
        wanted = "reasoning" if kind == "reasoning" else "message"
        if self.open != wanted:
            self._open(wanted)
        self.streamed += text
        index = len(self.items) - 1
        item_id = self.items[-1]["id"]
        if wanted == "reasoning":
            self.send("response.reasoning_text.delta", item_id=item_id, output_index=index, content_index=0, delta=text)
        else:
            self.send(
                "response.output_text.delta",
                item_id=item_id,
                output_index=index,
                content_index=0,
                delta=text,
                logprobs=[],
            )

    def close(self, final: Mapping[str, Any] | None = None) -> None:
        """Close the open item (``final``: its whole form, from the answered turn)."""
        if self.open is None:
            return
        index = len(self.items) - 1
        item = self.items[-1]
        if final is None:
            final = (
                _reasoning_item(self.ids, self.streamed, "completed")
                if self.open == "reasoning"
                else _message_item(self.ids, self.streamed, "completed")
            )
        part = final["content"][0]
        if self.open == "reasoning":
            self.send(
                "response.reasoning_text.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=part["text"],
            )
        else:
            self.send(
                "response.output_text.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=part["text"],
                logprobs=[],
            )
        self.send("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part)
        self.send("response.output_item.done", output_index=index, item=final)
        self.items[-1] = dict(final)
        self.open = None

    def finish(self, served: Served) -> bytes:
        self._finish(served)
        return self._flush()

    def error(self, exc: GatewayError) -> bytes:
        error = error_body(exc)["error"]
        self.send("error", code=exc.code, message=exc.message, param=exc.param, error=error)
        return self._flush()

    def _finish(self, served: Served) -> None:
        """The items the streamed text did not open (an empty message, the calls), then the whole response."""
        body = response_object(self.call, self.ids, self.created, served=served, gateway=self.gateway)
        output = body["output"]
        if [i["type"] for i in self.items] != [i["type"] for i in output[: len(self.items)]]:
            raise GatewayError(
                500,
                f"the streamed items {[i['type'] for i in self.items]} do not start the whole parse's "
                f"{[i['type'] for i in output]}",
                kind="server_error",
                code="stream_parse",
            )
        if self.open is not None:
            self.close(output[len(self.items) - 1])
        for index in range(len(self.items), len(output)):
            item = output[index]
            if item["type"] == "message":
                self.open, self.streamed = None, ""
                self._open("message")
                self.close(item)
                continue
            added = {**item, "arguments": "", "status": "in_progress"}
            self.items.append(added)
            self.send("response.output_item.added", output_index=index, item=added)
            self.send(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=index,
                delta=item["arguments"],
            )
            self.send(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=item["arguments"],
            )
            self.send("response.output_item.done", output_index=index, item=item)
            self.items[-1] = item
        kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
        self.send(kind, response=body)


async def _stream(
    request: web.Request,
    gateway: Gateway,
    call: ResponsesCall,
    turn: TurnRequest,
    suffix: str,
    created: int,
    *,
    session: str | None,
    harness_session: str | None,
    group: str | None,
    retry: bool,
) -> web.StreamResponse:
    events = gateway.stream_turn(
        turn,
        session=session,
        harness_session=harness_session,
        group=group,
        owner=owner_of(request),
        retry=retry,
    )

    def wire(first: Started) -> _Events:
        kept = suffix if first.replay is None else _suffix_of(first.replay, suffix)
        ids = _Ids(response=f"resp_{shown(request, first.session)}_{kept}", suffix=kept)
        return _Events(call, ids, created, gateway)

    return await stream_turn(request, gateway, events, wire)


def _suffix_of(turn: TurnRecord, default: str) -> str:
    """The response id suffix a kept turn was answered under (a retry answered with it gets the same ids)."""
    suffix = turn.request.get("responses", {}).get("id")
    return suffix if isinstance(suffix, str) else default
