"""Text for the emulator: token strings and completion text (``tokenizers``), and prompts for requests that
send text instead of ``nvext.token_data`` (the model's chat template through the core's renderer)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from backends_core.errors import RenderError
from backends_core.multiturn.rendering import encode, load_tokenizer, render_text

__all__ = ["Text"]


class Text:
    """The model directory's tokenizer.

    :param model_dir: a directory with ``tokenizer.json`` (and a chat template for :meth:`render`).
    """

    def __init__(self, model_dir: Path) -> None:
        self._dir = model_dir
        self._tokenizer: Any = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self._size = int(self._tokenizer.get_vocab_size(with_added_tokens=True))
        self._cache: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        """One token's text; ids the tokenizer does not know (padding of the embedding) decode to ``""``."""
        if token_id not in self._cache:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False) if token_id < self._size else ""
            self._cache[token_id] = text
        return self._cache[token_id]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of a completion (special tokens skipped, as the frontend's detokenizer does)."""
        return str(self._tokenizer.decode([t for t in ids if t < self._size], skip_special_tokens=True))

    def encode(self, text: str) -> list[int]:
        """A text prompt's ids."""
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        kwargs: Mapping[str, Any] | None,
    ) -> list[int]:
        """Chat messages through the model's chat template.

        :raises ValueError: the template rejects them.
        """
        tokenizer = load_tokenizer(str(self._dir))
        try:
            text = render_text(tokenizer, messages, tools=tools, chat_template_kwargs=kwargs)
        except RenderError as exc:
            raise ValueError(str(exc)) from exc
        return encode(tokenizer, text)
