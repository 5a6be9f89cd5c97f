"""A multi-turn exchange over a client: each turn extends the previous one's exact ids."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from backends_core.errors import BridgeError
from backends_core.multiturn.extension import extend_prompt
from backends_core.types import GenerateResult, Message, SamplingParams

if TYPE_CHECKING:
    from backends_core.client import Client

__all__ = ["Conversation"]


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
                    stats=stats,
                )
            except BridgeError as exc:
                stats.failures[exc.reason] += 1
                client.driver.emit("bridge", "bridge", None, started, exc, reason=exc.reason)
                raise
            stats.successes += 1
            client.driver.emit("bridge", "bridge", None, started, None, delta_tokens=len(ids) - len(previous.token_ids))
            sampling = client.template_stop(sampling, chat_template_kwargs=self.chat_template_kwargs)
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
