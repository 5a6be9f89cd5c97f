"""Which prompt ids belong to which message, and which ids a trainer trains on.

A prompt rendered from messages is attributed to them through the template itself. Where message ``k``'s content
is a non-empty string, the whole conversation is rendered again with a marker appended to that content: the
marker's position is where the content ends in the whole render (checked: the marked render is the whole render
with the marker inserted there), and the message ends where the markup the template writes after its content
(tool calls, the end of turn) stops agreeing with the whole render, taken from the first ``k`` messages rendered
with the marker. Otherwise message ``k``'s text is what rendering the first ``k`` messages adds to rendering the
first ``k - 1``; in the whole render it starts where message ``k - 1`` ended. A template may render a message
differently once later ones follow:

* it defers the message's closing markup (tool results grouped into one turn: the first result's block is not
  closed before the second's): the message ends where the two stop agreeing;
* it renders the message's beginning differently (Qwen3 writes a think block only for assistant turns after the
  last user message): the rest of the message's text, from some point on, continues the whole render right there
  and ends with the template's end of turn, and the message ends where that continuation ends.

Either way the spans cover the prompt contiguously and in order. The text after the last message is the
generation prompt (``message=None``).
Character offsets become token offsets through the tokenizer's own offsets (a token that straddles a boundary
belongs to the message it starts in).

A bridged prompt (a multi-turn turn that reuses the previous turn's exact ids) is attributed without rendering the
history: the previous turn's spans, its generation prompt relabelled as the reply's header, the sampled ids as
their own ``sampled=True`` span of the reply, the template's end of turn after them, then the new messages and
the generation prompt, attributed within the delta the bridge rendered.

:func:`loss_mask` marks exactly the sampled ids: every reused sampled span and the completion.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from backends_core.errors import InvalidRequestError
from backends_core.multiturn.rendering import encode, render_text
from backends_core.types import GenerateResult, Message, MessageSpan

__all__ = ["agreeing_prefix", "bridged_spans", "delta_bounds", "loss_mask", "rendered_spans", "token_bounds"]


def agreeing_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    if b.startswith(a):
        return len(a)
    n = min(len(a), len(b))
    lo, hi = 0, n  # the first differing index lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if a[lo : mid + 1] == b[lo : mid + 1]:
            lo = mid + 1
        else:
            hi = mid
    return lo


def token_bounds(tokenizer: Any, text: str, ids: Sequence[int], char_bounds: Sequence[int]) -> list[int] | None:
    """For each character offset of ``char_bounds`` (non-decreasing), the index of the first token of ``ids`` (the
    encoding of ``text``) that starts at or after it; ``None`` when ``ids`` are not ``text``'s encoding."""
    offsets = _offsets(tokenizer, text, ids)
    if offsets is not None:
        starts = [start for start, _ in offsets]
        out, i = [], 0
        for bound in char_bounds:
            while i < len(starts) and starts[i] < bound:
                i += 1
            out.append(i)
        return out
    # a tokenizer without offsets: the encoding of each prefix, where it is a prefix of the whole encoding
    out = []
    for bound in char_bounds:
        head = encode(tokenizer, text[:bound])
        if tuple(head) != tuple(ids[: len(head)]):
            return None
        out.append(len(head))
    return out


def _offsets(tokenizer: Any, text: str, ids: Sequence[int]) -> list[tuple[int, int]] | None:
    if not getattr(tokenizer, "is_fast", False):
        return None
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except (TypeError, ValueError, NotImplementedError):
        return None
    if list(encoded["input_ids"]) != list(ids):
        return None
    return [(int(s), int(e)) for s, e in encoded["offset_mapping"]]


def rendered_spans(
    tokenizer: Any,
    messages: Sequence[Message],
    prompt_ids: Sequence[int],
    *,
    tools: Sequence[Mapping[str, Any]] | None,
    chat_template_kwargs: Mapping[str, Any] | None,
    end_of_turn: str | None,
    add_generation_prompt: bool = True,
) -> tuple[MessageSpan, ...] | None:
    """The spans of ``prompt_ids`` rendered whole from ``messages``; ``None`` when they are not the encoding of
    the template's text (a backend's own ``render`` hook built them otherwise).

    :param end_of_turn: the template's text after a message (``"<|im_end|>\n"``), ``None`` when it has none to
        probe (then a message ends where the renders stop agreeing).
    """
    kwargs = dict(chat_template_kwargs or {})

    def render(upto: int, generation: bool) -> str:
        return render_text(
            tokenizer, messages[:upto], tools=tools, add_generation_prompt=generation, chat_template_kwargs=kwargs
        )

    def render_list(listed: Sequence[Message], generation: bool) -> str:
        return render_text(
            tokenizer, listed, tools=tools, add_generation_prompt=generation, chat_template_kwargs=kwargs
        )

    whole = render(len(messages), add_generation_prompt)
    bounds, at = [], 0
    for k in range(1, len(messages) + 1):
        end = _marked_end(messages, k - 1, whole, render_list, add_generation_prompt)
        if end is None or end < at:
            upto = render(k, False)
            added = upto[agreeing_prefix(render(k - 1, False) if k > 1 else "", upto) :]
            end = at + _message_end(added, whole[at:], end_of_turn)
        at = max(at, end)
        bounds.append(at)
    tokens = token_bounds(tokenizer, whole, prompt_ids, bounds)
    if tokens is None:
        return None
    roles = [str(m.get("role")) for m in messages]
    return _spans(range(len(messages)), roles, tokens, offset=0, end=len(prompt_ids))


_MARK = "\u27e6backends-span-mark\u27e7"


def _marked_end(
    messages: Sequence[Message],
    index: int,
    whole: str,
    render_list: Callable[[Sequence[Message], bool], str],
    generation: bool,
) -> int | None:
    """Where message ``index`` ends in ``whole``, found with a marker after its content; ``None`` where its content
    is not a non-empty string or the marked render is not ``whole`` with the marker inserted."""
    message = messages[index]
    content = message.get("content")
    if not isinstance(content, str) or not content:
        return None
    marked = [*messages[:index], {**message, "content": content + _MARK}, *messages[index + 1 :]]
    text = render_list(marked, generation)
    at = text.find(_MARK)
    if at < 0 or text.count(_MARK) != 1 or text[:at] != whole[:at] or text[at + len(_MARK) :] != whole[at:]:
        return None
    partial = render_list(marked[: index + 1], False)
    after = partial[partial.index(_MARK) + len(_MARK) :] if partial.count(_MARK) == 1 else ""
    return at + agreeing_prefix(after, whole[at:])


def _message_end(partial: str, whole: str, end_of_turn: str | None) -> int:
    """Where ``partial`` (a message's text) ends in ``whole`` (the whole render from where the message starts)."""
    agree = agreeing_prefix(partial, whole)
    rest = partial[agree:]
    if not end_of_turn or not rest.endswith(end_of_turn) or rest == end_of_turn:
        return agree
    for length in range(len(rest) - 1, len(end_of_turn) - 1, -1):
        if whole.startswith(rest[-length:], agree):
            return agree + length
    return agree


def _spans(
    indices: Sequence[int], roles: Sequence[str], ends: Sequence[int], *, offset: int, end: int
) -> tuple[MessageSpan, ...]:
    """Message ``indices[j]`` over ``[previous end, offset + ends[j])`` from ``offset``, then the generation prompt
    up to ``end``."""
    out, at = [], offset
    for index, role, stop in zip(indices, roles, ends, strict=True):
        out.append(MessageSpan(index, role, at, offset + stop))
        at = offset + stop
    if at < end:
        out.append(MessageSpan(None, "assistant", at, end))
    return tuple(out)


def bridged_spans(
    previous: tuple[MessageSpan, ...],
    *,
    reply: int,
    prompt_len: int,
    completion_len: int,
    close_len: int,
    new_messages: Sequence[Message],
    first_new: int,
    delta_ends: Sequence[int],
    delta_len: int,
) -> tuple[MessageSpan, ...]:
    """The spans of ``previous prompt + completion + close + delta``.

    :param previous: the previous turn's spans (covering its ``prompt_len`` prompt ids).
    :param reply: the index of the assistant message the completion is (the previous generation prompt becomes
        its header).
    :param delta_ends: where each new message ends within the delta's ids.
    :param first_new: the index of the first new message in the messages sent.
    """
    spans = [
        MessageSpan(reply, "assistant", s.start, s.end) if s.message is None else s for s in previous if s.end > s.start
    ]
    at = prompt_len
    spans.append(MessageSpan(reply, "assistant", at, at + completion_len, sampled=True))
    at += completion_len
    if close_len:
        spans.append(MessageSpan(reply, "assistant", at, at + close_len))
        at += close_len
    roles = [str(m.get("role")) for m in new_messages]
    indices = range(first_new, first_new + len(new_messages))
    spans.extend(_spans(indices, roles, delta_ends, offset=at, end=at + delta_len))
    return tuple(spans)


def delta_bounds(
    delta_text: str,
    new_messages: Sequence[Message],
    render_new: Callable[[int], str],
    generation_prompt: str | None,
) -> list[int]:
    """Character offsets in ``delta_text`` where each new message ends: ``render_new(j)`` is the delta of the first
    ``j`` new messages without a generation prompt; the last one ends where the generation prompt begins."""
    bounds = [agreeing_prefix(render_new(j), delta_text) for j in range(1, len(new_messages))]
    if generation_prompt is not None and delta_text.endswith(generation_prompt):
        last = len(delta_text) - len(generation_prompt)
    else:
        last = agreeing_prefix(render_new(len(new_messages)), delta_text)
    bounds.append(last)
    for j in range(1, len(bounds)):
        bounds[j] = max(bounds[j], bounds[j - 1])
    return bounds


def loss_mask(result: GenerateResult) -> npt.NDArray[np.uint8]:
    """A ``uint8`` array over ``result.token_ids``: 1 exactly on the ids the engine sampled (every reused sampled
    span of the prompt and the completion), 0 elsewhere.

    :raises InvalidRequestError: the prompt reuses earlier turns' ids (``reused_ids``) but carries no spans to
        tell which of them were sampled (a previous turn given as a bare id pair the client could not attribute).
    """
    if not isinstance(result, GenerateResult):
        raise InvalidRequestError(f"loss_mask takes a GenerateResult, got {type(result).__name__}")
    if result.reused_ids and not result.message_spans:
        raise InvalidRequestError(
            "this result's prompt reuses earlier turns' ids but has no message spans to tell which were sampled: "
            "pass the previous GenerateResult as previous= (not an id pair) so the spans carry over"
        )
    prompt = len(result.prompt_ids)
    mask = np.zeros(prompt + len(result.completion_ids), dtype=np.uint8)
    for span in result.message_spans:
        if span.sampled:
            mask[span.start : span.end] = 1
    mask[prompt:] = 1
    return mask
