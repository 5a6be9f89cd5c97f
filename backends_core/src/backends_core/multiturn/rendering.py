"""Chat-template rendering with transformers."""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from backends_core.errors import ConfigError, RenderError

__all__ = ["encode", "load_tokenizer", "render_text"]


@functools.lru_cache(maxsize=16)
def load_tokenizer(name_or_path: str) -> Any:
    """Load a transformers tokenizer from a local directory (or the local HF cache), never the network.

    Cached per path: building a fast tokenizer costs hundreds of milliseconds.

    :raises ConfigError: nothing loadable is there.
    """
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
    except Exception as exc:
        where = (
            "directory" if Path(name_or_path).is_dir() else "name (not a local directory; the hub is never contacted)"
        )
        raise ConfigError([f"cannot load tokenizer from {where} {name_or_path!r}: {exc} @ $.tokenizer"]) from exc
    if not getattr(tok, "chat_template", None):
        raise ConfigError([f"tokenizer {name_or_path!r} has no chat_template @ $.tokenizer"])
    return tok


def render_text(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """Apply the tokenizer's chat template and return the text.

    :raises RenderError: the template rejected the messages.
    """
    if not messages:
        raise RenderError("messages is empty")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise RenderError(f"messages[{i}] must be a mapping with a string 'role', got {m!r}")
    try:
        text = tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tools=[dict(t) for t in tools] if tools else None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **dict(chat_template_kwargs or {}),
        )
    except Exception as exc:
        raise RenderError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(text, str):
        raise RenderError(f"chat template returned {type(text).__name__}, expected str")
    return text


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` exactly as written (special-token strings become their ids; nothing added)."""
    return list(tokenizer.encode(text, add_special_tokens=False))
