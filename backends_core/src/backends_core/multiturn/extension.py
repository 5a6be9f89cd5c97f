"""Multi-turn token-in/token-out: turn N extends turn N-1's exact ids and renders only the new messages.

Re-rendering a conversation from messages silently changes tokens (BPE drift, dropped reasoning, tool-call
formatting), which corrupts RL training data. A ``Conversation`` therefore never re-tokenizes history.
For turn N it sends ``previous prompt + previous completion + close + delta`` where

* ``close`` finishes the previous assistant turn with the template's own end-of-turn tokens: only the part
  the model did not generate (``"\\n"`` after a sampled ``<|im_end|>``), or all of it when the turn was cut
  short (``length`` / ``abort``), after closing an unclosed ``<think>`` block;
* ``delta`` is the template's rendering of the new messages plus the generation prompt, taken from a render
  in which the previous assistant turn is a sentinel (so every template rule that looks at the neighbouring
  messages, tool-response grouping say, applies), or from a render of the new messages alone where that is
  verified to give the same text.

**What is rendered.** The *full* way renders the whole history before the sentinel, so rules that depend on
earlier messages (system blocks, position) apply exactly; its cost grows with the history. The *tail* way
renders the new messages in a minimal context — alone (the whole render is the delta), or after the sentinel
preceded by the history's leading system message (if any), or by that and one stand-in user message — so its
cost depends on the new messages only. A tail render is used only for a *shape* whose verdict is cached: the
first time a template (per tokenizer, chat template, tools and template variables) meets a shape — parity of
the history length, whether it starts with a system message, the role before the previous assistant turn,
whether that turn has tool calls, and the role, keys and content type of each new message — the bridge renders
in full, renders the tail in each candidate context, cheapest first, and keeps the first whose delta is
*identical* to the full one (the verdict). Only a history at least two messages longer than the context can
prove anything (positions must differ), so shorter ones are rendered in full without a verdict. A template
whose tail never matches (it numbers turns, say) gets the verdict *position-dependent* and is rendered in full
every turn. Every turn is counted: ``tail_renders``, or ``full_renders[reason]`` with reason ``verify``,
``short_history``, ``position_dependent``, ``tail_error`` (a verified context raised or lost the sentinel on
this turn's content), ``uncacheable`` (tools or template variables are not JSON, the tokenizer cannot be weakly
referenced, or a new message is not a mapping) or ``disabled``. The verdict assumes the template renders new
messages differently after different histories only through the features of the shape (a template that
changes its output past, say, the 40th message would be caught only by a verification past it);
``extend_prompt(..., tail_render=False)`` renders in full regardless.

The bridge then *proves* the result: the template's end-of-turn text followed by the delta, encoded in one
piece, must start with exactly the end-of-turn ids (no token merges across the boundary); the delta's ids are
the rest. Anything it cannot prove raises :class:`~backends_core.errors.BridgeError` with a reason; nothing
falls back to re-rendering or text. Attempts, successes and failures (by reason) are counted in
:class:`BridgeStats`.
"""

from __future__ import annotations

import json
import weakref
from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import attrs

from backends_core.errors import BridgeError, RenderError
from backends_core.images import Image, ImageSpan
from backends_core.multiturn.rendering import encode, render_text
from backends_core.multiturn.spans import bridged_spans, delta_bounds, token_bounds
from backends_core.types import GenerateResult, Message, MessageSpan

__all__ = [
    "BridgeStats",
    "Extension",
    "clear_template_cache",
    "end_of_turn_ids",
    "end_of_turn_stop_ids",
    "extend_prompt",
    "extend_with_spans",
]

_SENTINEL = "\u27e6backends-bridge-sentinel\u27e7"
_CONTEXT_USER = "\u27e6backends-bridge-context\u27e7"
_POSITION_DEPENDENT = -1  # verdict: no candidate context reproduces the full render's delta
_MAX_STATES = 64  # template states (chat template x tools x variables) kept per tokenizer
_MAX_SHAPES = 1024  # verdicts kept per template state


@attrs.define
class BridgeStats:
    """Counters for multi-turn bridging: ``attempts`` to reuse exact ids, ``successes`` (reused),
    ``failures`` keyed by :attr:`BridgeError.reason`, ``rerendered``: breaks the caller chose to re-render
    in full (``StatelessPolicy.on_break = "rerender"``); and how each bridged turn's new messages were
    rendered: ``tail_renders`` (alone, in a verified minimal context) or ``full_renders`` keyed by why the
    whole history was rendered around them (``verify``, ``short_history``, ``position_dependent``,
    ``tail_error``, ``uncacheable``, ``disabled``; see :mod:`backends_core.multiturn.extension`)."""

    attempts: int = 0
    successes: int = 0
    failures: Counter[str] = attrs.field(factory=Counter)
    rerendered: int = 0
    tail_renders: int = 0
    full_renders: Counter[str] = attrs.field(factory=Counter)

    @property
    def failed(self) -> int:
        return sum(self.failures.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "attempts": self.attempts,
            "successes": self.successes,
            "failures": dict(self.failures),
            "rerendered": self.rerendered,
            "tail_renders": self.tail_renders,
            "full_renders": dict(self.full_renders),
        }


# -- per-template cache: the end-of-turn probe and the tail verdicts ------------------------------------


@attrs.define
class _TemplateState:
    """What one template (tokenizer x chat template x tools x template variables) always renders the same."""

    eot: tuple[str, tuple[int, ...]] | None = None
    stop_ids: tuple[int, ...] | None = None
    verdicts: dict[Hashable, int] = attrs.field(factory=dict)
    #: The text the template appends for ``add_generation_prompt`` (``""`` when it cannot be told apart).
    generation_prompt: str | None = None


_STATES: weakref.WeakKeyDictionary[Any, dict[tuple[Any, str, str], _TemplateState]] = weakref.WeakKeyDictionary()


def clear_template_cache() -> None:
    """Forget every cached end-of-turn probe and tail verdict (they are rebuilt on the next turns)."""
    _STATES.clear()


def _freeze(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _template_state(
    tokenizer: Any, tools: Sequence[Mapping[str, Any]] | None, kwargs: Mapping[str, Any]
) -> _TemplateState | None:
    """The cached state of this template, ``None`` when it cannot be keyed (non-JSON tools or variables, a
    tokenizer that cannot be weakly referenced)."""
    template = getattr(tokenizer, "chat_template", None)
    try:
        key = (
            template if isinstance(template, str) else _freeze(template),
            _freeze(tools) if tools else "",
            _freeze(kwargs) if kwargs else "",
        )
        per_tokenizer = _STATES.get(tokenizer)
        if per_tokenizer is None:
            per_tokenizer = _STATES[tokenizer] = {}
    except (TypeError, ValueError):
        return None
    state = per_tokenizer.get(key)
    if state is None:
        if len(per_tokenizer) >= _MAX_STATES:
            per_tokenizer.clear()
        state = per_tokenizer[key] = _TemplateState()
    return state


def _end_of_turn(tokenizer: Any, chat_template_kwargs: Mapping[str, Any]) -> str:
    """The text the template puts after an assistant message's content (e.g. ``"<|im_end|>\\n"``)."""
    probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]
    text = render_text(tokenizer, probe, add_generation_prompt=False, chat_template_kwargs=chat_template_kwargs)
    at = text.rfind(_SENTINEL)
    if at < 0:
        raise BridgeError("sentinel_missing", "the chat template does not render assistant content")
    eot = text[at + len(_SENTINEL) :]
    if not eot:
        raise BridgeError("no_end_of_turn", "the chat template puts nothing after an assistant message")
    return eot


def end_of_turn_ids(
    tokenizer: Any, chat_template_kwargs: Mapping[str, Any] | None = None
) -> tuple[str, tuple[int, ...]]:
    """The template's end-of-turn text after an assistant message and its ids, probed once per template (the
    same cached probe the bridge closes turns with).

    :raises BridgeError: ``sentinel_missing`` / ``no_end_of_turn`` when the template has none to find.
    """
    kwargs = dict(chat_template_kwargs or {})
    state = _template_state(tokenizer, None, kwargs)
    if state is not None and state.eot is not None:
        return state.eot
    eot = _end_of_turn(tokenizer, kwargs)
    found = (eot, tuple(encode(tokenizer, eot)))
    if state is not None:
        state.eot = found
    return found


def _special_ids(tokenizer: Any) -> set[int]:
    ids = {int(i) for i in getattr(tokenizer, "all_special_ids", None) or ()}
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(int(i) for i, token in added.items() if getattr(token, "special", False))
    return ids


def end_of_turn_stop_ids(tokenizer: Any, chat_template_kwargs: Mapping[str, Any] | None = None) -> tuple[int, ...]:
    """The token ids that end an assistant turn in this chat template: the special tokens of its end-of-turn
    text (``<|im_end|>`` of ``"<|im_end|>\\n"``; the newline after it is formatting, not a stop). Empty when the
    end of turn is plain text only.

    :raises BridgeError: the template renders no end of turn to probe.
    """
    state = _template_state(tokenizer, None, dict(chat_template_kwargs or {}))
    if state is not None and state.stop_ids is not None:
        return state.stop_ids
    _, ids = end_of_turn_ids(tokenizer, chat_template_kwargs)
    special = _special_ids(tokenizer)
    stop_ids = tuple(dict.fromkeys(i for i in ids if i in special))
    if state is not None:
        state.stop_ids = stop_ids
    return stop_ids


def _message_shape(message: Mapping[str, Any]) -> tuple[Any, ...]:
    extra = sorted(k for k, v in message.items() if v is not None and k not in ("role", "content", "tool_calls"))
    return (message.get("role"), type(message.get("content")).__name__, bool(message.get("tool_calls")), *extra)


def _shape(history: Sequence[Message], sentinel_turn: Message, new_messages: Sequence[Message]) -> Hashable:
    """What the verdict of a tail render is keyed by: O(new messages), never the history's contents."""
    first = history[0].get("role") if history else None
    before = history[-1].get("role") if history else None
    return (
        len(history) % 2,
        first == "system",
        before,
        _message_shape(sentinel_turn),
        tuple(_message_shape(m) for m in new_messages),
    )


def _contexts(history: Sequence[Message]) -> list[list[Message] | None]:
    """Candidate minimal contexts for a tail render, cheapest first: ``None`` (the new messages alone, without
    the sentinel turn: the whole render is the delta), the leading system message (if any) before the
    sentinel, then that plus a stand-in user message."""
    base: list[Message] = [history[0]] if history and history[0].get("role") == "system" else []
    return [None, base, [*base, {"role": "user", "content": _CONTEXT_USER}]]


def _delta(text: str, eot: str) -> str:
    """What the template rendered after the sentinel assistant turn's end of turn."""
    at = text.rfind(_SENTINEL)
    if at < 0:
        raise BridgeError("sentinel_missing", "the chat template dropped the previous assistant turn")
    eot_at = text.find(eot, at + len(_SENTINEL))
    if eot_at < 0:
        raise BridgeError("no_end_of_turn", f"the template did not end the assistant turn with {eot!r}")
    return text[eot_at + len(eot) :]


def _render_delta(
    tokenizer: Any,
    state: _TemplateState | None,
    eot: str,
    history: Sequence[Message],
    sentinel_turn: Message,
    new_messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None,
    kwargs: Mapping[str, Any],
    tail_render: bool,
) -> tuple[str, str, Callable[[int], str]]:
    """The delta text, how it was rendered (``"tail"`` or the reason for a full render), and the delta of the first
    ``j`` new messages without a generation prompt, rendered in the same context (for their spans)."""

    def render(
        context: Sequence[Message] | None, new: Sequence[Message] = new_messages, generation: bool = True
    ) -> str:
        messages = list(new) if context is None else [*context, sentinel_turn, *new]
        text = render_text(
            tokenizer, messages, tools=tools, add_generation_prompt=generation, chat_template_kwargs=kwargs
        )
        return text if context is None else _delta(text, eot)

    def in_context(context: Sequence[Message] | None) -> Callable[[int], str]:
        return lambda j: render(context, new_messages[:j], False)

    shape: Hashable = None
    if state is None:
        how = "uncacheable"
    elif not tail_render:
        how = "disabled"
    else:
        try:
            shape = _shape(history, sentinel_turn, new_messages)
        except (AttributeError, TypeError):  # not mappings: the full render reports it
            how = "uncacheable"
        else:
            verdict = state.verdicts.get(shape)
            if verdict is None:
                how = "verify"
            elif verdict == _POSITION_DEPENDENT:
                how = "position_dependent"
            else:
                context = _contexts(history)[verdict]
                try:
                    return render(context), "tail", in_context(context)
                except (RenderError, BridgeError):
                    how = "tail_error"
    delta = render(history)
    if how == "verify":
        assert state is not None
        how = _verify(state, shape, history, delta, render)
    return delta, how, in_context(history)


def _verify(state: _TemplateState, shape: Hashable, history: Sequence[Message], delta: str, render: Any) -> str:
    """Find the cheapest candidate context whose tail render reproduces ``delta`` (the full render's) and
    cache it as the shape's verdict; a history too short to tell positions apart decides nothing."""
    verdict: int | None = _POSITION_DEPENDENT
    for index, context in enumerate(_contexts(history)):
        if len(history) < len(context or ()) + 2:
            verdict = None
            continue
        try:
            matches = render(context) == delta
        except (RenderError, BridgeError):
            matches = False
        if matches:
            verdict = index
            break
    if verdict is None:
        return "short_history"
    if len(state.verdicts) >= _MAX_SHAPES:
        state.verdicts.clear()
    state.verdicts[shape] = verdict
    return "verify"


def _unclosed_think_ids(tokenizer: Any, completion_ids: Sequence[int]) -> list[int]:
    ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<think>", "</think>")]
    unk = getattr(tokenizer, "unk_token_id", None)
    if any(i is None or i == unk for i in ids):
        return []
    opened, closed = completion_ids.count(ids[0]), completion_ids.count(ids[1])
    return encode(tokenizer, "\n</think>\n\n") if opened > closed else []


def _generation_prompt(tokenizer: Any, state: _TemplateState | None, kwargs: Mapping[str, Any]) -> str | None:
    """The text ``add_generation_prompt`` appends in this template, probed once per template (``None`` when the
    render with it does not extend the one without)."""
    if state is not None and state.generation_prompt is not None:
        return state.generation_prompt or None
    probe = [{"role": "user", "content": _CONTEXT_USER}]
    without = render_text(tokenizer, probe, add_generation_prompt=False, chat_template_kwargs=kwargs)
    with_prompt = render_text(tokenizer, probe, add_generation_prompt=True, chat_template_kwargs=kwargs)
    found = with_prompt[len(without) :] if with_prompt.startswith(without) else ""
    if state is not None:
        state.generation_prompt = found
    return found or None


@attrs.frozen
class Extension:
    """A bridged prompt: its ids, and which of them are what (see :func:`extend_with_spans`)."""

    ids: list[int]
    #: The message spans of ``ids`` (``None`` when the previous turn has none to carry over).
    spans: tuple[MessageSpan, ...] | None
    #: Leading ids reused verbatim: the previous prompt and completion.
    reused: int
    #: The previous turn's images and their spans in ``ids`` (reused with its ids).
    images: tuple[Image, ...] = ()
    image_spans: tuple[ImageSpan, ...] = ()


def extend_prompt(
    tokenizer: Any,
    *,
    history: Sequence[Message],
    previous: GenerateResult,
    new_messages: Sequence[Message],
    assistant_message: Message | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    stats: BridgeStats | None = None,
    tail_render: bool = True,
) -> list[int]:
    """The prompt ids of the next turn, proven to extend ``previous.prompt_ids + previous.completion_ids``.

    :param tokenizer: the chat-template tokenizer.
    :param history: every message before the previous assistant turn.
    :param previous: the previous turn's result (its exact ids are reused untouched).
    :param new_messages: what follows the assistant turn (tool results, a user message).
    :param assistant_message: the parsed assistant message, when it carries ``tool_calls`` the template must
        see; its content is never re-rendered.
    :param tools: tool schemas of the conversation.
    :param chat_template_kwargs: template variables of the conversation.
    :param stats: counts how the new messages were rendered (``tail_renders`` / ``full_renders``).
    :param tail_render: ``False`` renders the whole history around the new messages even where a tail render
        is verified.
    :raises BridgeError: with ``reason`` one of ``sentinel_missing``, ``no_end_of_turn``,
        ``foreign_stop_token``, ``boundary_drift``, ``template_error``, ``empty_turn``.
    """
    return extend_with_spans(
        tokenizer,
        history=history,
        previous=previous,
        new_messages=new_messages,
        assistant_message=assistant_message,
        tools=tools,
        chat_template_kwargs=chat_template_kwargs,
        stats=stats,
        tail_render=tail_render,
        spans=False,
    ).ids


def _stopped_on_its_last_id(tokenizer: Any, result: GenerateResult) -> bool:
    """Whether the completion's last id is the token that ended it: the stop token the engine reported, or the
    tokenizer's EOS (which engines report as no stop reason at all)."""
    completion = result.completion_ids
    if result.finish_reason != "stop" or not completion:
        return False
    reason = result.stop_reason
    eos = getattr(tokenizer, "eos_token_id", None)
    return (isinstance(reason, int) and not isinstance(reason, bool) and completion[-1] == reason) or (
        reason is None and isinstance(eos, int) and completion[-1] == eos
    )


def extend_with_spans(
    tokenizer: Any,
    *,
    history: Sequence[Message],
    previous: GenerateResult,
    new_messages: Sequence[Message],
    assistant_message: Message | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    stats: BridgeStats | None = None,
    tail_render: bool = True,
    spans: bool = True,
) -> Extension:
    """:func:`extend_prompt`, with the new prompt's message spans (``spans``): the previous turn's, its completion
    as the reply's sampled span (the reply is message ``len(history)``), then the new messages from
    ``len(history) + 1`` and the generation prompt (:func:`~backends_core.multiturn.spans.bridged_spans`)."""
    kwargs = dict(chat_template_kwargs or {})
    if not new_messages:
        raise BridgeError("empty_turn", "a new turn needs at least one new message")
    sentinel_turn: dict[str, Any] = {"role": "assistant", "content": _SENTINEL}
    if assistant_message is not None and assistant_message.get("tool_calls"):
        sentinel_turn["tool_calls"] = assistant_message["tool_calls"]
    state = _template_state(tokenizer, tools, kwargs)
    try:
        if state is not None and state.eot is not None:
            eot, eot_ids = state.eot
        else:
            eot, eot_ids = end_of_turn_ids(tokenizer, kwargs)
            if state is not None:
                state.eot = (eot, eot_ids)
        delta_text, how, render_new = _render_delta(
            tokenizer, state, eot, history, sentinel_turn, new_messages, tools, kwargs, tail_render
        )
        generation_prompt = _generation_prompt(tokenizer, state, kwargs) if spans else None
        char_ends = delta_bounds(delta_text, new_messages, render_new, generation_prompt) if spans else []
    except RenderError as exc:
        raise BridgeError("template_error", str(exc)) from exc
    tail_ids = encode(tokenizer, eot + delta_text)
    if tuple(tail_ids[: len(eot_ids)]) != eot_ids:
        raise BridgeError("boundary_drift", f"tokens merge across the turn boundary {eot!r} | {delta_text[:40]!r}")
    delta_ids = tail_ids[len(eot_ids) :]

    completion = previous.completion_ids
    generated_eot = 0
    for k in range(min(len(eot_ids), len(completion)), 0, -1):
        if tuple(completion[-k:]) == eot_ids[:k]:
            generated_eot = k
            break
    close: Sequence[int]
    if generated_eot:
        close = eot_ids[generated_eot:]
    elif previous.finish_reason in ("length", "abort"):
        close = [*_unclosed_think_ids(tokenizer, completion), *eot_ids]
    elif _stopped_on_its_last_id(tokenizer, previous):
        # the engine stopped on a token that ends the sample (the model's EOS, a second end token as Qwen's
        # <|endoftext|>, a stop_token_ids entry): the turn ended there, so the template's end of turn closes it
        # after that token, which stays as sampled; the reply's parse drops it as the answer's did
        close = eot_ids
    else:
        last = completion[-1] if completion else None
        raise BridgeError(
            "foreign_stop_token",
            f"the previous turn stopped on token {last!r} (stop reason {previous.stop_reason!r}), which is neither the "
            f"template's end of turn {eot!r} nor a stop token the engine reported: it cannot be told apart from a "
            "reply cut short, and closing it would invent tokens the template never produces",
        )
    if stats is not None:
        if how == "tail":
            stats.tail_renders += 1
        else:
            stats.full_renders[how] += 1
    # one copy of the previous ids (C speed), untouched: the new prompt starts with them by construction
    ids = [*previous.prompt_ids, *completion, *close, *delta_ids]
    found: tuple[MessageSpan, ...] | None = None
    if spans and (previous.message_spans or not previous.prompt_ids):
        ends = token_bounds(tokenizer, eot + delta_text, tail_ids, [len(eot) + e for e in char_ends])
        if ends is not None:
            found = bridged_spans(
                previous.message_spans,
                reply=len(history),
                prompt_len=len(previous.prompt_ids),
                completion_len=len(completion),
                close_len=len(close),
                new_messages=new_messages,
                first_new=len(history) + 1,
                delta_ends=[e - len(eot_ids) for e in ends],
                delta_len=len(delta_ids),
            )
    return Extension(ids, found, len(previous.prompt_ids) + len(completion), previous.images, previous.image_spans)
