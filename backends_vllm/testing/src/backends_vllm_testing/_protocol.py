"""The request models of the vLLM 0.32 routes the emulator serves (field names and types from its OpenAPI).

Fields the emulator implements are validated and used; fields it accepts but that change nothing here
(``cache_salt``, ``user``, ``stream_options``...) are validated and ignored; fields of features the reference
engine lacks (penalties, structured output...) are accepted only at their neutral
values — anything else is refused with a 400 that says so, never silently ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from backends_vllm_testing._validation import (
    REQUIRED,
    Field,
    any_value,
    boolean,
    integer,
    list_of,
    literal,
    model,
    nullable,
    number,
    object_any,
    string,
    union,
)

__all__ = [
    "ABORT_REQUEST",
    "COLLECTIVE_RPC",
    "COMPLETION_REQUEST",
    "FINISH_WEIGHT_UPDATE",
    "GENERATE_REQUEST",
    "INIT_WEIGHT_TRANSFER",
    "LOAD_LORA",
    "NEUTRAL",
    "SAMPLING_PARAMS",
    "UNLOAD_LORA",
    "UPDATE_WEIGHTS",
    "UPDATE_WEIGHT_VERSION",
]

_INT64 = 2**63
_opt_int = nullable(integer())
_opt_float = nullable(number())
_opt_bool = nullable(boolean())
_opt_str = nullable(string())
_token_list = list_of(integer())
_salt = nullable(string(min_length=1, max_length=1024))
_priority = integer(ge=-_INT64, le=_INT64)

#: Features the reference engine does not have: the values that mean "off". Other values are refused.
NEUTRAL: Mapping[str, tuple[Any, ...]] = {
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "suffix": (None, ""),
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),
    "truncate_prompt_tokens": (None,),
    "truncation_side": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "prompt_embeds": (None,),
    "response_format": (None,),
    "structured_outputs": (None,),
    "vllm_xargs": (None, {}),
    "repetition_detection": (None,),
    "thinking_token_budget": (None, -1),
    "stream_interval": (None,),
    "watermarking": (None, False),
    "prompt_logprob_token_ids": (None,),
    "prompt_logprob_start": (None, 0),
    "flat_logprobs": (False,),
    "trace_decode_token_ids": (None,),
    "extra_args": (None, {}),
    "features": (None,),
    "content_parts": (None,),
    "token_offsets": (None,),
    "kv_transfer_params": (None,),
    "ec_transfer_params": (None,),
}


def _neutral(name: str, default: Any = None) -> tuple[str, Field]:
    return name, Field(any_value(), default)


COMPLETION_REQUEST = model(
    dict(
        [
            ("model", Field(_opt_str)),
            (
                "prompt",
                Field(
                    nullable(
                        union(
                            list_of(integer(ge=0)),
                            list_of(list_of(integer(ge=0))),
                            string(),
                            list_of(string()),
                        )
                    )
                ),
            ),
            ("echo", Field(_opt_bool, False)),
            ("logprobs", Field(_opt_int)),
            ("max_tokens", Field(_opt_int, 16)),
            ("n", Field(integer(), 1)),
            ("seed", Field(nullable(integer(ge=-_INT64, le=_INT64)))),
            ("stream_options", Field(nullable(object_any()))),
            ("temperature", Field(_opt_float)),
            ("top_p", Field(_opt_float)),
            ("top_k", Field(_opt_int)),
            ("min_p", Field(_opt_float)),
            ("user", Field(_opt_str)),
            ("stop_token_ids", Field(nullable(_token_list), [])),
            ("include_stop_str_in_output", Field(boolean(), False)),
            ("ignore_eos", Field(boolean(), False)),
            ("min_tokens", Field(integer(), 0)),
            ("skip_special_tokens", Field(boolean(), True)),
            ("spaces_between_special_tokens", Field(boolean(), True)),
            ("prompt_logprobs", Field(_opt_int)),
            ("logprob_token_ids", Field(nullable(_token_list))),
            ("add_special_tokens", Field(boolean(), True)),
            ("priority", Field(_priority, 0)),
            ("request_id", Field(string())),
            ("session_id", Field(_opt_str)),
            ("return_tokens_as_token_ids", Field(_opt_bool)),
            ("return_token_ids", Field(_opt_bool)),
            ("routed_experts_prompt_start", Field(integer(ge=0), 0)),
            ("return_token_offsets", Field(_opt_bool)),
            ("mm_payload", Field(literal("tensors", "none"), "tensors")),
            ("return_mm_kwargs", Field(_opt_bool)),
            ("cache_salt", Field(_salt)),
            _neutral("frequency_penalty"),
            _neutral("presence_penalty"),
            _neutral("repetition_penalty"),
            _neutral("logit_bias"),
            _neutral("suffix"),
            _neutral("use_beam_search", False),
            _neutral("length_penalty", 1.0),
            _neutral("truncate_prompt_tokens"),
            _neutral("truncation_side"),
            _neutral("allowed_token_ids"),
            _neutral("bad_words", []),
            _neutral("prompt_embeds"),
            _neutral("response_format"),
            _neutral("structured_outputs"),
            _neutral("vllm_xargs"),
            _neutral("repetition_detection"),
            _neutral("thinking_token_budget"),
            _neutral("stream_interval"),
            _neutral("watermarking"),
            _neutral("stop", []),
            ("stream", Field(_opt_bool, False)),
            _neutral("kv_transfer_params"),
            _neutral("ec_transfer_params"),
        ]
    )
)

SAMPLING_PARAMS = model(
    dict(
        [
            ("n", Field(integer(), 1)),
            ("temperature", Field(number(), 1.0)),
            ("top_p", Field(number(), 1.0)),
            ("top_k", Field(integer(), 0)),
            ("min_p", Field(number(), 0.0)),
            ("seed", Field(_opt_int)),
            ("stop_token_ids", Field(nullable(_token_list))),
            ("ignore_eos", Field(boolean(), False)),
            ("max_tokens", Field(_opt_int)),
            ("min_tokens", Field(integer(), 0)),
            ("logprobs", Field(_opt_int)),
            ("prompt_logprobs", Field(_opt_int)),
            ("logprob_token_ids", Field(nullable(_token_list))),
            ("detokenize", Field(boolean(), True)),
            ("skip_special_tokens", Field(boolean(), True)),
            ("spaces_between_special_tokens", Field(boolean(), True)),
            ("include_stop_str_in_output", Field(boolean(), False)),
            ("output_kind", Field(integer(), 0)),
            ("skip_clone", Field(boolean(), False)),
            ("output_text_buffer_length", Field(integer(), 0)),
            ("skip_reading_prefix_cache", Field(_opt_bool)),
            ("routed_experts_prompt_start", Field(integer(), 0)),
            _neutral("presence_penalty", 0.0),
            _neutral("frequency_penalty", 0.0),
            _neutral("repetition_penalty", 1.0),
            _neutral("watermarking"),
            _neutral("stop"),
            _neutral("prompt_logprob_token_ids"),
            _neutral("prompt_logprob_start"),
            _neutral("flat_logprobs", False),
            _neutral("stream_interval"),
            _neutral("structured_outputs"),
            _neutral("logit_bias"),
            _neutral("allowed_token_ids"),
            _neutral("extra_args"),
            _neutral("bad_words"),
            _neutral("thinking_token_budget"),
            _neutral("repetition_detection"),
            _neutral("trace_decode_token_ids"),
        ]
    )
)

GENERATE_REQUEST = model(
    dict(
        [
            ("request_id", Field(string())),
            ("token_ids", Field(list_of(integer(), min_length=1), REQUIRED)),
            ("sampling_params", Field(object_any(), REQUIRED)),
            ("model", Field(_opt_str)),
            ("reasoning_ended", Field(_opt_bool)),
            ("reasoning_parser_kwargs", Field(nullable(object_any()))),
            ("return_token_ids", Field(_opt_bool)),
            ("output_mode", Field(literal("tokens", "text"), "tokens")),
            ("stream_options", Field(nullable(object_any()))),
            ("cache_salt", Field(_salt)),
            ("priority", Field(_priority, 0)),
            ("stream", Field(_opt_bool, False)),
            _neutral("token_offsets"),
            _neutral("features"),
            _neutral("content_parts"),
            _neutral("kv_transfer_params"),
            _neutral("ec_transfer_params"),
        ]
    )
)

LOAD_LORA = model(
    {
        "lora_name": Field(string(), REQUIRED),
        "lora_path": Field(string(), REQUIRED),
        "load_inplace": Field(boolean(), False),
        "is_3d_lora_weight": Field(boolean(), False),
    }
)
UNLOAD_LORA = model({"lora_name": Field(string(), REQUIRED), "lora_int_id": Field(_opt_int)})
UPDATE_WEIGHT_VERSION = model({"new_version": Field(string(), REQUIRED)})
INIT_WEIGHT_TRANSFER = model({"init_info": Field(object_any(), REQUIRED)})
UPDATE_WEIGHTS = model({"update_info": Field(union(object_any(), list_of(object_any())), REQUIRED)})
FINISH_WEIGHT_UPDATE = model({"weight_version": Field(_opt_str)})
ABORT_REQUEST = model({"request_ids": Field(list_of(string()), REQUIRED)})
COLLECTIVE_RPC = model(
    {
        "method": Field(string(), REQUIRED),
        "args": Field(nullable(list_of(any_value())), []),
        "kwargs": Field(nullable(object_any()), {}),
        "timeout": Field(_opt_float),
    }
)
