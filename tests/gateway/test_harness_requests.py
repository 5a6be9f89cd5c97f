"""What real harnesses send with their default settings, each honoured or refused by name, never dropped: Claude
Code's Messages fields, Codex's Responses fields, OpenAI's ``developer`` role, a completion limit that fits the
model, tool-call ids that stay unique, the gateway's own start-up checks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends_core import Client, ClientConfig, ConfigError, Grammar, hookimpl
from backends_core.config import StatelessPolicy
from backends_core.multiturn.rendering import load_tokenizer
from backends_gateway import Gateway, SQLiteStore, serve
from scripted_stream import StreamingScript

TOOL = {"name": "Bash", "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}
CALL = '<tool_call>\n{"name": "Bash", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>'


async def post(url: str, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=60) as http:
        return await http.post(path, json=body, headers=headers)


def prompt_text(served: Any, index: int = -1) -> str:
    request = served.script.requests[index]
    return str(served.client.tokenizer.decode(list(request.prompt_ids), skip_special_tokens=False))


# -- Claude Code -----------------------------------------------------------------------------------------------

CLAUDE_CODE = {
    "model": "tiny",
    "max_tokens": 1024,
    "stream": False,
    "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.838; cc_entrypoint=sdk-cli;"},
        {"type": "text", "text": "You are a Claude agent."},
        {"type": "text", "text": "Use the tools.", "cache_control": {"type": "ephemeral"}},
    ],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "run ls"}]},
        {"role": "system", "content": "Available agent types for the Agent tool: none."},
    ],
    "tools": [TOOL],
    "thinking": {"type": "adaptive"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "output_config": {"effort": "high"},
    "metadata": {"user_id": json.dumps({"device_id": "d", "account_uuid": "", "session_id": "cc-session-1"})},
}
CLAUDE_HEADERS = {
    "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27",
    "x-claude-code-session-id": "cc-session-1",
    "x-app": "cli",
}


async def test_claude_codes_first_request_is_answered(scripted_gateway) -> None:
    async with scripted_gateway([CALL]) as served:
        response = await post(served.url, "/v1/messages?beta=true", CLAUDE_CODE, **CLAUDE_HEADERS)
        assert response.status_code == 200, response.text
        assert response.headers["X-Session-ID"] == "cc-session-1"  # the harness's own id names the session
        assert [b["type"] for b in response.json()["content"]] == ["tool_use"]
        prompt = prompt_text(served)
        # the billing block is the API's, not the model's: not rendered, kept with the turn
        assert "x-anthropic-billing-header" not in prompt and "You are a Claude agent." in prompt
        assert "Available agent types" in prompt  # the mid-conversation system message reached the model
        traj = await served.gateway.trajectory("cc-session-1")
        request = traj["turns"][0]["request"]
        assert request["billing_header"].startswith("x-anthropic-billing-header")
        assert request["effort"] == "high"
        assert json.loads(request["metadata"]["user_id"])["session_id"] == "cc-session-1"


async def test_claude_codes_head_probe_is_answered(scripted_gateway) -> None:
    async with scripted_gateway([]) as served, httpx.AsyncClient(base_url=served.url, trust_env=False) as http:
        assert (await http.head("/")).status_code == 200
        assert (await http.get("/")).json()["model"] == "tiny"


async def test_an_output_format_is_a_schema_constraint_refused_by_name_by_an_engine_without_one(
    scripted_gateway,
) -> None:
    schema = {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}
    body = {**CLAUDE_CODE, "output_config": {"format": {"type": "json_schema", "schema": schema}}, "tools": None}
    async with scripted_gateway(['{"title": "ls"}<|im_end|>']) as served:
        response = await post(served.url, "/v1/messages", body)
        # the scripted engine takes no structured output: refused by name, before anything is generated
        assert response.status_code == 400, response.text
        assert "structured.json_schema" in response.json()["error"]["message"]
        assert served.script.requests == []


async def test_a_mid_conversation_system_message_the_template_does_not_render_is_refused_so_claude_code_retries(
    scripted_gateway, monkeypatch
) -> None:
    async with scripted_gateway(["ok<|im_end|>"]) as served:
        monkeypatch.setattr(served.gateway, "roles", attrs_evolve(served.gateway.roles, system_later=False))
        response = await post(served.url, "/v1/messages", {**CLAUDE_CODE, "tools": None})
        assert response.status_code == 400
        message = response.json()["error"]["message"]
        # Claude Code drops its mid-conversation system messages and retries on a 400 saying so
        assert "role system is not supported" in message
        assert served.script.requests == []


def attrs_evolve(value: Any, **changes: Any) -> Any:
    import attrs

    return attrs.evolve(value, **changes)


# -- Codex ---------------------------------------------------------------------------------------------------------

CODEX = {
    "model": "tiny",
    "stream": False,
    "input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are Codex."}]},
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "<skills>none</skills>"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "run ls"}]},
    ],
    "tools": [
        {"type": "function", "name": "exec_command", "parameters": {"type": "object", "properties": {}}},
        {"type": "namespace", "name": "multi_agent_v1", "tools": [{"type": "function", "name": "spawn_agent"}]},
        {"type": "web_search", "external_web_access": False},
    ],
    "tool_choice": "auto",
    "parallel_tool_calls": True,
    "reasoning": {"summary": "auto"},
    "store": False,
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "codex-thread-1",
    "client_metadata": {"x-codex-window-id": "w:0", "turn_id": "t"},
}


async def test_codexs_first_request_is_answered(scripted_gateway) -> None:
    reply = '<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "ls"}}\n</tool_call><|im_end|>'
    async with scripted_gateway([reply]) as served:
        response = await post(served.url, "/v1/responses", CODEX, **{"session-id": "codex-thread-1"})
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["store"] is False and answer["id"].startswith("resp_codex-thread-1_")
        assert [item["type"] for item in answer["output"]] == ["function_call"]
        prompt = prompt_text(served)
        assert "You are Codex." in prompt and "<skills>none</skills>" in prompt  # developer messages reach the model
        assert "exec_command" in prompt and "spawn_agent" not in prompt and "web_search" not in prompt
        request = (await served.gateway.trajectory("codex-thread-1"))["turns"][0]["request"]
        assert [t["tool"]["type"] for t in request["tools_not_offered"]] == ["namespace", "web_search"]
        assert request["client_metadata"]["turn_id"] == "t"


# -- developer messages and every role each route takes -------------------------------------------------------

MARK = "zq{}mark"


def chat_messages(role: str, kind: str) -> list[dict[str, Any]]:
    text = MARK.format(role + kind)
    content: Any = text if kind == "string" else [{"type": "text", "text": text}]
    message: dict[str, Any] = {"role": role, "content": content}
    if role == "tool":
        message["tool_call_id"] = "call_1"
        call = {"id": "call_1", "type": "function", "function": {"name": "Bash", "arguments": "{}"}}
        return [{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": [call]}, message]
    if role == "assistant":
        return [{"role": "user", "content": "go"}, message, {"role": "user", "content": "more"}]
    return [message, {"role": "user", "content": "go"}] if role in ("system", "developer") else [message]


@pytest.mark.parametrize("kind", ["string", "parts"])
@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant", "tool"])
async def test_every_message_the_chat_route_accepts_reaches_the_prompt(scripted_gateway, role, kind) -> None:
    async with scripted_gateway(["ok<|im_end|>"]) as served:
        body = {"model": "tiny", "messages": chat_messages(role, kind), "max_tokens": 8}
        response = await post(served.url, "/v1/chat/completions", body)
        assert response.status_code == 200, response.text
        assert MARK.format(role + kind) in prompt_text(served)


@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant"])
async def test_every_message_the_responses_route_accepts_reaches_the_prompt(scripted_gateway, role) -> None:
    text = MARK.format(role)
    part = "output_text" if role == "assistant" else "input_text"
    items = [{"type": "message", "role": role, "content": [{"type": part, "text": text}]}]
    if role in ("system", "developer", "assistant"):
        items.append({"type": "message", "role": "user", "content": "go"})
    async with scripted_gateway(["ok<|im_end|>"]) as served:
        response = await post(served.url, "/v1/responses", {"model": "tiny", "input": items})
        assert response.status_code == 200, response.text
        assert text in prompt_text(served)


@pytest.mark.parametrize("where", ["system", "user text", "assistant text", "tool_result", "mid system"])
async def test_every_message_the_messages_route_accepts_reaches_the_prompt(scripted_gateway, where) -> None:
    text = MARK.format(where.replace(" ", ""))
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 8}
    if where == "system":
        body["system"] = [{"type": "text", "text": text}]
    elif where == "user text":
        messages = [{"role": "user", "content": [{"type": "text", "text": text}]}]
    elif where == "assistant text":
        messages += [
            {"role": "assistant", "content": [{"type": "text", "text": text}]},
            {"role": "user", "content": "x"},
        ]
    elif where == "tool_result":
        use = {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {}}
        result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": text}
        messages += [{"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}]
        body["tools"] = [TOOL]
    else:
        messages += [{"role": "system", "content": text}]
    async with scripted_gateway(["ok<|im_end|>"]) as served:
        response = await post(served.url, "/v1/messages", {**body, "messages": messages})
        assert response.status_code == 200, response.text
        assert text in prompt_text(served)


# -- completion limits ------------------------------------------------------------------------------------------


async def test_max_tokens_past_the_models_context_is_refused_saying_which_limit_and_how_to_raise_it(
    scripted_gateway,
) -> None:
    async with scripted_gateway([]) as served:
        response = await post(served.url, "/v1/messages", {**CLAUDE_CODE, "max_tokens": 32000})
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == "max_tokens"
        assert "context length (2048 ids" in error["message"] and "--context-length" in error["message"]


async def test_a_request_naming_no_limit_may_use_what_its_prompt_leaves_of_the_context(scripted_gateway) -> None:
    async with scripted_gateway(["ok<|im_end|>"]) as served:
        response = await post(
            served.url, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        )
        assert response.status_code == 200, response.text
        request = served.script.requests[-1]
        assert len(request.prompt_ids) + request.sampling.max_tokens == 2048  # the tiny model's context


# -- tool-call ids ----------------------------------------------------------------------------------------------


async def test_the_same_call_made_twice_in_a_session_gets_two_ids(scripted_gateway) -> None:
    call = '<tool_call>\n{"name": "Bash", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>'
    tools = [{"type": "function", "function": {"name": "Bash", "parameters": TOOL["input_schema"]}}]
    async with scripted_gateway([call, call]) as served:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "run ls twice"}]
        ids = []
        for _ in range(2):
            body = {"model": "tiny", "messages": messages, "tools": tools, "max_tokens": 64}
            message = (await post(served.url, "/s/twice/v1/chat/completions", body)).json()["choices"][0]["message"]
            ids.append(message["tool_calls"][0]["id"])
            messages += [message, {"role": "tool", "tool_call_id": ids[-1], "content": "a.py"}]
        assert ids[0] != ids[1]
        traj = await served.gateway.trajectory("twice")
        assert [t["reply"]["tool_calls"][0]["id"] for t in traj["turns"]] == ids  # reproducible from the turns
        assert [b["turns"] for b in traj["branches"]] == [[0, 1]]


# -- start-up ---------------------------------------------------------------------------------------------------


async def test_a_gateway_whose_tokenizer_does_not_load_refuses_to_start_naming_it(tmp_path: Path) -> None:
    config = ClientConfig(
        backend="vllm",
        base_url="http://127.0.0.1:9",
        model="m",
        tokenizer=str(tmp_path / "no-such-model"),
        stateless=StatelessPolicy(enabled=False),
    )
    async with Client(config) as client:
        gateway = Gateway(client, SQLiteStore(tmp_path / "g.db"))
        with pytest.raises(ConfigError, match="no-such-model"):
            await gateway.open()


async def test_streamed_answers_name_their_turn_and_branch(scripted_gateway) -> None:
    replies = ["<think>\nx\n</think>\n\none<|im_end|>", "<think>\ny\n</think>\n\ntwo<|im_end|>"]
    async with scripted_gateway(replies) as served, httpx.AsyncClient(base_url=served.url, trust_env=False) as http:
        seen = []
        messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
        for _ in range(2):
            body = {"model": "tiny", "messages": messages, "max_tokens": 32, "stream": True}
            async with http.stream("POST", "/s/streamed/v1/chat/completions", json=body) as response:
                seen.append((response.headers["X-Turn"], response.headers["X-Branch"]))
                pieces = [
                    json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                    async for line in response.aiter_lines()
                    if line.startswith("data: {")
                ]
            text = "".join(pieces)
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
        assert seen == [("0", "0"), ("1", "0")]
        traj = await served.gateway.trajectory("streamed")
        assert [(t["turn"], t["branch"]) for t in traj["turns"]] == [(0, 0), (1, 0)]


class GrammarScript(StreamingScript):
    """A scripted engine that takes grammars (and, scripted, keeps to none)."""

    @hookimpl
    def sampling_features(self) -> frozenset[str]:
        return frozenset({"structured.grammar"})


@pytest.mark.parametrize("stream", [False, True])
async def test_a_forced_tool_choice_goes_to_the_engine_as_its_markups_grammar(tiny_models, tmp_path, stream) -> None:
    tokenizer = load_tokenizer(str(tiny_models.dense))
    script = GrammarScript(tokenizer, [CALL, "no call here<|im_end|>"])
    config = ClientConfig(
        backend="scripted",
        base_url="http://scripted",
        model="tiny",
        tokenizer=str(tiny_models.dense),
        stateless=StatelessPolicy(enabled=False),
    )
    tools = [{"type": "function", "function": {"name": "Bash", "parameters": TOOL["input_schema"]}}]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], "tools": tools, "stream": stream}
    async with (
        Client(config, plugin=script) as client,
        Gateway(client, SQLiteStore(tmp_path / "g.db")) as gateway,
        serve(gateway) as url,
    ):
        answered = await post(url, "/v1/chat/completions", {**body, "tool_choice": "required"})
        assert answered.status_code == 200 and "Bash" in answered.text
        grammar = script.requests[0].sampling.structured
        assert isinstance(grammar, Grammar) and '"\\"Bash\\""' in grammar.grammar
        named = {"type": "function", "function": {"name": "Bash"}}
        unmet = await post(url, "/v1/chat/completions", {**body, "tool_choice": named, "parallel_tool_calls": False})
        # an engine that ignored its grammar: no call to answer a forced choice with, and no turn kept
        if stream:  # found once the stream had started: its error event
            assert unmet.status_code == 200 and '"code":"tool_choice_unmet"' in unmet.text
        else:
            assert unmet.status_code == 502 and unmet.json()["error"]["code"] == "tool_choice_unmet"
        assert rules_of(script.requests[1].sampling.structured)["root"].endswith("call")  # one call at most
        sessions = await gateway.sessions(group=None, status=None, limit=10, after=None)
        assert sum(s["turns"] for s in sessions) == 1


def rules_of(grammar: Any) -> dict[str, str]:
    return dict(line.split(" ::= ", 1) for line in grammar.grammar.splitlines())
