"""The request schema Dynamo 1.6.1's frontend enforces, and its 400 messages.

``nvext`` and its nested objects are deny-unknown (serde): an unknown key is a 400 listing every accepted
field, with the position of the key in the body. Unknown top-level keys are a 400 "Unsupported parameter(s)".
Field lists: the binary's own error messages (captures) and the OpenAI request schema.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from backends_testkit import emulator

__all__ = [
    "CHAT_FIELDS",
    "COMPLETION_FIELDS",
    "NVEXT_FIELDS",
    "HttpError",
    "check_nvext",
    "check_top_level",
]

_DESERIALIZE = "Failed to deserialize the JSON body into the target type: "
NVEXT_FIELDS = (
    "greed_sampling",
    "use_raw_prompt",
    "annotations",
    "backend_instance_id",
    "token_data",
    "max_thinking_tokens",
    "cache_salt",
    "extra_fields",
    "metadata_upload",
    "prefill_worker_id",
    "decode_worker_id",
    "dp_rank",
    "prefill_dp_rank",
    "agent_hints",
    "request_timestamp_ms",
    "routing_constraints",
    "router",
)
_NESTED = {
    "agent_hints": ("priority", "strict_priority", "osl", "speculative_prefill", "latency_sensitivity"),
    "routing_constraints": ("required_taints", "preferred_taints"),
    "router": ("ttft_target", "itl_target"),
    "metadata_upload": ("url",),
}
#: Extensions every generation route accepts besides the OpenAI fields (Dynamo's ``CommonExt``).
_COMMON_EXT = (
    "nvext",
    "ignore_eos",
    "min_tokens",
    "top_k",
    "min_p",
    "repetition_penalty",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "prompt_logprobs",
    "guided_json",
    "guided_regex",
    "guided_grammar",
    "guided_choice",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
    "stop_token_ids",
    "return_tokens_as_token_ids",
    "chat_template_kwargs",
    "max_completion_tokens",
    "cache_salt",
)
_OPENAI_COMMON = (
    "model",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "max_tokens",
    "n",
    "presence_penalty",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "user",
)
CHAT_FIELDS = frozenset(
    (
        *_OPENAI_COMMON,
        *_COMMON_EXT,
        "messages",
        "store",
        "reasoning_effort",
        "metadata",
        "top_logprobs",
        "modalities",
        "prediction",
        "audio",
        "response_format",
        "service_tier",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "function_call",
        "functions",
        "web_search_options",
    )
)
COMPLETION_FIELDS = frozenset((*_OPENAI_COMMON, *_COMMON_EXT, "prompt", "best_of", "echo", "suffix"))


class HttpError(emulator.HttpError):
    """Becomes an error answer: ``status`` with ``body`` (the frontend's ``{"message", "type", "code"}`` shape
    unless a body is given)."""

    _TYPES: ClassVar[dict[int, str]] = {
        400: "Bad Request",
        404: "Not Found",
        500: "Internal Server Error",
        503: "Service Unavailable",
    }

    def __init__(self, status: int, message: str, *, body: Any = None) -> None:
        self.status = status
        self.body = body if body is not None else {"message": message, "type": self._TYPES[status], "code": status}
        super().__init__(emulator.json_reply(status, self.body), message)


def _expected(fields: tuple[str, ...]) -> str:
    quoted = [f"`{f}`" for f in fields]
    if len(quoted) == 1:
        return f"expected {quoted[0]}"
    if len(quoted) == 2:
        return f"expected {quoted[0]} or {quoted[1]}"
    return "expected one of " + ", ".join(quoted)


def _position(raw: str, key: str, after: str) -> str:
    """serde's ``line L column C`` of the closing quote of ``key``, searched after ``after``."""
    start = raw.find(f'"{after}"')
    index = raw.find(f'"{key}"', max(start, 0))
    if index < 0:
        return "line 1 column 1"
    end = index + len(key) + 1
    line = raw.count("\n", 0, end) + 1
    column = end - (raw.rfind("\n", 0, end) + 1) + 1
    return f"line {line} column {column}"


def _unknown(key: str, fields: tuple[str, ...], raw: str, after: str) -> HttpError:
    return HttpError(
        400,
        f"{_DESERIALIZE}unknown field `{key}`, {_expected(fields)} at {_position(raw, key, after)}",
    )


def check_nvext(nvext: Any, raw: str) -> None:
    """Refuse an ``nvext`` the frontend would not deserialize.

    :raises HttpError: 400 for an unknown key (also inside ``agent_hints``, ``routing_constraints``, ``router``,
        ``metadata_upload``) or a value of the wrong type.
    """
    if nvext is None:
        return
    if not isinstance(nvext, Mapping):
        raise HttpError(400, f"{_DESERIALIZE}nvext: expected a map")
    for key, value in nvext.items():
        if key not in NVEXT_FIELDS:
            raise _unknown(key, NVEXT_FIELDS, raw, "nvext")
        if key in _NESTED and value is not None:
            if not isinstance(value, Mapping):
                raise HttpError(400, f"{_DESERIALIZE}nvext.{key}: expected a map")
            for inner in value:
                if inner not in _NESTED[key]:
                    raise _unknown(inner, _NESTED[key], raw, key)
    ids = nvext.get("token_data")
    if ids is not None and (not isinstance(ids, list) or not all(_u32(t) for t in ids)):
        raise HttpError(400, f"{_DESERIALIZE}nvext.token_data: expected a sequence of u32")
    fields = nvext.get("extra_fields")
    if fields is not None and (not isinstance(fields, list) or not all(isinstance(f, str) for f in fields)):
        raise HttpError(400, f"{_DESERIALIZE}nvext.extra_fields: expected a sequence of strings")


def _u32(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**32


def check_top_level(body: Mapping[str, Any], accepted: frozenset[str]) -> None:
    """Refuse unknown top-level keys, as the frontend's validation does.

    :raises HttpError: 400 "Validation: Unsupported parameter(s): `x`".
    """
    unknown = [key for key in body if key not in accepted]
    if unknown:
        raise HttpError(400, "Validation: Unsupported parameter(s): " + ", ".join(f"`{k}`" for k in unknown))
