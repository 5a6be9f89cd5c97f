"""A verifiers 0.4.0 model client that runs verifiers' rollouts through :class:`backends_core.Client`, exact ids.

verifiers' interception server hands each model call of a rollout to a ``verifiers.v1.clients.Client``:
``get_response(dialect, body, sampling, session_id, turn)`` with the whole conversation as typed messages, the
rollout's sampling, the rollout's trace id and the graph-resolved :class:`~verifiers.v1.graph.PendingTurn`. It takes
back a ``Response``: the assistant message, and ``TurnTokens`` (prompt ids, completion ids, one logprob per
completion id, and each prompt message's ``(start, end)`` span), from which ``turn.commit`` builds the trace's
message graph (each node holds the ids its message adds; an assistant node's sampled ids are masked for training).

:class:`BackendsClient` does that with exact ids:

* every turn whose messages continue an earlier turn of the same rollout (its messages, then its reply, then tool
  results or user messages) is sent with ``previous=`` that turn's :class:`~backends_core.GenerateResult`, so its
  prompt starts with that turn's prompt + completion ids, reused verbatim; a turn that continues none (the first
  one, a rewritten or forked history) is rendered whole, and verifiers' graph records it as a new branch;
* the reply is the library's parse of the completion (content, reasoning, tool calls) as verifiers'
  ``AssistantMessage``, the ids and float32 logprobs come as the engine returned them, and the library's
  per-message spans become verifiers' ``message_spans``;
* the library's errors become verifiers' ``ProviderError`` with the HTTP status the harness SDK retries on (5xx,
  timeouts) or not (4xx): see :func:`provider_error`.

The backends client is built with ``stateless=StatelessPolicy(enabled=False)``: this adapter keeps the turns, and the
rollout's trace id is passed as ``session=`` only to keep a rollout on one server (its prefix cache).

verifiers 0.4.0 builds its clients from its own config (``resolve_client``); an interception server takes another
client in its per-endpoint cache, ``server.clients[client_config.model_dump_json()] = BackendsClient(...)``.

The test suite runs it (tests/test_verifiers_client.py) against scripted replies over the library's pipeline.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import attrs
from verifiers.v1.clients import Client as VerifiersClient
from verifiers.v1.clients.train import serialize_completion, tool_to_wire
from verifiers.v1.dialects import ChatDialect, Dialect
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.errors import ProviderError
from verifiers.v1.graph import PendingTurn, message_hash
from verifiers.v1.types import (
    AssistantMessage,
    FinishReason,
    Message,
    Response,
    SamplingConfig,
    Tool,
    ToolCall,
    TurnTokens,
    Usage,
)

from backends_core import (
    BackendError,
    BridgeError,
    Client,
    ClientClosedError,
    ConfigError,
    GenerateResult,
    InvalidRequestError,
    NetworkError,
    RenderError,
    RequestTimeout,
    SamplingParams,
    ServerStatusError,
    StaleServerError,
    UnsupportedOperationError,
)

#: verifiers' sampling keys that are :class:`SamplingParams` fields of the same name and meaning.
SAMPLING_FIELDS = frozenset(
    f.name for f in attrs.fields(SamplingParams) if f.name not in ("max_tokens", "n", "structured", "extra")
)
#: verifiers' sampling keys that are arguments of ``Client.generate`` rather than sampling parameters.
GENERATE_ARGUMENTS = frozenset({"chat_template_kwargs", "cache_salt"})


class BackendsClient(VerifiersClient):
    """A verifiers model client generating through ``client`` (which it owns: :meth:`close` closes it).

    :param client: a :class:`backends_core.Client` built with ``stateless=StatelessPolicy(enabled=False)``.
    :param max_sessions: rollouts whose turns are remembered (least recently used forgotten).
    :param max_turns: turns remembered per rollout (oldest forgotten).
    :raises ConfigError: ``client`` keeps turns itself (``stateless.enabled``), or a bound is below 1.
    """

    def __init__(self, client: Client, *, max_sessions: int = 4096, max_turns: int = 16) -> None:
        if client.config.stateless.enabled:
            raise ConfigError(
                [
                    "the verifiers adapter passes each turn's previous result itself and the rollout id as session= "
                    "for routing only: build the client with stateless=StatelessPolicy(enabled=False) "
                    "@ $.stateless.enabled"
                ]
            )
        if max_sessions < 1 or max_turns < 1:
            raise ConfigError([f"max_sessions and max_turns must be >= 1, got {max_sessions} and {max_turns}"])
        self.client = client
        self.max_sessions = max_sessions
        self.max_turns = max_turns
        #: rollout (``session_id``, ``None`` without one) -> the key of a turn's prompt -> its replies, latest last
        self._turns: OrderedDict[str | None, OrderedDict[tuple[str, ...], list[tuple[str, GenerateResult]]]] = (
            OrderedDict()
        )

    async def get_response(
        self,
        dialect: Dialect[Any],
        body: dict[str, Any],
        sampling: SamplingConfig,
        session_id: str | None = None,
        turn: PendingTurn | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Response:
        """Generate the assistant's next message for ``turn`` (or ``body``'s messages without a turn).

        :raises NotImplementedError: ``dialect`` is not chat completions (the chat template renders chat messages).
        :raises ProviderError: the library refused or failed the call (see :func:`provider_error`).
        """
        if not isinstance(dialect, ChatDialect):
            raise NotImplementedError(
                f"the backends client renders chat-completions requests only, got {type(dialect).__name__}"
            )
        if turn is not None:
            prompt, tools = list(turn.prompt), list(turn.tools)
        else:
            request = dialect.parse_request(body)
            prompt, tools = list(request.messages), list(request.tools or [])
        params, generate_arguments = sampling_params(sampling)
        keys = prompt_keys(prompt, tools)
        previous = self._previous(session_id, prompt, keys)
        try:
            result = await self.client.generate(
                messages=[message_to_wire(m) for m in prompt],
                tools=[tool_to_wire(t) for t in tools] or None,
                sampling=params,
                model=body.get("model") or None,
                session=session_id,
                previous=previous,
                **generate_arguments,
            )
            parsed = self.client.parse_completion(result)
        except BackendError as exc:
            raise provider_error(exc) from exc
        response = to_response(result, parsed, model=str(body.get("model") or self.client.config.model or ""))
        response.tokens = turn_tokens(result, len(prompt))
        response.raw = serialize_completion(response, response.model)
        self._remember(session_id, keys, message_hash(response.message), result)
        return response

    async def close(self) -> None:
        await self.client.aclose()

    def _previous(self, session: str | None, prompt: list[Message], keys: tuple[str, ...]) -> GenerateResult | None:
        """The earlier turn ``prompt`` continues: the one whose messages are ``prompt`` up to its last assistant
        message, which is that turn's reply, followed only by tool results and user messages. Of several turns with
        those messages, the one whose reply is that message, else the latest (the library then checks the reply)."""
        last = max((i for i, m in enumerate(prompt) if isinstance(m, AssistantMessage)), default=None)
        turns = self._turns.get(session)
        if last is None or turns is None:
            return None
        self._turns.move_to_end(session)
        replies = turns.get(keys[: last + 1])  # the tools' key, then the messages before the reply
        if not replies:
            return None
        reply = message_hash(prompt[last])
        return next((result for h, result in reversed(replies) if h == reply), replies[-1][1])

    def _remember(self, session: str | None, keys: tuple[str, ...], reply: str, result: GenerateResult) -> None:
        turns = self._turns.setdefault(session, OrderedDict())
        self._turns.move_to_end(session)
        while len(self._turns) > self.max_sessions:
            self._turns.popitem(last=False)
        replies = turns.pop(keys, [])
        turns[keys] = [*(r for r in replies if r[0] != reply), (reply, result)][-self.max_turns :]
        while len(turns) > self.max_turns:
            turns.popitem(last=False)


def prompt_keys(prompt: list[Message], tools: list[Tool]) -> tuple[str, ...]:
    """The identity of a prompt: its tools, then each message's verifiers hash (the graph's message identity)."""
    tools_key = json.dumps([t.model_dump(mode="json", exclude_none=True) for t in tools], sort_keys=True)
    return (tools_key, *(message_hash(m) for m in prompt))


def sampling_params(sampling: SamplingConfig) -> tuple[SamplingParams, dict[str, Any]]:
    """verifiers' sampling as :class:`SamplingParams`, and the keys that are ``generate`` arguments
    (``chat_template_kwargs``, ``cache_salt``). A key that is neither goes to ``SamplingParams.extra``, which the
    backend passes to its engine or refuses; ``logprobs`` is dropped (logprobs are always returned).

    :raises ProviderError: (400) no ``max_tokens``, or a value :class:`SamplingParams` refuses.
    """
    settings = {k: v for k, v in sampling.model_dump().items() if v is not None and k != "logprobs"}
    if "max_tokens" not in settings:
        raise ProviderError(
            "the rollout's sampling sets no max_tokens, which the backends client needs", status_code=400
        )
    fields = {k: settings.pop(k) for k in list(settings) if k in SAMPLING_FIELDS}
    arguments = {k: settings.pop(k) for k in list(settings) if k in GENERATE_ARGUMENTS}
    max_tokens = settings.pop("max_tokens")
    try:
        return SamplingParams(max_tokens=max_tokens, **fields, extra=settings), arguments
    except (InvalidRequestError, TypeError) as exc:
        raise ProviderError(f"sampling: {exc}", status_code=400) from exc


def to_response(result: GenerateResult, parsed: Mapping[str, Any], *, model: str) -> Response:
    """``result`` as verifiers' ``Response``: the parsed assistant message, finish reason and usage."""
    calls = [
        ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
        for c in parsed.get("tool_calls") or ()
    ]
    finish: FinishReason = None  # an aborted request has no verifiers finish reason
    if result.finish_reason == "stop":
        finish = "tool_calls" if calls else "stop"
    elif result.finish_reason == "length":
        finish = "length"
    cached = result.usage.cached_tokens if result.usage is not None else None
    return Response(
        id=result.request_id or "",
        created=0,
        model=model,
        message=AssistantMessage(
            content=parsed["content"], reasoning_content=parsed.get("reasoning_content"), tool_calls=calls or None
        ),
        finish_reason=finish,
        usage=Usage(
            prompt_tokens=len(result.prompt_ids) - (cached or 0),
            completion_tokens=len(result.completion_ids),
            cached_input_tokens=cached,
        ),
    )


def turn_tokens(result: GenerateResult, messages: int) -> TurnTokens:
    """``result``'s ids and logprobs, and each of the ``messages`` prompt messages' span ``(start, end)`` of
    ``prompt_ids`` (from its first span to its last: a reused reply has its header, its sampled ids and its end of
    turn), ``None`` for a message with no ids. The generation prompt is no message: verifiers gives the ids after
    the last message's span to the assistant node, before its sampled ids."""
    spans: list[tuple[int, int] | None] = [None] * messages
    for span in result.message_spans:
        if span.message is not None:
            held = spans[span.message]
            spans[span.message] = (span.start, span.end) if held is None else (held[0], span.end)
    return TurnTokens(
        prompt_ids=list(result.prompt_ids),
        completion_ids=list(result.completion_ids),
        completion_logprobs=result.logprobs.tolist(),
        message_spans=spans if result.message_spans else None,
    )


def provider_error(exc: BackendError) -> ProviderError:
    """The library's error as verifiers' ``ProviderError``, whose ``status_code`` the interception server answers
    the harness with, so the harness SDK retries what may succeed again and not what cannot:

    * 400: the call itself is wrong (``InvalidRequestError``, ``ConfigError``, ``RenderError``: the template refused
      the messages, ``BridgeError``: the messages do not continue the previous turn's exact ids,
      ``UnsupportedOperationError``);
    * the server's status for ``ServerStatusError``; 504 for ``RequestTimeout``; 503 for ``NetworkError``,
      ``StaleServerError`` and ``ClientClosedError``; 502 for any other ``RequestError``, a ``ResponseParseError``
      and the rest.
    """
    status = 502
    if isinstance(exc, InvalidRequestError | ConfigError | RenderError | BridgeError | UnsupportedOperationError):
        status = 400
    elif isinstance(exc, ServerStatusError):
        status = exc.status_code
    elif isinstance(exc, RequestTimeout):
        status = 504
    elif isinstance(exc, NetworkError | StaleServerError | ClientClosedError):
        status = 503
    return ProviderError(f"{type(exc).__name__}: {exc}", status_code=status)
