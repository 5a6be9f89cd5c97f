"""``POST /tokenize`` (prompt and messages forms) and ``POST /detokenize``, as vLLM 0.32 answers them.

The messages form renders with the model's own Hugging Face chat template (through transformers, like vLLM),
then encodes without adding special tokens unless asked. A body with neither ``prompt`` nor ``messages`` gets
the captured two-error 400.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from backends_core.errors import InvalidRequestError
from backends_core.multiturn.rendering import content_format, load_tokenizer, template_messages
from backends_vllm_testing._errors import bad_request
from backends_vllm_testing._formatting import Detokenizer
from backends_vllm_testing._serving import Serving
from backends_vllm_testing._validation import (
    REQUIRED,
    Field,
    ValidationFailure,
    boolean,
    integer,
    list_of,
    model,
    nullable,
    object_any,
    string,
)

__all__ = ["detokenize", "tokenize"]

_opt_str = nullable(string())
_opt_bool = nullable(boolean())

_TOKENIZE_PROMPT = model(
    {
        "model": Field(_opt_str),
        "prompt": Field(string(), REQUIRED),
        "add_special_tokens": Field(boolean(), True),
        "return_token_strs": Field(_opt_bool, False),
    }
)
_TOKENIZE_MESSAGES = model(
    {
        "model": Field(_opt_str),
        "messages": Field(list_of(object_any()), REQUIRED),
        "add_generation_prompt": Field(boolean(), True),
        "return_token_strs": Field(_opt_bool, False),
        "continue_final_message": Field(boolean(), False),
        "add_special_tokens": Field(boolean(), False),
        "chat_template": Field(_opt_str),
        "chat_template_kwargs": Field(nullable(object_any())),
        "media_io_kwargs": Field(nullable(object_any())),
        "mm_processor_kwargs": Field(nullable(object_any())),
        "tools": Field(nullable(list_of(object_any()))),
    }
)
_DETOKENIZE = model({"model": Field(_opt_str), "tokens": Field(list_of(integer(ge=0, le=2**63)), REQUIRED)})


def _render(serving: Serving, values: Mapping[str, Any]) -> str:
    tokenizer = load_tokenizer(str(serving.engine.model_dir))
    kwargs = dict(values["chat_template_kwargs"] or {})
    if values["chat_template"] is not None:
        kwargs["chat_template"] = values["chat_template"]
    try:  # content parts as vLLM's chat route hands them to the template (text parts only on a text model)
        messages = template_messages(values["messages"], content_format(tokenizer, values["tools"]))
    except InvalidRequestError as exc:
        raise bad_request(str(exc)) from None
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=values["tools"],
            add_generation_prompt=values["add_generation_prompt"],
            continue_final_message=values["continue_final_message"],
            tokenize=False,
            **kwargs,
        )
    except Exception as exc:  # the template's own errors (raise_exception, bad roles...) are the caller's
        raise bad_request(f"Chat template rendering failed: {exc}") from None
    return str(text)


def tokenize(serving: Serving, body: Any) -> dict[str, Any]:
    """The ``/tokenize`` answer: ``{"count", "max_model_len", "tokens", "token_strs"}``."""
    if isinstance(body, dict) and "messages" in body:
        values, ignored = _TOKENIZE_MESSAGES(body, ("body",))
        serving.resolve_model(values["model"])
        if values["add_generation_prompt"] and values["continue_final_message"]:
            raise bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        tokens = serving.detok.encode(_render(serving, values), add_special_tokens=values["add_special_tokens"])
    else:
        try:
            values, ignored = _TOKENIZE_PROMPT(body, ("body",))
        except ValidationFailure as exc:
            if isinstance(body, dict) and "prompt" not in body:
                missing = ValidationFailure.one("missing", ("body", "messages"), "Field required", body)
                raise ValidationFailure([*exc.errors, *missing.errors]) from None
            raise
        serving.resolve_model(values["model"])
        tokens = serving.detok.encode(values["prompt"], add_special_tokens=values["add_special_tokens"])
    serving.ignored_fields.extend(f"/tokenize: {name}" for name in ignored)
    detok: Detokenizer = serving.detok
    return {
        "count": len(tokens),
        "max_model_len": serving.max_model_len,
        "tokens": tokens,
        "token_strs": [detok.token_str(t) for t in tokens] if values["return_token_strs"] else None,
    }


def detokenize(serving: Serving, body: Any) -> dict[str, Any]:
    """The ``/detokenize`` answer: ``{"prompt": text}`` (specials kept; unknown ids decode to nothing)."""
    values, ignored = _DETOKENIZE(body, ("body",))
    serving.resolve_model(values["model"])
    serving.ignored_fields.extend(f"/detokenize: {name}" for name in ignored)
    return {"prompt": serving.detok.text(values["tokens"], skip_special_tokens=False)}
