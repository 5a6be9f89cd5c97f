"""Multi-turn token-in/token-out: turn N extends turn N-1's exact ids and renders only the new messages.

Re-rendering a conversation from messages silently changes tokens (BPE drift, dropped reasoning, tool-call
formatting), which corrupts RL training data. A :class:`Conversation` therefore never re-renders history. For
turn N it sends ``previous prompt + previous completion + close + delta`` where

* ``close`` finishes the previous assistant turn with the template's own end-of-turn tokens: only the part
  the model did not generate (``"\\n"`` after a sampled ``<|im_end|>``), or all of it when the turn was cut
  short (``length`` / ``abort``), after closing an unclosed ``<think>`` block;
* ``delta`` is the template's rendering of the new messages plus the generation prompt, taken from a render
  of the whole conversation in which the previous assistant turn is a sentinel, so every template rule that
  depends on earlier messages (tool-response grouping, system blocks) still applies.

The bridge then *proves* the result: the re-encoded tail ``end-of-turn + delta`` must tokenize exactly to
``end-of-turn ids + delta ids`` (no token merges across the boundary), and the new prompt must start with
the previous ids. Anything it cannot prove raises :class:`~backends_core.errors.BridgeError` with a reason;
nothing falls back to re-rendering or text. Attempts, successes and failures (by reason) are counted in
:class:`BridgeStats`.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from backends_core.errors import BridgeError, RenderError
from backends_core.rendering import encode, render_text
from backends_core.types import GenerateResult, Message, SamplingParams

if TYPE_CHECKING:
    from backends_core.client import Client

__all__ = ["BridgeStats", "Conversation", "extend_prompt"]

_SENTINEL = "\u27e6backends-bridge-sentinel\u27e7"


@attrs.define
class BridgeStats:
    """Counters for multi-turn bridging: ``attempts`` to reuse exact ids, ``successes`` (reused),
    ``failures`` keyed by :attr:`BridgeError.reason`, and ``rerendered``: breaks the caller chose to
    re-render in full (``StatelessPolicy.on_break = "rerender"``)."""

    attempts: int = 0
    successes: int = 0
    failures: Counter[str] = attrs.field(factory=Counter)
    rerendered: int = 0

    @property
    def failed(self) -> int:
        return sum(self.failures.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "attempts": self.attempts,
            "successes": self.successes,
            "failures": dict(self.failures),
            "rerendered": self.rerendered,
        }


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


def _unclosed_think_ids(tokenizer: Any, completion_ids: Sequence[int]) -> list[int]:
    ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<think>", "</think>")]
    unk = getattr(tokenizer, "unk_token_id", None)
    if any(i is None or i == unk for i in ids):
        return []
    opened, closed = completion_ids.count(ids[0]), completion_ids.count(ids[1])
    return encode(tokenizer, "\n</think>\n\n") if opened > closed else []


def extend_prompt(
    tokenizer: Any,
    *,
    history: Sequence[Message],
    previous: GenerateResult,
    new_messages: Sequence[Message],
    assistant_message: Message | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
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
    :raises BridgeError: with ``reason`` one of ``sentinel_missing``, ``no_end_of_turn``,
        ``foreign_stop_token``, ``boundary_drift``, ``template_error``, ``empty_turn``.
    """
    kwargs = dict(chat_template_kwargs or {})
    if not new_messages:
        raise BridgeError("empty_turn", "a new turn needs at least one new message")
    try:
        eot = _end_of_turn(tokenizer, kwargs)
        sentinel_turn: dict[str, Any] = {"role": "assistant", "content": _SENTINEL}
        if assistant_message is not None and assistant_message.get("tool_calls"):
            sentinel_turn["tool_calls"] = assistant_message["tool_calls"]
        full = render_text(
            tokenizer,
            [*history, sentinel_turn, *new_messages],
            tools=tools,
            add_generation_prompt=True,
            chat_template_kwargs=kwargs,
        )
    except RenderError as exc:
        raise BridgeError("template_error", str(exc)) from exc
    at = full.rfind(_SENTINEL)
    if at < 0:
        raise BridgeError("sentinel_missing", "the chat template dropped the previous assistant turn")
    eot_at = full.find(eot, at + len(_SENTINEL))
    if eot_at < 0:
        raise BridgeError("no_end_of_turn", f"the template did not end the assistant turn with {eot!r}")
    delta_text = full[eot_at + len(eot) :]
    eot_ids = encode(tokenizer, eot)
    delta_ids = encode(tokenizer, delta_text)
    if encode(tokenizer, eot + delta_text) != eot_ids + delta_ids:
        raise BridgeError("boundary_drift", f"tokens merge across the turn boundary {eot!r} | {delta_text[:40]!r}")

    completion = list(previous.completion_ids)
    generated_eot = 0
    for k in range(min(len(eot_ids), len(completion)), 0, -1):
        if completion[-k:] == eot_ids[:k]:
            generated_eot = k
            break
    if generated_eot:
        close = eot_ids[generated_eot:]
    elif previous.finish_reason in ("length", "abort"):
        close = _unclosed_think_ids(tokenizer, completion) + eot_ids
    else:
        last = completion[-1] if completion else None
        raise BridgeError(
            "foreign_stop_token",
            f"the previous turn stopped on token {last!r} ({previous.stop_reason!r}), which is not the template's "
            f"end of turn {eot!r}; closing it would invent tokens the template never produces",
        )
    prompt = list(previous.prompt_ids) + completion + close + delta_ids
    if prompt[: len(previous.prompt_ids) + len(completion)] != list(previous.token_ids):
        raise BridgeError("boundary_drift", "the new prompt does not start with the previous ids")
    return prompt


class Conversation:
    """A multi-turn exchange that keeps exact ids between turns.

    ``await conv.send(messages)`` renders the first turn in full; every later ``send`` takes only the new
    messages (tool results, the next user message) and extends the previous ids through
    :func:`extend_prompt`. Pass ``assistant_message=`` when the previous turn's parsed tool calls matter to
    the template.
    """

    def __init__(
        self,
        client: Client,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        server: int | str | None = None,
    ) -> None:
        self._client = client
        self.tools = list(tools) if tools else None
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self._server = server
        #: Session key: every turn sticks to one server (its prefix cache) unless ``server`` pins one.
        self.session = uuid.uuid4().hex
        #: Every message so far; assistant turns appear as the caller described them (or their decoded text).
        self.messages: list[Message] = []
        #: Each turn's result, in order.
        self.turns: list[GenerateResult] = []

    @property
    def token_ids(self) -> tuple[int, ...]:
        """The exact ids so far (last prompt + last completion)."""
        return self.turns[-1].token_ids if self.turns else ()

    async def send(
        self,
        new_messages: Sequence[Message],
        *,
        sampling: SamplingParams | None = None,
        assistant_message: Message | None = None,
        **generate_kwargs: Any,
    ) -> GenerateResult:
        """Run the next turn.

        :param new_messages: the first turn's messages, then only what is new.
        :param sampling: sampling parameters for this turn.
        :param assistant_message: the previous turn parsed as a message (tool calls), if the caller has it.
        :param generate_kwargs: passed to :meth:`Client.generate` (``request_id``, ``lora``...).
        :raises BridgeError: the new prompt cannot be proven to extend the previous ids.
        """
        client = self._client
        if generate_kwargs.get("server") is None:
            generate_kwargs["server"] = self._server
        generate_kwargs.setdefault("session", self.session)
        if not self.turns:
            result = await client.generate(
                messages=list(new_messages),
                sampling=sampling,
                tools=self.tools,
                chat_template_kwargs=self.chat_template_kwargs,
                **generate_kwargs,
            )
        else:
            previous = self.turns[-1]
            history = self.messages
            stats = client.bridge_stats
            stats.attempts += 1
            started = time.perf_counter()
            try:
                ids = extend_prompt(
                    client.tokenizer,
                    history=history,
                    previous=previous,
                    new_messages=new_messages,
                    assistant_message=assistant_message,
                    tools=self.tools,
                    chat_template_kwargs=self.chat_template_kwargs,
                )
            except BridgeError as exc:
                stats.failures[exc.reason] += 1
                client.driver.emit("bridge", "bridge", None, started, exc, reason=exc.reason)
                raise
            stats.successes += 1
            client.driver.emit("bridge", "bridge", None, started, None, delta_tokens=len(ids) - len(previous.token_ids))
            result = await client.generate(prompt_ids=ids, sampling=sampling, **generate_kwargs)
            self.messages.append(self._assistant(previous, assistant_message))
        self.messages.extend(new_messages)
        self.turns.append(result)
        return result

    def _assistant(self, previous: GenerateResult, given: Message | None) -> Message:
        if given is not None:
            return given
        text = self._client.tokenizer.decode(list(previous.completion_ids), skip_special_tokens=True)
        return {"role": "assistant", "content": text}
