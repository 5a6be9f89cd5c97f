"""The default render's prefix cache: a rollout batch's shared prefix is tokenized once.

Rows of a rollout batch share their system prompt, tool schemas and few-shot turns; only the last message
differs. Rendering the chat template is cheap next to tokenizing its text, so the cache keeps the *ids* of the
shared prefix text and tokenizes only the rest of each prompt:

* the prompt text is always the full render (``apply_chat_template`` over every message, as without the cache);
* the *prefix* of a message list is what the template renders before the last message's content: found once
  per (tokenizer, chat template, tools, template variables, generation prompt, earlier messages, shape of the
  last message) by rendering the list with the last message's content replaced by a sentinel, and cut back to
  the end of the last added token (``<|im_start|>``, say) before it. Hugging Face tokenizers split added tokens
  out of the text before anything else looks at it, so the ids of ``prefix + rest`` are the prefix's ids
  followed by the rest's. Only added tokens that match exactly as written are cut at (not normalized, no
  whitespace stripping, not single-word, not part of a longer added token);
* an entry is used only when the prompt text starts with its prefix text, and the first time it is built its
  ids are checked against the whole text's: a mismatch marks the *shape* of the message list (roles, keys and
  content types of every message) as not splittable for this template, and every later list of that shape
  without a verified entry is tokenized whole (a tokenizer that marks the start of each piece, say). When the
  text no longer starts with the entry's prefix (the template renders the earlier messages after the last
  one's content, or the date), the entry shrinks to the part both renders share, checked again.

The whole text is rendered every call on purpose: rendering only the last message would leave undetected a
template that renders earlier messages according to the last one (Qwen3 shows reasoning only after the last
real user query, and a user message that is a tool response is not one).

Nothing else changes: errors come from the full render as before, and each call gets a fresh list. Every call
is counted in :class:`RenderStats`: ``prefix_renders`` (tokenized from a cached prefix) or ``full_renders`` keyed
by why the whole text was tokenized: ``verify`` (first use of a prefix, checked), ``mismatch`` (that check
failed), ``not_splittable`` (the shape failed it before), ``prefix_changed`` (the template rendered the same
earlier messages differently: the prefix shrank, checked), ``no_boundary`` (no added token to cut at),
``uncacheable`` (tools, template variables or messages that are not JSON, a tokenizer that cannot be weakly
referenced) or ``disabled``.

The cache is bounded (least recently used entries go first) and keeps only strings and ids: never the caller's
messages, tools or variables. A tokenizer whose vocabulary is changed in place after use must get
:meth:`PrefixRenderCache.clear`.
"""

from __future__ import annotations

import contextlib
import json
import weakref
from collections import Counter, OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import attrs

from backends_core.multiturn.rendering import encode, render_text

__all__ = ["PrefixRenderCache", "RenderStats"]

_SENTINEL = "\u27e6backends-prefix-sentinel\u27e7"
_MAX_ENTRIES = 256  # prefixes kept per tokenizer (all its templates, tools and variables together)
_MAX_SHAPES = 1024  # shapes remembered as not splittable


@attrs.define
class RenderStats:
    """How the default render tokenized each prompt: ``prefix_renders`` from a cached prefix's ids plus the
    rest, ``full_renders`` whole, keyed by why (see :mod:`backends_core.multiturn.prefix_cache`)."""

    prefix_renders: int = 0
    full_renders: Counter[str] = attrs.field(factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        return {"prefix_renders": self.prefix_renders, "full_renders": dict(self.full_renders)}


@attrs.frozen
class _Entry:
    text: str
    ids: tuple[int, ...]


class _Uncacheable(Exception):
    pass


def _freeze(value: Any) -> str:
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise _Uncacheable from exc


def _message_key(message: Mapping[str, Any]) -> Hashable:
    """A copy of ``message`` that holds only immutable values (strings as they are, anything else as JSON)."""
    items = tuple(message.items())
    if all(type(v) is str or v is None for _, v in items):
        return items
    return _freeze(message)


def _message_shape(message: Mapping[str, Any]) -> tuple[Any, ...]:
    keys = tuple(sorted(k for k, v in message.items() if v is not None and k != "content"))
    return (message.get("role"), type(message.get("content")).__name__, keys)


def _safe_added_tokens(tokenizer: Any) -> tuple[str, ...]:
    """Added tokens a prompt can be cut after: matched exactly as written, and not inside a longer one (which
    the text after the cut could complete)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None)
    if not isinstance(decoder, Mapping):
        return ()
    contents = [str(getattr(t, "content", "")) for t in decoder.values()]
    safe = []
    for token in decoder.values():
        content = getattr(token, "content", None)
        if not isinstance(content, str) or not content:
            continue
        if any(getattr(token, flag, True) for flag in ("normalized", "lstrip", "rstrip", "single_word")):
            continue
        if any(content in other and content != other for other in contents):
            continue
        safe.append(content)
    return tuple(safe)


def _common_length(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class _TokenizerState:
    def __init__(self, tokenizer: Any) -> None:
        self.safe_tokens = _safe_added_tokens(tokenizer)
        self.not_splittable: set[Hashable] = set()
        self.entries: OrderedDict[Hashable, _Entry] = OrderedDict()


class PrefixRenderCache:
    """Prompt ids of chat messages, exactly as :func:`~backends_core.multiturn.rendering.render_text` then
    :func:`~backends_core.multiturn.rendering.encode` give them, with the shared prefix tokenized once.

    :param enabled: ``False`` tokenizes every prompt whole (counted as ``disabled``); may be set at any time.
    :param max_entries: prefixes kept per tokenizer, least recently used dropped first.
    """

    def __init__(self, *, enabled: bool = True, max_entries: int = _MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self.enabled = enabled
        self.max_entries = max_entries
        self.stats = RenderStats()
        self._tokenizers: weakref.WeakKeyDictionary[Any, _TokenizerState] = weakref.WeakKeyDictionary()

    def __len__(self) -> int:
        """Prefixes kept, over every tokenizer."""
        return sum(len(state.entries) for state in list(self._tokenizers.values()))

    def clear(self) -> None:
        """Forget every prefix and verdict (counters are kept)."""
        self._tokenizers.clear()

    def render(
        self,
        tokenizer: Any,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Prompt ids of ``messages``.

        :raises RenderError: the template rejected the messages (as :func:`render_text`).
        :raises InvalidRequestError: a content part that is not text.
        """
        text = render_text(
            tokenizer,
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
        )
        if not self.enabled:
            return self._full(tokenizer, text, "disabled")
        try:
            state = self._tokenizers.get(tokenizer)
            if state is None:
                state = self._tokenizers[tokenizer] = _TokenizerState(tokenizer)
            template = getattr(tokenizer, "chat_template", None)
            template_key = (
                template if isinstance(template, str) else _freeze(template),
                _freeze(tools) if tools else "",
                _freeze(chat_template_kwargs) if chat_template_kwargs else "",
                add_generation_prompt,
            )
            last_shape = _message_shape(messages[-1])
            key = (template_key, tuple(_message_key(m) for m in messages[:-1]), last_shape)
        except (_Uncacheable, TypeError):
            return self._full(tokenizer, text, "uncacheable")
        entry = state.entries.get(key)
        if entry is not None and text.startswith(entry.text):
            with contextlib.suppress(KeyError):  # dropped meanwhile by a render on another thread
                state.entries.move_to_end(key)
            self.stats.prefix_renders += 1
            return [*entry.ids, *encode(tokenizer, text[len(entry.text) :])]
        # an entry was verified for its own messages; without one, the shape's verdict decides
        shape = (template_key, *(_message_shape(m) for m in messages[:-1]), last_shape)
        if entry is None and shape in state.not_splittable:
            return self._full(tokenizer, text, "not_splittable")
        if entry is not None:
            # the template renders these earlier messages differently now (a date, the last message's content):
            # keep the part both renders share
            state.entries.pop(key, None)
            limit = _common_length(text, entry.text)
            cut = _last_token_end(state, text, limit)
            return self._store(state, key, shape, tokenizer, text, cut, "prefix_changed")
        return self._first_use(
            tokenizer, state, key, shape, text, messages, tools, add_generation_prompt, chat_template_kwargs
        )

    def _full(self, tokenizer: Any, text: str, reason: str) -> list[int]:
        self.stats.full_renders[reason] += 1
        return encode(tokenizer, text)

    def _first_use(
        self,
        tokenizer: Any,
        state: _TokenizerState,
        key: Hashable,
        shape: Hashable,
        text: str,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
        chat_template_kwargs: Mapping[str, Any] | None,
    ) -> list[int]:
        """Find this list's prefix and keep it if it splits the text exactly."""
        cut = self._cut(tokenizer, state, text, messages, tools, add_generation_prompt, chat_template_kwargs)
        return self._store(state, key, shape, tokenizer, text, cut, "verify")

    def _store(
        self, state: _TokenizerState, key: Hashable, shape: Hashable, tokenizer: Any, text: str, cut: int, reason: str
    ) -> list[int]:
        """Tokenize ``text`` whole and in two pieces at ``cut``; keep the first piece as the prefix of ``key``
        when both agree, else remember that ``shape`` does not split."""
        if cut <= 0:
            return self._full(tokenizer, text, "no_boundary")
        whole = encode(tokenizer, text)
        prefix_ids = encode(tokenizer, text[:cut])
        if [*prefix_ids, *encode(tokenizer, text[cut:])] != whole:
            if len(state.not_splittable) >= _MAX_SHAPES:
                state.not_splittable.clear()
            state.not_splittable.add(shape)
            self.stats.full_renders["mismatch"] += 1
            return whole
        state.entries[key] = _Entry(text[:cut], tuple(prefix_ids))
        while len(state.entries) > self.max_entries:
            state.entries.popitem(last=False)
        self.stats.full_renders[reason] += 1
        return whole

    @staticmethod
    def _cut(
        tokenizer: Any,
        state: _TokenizerState,
        text: str,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
        chat_template_kwargs: Mapping[str, Any] | None,
    ) -> int:
        """Where ``text`` is cut: after the last safe added token before the last message's content (the
        text the template renders the same whatever that content is), 0 when there is none."""
        if not state.safe_tokens:
            return 0
        probe = [*messages[:-1], {**messages[-1], "content": _SENTINEL}]
        try:
            other = render_text(
                tokenizer,
                probe,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                chat_template_kwargs=chat_template_kwargs,
            )
        except Exception:  # the template wants this content as it is: nothing to share
            return 0
        at = other.find(_SENTINEL)
        return _last_token_end(state, text, _common_length(text, other if at < 0 else other[:at]))


def _last_token_end(state: _TokenizerState, text: str, limit: int) -> int:
    """Where the last safe added token in ``text[:limit]`` ends, 0 when there is none."""
    cut = 0
    for token in state.safe_tokens:
        found = text.rfind(token, 0, limit)
        if found >= 0:
            cut = max(cut, found + len(token))
    return cut
