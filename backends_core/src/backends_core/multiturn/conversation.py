"""A multi-turn exchange over a client: each turn extends the previous one's exact ids."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from backends_core.errors import BridgeError
from backends_core.multiturn.extension import extend_with_spans
from backends_core.multiturn.messages import images_of, normalize_message
from backends_core.multiturn.turn_cache import check_reply
from backends_core.types import GenerateResult, Message, SamplingParams

if TYPE_CHECKING:
    from backends_core.client import Client

__all__ = ["Conversation"]


class Conversation:
    """A multi-turn exchange that keeps exact ids between turns.

    ``await conv.send(messages)`` renders the first turn in full; every later ``send`` takes only the new
    messages (tool results, the next user message; never an assistant message) and extends the previous ids
    through :func:`extend_prompt`. The previous turn's reply is recorded in :attr:`messages` as
    :meth:`Client.parse_completion <backends_core.Client.parse_completion>` of its completion (tool calls and
    reasoning as the client's parsers find them), and that parse is what the template sees for it.
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
        #: Every message so far; each earlier turn's reply as ``client.parse_completion`` of its completion (the
        #: last turn's reply joins on the next ``send``).
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
        :param assistant_message: the previous turn's reply as the caller holds it: checked to be the parse of its
            completion (normal form), so a reply edited after sampling cannot pass for the sampled ids.
        :param generate_kwargs: passed to :meth:`Client.generate` (``request_id``, ``lora``...).
        :raises BridgeError: the new prompt cannot be proven to extend the previous ids; reasons as
            :func:`extend_prompt`, ``history_rewritten`` (an assistant message among ``new_messages``) and
            ``assistant_mismatch`` (``assistant_message`` is not the parse of the previous completion). Every
            failure is counted in ``client.bridge_stats.failures``.
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
            stats = client.bridge_stats
            stats.attempts += 1
            started = time.perf_counter()
            try:
                _refuse_assistant_turns(new_messages)
                reply = client.parse_completion(previous)
                if assistant_message is not None:
                    check_reply(normalize_message(assistant_message), reply)
                extension = extend_with_spans(
                    client.tokenizer,
                    history=self.messages,
                    previous=previous,
                    new_messages=new_messages,
                    assistant_message=reply,
                    tools=self.tools,
                    chat_template_kwargs=self.chat_template_kwargs,
                    stats=stats,
                )
            except BridgeError as exc:
                stats.failures[exc.reason] += 1
                client.driver.emit("bridge", "bridge", None, started, exc, reason=exc.reason)
                raise
            stats.successes += 1
            ids = extension.ids
            client.driver.emit("bridge", "bridge", None, started, None, delta_tokens=len(ids) - len(previous.token_ids))
            sampling = client.template_stop(sampling, chat_template_kwargs=self.chat_template_kwargs)
            images = previous.images + images_of(new_messages, where="new_messages")
            if images:
                generate_kwargs.update(images=images, image_spans=previous.image_spans)
            result = await client.generate(prompt_ids=ids, sampling=sampling, **generate_kwargs)
            result = attrs.evolve(result, message_spans=extension.spans or (), reused_ids=extension.reused)
            self.messages.append(reply)
        self.messages.extend(new_messages)
        self.turns.append(result)
        return result


def _refuse_assistant_turns(new_messages: Sequence[Message]) -> None:
    """A later turn's new messages are what follows the sampled reply: an assistant message among them would put
    words in the model's mouth that it never sampled.

    :raises BridgeError: reason ``history_rewritten``.
    """
    for i, m in enumerate(new_messages):
        if isinstance(m, Mapping) and m.get("role") == "assistant":
            raise BridgeError(
                "history_rewritten",
                f"new_messages[{i}] is an assistant message: the previous turn's reply is its sampled completion "
                "(conv.messages holds its parse); send only tool results and user messages, or start a new "
                "conversation for a rewritten history",
            )
