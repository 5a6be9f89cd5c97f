"""OpenAI's Responses API through the gateway, driven by the official ``openai`` SDK and the OpenAI Agents SDK's
default model: the response object and the event stream agree, a function-calling loop continues its session on
exact ids whether it resends its input or names ``previous_response_id``, and bad input is refused by name before
the engine sees it."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from agents import set_tracing_disabled
from test_openai_sdk import TOOL_REPLIES, assert_exact_chain, trajectory

from backends_gateway import Keys

set_tracing_disabled(True)  # the SDK would otherwise export traces to OpenAI

ADD = {
    "type": "function",
    "name": "add",
    "description": "a + b",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
}


def _call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


SHAPES = {
    "text": ("Hello there.<|im_end|>", ["message"]),
    "reasoning and text": ("<think>\nsay hi\n</think>\n\nHi!<|im_end|>", ["reasoning", "message"]),
    "one call": (
        "<think>\nadd them\n</think>\n\n" + _call("add", '{"a": 1, "b": 2}') + "<|im_end|>",
        ["reasoning", "function_call"],
    ),
    "text and two calls": (
        "Two sums: " + _call("add", '{"a": 1, "b": 2}') + "\n" + _call("add", '{"a": 3, "b": 4}') + "<|im_end|>",
        ["message", "function_call", "function_call"],
    ),
}


def _without_ids(items: list[Any]) -> list[dict[str, Any]]:
    """Output items with their per-response ids left out (each response names its own)."""
    out = []
    for item in items:
        dumped = item.model_dump(exclude_none=True)
        dumped.pop("id", None)
        dumped.pop("call_id", None)
        out.append(dumped)
    return out


@pytest.mark.parametrize("shape", list(SHAPES))
async def test_create_and_stream_answer_the_same_items(scripted_gateway, shape) -> None:
    reply, kinds = SHAPES[shape]
    async with scripted_gateway([reply, reply]) as served:
        sdk = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
        created = await sdk.responses.create(model="tiny", input="hi", tools=[ADD], max_output_tokens=64)
        deltas: dict[str, str] = {"response.output_text.delta": "", "response.reasoning_text.delta": ""}
        kinds_seen = []
        async with sdk.responses.stream(model="tiny", input="hi", tools=[ADD], max_output_tokens=64) as stream:
            async for event in stream:
                kinds_seen.append(event.type)
                if event.type in deltas:
                    deltas[event.type] += event.delta
            streamed = await stream.get_final_response()
        await sdk.close()
        turns = (await trajectory(served.url, created.id.split("_")[1]))["turns"]
    assert [item.type for item in created.output] == kinds
    assert created.usage.output_tokens == len(turns[0]["completion_ids"])
    assert created.usage.input_tokens == len(turns[0]["prompt_ids"])
    assert created.status == streamed.status == "completed" and created.incomplete_details is None
    assert _without_ids(created.output) == _without_ids(streamed.output)
    assert created.output_text == streamed.output_text == deltas["response.output_text.delta"]
    assert kinds_seen[:2] == ["response.created", "response.in_progress"] and kinds_seen[-1] == "response.completed"
    assert kinds_seen.count("response.output_item.added") == kinds_seen.count("response.output_item.done") == len(kinds)
    reasoning = [i for i in created.output if i.type == "reasoning"]
    assert [i.content[0].text for i in reasoning] == {"reasoning and text": ["say hi"], "one call": ["add them"]}.get(
        shape, []
    )
    assert deltas["response.reasoning_text.delta"] == "".join(i.content[0].text for i in reasoning)
    assert (created.usage.output_tokens_details.reasoning_tokens > 0) == bool(reasoning)
    calls = [i for i in created.output if i.type == "function_call"]
    assert [json.loads(c.arguments) for c in calls] == {
        "one call": [{"a": 1, "b": 2}],
        "text and two calls": [{"a": 1, "b": 2}, {"a": 3, "b": 4}],
    }.get(shape, [])
    assert all(c.name == "add" and c.status == "completed" and c.call_id for c in calls)
    assert created.usage.total_tokens == created.usage.input_tokens + created.usage.output_tokens
    assert streamed.id != created.id and streamed.id.startswith("resp_") and created.id.startswith("resp_")


async def test_a_reply_cut_at_max_output_tokens_is_incomplete(scripted_gateway) -> None:
    async with scripted_gateway(["cut short", "cut short"]) as served:
        sdk = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
        answer = await sdk.responses.create(model="tiny", input="hi", max_output_tokens=3)
        kinds = []
        async with sdk.responses.stream(model="tiny", input="hi", max_output_tokens=3) as stream:
            async for event in stream:
                kinds.append(event.type)
                if event.type == "response.incomplete":
                    last = event.response
        await sdk.close()
    assert answer.status == "incomplete" and answer.incomplete_details.reason == "max_output_tokens"
    assert answer.output_text == "cut short" and answer.output[0].status == "incomplete"
    assert kinds[-1] == "response.incomplete" and "response.completed" not in kinds
    assert last.status == "incomplete" and last.output_text == "cut short"


async def _loop(sdk: openai.AsyncOpenAI, *, stream: bool, chained: bool) -> list[Any]:
    """Add 2, 3 and 5 with the ``add`` tool: resending the whole input, or only the new items after
    ``previous_response_id``."""
    history: list[Any] = [{"role": "user", "content": "add 2, 3 and 5"}]
    new: list[Any] = list(history)
    previous = None
    answers = []
    while True:
        args: dict[str, Any] = {"model": "tiny", "tools": [ADD], "max_output_tokens": 64, "instructions": "Add."}
        if chained and previous is not None:
            args |= {"input": new, "previous_response_id": previous}
        else:
            args["input"] = history
        if stream:
            async with sdk.responses.stream(**args) as events:
                answer = await events.get_final_response()
        else:
            answer = await sdk.responses.create(**args)
        answers.append(answer)
        previous = answer.id
        new = []
        for item in answer.output:
            history.append(item.model_dump(exclude_none=True))
            if item.type == "function_call":
                value = sum(json.loads(item.arguments).values())
                output = {"type": "function_call_output", "call_id": item.call_id, "output": str(value)}
                history.append(output)
                new.append(output)
        if not new:
            return answers


@pytest.mark.parametrize("chained", [False, True], ids=["resent input", "previous_response_id"])
@pytest.mark.parametrize("stream", [False, True], ids=["created", "streamed"])
async def test_a_function_calling_loop_continues_its_session_on_exact_ids(scripted_gateway, stream, chained) -> None:
    async with scripted_gateway(list(TOOL_REPLIES)) as served:
        sdk = openai.AsyncOpenAI(base_url=f"{served.url}/s/loop/v1", api_key="unused", max_retries=0)
        answers = await _loop(sdk, stream=stream, chained=chained)
        await sdk.close()
        assert [[i.type for i in a.output] for a in answers] == [
            ["reasoning", "function_call"],
            ["reasoning", "message", "function_call"],
            ["reasoning", "message"],
        ]
        assert answers[-1].output_text == "The answer is 10 (2 + 3 + 5)."
        assert [json.loads(a.output[-1].arguments) for a in answers[:2]] == [{"a": 2, "b": 3}, {"a": 5, "b": 5}]
        assert all(a.id.startswith("resp_loop_") for a in answers)
        traj = await trajectory(served.url, "loop")
        assert_exact_chain(traj)
        assert traj["bridged"] == 2 and all(t["reused_ids"] > 0 for t in traj["turns"][1:])
        last = traj["turns"][-1]["messages"]
        assert [m["role"] for m in last] == ["system", "user", "assistant", "tool", "assistant", "tool"]
        assert last[0]["content"] == "Add." and last[3]["content"] == "5" and last[5]["content"] == "10"
        assert last[2]["reasoning_content"] == "add 2 and 3 first"
        assert last[3]["tool_call_id"] == last[2]["tool_calls"][0]["id"] == answers[0].output[-1].call_id
        assert len(served.script.requests) == 3


async def test_the_session_is_found_without_naming_it(scripted_gateway) -> None:
    """A stateless harness sending its whole input on the bare route joins the session its history extends; one
    naming ``previous_response_id`` lands in that response's session."""
    async with scripted_gateway(list(TOOL_REPLIES)) as served:
        sdk = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
        answers = await _loop(sdk, stream=False, chained=False)
        await sdk.close()
        (session,) = {a.id.split("_")[1] for a in answers}
        assert_exact_chain(await trajectory(served.url, session))


async def test_instructions_are_not_carried_over_from_the_previous_response(scripted_gateway) -> None:
    async with scripted_gateway(["One.<|im_end|>", "Two.<|im_end|>", "Three.<|im_end|>"]) as served:
        sdk = openai.AsyncOpenAI(base_url=f"{served.url}/s/inst/v1", api_key="unused", max_retries=0)
        first = await sdk.responses.create(model="tiny", input="a", instructions="Be brief.")
        second = await sdk.responses.create(model="tiny", input="b", previous_response_id=first.id)
        third = await sdk.responses.create(
            model="tiny", input="c", previous_response_id=second.id, instructions="Be terse."
        )
        await sdk.close()
        turns = (await trajectory(served.url, "inst"))["turns"]
    assert [[m["role"] for m in t["messages"]] for t in turns] == [
        ["system", "user"],
        ["user", "assistant", "user"],
        ["system", "user", "assistant", "user", "assistant", "user"],
    ]
    assert turns[2]["messages"][0]["content"] == "Be terse." and third.instructions == "Be terse."
    assert second.previous_response_id == first.id and turns[1]["branch"] == 1  # the instructions were dropped


USER = [{"role": "user", "content": "hi"}]
PNG_URL = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAFklEQVR4nGP4z8DA8J+BkYHh////DAAe9gT9Ce00"
    "PgAAAABJRU5ErkJggg=="
)


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "input": USER, "max_output_tokens": 8, **fields}


BAD = [
    ("unknown field", body(temperatur=0.5), "temperatur", "unknown_parameter"),
    ("no model", {"input": "hi"}, "model", "invalid_type"),
    ("no input", {"model": "tiny"}, "input", "invalid_type"),
    ("input a number", body(input=3), "input", "invalid_type"),
    ("an empty input", body(input=[]), "input", "invalid_value"),
    ("a bad role", body(input=[{"role": "robot", "content": "x"}]), "input[0].role", "invalid_value"),
    (
        "an image that is no data URL",
        body(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "data:x"}]}]),
        "input[0].content[0].image_url",
        "invalid_image",
    ),
    (
        "an image by file id",
        body(input=[{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]),
        "input[0].content[0].file_id",
        "unsupported_parameter",
    ),
    (
        "an image detail the processor decides",
        body(input=[{"role": "user", "content": [{"type": "input_image", "image_url": PNG_URL, "detail": "high"}]}]),
        "input[0].content[0].detail",
        "unsupported_parameter",
    ),
    (
        "an image in a developer message",
        body(input=[{"role": "developer", "content": [{"type": "input_image", "image_url": PNG_URL}]}]),
        "input[0].content[0]",
        "unsupported_content",
    ),
    (
        "an unknown part field",
        body(input=[{"role": "user", "content": [{"type": "input_text", "text": "x", "colour": 1}]}]),
        "input[0].content[0].colour",
        "unknown_parameter",
    ),
    (
        "an item reference",
        body(input=[{"type": "item_reference", "id": "x"}]),
        "input[0].type",
        "unsupported_parameter",
    ),
    (
        "a function call without a call id",
        body(input=[{"type": "function_call", "name": "add", "arguments": "{}"}]),
        "input[0].call_id",
        "invalid_type",
    ),
    (
        "encrypted reasoning",
        body(input=[{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]),
        "input[0].encrypted_content",
        "unsupported_parameter",
    ),
    ("a file search tool", body(tools=[{"type": "file_search"}]), "tools[0].type", "unsupported_parameter"),
    ("a file search tool", body(tools=[{"type": "file_search"}]), "tools[0].type", "unsupported_parameter"),
    ("a computer tool", body(tools=[{"type": "computer_use_preview"}]), "tools[0].type", "unsupported_parameter"),
    ("a function without a name", body(tools=[{"type": "function"}]), "tools[0].name", "invalid_value"),
    ("tool_choice required without tools", body(tool_choice="required"), "tool_choice", "invalid_value"),
    ("parallel_tool_calls off", body(parallel_tool_calls=False), "parallel_tool_calls", "unsupported_parameter"),
    ("reasoning effort", body(reasoning={"effort": "high"}), "reasoning.effort", "unsupported_parameter"),
    ("include logprobs", body(include=["message.output_text.logprobs"]), "include[0]", "unsupported_parameter"),
    ("truncation auto", body(truncation="auto"), "truncation", "unsupported_parameter"),
    ("background", body(background=True), "background", "unsupported_parameter"),
    ("conversation", body(conversation="conv_1"), "conversation", "unsupported_parameter"),
    ("text format xml", body(text={"format": {"type": "xml"}}), "text.format", "invalid_value"),
    ("verbosity", body(text={"verbosity": "low"}), "text.verbosity", "unsupported_parameter"),
    ("max_output_tokens past the limit", body(max_output_tokens=10**6), "max_output_tokens", "max_tokens_too_large"),
    ("temperature a string", body(temperature="hot"), "temperature", "invalid_type"),
    ("top_p out of range", body(top_p=1.5), "top_p", "invalid_value"),
    ("stream_options without stream", body(stream_options={}), "stream_options", "invalid_value"),
]


@pytest.mark.parametrize(("case", "payload", "param", "code"), BAD, ids=[c[0] for c in BAD])
async def test_bad_requests_are_refused_naming_the_field_before_the_engine_sees_them(
    scripted_gateway, case, payload, param, code
) -> None:
    async with scripted_gateway(["never<|im_end|>"]) as served:
        async with httpx.AsyncClient(base_url=served.url, trust_env=False) as http:
            response = await http.post("/v1/responses", json=payload)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")
        assert param.split(".")[0].split("[")[0] in error["message"] or param in error["message"]
        assert served.script.requests == []


@pytest.mark.parametrize(
    "ident", ["resp_nosuch_0123456789abcdef01234567", "resp_x", "chatcmpl-1"], ids=["unknown", "short", "foreign"]
)
async def test_an_unknown_previous_response_is_404_naming_it(scripted_gateway, ident) -> None:
    async with scripted_gateway(["never<|im_end|>"]) as served:
        async with httpx.AsyncClient(base_url=served.url, trust_env=False) as http:
            response = await http.post("/v1/responses", json=body(previous_response_id=ident))
        assert response.status_code == 404, response.text
        error = response.json()["error"]
        assert error["param"] == "previous_response_id" and ident in error["message"]
        assert served.script.requests == []


async def test_the_raw_stream_names_each_event_and_numbers_it(scripted_gateway) -> None:
    async with (
        scripted_gateway(["<think>\nhm\n</think>\n\nFine.<|im_end|>"]) as served,
        httpx.AsyncClient(base_url=served.url, trust_env=False) as http,
        http.stream("POST", "/s/raw/v1/responses", json=body(stream=True, max_output_tokens=32)) as response,
    ):
        assert response.status_code == 200 and response.headers["X-Session-ID"] == "raw"
        assert response.headers["Content-Type"] == "text/event-stream"
        blocks = (await response.aread()).decode().strip().split("\n\n")
    events = []
    for block in blocks:
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        event = json.loads(data.removeprefix("data: "))
        assert event["type"] == name.removeprefix("event: ")
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == events[-1]["response"]["output"]
    assert {e["response"]["id"] for e in events if "response" in e} == {events[-1]["response"]["id"]}


async def test_a_previous_response_of_another_session_is_refused(scripted_gateway) -> None:
    async with scripted_gateway(["One.<|im_end|>"]) as served:
        async with httpx.AsyncClient(base_url=served.url, trust_env=False) as http:
            answered = await http.post("/s/a/v1/responses", json=body())
            assert (answered.headers["X-Session-ID"], answered.headers["X-Turn"]) == ("a", "0")
            first = answered.json()
            response = await http.post("/s/b/v1/responses", json=body(previous_response_id=first["id"]))
            missing = await http.post("/s/a/v1/responses", json=body(previous_response_id=first["id"][:-24] + "0" * 24))
        assert response.status_code == 400 and response.json()["error"]["param"] == "previous_response_id"
        assert missing.status_code == 404 and "no response" in missing.json()["error"]["message"]
        assert len(served.script.requests) == 1


async def test_another_keys_response_is_not_found(scripted_gateway) -> None:
    keys = Keys(
        trainer={"trainer": "tk-0123456789abcdef-trainer"},
        harness={"team-a": "hk-0123456789abcdef-team-a", "team-b": "hk-0123456789abcdef-team-b"},
    )
    async with scripted_gateway(["One.<|im_end|>", "Two.<|im_end|>"], keys=keys) as served:

        def client(key: str) -> httpx.AsyncClient:
            headers = {"Authorization": f"Bearer hk-0123456789abcdef-{key}"}
            return httpx.AsyncClient(base_url=served.url, trust_env=False, headers=headers)

        async with client("team-a") as a, client("team-b") as b:
            first = (await a.post("/v1/responses", json=body())).json()
            stolen = await b.post("/v1/responses", json=body(previous_response_id=first["id"]))
            own = await a.post("/v1/responses", json=body(previous_response_id=first["id"]))
        assert stolen.status_code == 404 and stolen.json()["error"]["param"] == "previous_response_id"
        assert "One." not in stolen.text
        assert own.status_code == 200 and own.json()["previous_response_id"] == first["id"]
        assert len(served.script.requests) == 2
