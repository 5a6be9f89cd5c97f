"""examples/verifiers_client.py: verifiers 0.4.0 rollouts through backends_core.Client, with exact ids.

A tool-calling rollout runs the way verifiers' interception server runs one: the harness posts chat-completions
bodies holding the whole history; each is parsed by verifiers' chat dialect, resolved against the rollout's trace
(``prepare_turn``), answered by the adapter (``get_response``) and committed to verifiers' message graph
(``turn.commit``); the harness reads the served chat completion, runs the local tool it asked for and posts the next
body. The model's replies are scripted (reasoning, tool calls) over the library's real rendering, bridging and
parsing.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from verifiers.v1.configs.agent import AgentConfig
from verifiers.v1.dialects import ChatDialect
from verifiers.v1.errors import ProviderError
from verifiers.v1.graph import prepare_turn
from verifiers.v1.trace import AgentInfo, Trace, TraceTask
from verifiers.v1.types import SamplingConfig

from backends_core import (
    BridgeError,
    Client,
    ClientConfig,
    ConfigError,
    GenerateRequest,
    GenerateResult,
    InvalidRequestError,
    RequestTimeout,
    RetryPolicy,
    ServerStatusError,
    hookimpl,
    loss_mask,
)
from backends_core.config import StatelessPolicy
from backends_core.multiturn.rendering import encode, load_tokenizer
from scripted_backend import ScriptedBackend

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "verifiers_client.py"
_spec = importlib.util.spec_from_file_location("verifiers_client", EXAMPLE)
assert _spec is not None and _spec.loader is not None
verifiers_client = importlib.util.module_from_spec(_spec)
sys.modules["verifiers_client"] = verifiers_client
_spec.loader.exec_module(verifiers_client)
BackendsClient = verifiers_client.BackendsClient

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "a + b",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
LOCAL_TOOLS = {"add": lambda a, b: a + b}
REPLIES = [
    '<think>\nadd 2 and 3 first\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
    "</tool_call><|im_end|>",
    '<think>\nthen add 5\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 5, "b": 5}}\n'
    "</tool_call><|im_end|>",
    "<think>\n\n</think>\n\nThe answer is 10.<|im_end|>",
]
SAMPLING = SamplingConfig(max_tokens=64, temperature=1.0, top_k=20, seed=3)


class LogprobScript(ScriptedBackend):
    """Scripted replies whose logprobs differ per position (exact in float32), recorded as the engine returned
    them."""

    def __init__(self, tokenizer: Any, replies: list[str]) -> None:
        super().__init__(tokenizer, replies)
        self.logprobs: list[list[float]] = []

    @hookimpl
    def parse_response(self, raw: str, request: GenerateRequest, server_url: str) -> list[GenerateResult]:
        ids = encode(self.tokenizer, raw)
        logprobs = -np.arange(1, len(ids) + 1, dtype=np.float32) / 64 - len(self.logprobs)
        self.logprobs.append(logprobs.tolist())
        return [
            GenerateResult(
                prompt_ids=request.prompt_ids,
                completion_ids=tuple(ids),
                logprobs=logprobs,
                finish_reason="stop",
                server=server_url,
            )
        ]


def config(models: Any, **fields: Any) -> ClientConfig:
    return ClientConfig(
        backend=fields.pop("backend", "scripted"),
        base_url=fields.pop("base_url", "http://scripted"),
        tokenizer=str(models.dense),
        tool_parser="hermes",
        reasoning_parser="qwen3",
        stateless=StatelessPolicy(enabled=False),
        **fields,
    )


def new_trace() -> Trace:
    return Trace(task=TraceTask(type="arithmetic", data={}), agent=AgentInfo(config=AgentConfig()))


class Spy:
    """Records each ``Client.generate`` call's arguments and result."""

    def __init__(self, client: Client) -> None:
        self.calls: list[tuple[dict[str, Any], GenerateResult]] = []
        generate = client.generate

        async def recorded(**kwargs: Any) -> GenerateResult:
            result = await generate(**kwargs)
            self.calls.append((kwargs, result))
            return result

        client.generate = recorded  # type: ignore[method-assign]


class Rollout:
    """One rollout as verifiers' interception server runs it, driven by a chat-completions agent loop.

    :ivar responses: the adapter's response to each model call.
    """

    def __init__(self, adapter: Any, *, identity: bool = True) -> None:
        self.adapter = adapter
        self.identity = identity
        self.trace = new_trace()
        self.responses: list[Any] = []

    async def call(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """One model call as the interception server makes it: parse the body, resolve the turn against the
        trace, get the response, commit it; the chat completion the harness gets back. Without ``identity`` the
        adapter gets neither the trace id nor the resolved turn."""
        body = {"model": "tiny-qwen3", "messages": messages, "tools": TOOLS}
        dialect = ChatDialect()
        request = dialect.parse_request(body)
        turn = prepare_turn(self.trace, request.messages, request.tools)
        response = await self.adapter.get_response(
            dialect,
            body,
            SAMPLING,
            session_id=self.trace.id if self.identity else None,
            turn=turn if self.identity else None,
        )
        turn.commit(response)
        self.responses.append(response)
        return dict(response.raw)

    async def run(self) -> list[dict[str, Any]]:
        """Post the history, run the local tools the reply calls, until a reply calls none; the history."""
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "Use the add tool."},
            {"role": "user", "content": "What is 2 + 3 + 5?"},
        ]
        while True:
            reply = (await self.call(messages))["choices"][0]["message"]
            messages.append(reply)
            if not reply.get("tool_calls"):
                return messages
            for call in reply["tool_calls"]:
                output = LOCAL_TOOLS[call["function"]["name"]](**json.loads(call["function"]["arguments"]))
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": str(output)})


@pytest.fixture
async def scripted(tiny_models):
    """An adapter over a client whose replies are the given texts; the backend and a spy on ``generate``."""
    adapters = []

    async def make(*replies: str) -> tuple[Any, LogprobScript, Spy]:
        backend = LogprobScript(load_tokenizer(str(tiny_models.dense)), list(replies))
        client = Client(config(tiny_models), plugin=backend)
        spy = Spy(client)
        adapter = BackendsClient(client)
        adapters.append(adapter)
        return adapter, backend, spy

    yield make
    for adapter in adapters:
        await adapter.close()


@pytest.mark.parametrize("identity", [True, False], ids=["rollout-id", "prompt-prefix"])
async def test_a_tool_calling_rollout_reuses_each_turns_exact_ids_and_fills_the_graph_exactly(
    scripted, identity: bool
) -> None:
    adapter, backend, spy = await scripted(*REPLIES)
    rollout = Rollout(adapter, identity=identity)
    history = await rollout.run()
    results = [result for _, result in spy.calls]
    assert len(results) == 3 and backend.replies == []

    # each turn after the first is sent with previous= the turn before it and starts with its prompt + completion
    assert [kwargs["previous"] for kwargs, _ in spy.calls] == [None, results[0], results[1]]
    for before, after, request in zip(results, results[1:], backend.requests[1:], strict=False):
        assert after.prompt_ids[: len(before.token_ids)] == before.token_ids
        assert after.reused_ids == len(before.token_ids)
        assert request.prompt_ids == after.prompt_ids  # what the engine got

    # ids and logprobs as the engine returned them
    for response, result, logprobs in zip(rollout.responses, results, backend.logprobs, strict=True):
        assert response.tokens.prompt_ids == list(result.prompt_ids)
        assert response.tokens.completion_ids == list(result.completion_ids)
        assert response.tokens.completion_logprobs == logprobs

    # tool calls and reasoning come back parsed; the harness ran the tool on them
    first, second, last = (r.message for r in rollout.responses)
    assert first.reasoning_content == "add 2 and 3 first" and first.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in first.tool_calls] == [("add", {"a": 2, "b": 3})]
    assert [(c.name, json.loads(c.arguments)) for c in second.tool_calls] == [("add", {"a": 5, "b": 5})]
    assert (last.content, last.reasoning_content, last.tool_calls) == ("The answer is 10.", "", None)
    assert [r.finish_reason for r in rollout.responses] == ["tool_calls", "tool_calls", "stop"]
    assert [m["content"] for m in history if m["role"] == "tool"] == ["5", "10"]
    assert history[2]["tool_calls"][0]["id"] == first.tool_calls[0].id

    # one branch: every message once, its ids exactly the last turn's, sampled exactly where the library says
    (branch,) = rollout.trace.branches
    assert [n.message.role for n in branch.nodes] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    final = results[-1]
    assert branch.token_ids == list(final.token_ids)
    assert branch.sampled_mask == loss_mask(final).astype(bool).tolist()
    ends = np.cumsum([len(n.token_ids) for n in branch.nodes]).tolist()
    assistants = [i for i, n in enumerate(branch.nodes) if n.message.role == "assistant"]
    for turn, (result, node_index) in enumerate(zip(results, assistants, strict=True)):
        node = branch.nodes[node_index]
        # the assistant node: this turn's generation prompt, then its sampled ids with their logprobs
        assert node.sampled and ends[node_index] == len(result.token_ids)
        assert node.token_ids[-len(result.completion_ids) :] == list(result.completion_ids)
        assert node.mask == [False] * (len(node.token_ids) - len(result.completion_ids)) + [True] * len(
            result.completion_ids
        )
        assert node.logprobs == backend.logprobs[turn]
        # in the last prompt, the library's sampled spans of that message are the same ids
        sampled = [s for s in final.message_spans if s.sampled and s.message == node_index]
        if node_index < len(branch.nodes) - 1:
            assert [i for s in sampled for i in final.prompt_ids[s.start : s.end]] == list(result.completion_ids)
        # the messages this turn sent first end where the library's spans of them end
        first_sent = range(assistants[turn - 1] + 1 if turn else 0, node_index)
        for message in first_sent:
            assert ends[message] == max(s.end for s in result.message_spans if s.message == message)
            assert not branch.nodes[message].sampled and not any(branch.nodes[message].mask)


async def test_a_history_that_continues_no_turn_is_rendered_whole_as_a_new_branch(scripted) -> None:
    adapter, _, spy = await scripted(REPLIES[0], "Summarised.<|im_end|>")
    rollout = Rollout(adapter)
    first = await rollout.call([{"role": "user", "content": "What is 2 + 3?"}])
    assert first["choices"][0]["message"]["tool_calls"]
    await rollout.call([{"role": "user", "content": "Summary so far: nothing. What is 2 + 3?"}])
    assert spy.calls[1][0]["previous"] is None and spy.calls[1][1].reused_ids == 0
    assert len(rollout.trace.branches) == 2


async def test_an_edited_reply_surfaces_the_bridge_error_as_a_non_retryable_provider_error(scripted) -> None:
    adapter, _, _ = await scripted(REPLIES[0], "unused<|im_end|>")
    rollout = Rollout(adapter)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 2 + 3?"}]
    reply = (await rollout.call(messages))["choices"][0]["message"]
    edited = {**reply, "content": "I will add them."}  # not what was sampled
    with pytest.raises(ProviderError) as info:
        await rollout.call(
            [*messages, edited, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "5"}]
        )
    assert info.value.status_code == 400
    assert isinstance(info.value.__cause__, BridgeError) and info.value.__cause__.reason == "assistant_mismatch"


def failing_transport(error: Exception | int) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        if isinstance(error, Exception):
            raise error
        return httpx.Response(error, json={"error": "engine failed"})

    return httpx.MockTransport(handler)


@pytest.mark.parametrize(
    ("failure", "cause", "status"),
    [
        (500, ServerStatusError, 500),
        (httpx.ReadTimeout("read timed out"), RequestTimeout, 504),
    ],
    ids=["server-status", "timeout"],
)
async def test_a_failed_server_call_surfaces_as_a_provider_error_with_the_status_to_retry_on(
    tiny_models, failure, cause, status
) -> None:
    client = Client(
        config(tiny_models, backend="vllm", base_url="http://engine", retry=RetryPolicy(attempts=1)),
        transport=failing_transport(failure),
    )
    adapter = BackendsClient(client)
    try:
        with pytest.raises(ProviderError) as info:
            await Rollout(adapter).call([{"role": "user", "content": "hi"}])
    finally:
        await adapter.close()
    assert info.value.status_code == status and isinstance(info.value.__cause__, cause)


async def test_sampling_the_library_refuses_is_a_provider_error_400_before_anything_is_sent(scripted) -> None:
    adapter, backend, _ = await scripted("unused<|im_end|>")
    dialect = ChatDialect()
    body = {"model": "tiny-qwen3", "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(ProviderError) as info:
        await adapter.get_response(dialect, body, SamplingConfig(temperature=1.0))
    assert info.value.status_code == 400 and "max_tokens" in str(info.value)
    with pytest.raises(ProviderError) as info:
        await adapter.get_response(dialect, body, SamplingConfig(max_tokens=8, top_p=2.0))
    assert info.value.status_code == 400 and isinstance(info.value.__cause__, InvalidRequestError)
    assert "top_p" in str(info.value)
    assert backend.requests == []


async def test_a_client_that_keeps_turns_itself_is_refused(tiny_models) -> None:
    client = Client(
        ClientConfig(backend="scripted", base_url="http://scripted", tokenizer=str(tiny_models.dense)),
        plugin=ScriptedBackend(None, []),
    )
    try:
        with pytest.raises(ConfigError, match=r"stateless\.enabled"):
            BackendsClient(client)
    finally:
        await client.aclose()
