"""A small LRU prefix cache: KV caches (and MoE routing) of finished sequences, reused by prefix."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from backends_testkit._numpy_qwen3 import KVCache

__all__ = ["PrefixCache", "PrefixHit"]


@attrs.frozen(kw_only=True)
class PrefixHit:
    """A reusable prefix: an independent copy of its KV cache and routing rows."""

    length: int
    cache: KVCache
    routed_experts: npt.NDArray[np.int32] | None


@attrs.define
class _Entry:
    tokens: npt.NDArray[np.int64]
    cache: KVCache
    routed_experts: npt.NDArray[np.int32] | None


class PrefixCache:
    """Keeps up to ``max_entries`` finished sequences per adapter key, least recently used evicted first.

    Entries are keyed by an opaque ``namespace`` (the LoRA adapter in use) because an adapter changes
    every cached key/value. Weight updates are deliberately *not* part of the key: like a real server,
    stale KV survives a weight reload until :meth:`clear` is called.
    """

    def __init__(self, *, max_entries: int = 64) -> None:
        self._max_entries = max_entries
        self._entries: OrderedDict[int, tuple[Any, _Entry]] = OrderedDict()
        self._next_key = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Drop every entry."""
        self._entries.clear()

    def insert(
        self,
        namespace: Any,
        tokens: npt.NDArray[np.int64],
        cache: KVCache,
        routed_experts: npt.NDArray[np.int32] | None,
    ) -> None:
        """Remember a finished sequence; ``tokens`` must be exactly the tokens held in ``cache``."""
        if cache.length == 0 or cache.length != tokens.size:
            return
        self._entries[self._next_key] = (namespace, _Entry(tokens.copy(), cache, routed_experts))
        self._next_key += 1
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)

    def lookup(self, namespace: Any, tokens: npt.NDArray[np.int64], *, max_length: int) -> PrefixHit | None:
        """Return the longest cached prefix of ``tokens`` (at most ``max_length`` tokens), or ``None``."""
        best_key, best_length = -1, 0
        for key, (space, entry) in self._entries.items():
            if space != namespace:
                continue
            n = min(entry.tokens.size, tokens.size, max_length)
            mismatch = np.flatnonzero(entry.tokens[:n] != tokens[:n])
            length = int(mismatch[0]) if mismatch.size else n
            if length > best_length:
                best_key, best_length = key, length
        if best_length == 0:
            return None
        self._entries.move_to_end(best_key)
        entry = self._entries[best_key][1]
        routed = None if entry.routed_experts is None else entry.routed_experts[:best_length].copy()
        return PrefixHit(length=best_length, cache=entry.cache.prefix(best_length), routed_experts=routed)
