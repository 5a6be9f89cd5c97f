"""Stateless token-in/token-out: callers send the whole message list every turn; exact ids are still reused.

A :class:`TurnCache` remembers, per session (trajectory), the messages of each turn and the exact ids the
server produced for them. For a new message list it finds the longest remembered turn whose messages, followed
by an assistant message, are a prefix of the new list (compared in :func:`.messages.normalize_message`
form, so dicts vs Pydantic objects, ``None`` keys or JSON spacing in tool arguments don't matter), reuses that
turn's prompt + completion ids untouched, and renders only the tail through the multi-turn bridge.

The assistant message at the reuse point must be the parse of the completion reused
(:meth:`Client.parse_completion <backends_core.Client.parse_completion>`, compared in normal form): the ids
reused are that completion, so a reply the caller edited would otherwise be sent as the old ids. The tail may
only hold tool results and user messages. Anything else is a break: the reply differs from the completion
(``assistant_mismatch``), history was rewritten (an assistant message in the tail, context folding, a branched
sub-agent) or no turn matches. A break raises
:class:`~backends_core.errors.BridgeError` (``on_break="raise"``, the default) or, if the caller chose
``"rerender"``, renders the whole list and records a counted, logged re-render. Never a silent fallback.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from backends_core.config import StatelessPolicy
from backends_core.errors import BridgeError
from backends_core.multiturn.extension import BridgeStats, Extension, extend_with_spans
from backends_core.multiturn.messages import _flat_strings, normal_forms, normalize_message
from backends_core.types import GenerateResult

__all__ = ["REASONING_KEYS", "Turn", "TurnCache", "check_reply", "extend_after_reply", "reply_form"]

_TAIL_ROLES = frozenset({"tool", "user"})


@attrs.frozen
class Turn:
    """One remembered turn: the normalised messages it was prompted with and its result."""

    messages: tuple[dict[str, Any], ...]
    result: GenerateResult


class TurnCache:
    """Bounded per-session memory of turns, and the prefix search over it.

    :param policy: how many sessions and turns to remember.
    :param parse: a completion's assistant message (``Client.parse_completion``): the reply a reused turn
        must be followed by.
    """

    def __init__(self, policy: StatelessPolicy, *, parse: Callable[[GenerateResult], Mapping[str, Any]]) -> None:
        self.policy = policy
        self.parse = parse
        self._sessions: OrderedDict[str, list[Turn]] = OrderedDict()
        # per session, the last message list seen: a deep snapshot of each dict and its normal form, so the
        # next list (the same messages, fresh copies, plus a few new ones) is normalised by one C-level
        # comparison of its prefix instead of message by message
        self._seen: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def turns(self, session: str) -> list[Turn]:
        return list(self._sessions.get(session, ()))

    def remember(self, session: str, messages: Sequence[dict[str, Any]], result: GenerateResult) -> None:
        turns = self._sessions.setdefault(session, [])
        turns.append(Turn(tuple(messages), result))
        del turns[: -self.policy.max_turns]
        self._sessions.move_to_end(session)
        while len(self._sessions) > self.policy.max_sessions:
            forgotten, _ = self._sessions.popitem(last=False)
            self._seen.pop(forgotten, None)

    def _normalize(self, session: str, messages: Sequence[Any]) -> list[dict[str, Any]]:
        """Normal forms of ``messages`` (read only): the prefix equal to the session's last list is not
        normalised again. Equal raw dicts have equal normal forms, and the snapshots are deep copies, so an
        earlier message edited in place is normalised afresh (and breaks the prefix as before)."""
        snapshots, forms = self._seen.get(session, ([], []))
        k = len(snapshots)
        if k and len(messages) >= k and list(messages[:k]) == snapshots:
            rest = messages[k:]
            normalized = [*forms, *normal_forms(rest)]
        else:
            snapshots, forms, rest = [], [], messages
            normalized = normal_forms(messages)
        for m, form in zip(rest, normalized[len(forms) :], strict=True):
            if type(m) is not dict:
                break  # objects are compared through their normal forms, from here on every time
            try:
                snapshots.append(dict(m) if _flat_strings(m) else copy.deepcopy(m))
            except Exception:  # an uncopyable value: compared through normal forms from here on
                break
            forms.append(form)
        self._seen[session] = (snapshots, forms)
        return normalized

    def match(self, session: str, messages: Sequence[dict[str, Any]]) -> tuple[Turn, int] | None:
        """The longest turn whose messages + one assistant message prefix ``messages``, with the index of
        that assistant message; ``None`` when the session has no such turn."""
        # longest first: the first match is the answer (one O(n) comparison in the usual case)
        for turn in sorted(self._sessions.get(session, ()), key=lambda t: len(t.messages), reverse=True):
            n = len(turn.messages)
            if n < len(messages) and messages[n]["role"] == "assistant" and turn.messages == tuple(messages[:n]):
                return turn, n
        return None

    def prompt_ids(
        self,
        tokenizer: Any,
        session: str,
        messages: Sequence[Any],
        *,
        tools: Sequence[Mapping[str, Any]] | None,
        chat_template_kwargs: Mapping[str, Any] | None,
        stats: BridgeStats | None = None,
    ) -> Extension | None:
        """The prompt reusing an earlier turn (ids and spans), ``None`` for a session's first turn; ``stats``
        counts how the tail was rendered (see :func:`~backends_core.multiturn.extension.extend_prompt`).

        :raises BridgeError: reasons ``no_prefix`` (no remembered turn prefixes the list: history rewritten
            or folded), ``assistant_mismatch`` (the assistant message after the reused turn is not the parse
            of its completion), ``history_rewritten`` (the tail holds an assistant or system message), or any
            :func:`~backends_core.multiturn.extension.extend_prompt` reason.
        """
        if session not in self._sessions:
            return None
        normalized = self._normalize(session, messages)
        found = self.match(session, normalized)
        if found is None:
            raise BridgeError(
                "no_prefix",
                f"no earlier turn of session {session!r} is a prefix of these "
                f"{len(normalized)} messages (history rewritten or folded?)",
            )
        turn, at = found
        return extend_after_reply(
            tokenizer,
            normalized,
            at,
            turn.result,
            self.parse,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
            stats=stats,
        )


def extend_after_reply(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    at: int,
    previous: GenerateResult,
    parse: Callable[[GenerateResult], Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None,
    chat_template_kwargs: Mapping[str, Any] | None,
    stats: BridgeStats | None,
) -> Extension:
    """The prompt for ``messages`` (normal forms) that reuses ``previous``'s exact ids: ``messages[at]`` must be
    the same turn as ``previous``'s completion (:func:`check_reply`), ``messages[:at]`` is its history, and what
    follows may hold only tool results and user messages.

    :raises BridgeError: ``assistant_mismatch``, ``history_rewritten``, or any
        :func:`~backends_core.multiturn.extension.extend_prompt` reason.
    """
    check_reply(messages[at], parse(previous))
    tail = messages[at + 1 :]
    odd = [m["role"] for m in tail if m["role"] not in _TAIL_ROLES]
    if odd:
        raise BridgeError(
            "history_rewritten",
            f"after the reused turn the new messages hold {odd}: only tool "
            "results and user messages can follow without re-rendering",
        )
    return extend_with_spans(
        tokenizer,
        history=messages[:at],
        previous=previous,
        new_messages=tail,
        assistant_message=messages[at],
        tools=tools,
        chat_template_kwargs=chat_template_kwargs,
        stats=stats,
    )


#: Keys under which harnesses hold an assistant message's reasoning (OpenAI-style clients, vLLM's newer name).
REASONING_KEYS = ("reasoning_content", "reasoning")


#: What of a tool call is the harness's bookkeeping, which no template renders: its ``id`` and ``type``, and the
#: ``index`` a streamed call keeps once an SDK has accumulated its chunks.
_CALL_BOOKKEEPING = frozenset({"id", "type", "index"})


def reply_form(message: Mapping[str, Any], *, keep_reasoning: bool) -> dict[str, Any]:
    """What of an assistant message (normal form) decides whether it is the same turn as a completion: its role,
    content, tool calls (name and arguments; a call's ``id``, ``type`` and streamed ``index`` are the harness's
    bookkeeping, which the template does not render) and, with ``keep_reasoning``, its reasoning text under
    ``reasoning_content``."""
    form = {k: v for k, v in message.items() if k not in REASONING_KEYS}
    calls = form.get("tool_calls")
    if calls:
        form["tool_calls"] = [
            {k: v for k, v in call.items() if k not in _CALL_BOOKKEEPING} if isinstance(call, Mapping) else call
            for call in calls
        ]
    if keep_reasoning:
        form["reasoning_content"] = _reasoning(message)
    return form


def _reasoning(message: Mapping[str, Any]) -> Any:
    """The message's reasoning text, ``None`` when it carries none (absent, ``None`` or empty)."""
    for key in REASONING_KEYS:
        value = message.get(key)
        if value is not None and value != "":
            return value
    return None


def check_reply(given: Mapping[str, Any], parsed: Mapping[str, Any]) -> None:
    """``given`` (an assistant message as a harness sends it back, normal form) is the same turn as ``parsed``
    (the parse of the completion whose ids would be reused).

    It is when the two differ only in what OpenAI-style harnesses do not carry or normalise: reasoning that
    ``given`` does not carry (absent, ``None`` or ``''``: most harnesses never keep it), a tool call's ``id``,
    ``type`` and ``index`` (an SDK's accumulated stream keeps it), the spacing and key order of a tool call's
    JSON arguments, and ``content`` ``None`` vs ``''``. A difference in what was said is refused: content text, a
    tool call's name or arguments, their number or order, or reasoning text that ``given`` carries and that
    differs from the parse.

    :raises BridgeError: reason ``assistant_mismatch``, naming the fields that differ.
    """
    keep = _reasoning(given) is not None
    mine = reply_form(given, keep_reasoning=keep)
    expected = reply_form(normalize_message(parsed), keep_reasoning=keep)
    if mine == expected:
        return
    fields = sorted(k for k in {*mine, *expected} if mine.get(k) != expected.get(k))
    shown = "; ".join(f"{k}: given {mine.get(k)!r:.80}, parsed {expected.get(k)!r:.80}" for k in fields)
    raise BridgeError(
        "assistant_mismatch",
        f"the assistant message is not the parse of the completion whose ids would be reused ({shown}); "
        "send client.parse_completion(result) as the reply, or start a new session",
    )
