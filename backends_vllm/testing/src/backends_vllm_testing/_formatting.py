"""Response pieces in vLLM 0.32's shapes: token strings, logprob blocks, prompt logprobs, routed experts.

Logprob blocks need each token's *rank* (``1 + #tokens with a higher logprob``), which the reference engine
does not report; the emulator asks the engine for enough of the sorted distribution of every scored position
(a ``(token_id, logprob)`` list, best first) to read ranks, top-k lists and arbitrary ids from it: the best few
when the rank is bounded (greedy, top-k sampling), else the whole vocabulary (slow: the engine builds a Python
list of the vocabulary per position). With ``exact_ranks=False`` only the shown entries are asked for, and a
chosen token outside them gets the lower bound ``len + 1`` as rank.

Ordering rules, from the captures:

* ``/inference/v1/generate`` ``top_logprobs``: the sampled token first, then the best tokens other than it,
  cut to ``max(k, 1)`` entries.
* legacy completions ``top_logprobs`` and every ``prompt_logprobs`` entry: the chosen token first, then the
  top-k other than it (``k + 1`` entries, or ``k`` when the chosen token is among the top k), then any
  ``logprob_token_ids``. Legacy dicts are keyed by decoded text, so keys can collide (as on vLLM).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
from tokenizers import Tokenizer

__all__ = ["Detokenizer", "Position", "Scored", "npy_base64"]

_MIN_LOGPROB = -9999.0


def _f32(value: float) -> float:
    return max(float(np.float32(value)), _MIN_LOGPROB)


@attrs.frozen
class Scored:
    """One token at one position: id, raw logprob (float32 precision) and rank."""

    token_id: int
    logprob: float
    rank: int


class Position:
    """The distribution at one position, from the engine's best-first ``(id, logprob)`` list (the whole vocabulary,
    or the best few when a token's rank is bounded). ``fallback`` is the chosen token's logprob for the
    approximate mode: a chosen token missing from the list then ranks just below it (a lower bound)."""

    __slots__ = ("_fallback", "_ids", "_pairs")

    def __init__(self, pairs: Sequence[tuple[int, float]], fallback: float | None = None) -> None:
        self._pairs = pairs
        self._fallback = fallback
        self._ids: list[int] | None = None

    def get(self, token_id: int) -> Scored:
        if self._ids is None:
            self._ids = [t for t, _ in self._pairs]
        try:
            index = self._ids.index(token_id)
        except ValueError:
            if self._fallback is None:
                raise RuntimeError(
                    f"vLLM emulator: token {token_id} is not among the {len(self._ids)} best of its position"
                ) from None
            return Scored(token_id, _f32(self._fallback), len(self._ids) + 1)
        return Scored(token_id, _f32(self._pairs[index][1]), index + 1)

    def top(self, k: int) -> list[Scored]:
        return [Scored(t, _f32(lp), i + 1) for i, (t, lp) in enumerate(self._pairs[: max(k, 0)])]

    def ordered(self, chosen: int, k: int, extra: Sequence[int] = ()) -> list[Scored]:
        """``chosen``, then the top ``k`` without it, then ``extra`` ids."""
        first = self.get(chosen)
        out = [first, *(s for s in self.top(k) if s.token_id != chosen)]
        out.extend(self.get(t) for t in extra)
        return out


class Detokenizer:
    """The model's ``tokenizer.json`` through ``tokenizers``: per-token strings (cached) and texts."""

    def __init__(self, model_dir: Path) -> None:
        self._tokenizer: Any = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self._size = int(self._tokenizer.get_vocab_size(with_added_tokens=True))
        self._cache: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        """The token decoded alone, as vLLM's logprob detokenizer shows it: ``""`` for a lone partial
        UTF-8 sequence, specials included."""
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False) if token_id < self._size else ""
            if text and set(text) == {"\ufffd"}:
                text = ""
            self._cache[token_id] = text
        return text

    def text(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        ids = [t for t in token_ids if 0 <= t < self._size]
        return str(self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return [int(t) for t in self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids]

    def token_str(self, token_id: int) -> str:
        """The token's vocabulary string (byte-level BPE form, e.g. ``"Ġw"``)."""
        return str(self._tokenizer.id_to_token(token_id))

    # -- logprob blocks ---------------------------------------------------------------------------------

    @staticmethod
    def generate_content(
        token_ids: Sequence[int], positions: Sequence[Position], k: int, extra: Sequence[int] = ()
    ) -> list[dict[str, Any]]:
        """``choices[].logprobs.content`` of ``/inference/v1/generate`` in ``tokens`` mode."""
        content = []
        for token, position in zip(token_ids, positions, strict=True):
            entries = position.ordered(token, max(k, 1))[: max(k, 1)]
            entries.extend(position.get(t) for t in extra)
            first = entries[0]
            content.append(
                {
                    "token_id": first.token_id,
                    "logprob": first.logprob,
                    "rank": first.rank,
                    "top_logprobs": [{"token_id": e.token_id, "logprob": e.logprob, "rank": e.rank} for e in entries],
                }
            )
        return content

    def text_content(
        self, token_ids: Sequence[int], positions: Sequence[Position], k: int, extra: Sequence[int] = ()
    ) -> list[dict[str, Any]]:
        """``choices[].logprobs.content`` of ``/inference/v1/generate`` in ``text`` mode (chat style)."""
        content = []
        for token, position in zip(token_ids, positions, strict=True):
            entries = position.ordered(token, max(k, 1))[: max(k, 1)]
            entries.extend(position.get(t) for t in extra)
            tops = [self._chat_entry(e) for e in entries]
            content.append({**self._chat_entry(entries[0]), "top_logprobs": tops})
        return content

    def _chat_entry(self, entry: Scored) -> dict[str, Any]:
        text = self.token(entry.token_id)
        return {"token": text, "logprob": entry.logprob, "bytes": list(text.encode("utf-8"))}

    def legacy(
        self,
        token_ids: Sequence[int],
        positions: Sequence[Position | None],
        k: int,
        *,
        extra: Sequence[int] = (),
        as_token_ids: bool = False,
    ) -> dict[str, Any]:
        """The legacy completions ``logprobs`` block; a ``None`` position (echoed first prompt token) has no
        logprob."""
        name: Callable[[int], str] = (lambda t: f"token_id:{t}") if as_token_ids else self.token
        offsets: list[int] = []
        token_logprobs: list[float | None] = []
        tokens: list[str] = []
        tops: list[dict[str, float] | None] = []
        offset = 0
        for token, position in zip(token_ids, positions, strict=True):
            text = name(token)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            if position is None:
                token_logprobs.append(None)
                tops.append(None)
                continue
            entries = position.ordered(token, k, extra)
            token_logprobs.append(entries[0].logprob)
            tops.append({name(e.token_id): e.logprob for e in entries})
        return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": tops}

    def prompt_logprobs(
        self, prompt_ids: Sequence[int], positions: Sequence[Position | None], k: int
    ) -> list[dict[str, dict[str, Any]] | None]:
        """``prompt_logprobs``: ``[null, {"<id>": {"logprob", "rank", "decoded_token"}, ...}, ...]``."""
        out: list[dict[str, dict[str, Any]] | None] = []
        for token, position in zip(prompt_ids, positions, strict=True):
            if position is None:
                out.append(None)
                continue
            out.append(
                {
                    str(e.token_id): {"logprob": e.logprob, "rank": e.rank, "decoded_token": self.token(e.token_id)}
                    for e in position.ordered(token, k)
                }
            )
        return out


def npy_base64(array: npt.NDArray[Any], num_experts: int) -> str:
    """Routed experts as vLLM sends them: base64 of a ``.npy`` file, in the smallest dtype for the experts."""
    dtype: type[np.integer[Any]] = np.uint8 if num_experts <= 256 else np.uint16 if num_experts <= 65536 else np.int32
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array, dtype=dtype), allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")
