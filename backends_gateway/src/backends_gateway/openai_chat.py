"""OpenAI's chat-completions wire: a request body checked field by field into a :class:`Turn` request, and the
answer (one body, or the chunk stream the official SDK accumulates) built from a served turn.

Every field OpenAI defines is either honoured or refused by name (``unsupported_parameter``); nothing is dropped.
The vLLM extensions harnesses send to open-weight servers (``top_k``, ``min_p``, ``repetition_penalty``,
``chat_template_kwargs``...) are honoured as vLLM's OpenAI server does.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

import attrs
import orjson

from backends_core import GenerateResult, JsonSchema
from backends_gateway.errors import GatewayError
from backends_gateway.fields import (
    CompletionLimit,
    bad,
    boolean,
    check_image,
    check_image_detail,
    completion_tokens,
    integer,
    number,
    one_of,
    sampling_params,
    tool_choice,
)
from backends_gateway.sessions import TurnRequest

__all__ = ["ChatCall", "ChatStream", "chat_completion", "chunk", "error_body", "parse_chat_request", "token_logprobs"]

_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
# what the gateway cannot do faithfully, refused rather than ignored
_REFUSED = {
    "n": "one choice per turn: run one session per sample (X-Session-Group groups them)",
    "functions": "the legacy functions field: send tools",
    "function_call": "the legacy function_call field: send tool_choice",
    "audio": "audio output",
    "modalities": "output modalities other than text",
    "prediction": "predicted outputs",
    "web_search_options": "web search",
    "service_tier": "service tiers",
    "reasoning_effort": "reasoning effort (pass chat_template_kwargs, e.g. enable_thinking)",
    "verbosity": "verbosity",
    "prompt_cache_key": "prompt cache keys (sessions and salts are the gateway's)",
    "safety_identifier": "safety identifiers",
}
_IGNORED_WHEN_DEFAULT = {"n": 1, "parallel_tool_calls": True, "store": False, "service_tier": "auto"}


def _is_default(key: str, value: Any) -> bool:
    """Whether a refused parameter only restates its default (of the default's own type: ``n: true`` is not 1)."""
    default = _IGNORED_WHEN_DEFAULT.get(key, object())
    return type(value) is type(default) and value == default


_KNOWN = frozenset(
    {
        "model",
        "messages",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "stream",
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "top_logprobs",
        "response_format",
        "user",
        "metadata",
        "store",
        # vLLM's extensions
        "top_k",
        "min_p",
        "repetition_penalty",
        "min_tokens",
        "ignore_eos",
        "stop_token_ids",
        "chat_template_kwargs",
        "return_routed_experts",
        *_REFUSED,
    }
)


@attrs.frozen(kw_only=True)
class ChatCall:
    """One checked chat-completions request."""

    turn: TurnRequest
    model: str
    stream: bool
    include_usage: bool
    logprobs: bool


def _check_image_part(part: dict[str, Any], where: str) -> None:
    extra = sorted(set(part) - {"type", "image_url"})
    if extra:
        raise bad(f"unknown parameter {where}.{extra[0]}", f"{where}.{extra[0]}", "unknown_parameter")
    value = part.get("image_url")
    if not isinstance(value, dict):
        raise bad(f'{where}.image_url must be an object {{"url": ...}}', f"{where}.image_url", "invalid_type")
    extra = sorted(set(value) - {"url", "detail"})
    if extra:
        raise bad(
            f"unknown parameter {where}.image_url.{extra[0]}", f"{where}.image_url.{extra[0]}", "unknown_parameter"
        )
    check_image_detail(value.get("detail"), f"{where}.image_url.detail")
    check_image(value.get("url"), f"{where}.image_url.url")


def _check_messages(messages: Any) -> tuple[list[dict[str, Any]], tuple[str, ...]]:
    """The messages, and where each image part is (in prompt order)."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list of messages", "messages", "invalid_type")
    images: list[str] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(f"{where} must be an object, got {type(message).__name__}", where, "invalid_type")
        role = message.get("role")
        if not one_of(role, _ROLES):
            raise bad(f"{where}.role must be one of {sorted(_ROLES)}, got {role!r}", f"{where}.role")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise bad(f"{where}.content must be a string or a list of parts", f"{where}.content", "invalid_type")
        if isinstance(content, list):
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                at = f"{where}.content[{j}]"
                if kind == "image_url" and role == "user":
                    _check_image_part(part, at)
                    images.append(at)
                elif kind != "text" or not isinstance(part.get("text"), str):
                    takes = "text parts, and image_url parts in user messages" if kind == "image_url" else "text parts"
                    raise bad(f"{at} is a {kind!r} part: this gateway takes {takes}", at, "unsupported_content")
        calls = message.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list):
                raise bad(f"{where}.tool_calls must be a list on an assistant message", f"{where}.tool_calls")
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise bad(f"{where}.tool_calls[{j}] needs function.name", f"{where}.tool_calls[{j}]")
                if not isinstance(fn.get("arguments"), str | dict):
                    raise bad(
                        f"{where}.tool_calls[{j}].function.arguments must be a JSON string",
                        f"{where}.tool_calls[{j}].function.arguments",
                    )
        if role == "tool" and not isinstance(message.get("tool_call_id", ""), str):
            raise bad(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id", "invalid_type")
    return messages, tuple(images)


def _check_tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("tools must be a list", "tools", "invalid_type")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise bad(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}', f"tools[{i}]")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"tools[{i}].function.name must be a non-empty string", f"tools[{i}].function.name")
    return tools or None


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value) and len(value) <= 16:
        return tuple(value)
    raise bad("stop must be a string or a list of at most 16 strings", "stop", "invalid_type")


def _logit_bias(value: Any) -> dict[int, float]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad("logit_bias must map token ids to biases", "logit_bias", "invalid_type")
    out: dict[int, float] = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise bad(f"logit_bias keys are token ids, got {key!r}", "logit_bias") from None
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise bad(f"logit_bias[{key}] must be a number in [-100, 100], got {bias!r}", "logit_bias")
        out[token] = float(bias)
    return out


def _response_format(value: Any) -> JsonSchema | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return JsonSchema({"type": "object"})
    if kind == "json_schema":
        schema = value.get("json_schema")
        if not isinstance(schema, dict) or not isinstance(schema.get("schema"), dict):
            raise bad("response_format.json_schema.schema must be an object", "response_format.json_schema")
        return JsonSchema(schema["schema"])
    raise bad(f"response_format.type must be text, json_object or json_schema, got {kind!r}", "response_format")


def parse_chat_request(body: Any, *, limit: CompletionLimit) -> ChatCall:
    """Check a chat-completions body (decoded JSON) and turn it into a :class:`ChatCall`.

    :param limit: the gateway's bound on a turn's completion; a request naming no
        ``max_completion_tokens``/``max_tokens`` may use what its prompt leaves of the model's context (OpenAI's
        "as many as the model allows").
    :raises GatewayError: naming the field (400), before anything is sent.
    """
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object", "body", "invalid_type")
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise bad(f"unknown parameter {unknown[0]!r}", unknown[0], "unknown_parameter")
    for key, why in _REFUSED.items():
        if key in body and body[key] is not None and not _is_default(key, body[key]):
            raise bad(f"{key} is not supported by this gateway: {why}", key, "unsupported_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model must be a non-empty string", "model", "invalid_type")
    messages, image_parts = _check_messages(body.get("messages"))
    tools = _check_tools(body.get("tools"))
    choice = body.get("tool_choice")
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    forced = tool_choice(
        choice,
        body.get("parallel_tool_calls"),
        tools=tools,
        named=fn.get("name") if isinstance(fn, dict) and isinstance(fn.get("name"), str) else None,
    )
    stream = boolean(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad("stream_options is only allowed with stream=true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise bad("stream_options takes include_usage only", "stream_options", "unsupported_parameter")
        include_usage = bool(boolean(options, "include_usage"))
    named = body.get("max_completion_tokens")
    key = "max_completion_tokens"
    if named is None:
        named, key = body.get("max_tokens"), "max_tokens"
    max_tokens = completion_tokens({key: named}, key, limit)
    logprobs = boolean(body, "logprobs")
    top = integer(body, "top_logprobs", low=0, high=20) or 0
    if top and not logprobs:
        raise bad("top_logprobs needs logprobs=true", "top_logprobs")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad("chat_template_kwargs must be an object", "chat_template_kwargs", "invalid_type")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise bad("metadata must be an object", "metadata", "invalid_type")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("user must be a string", "user", "invalid_type")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and (
        not isinstance(stop_ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in stop_ids)
    ):
        raise bad("stop_token_ids must be a list of token ids", "stop_token_ids", "invalid_type")
    for flag in ("ignore_eos", "return_routed_experts", "store"):
        boolean(body, flag)
    temperature = number(body, "temperature", low=0.0, high=2.0)
    top_p = number(body, "top_p", low=0.0, high=1.0)
    top_k = integer(body, "top_k", low=-1)
    sampling = sampling_params(
        max_tokens=max_tokens or limit.tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=-1 if top_k in (None, 0) else top_k,
        min_p=number(body, "min_p", low=0.0, high=1.0) or 0.0,
        seed=integer(body, "seed", low=-(2**63), high=2**63 - 1),
        stop=_stop(body.get("stop")),
        stop_token_ids=tuple(stop_ids) if stop_ids else None,
        presence_penalty=number(body, "presence_penalty", low=-2.0, high=2.0) or 0.0,
        frequency_penalty=number(body, "frequency_penalty", low=-2.0, high=2.0) or 0.0,
        repetition_penalty=number(body, "repetition_penalty", low=0.01, high=10.0) or 1.0,
        min_tokens=integer(body, "min_tokens", low=0) or 0,
        ignore_eos=bool(body.get("ignore_eos")),
        logit_bias=_logit_bias(body.get("logit_bias")),
        top_logprobs=top,
        structured=_response_format(body.get("response_format")),
    )
    turn = TurnRequest(
        messages=messages,
        tools=tools,
        sampling=sampling,
        chat_template_kwargs=kwargs,
        return_routed_experts=bool(body.get("return_routed_experts")),
        metadata={k: v for k, v in (("user", user), ("metadata", metadata)) if v is not None},
        image_parts=image_parts,
        fit_context=max_tokens is None,
        tool_choice=forced,
    )
    return ChatCall(turn=turn, model=model, stream=bool(stream), include_usage=include_usage, logprobs=bool(logprobs))


def error_body(exc: GatewayError) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": exc.message, "type": exc.kind, "param": exc.param, "code": exc.code}}


def finish_reason(message: Mapping[str, Any], finish: str) -> str:
    """OpenAI's finish reason: ``tool_calls`` when the reply calls tools, else the engine's."""
    return "tool_calls" if message.get("tool_calls") and finish == "stop" else finish


def wire_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """The assistant message as OpenAI's chat completion carries it (``reasoning_content`` as vLLM sends it)."""
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content") or None}
    if message.get("reasoning_content"):  # an empty reasoning block is no reasoning (as a stream sends none)
        out["reasoning_content"] = message["reasoning_content"]
    if message.get("tool_calls"):
        out["tool_calls"] = list(message["tool_calls"])
    if out["content"] is None and not message.get("tool_calls"):
        out["content"] = ""
    return out


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chat_completion(
    *,
    id: str,
    model: str,
    message: Mapping[str, Any],
    finish: str,
    prompt_tokens: int,
    completion_tokens: int,
    logprobs: list[dict[str, Any]] | None,
    fingerprint: str | None,
) -> dict[str, Any]:
    """A whole ``chat.completion`` body."""
    return {
        "id": id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": fingerprint,
        "choices": [
            {
                "index": 0,
                "message": wire_message(message),
                "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
                "finish_reason": finish_reason(message, finish),
            }
        ],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def chunk(
    *,
    id: str,
    model: str,
    created: int,
    delta: Mapping[str, Any] | None,
    finish: str | None = None,
    logprobs: list[dict[str, Any]] | None = None,
    usage_: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """One ``chat.completion.chunk``; ``delta=None`` gives the usage chunk (no choices)."""
    body: dict[str, Any] = {"id": id, "object": "chat.completion.chunk", "created": created, "model": model}
    if delta is None:
        body["choices"] = []
        body["usage"] = dict(usage_ or {})
        return body
    body["choices"] = [
        {
            "index": 0,
            "delta": dict(delta),
            "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
            "finish_reason": finish,
        }
    ]
    return body


def token_logprobs(tokenizer: Any, result: GenerateResult) -> list[dict[str, Any]]:
    """The completion's per-token logprobs in OpenAI's form (each token's text and bytes, its top alternatives)."""
    tops = result.top_logprobs

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    out = []
    for i, (token_id, logprob) in enumerate(zip(result.completion_ids, result.logprobs.tolist(), strict=True)):
        item = entry(token_id, logprob)
        item["top_logprobs"] = [] if tops is None else [entry(t.token_id, t.logprob) for t in tops[i]]
        out.append(item)
    return out


class ChatStream:
    """A streamed turn as ``chat.completion.chunk`` events: the role, the text as it streams, then (once the turn
    is durable) the tool calls, the finish reason (with logprobs when asked) and usage, then ``[DONE]``."""

    def __init__(self, call: ChatCall, session: str, tokenizer: Any) -> None:
        self.call = call
        self.tokenizer = tokenizer
        self.id = f"chatcmpl-{session}-{uuid.uuid4().hex[:12]}"
        self.created = int(time.time())

    def _chunk(self, delta: Mapping[str, Any] | None, **fields: Any) -> bytes:
        body = chunk(id=self.id, model=self.call.model, created=self.created, delta=delta, **fields)
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def start(self) -> bytes:
        return self._chunk({"role": "assistant", "content": ""})

    def text(self, kind: str, text: str) -> bytes:
        return self._chunk({"content" if kind == "content" else "reasoning_content": text})

    def finish(self, served: Any) -> bytes:
        message, result = served.message, served.result
        out = [
            self._chunk({"tool_calls": [{"index": i, **call}]})
            for i, call in enumerate(message.get("tool_calls") or ())
        ]
        logprobs = token_logprobs(self.tokenizer, result) if self.call.logprobs else None
        out.append(self._chunk({}, finish=finish_reason(message, result.finish_reason), logprobs=logprobs))
        if self.call.include_usage:
            out.append(self._chunk(None, usage_=usage(len(result.prompt_ids), len(result.completion_ids))))
        return b"".join(out) + _DONE

    def error(self, exc: GatewayError) -> bytes:
        return b"data: " + orjson.dumps(error_body(exc)) + b"\n\n" + _DONE


_DONE = b"data: [DONE]\n\n"
