"""The served model's tokenizer (``tokenizer.json`` through ``tokenizers``): SGLang's ``text`` fields."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

__all__ = ["Text"]


class Text:
    """Encode prompts given as text, decode completions and single tokens (cached)."""

    def __init__(self, model_dir: Path) -> None:
        self._tokenizer: Any = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self._size = int(self._tokenizer.get_vocab_size(with_added_tokens=True))
        self._tokens: dict[int, str] = {}

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self._tokenizer.encode(text, add_special_tokens=True).ids]

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        ids = [t for t in token_ids if 0 <= t < self._size]
        return str(self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def token(self, token_id: int) -> str:
        """One token decoded alone, specials included (the third element of SGLang's logprob triples)."""
        text = self._tokens.get(token_id)
        if text is None:
            text = self.decode([token_id], skip_special_tokens=False)
            self._tokens[token_id] = text
        return text
