"""The official ``openai`` SDK (sync and async, streamed and not) through the gateway, then the trajectory: each
turn's prompt starts with the previous turn's exact prompt and completion ids, the loss mask is 1 exactly on the
sampled ids, and the logprobs are the engine's."""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import httpx
import numpy as np
import openai

from backends_core import loss_mask
from backends_gateway import Trajectories

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
TOOL_REPLIES = [
    '<think>\nadd 2 and 3 first\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
    "</tool_call><|im_end|>",
    '<think>\nthen add 5\n</think>\n\nOne more: <tool_call>\n{"name": "add", "arguments": {"a": 5, "b": 5}}\n'
    "</tool_call><|im_end|>",
    "<think>\nall added\n</think>\n\nThe answer is 10 (2 + 3 + 5).<|im_end|>",
]


async def trajectory(url: str, session: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, trust_env=False) as http:
        response = await http.get(f"/v1/sessions/{session}/trajectory")
        assert response.status_code == 200, response.text
        return dict(response.json())


def assert_exact_chain(traj: dict[str, Any]) -> None:
    """One branch; every turn extends the previous turn's exact ids; the training view marks exactly the sampled
    ids and carries their logprobs."""
    turns = traj["turns"]
    assert [t["branch"] for t in turns] == [0] * len(turns)
    for before, after in itertools.pairwise(turns):
        ids = before["prompt_ids"] + before["completion_ids"]
        assert after["prompt_ids"][: len(ids)] == ids
        assert after["reused_ids"] == len(ids) and after["parent"] == before["turn"]
    (branch,) = traj["branches"]
    last = turns[-1]
    assert branch["input_ids"] == last["prompt_ids"] + last["completion_ids"]
    expected_mask = np.zeros(len(branch["input_ids"]), np.uint8)
    expected_logprobs = np.zeros(len(branch["input_ids"]), np.float32)
    for t in turns:
        start = len(t["prompt_ids"])
        expected_mask[start : start + len(t["completion_ids"])] = 1
        expected_logprobs[start : start + len(t["completion_ids"])] = t["logprobs"]
    assert branch["loss_mask"] == expected_mask.tolist()
    np.testing.assert_array_equal(np.asarray(branch["logprobs"], np.float32), expected_logprobs)
    assert traj["bridged"] == len(turns) - 1 and traj["branched"] == 0 and traj["rerendered"] == 0


async def engine_logprobs(served: Any, ids: list[int]) -> np.ndarray:
    """The engine's own logprob of each id given the ids before it (teacher scoring of the same sequence)."""
    scored = await served.client.teacher_logprobs(ids)
    return np.asarray(scored.logprobs, np.float32)


async def test_the_sync_sdk_multi_turn_on_the_vllm_emulator_keeps_exact_ids_and_the_engines_logprobs(
    vllm_gateway,
) -> None:
    served = vllm_gateway

    def harness() -> None:  # the SDK's blocking client, in a thread while the gateway serves on this loop
        with openai.OpenAI(base_url=f"{served.url}/s/run-1/v1", api_key="unused", max_retries=0) as sdk:
            messages: list[Any] = [{"role": "user", "content": "hello"}]
            for i in range(3):
                answer = sdk.chat.completions.create(model=served.model, messages=messages, max_tokens=8, seed=i)
                assert answer.choices[0].finish_reason in ("stop", "length")
                reply = answer.choices[0].message.model_dump(exclude_none=True)
                messages += [reply, {"role": "user", "content": f"go on {i}"}]

    await asyncio.to_thread(harness)
    traj = await trajectory(served.url, "run-1")
    assert len(traj["turns"]) == 3
    assert_exact_chain(traj)
    (branch,) = traj["branches"]
    engine = await engine_logprobs(served, branch["input_ids"])
    sampled = np.asarray(branch["loss_mask"], bool)
    np.testing.assert_allclose(np.asarray(branch["logprobs"])[sampled], engine[sampled], atol=1e-4)
    assert len({t["server"] for t in traj["turns"]}) == 1


async def test_the_async_sdk_streams_turns_the_same_ids_and_text_as_unstreamed_ones(vllm_gateway) -> None:
    served = vllm_gateway
    sdk = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "stream please"}]
    session = None
    streamed_texts = []
    for i in range(3):
        raw = await sdk.chat.completions.with_raw_response.create(
            model=served.model,
            messages=messages,
            max_tokens=8,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={} if session is None else {"X-Session-ID": session},
        )
        session = raw.headers["X-Session-ID"]
        content, usage, finish = "", None, None
        async for chunk in raw.parse():
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                content += choice.delta.content or ""
                finish = choice.finish_reason or finish
        assert usage is not None and finish in ("stop", "length")
        streamed_texts.append(content)
        messages += [{"role": "assistant", "content": content}, {"role": "user", "content": f"more {i}"}]
    await sdk.close()
    traj = await trajectory(served.url, session)
    assert_exact_chain(traj)
    assert [t["reply"]["content"] for t in traj["turns"]] == streamed_texts
    assert all(t["completion_ids"] for t in traj["turns"])


async def test_a_scripted_tool_loop_through_the_sdk_streamed_and_not(scripted_gateway) -> None:
    for stream in (False, True):
        async with scripted_gateway(list(TOOL_REPLIES), name=f"tools-{stream}") as served:

            def harness(url: str = served.url, stream: bool = stream) -> list[Any]:
                local = {"add": lambda a, b: a + b}
                replies = []
                with openai.OpenAI(base_url=f"{url}/s/tools/v1", api_key="unused", max_retries=0) as sdk:
                    messages: list[Any] = [{"role": "user", "content": "add 2, 3 and 5"}]
                    while True:
                        if stream:
                            with sdk.chat.completions.stream(
                                model="tiny", messages=messages, tools=TOOLS, max_tokens=64
                            ) as events:
                                completion = events.get_final_completion()
                        else:
                            completion = sdk.chat.completions.create(
                                model="tiny", messages=messages, tools=TOOLS, max_tokens=64
                            )
                        message = completion.choices[0].message
                        replies.append((message, completion.choices[0].finish_reason))
                        messages.append(message.model_dump(exclude_none=True))
                        if not message.tool_calls:
                            return replies
                        for call in message.tool_calls:
                            value = local[call.function.name](**json.loads(call.function.arguments))
                            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(value)})

            replies = await asyncio.to_thread(harness)
            assert [finish for _, finish in replies] == ["tool_calls", "tool_calls", "stop"]
            first, second, last = (m for m, _ in replies)
            assert first.tool_calls[0].function.name == "add"
            assert json.loads(first.tool_calls[0].function.arguments) == {"a": 2, "b": 3}
            assert second.content == "One more: " and json.loads(second.tool_calls[0].function.arguments) == {
                "a": 5,
                "b": 5,
            }
            assert last.content == "The answer is 10 (2 + 3 + 5)."
            assert (last.model_extra or {}).get("reasoning_content") == "all added"
            traj = await trajectory(served.url, "tools")
            assert_exact_chain(traj)
            tip = next(t for t in await served.gateway.store.turns("tools") if t.turn == 2)
            assert loss_mask(tip.result()).tolist() == traj["branches"][0]["loss_mask"]
            assert len(served.script.requests) == 3


async def test_closed_sessions_reach_the_trainers_reader_as_numpy_arrays(vllm_gateway) -> None:
    served = vllm_gateway
    sdk = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    for name, reward in (("a", 1.0), ("b", 0.0)):
        messages: list[Any] = [{"role": "user", "content": f"task {name}"}]
        for i in range(2):
            answer = await sdk.chat.completions.create(
                model=served.model,
                messages=messages,
                max_tokens=4,
                seed=i,
                extra_headers={"X-Session-ID": name, "X-Session-Group": "step-1"},
            )
            messages += [answer.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "next"}]
        async with httpx.AsyncClient(base_url=served.url, trust_env=False) as http:
            assert (await http.post(f"/v1/sessions/{name}/reward", json={"reward": reward})).status_code == 200
            closed = (await http.post(f"/v1/sessions/{name}/close")).json()
            assert closed["status"] == "closed" and closed["reward"] == reward and closed["turns"] == 2
    await sdk.close()
    read = list(Trajectories(served.store).closed(group="step-1"))
    assert [(t.session, t.reward) for t in read] == [("a", 1.0), ("b", 0.0)]
    for t in read:
        (sample,) = t.samples
        assert sample.input_ids.dtype == np.int32 and sample.loss_mask.dtype == np.uint8
        assert sample.logprobs.dtype == np.float32 and len(sample.turns) == 2
        as_json = await trajectory(served.url, t.session)
        assert sample.input_ids.tolist() == as_json["branches"][0]["input_ids"]
        assert sample.loss_mask.tolist() == as_json["branches"][0]["loss_mask"]
