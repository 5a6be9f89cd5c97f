"""The main job: a tour of the whole API on the embedded reference engine, over real HTTP.

It builds the tiny models (cached), serves a dense fleet of two reference servers and one MoE server on
local ports, and drives them through the public API exactly as a trainer would: multi-turn token-in/
token-out with a tool call, teacher logprobs, routed experts, LoRA, and a weight sync under pause. Every
step checks what it shows; a broken invariant ends the demo with a non-zero exit status.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np

from backends_core import AdminError, Client, ClientConfig, LoraAdapter, SamplingParams
from backends_core.reference.emulator import ReferenceEmulator
from backends_core.testing.engine import ReferenceEngine
from backends_core.testing.http_server import serve
from backends_core.testing.tinymodel import build_tiny_models, default_models_dir, write_perturbed_weights

__all__ = ["run_demo"]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "list_files",
            "description": "List files in a directory",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]


class DemoFailure(AssertionError):
    """An invariant the demo shows did not hold."""


def check(condition: bool, what: str) -> None:
    if not condition:
        raise DemoFailure(what)
    print(f"  ok  {what}")


@contextlib.asynccontextmanager
async def reference_fleet(model_dir: Path, count: int, seed: int) -> AsyncIterator[list[str]]:
    """``count`` reference servers on free local ports; yields their URLs."""
    async with contextlib.AsyncExitStack() as stack:
        urls = []
        for i in range(count):
            engine = ReferenceEngine(model_dir, seed=seed + i)
            stack.push_async_callback(engine.aclose)
            urls.append(await stack.enter_async_context(serve(ReferenceEmulator(engine).handle)))
        yield urls


async def _demo(models_dir: Path, seed: int) -> None:
    started = time.perf_counter()
    models = build_tiny_models(models_dir, seed=seed)
    print(f"tiny models in {models.root}")
    async with reference_fleet(models.dense, 2, seed) as dense_urls, reference_fleet(models.moe, 1, seed) as moe_urls:
        config = ClientConfig(backend="reference", base_url=dense_urls, model="tiny-qwen3", tokenizer=str(models.dense))
        async with Client(config) as client:
            print(f"\nbackend {client.backend!r} over {len(client.servers)} servers: {', '.join(dense_urls)}")
            print("capabilities: " + ", ".join(sorted(client.capabilities)))
            check(await client.admin.health() == [True, True], "every server is healthy")

            print("\n1. multi-turn token-in/token-out with a tool call")
            conv = client.conversation(tools=TOOLS, server=0)
            sampling = SamplingParams(max_tokens=24, temperature=0.8, seed=seed)
            first = await conv.send([{"role": "user", "content": "Which files are in src?"}], sampling=sampling)
            print(
                f"  turn 1: {len(first.prompt_ids)} prompt ids -> {len(first.completion_ids)} completion ids "
                f"({first.finish_reason})"
            )
            call = {"type": "function", "function": {"name": "list_files", "arguments": {"path": "src"}}}
            second = await conv.send(
                [{"role": "tool", "content": "main.py util.py"}],
                sampling=sampling,
                assistant_message={"role": "assistant", "content": "", "tool_calls": [call]},
            )
            delta = len(second.prompt_ids) - len(first.token_ids)
            print(f"  turn 2: reused {len(first.token_ids)} exact ids, rendered {delta} new ones")
            check(second.prompt_ids[: len(first.token_ids)] == first.token_ids, "turn 2 starts with turn 1's exact ids")
            check(client.bridge_stats.as_dict() == {"attempts": 1, "successes": 1, "failures": {}}, "bridge counted")
            check(
                len(second.logprobs) == len(second.completion_ids) and bool(np.isfinite(second.logprobs).all()),
                "one finite float32 logprob per completion id",
            )

            print("\n2. teacher logprobs of the sampled sequence")
            teacher = await client.teacher_logprobs(second.token_ids, server=0)
            gap = float(np.abs(teacher.logprobs[len(second.prompt_ids) :] - second.logprobs).max())
            print(f"  max |teacher - generation| = {gap:.2e} over {len(second.completion_ids)} tokens")
            check(gap < 1e-4 and bool(np.isnan(teacher.logprobs[0])), "teacher scores equal the sampling logprobs")

            print("\n3. LoRA load, generate, unload on every server")
            greedy = SamplingParams(max_tokens=8, temperature=0.0)
            prompt = list(first.prompt_ids)
            base = await client.generate(prompt_ids=prompt, sampling=greedy, server=0)
            await client.admin.load_lora(LoraAdapter(name="tiny-lora", path=str(models.lora)))
            tuned = await client.generate(prompt_ids=prompt, sampling=greedy, lora="tiny-lora", server=0)
            shift = float(np.abs(tuned.logprobs[:1] - base.logprobs[:1]).max())
            check(shift > 1e-4, f"the adapter changes the first logprob by {shift:.3f}")
            await client.admin.unload_lora("tiny-lora")

            print("\n4. weight sync: pause(keep) with a request in flight, update, resume")
            in_flight = asyncio.create_task(
                client.generate(
                    prompt_ids=prompt, sampling=SamplingParams(max_tokens=400, ignore_eos=True, seed=seed), server=1
                )
            )
            while not (await client.admin.state())[1].in_flight:  # noqa: ASYNC110 - polling a remote server
                await asyncio.sleep(0.005)
            new_weights = write_perturbed_weights(models.dense, Path(tempfile.mkdtemp()) / "step-1", seed=1, scale=0.3)
            await client.admin.pause("keep")
            try:
                await client.admin.update_weights(str(new_weights), version="step-1")
                try:
                    await client.admin.flush_cache()
                    raise DemoFailure("flush_cache reported success with a request kept in flight")
                except AdminError as exc:
                    refused = [o.server for o in exc.results if not o.ok]
                    check(refused == [dense_urls[1]], "flush is refused (not faked) where a request is kept in flight")
                states = await client.admin.state()
                check(all(s.paused and s.weight_version == "step-1" for s in states), "both servers paused on step-1")
            finally:
                await client.admin.resume()
            kept = await in_flight
            spans = [(s.version, s.start, s.end) for s in kept.weight_versions]
            print(f"  the kept request finished with {len(kept.completion_ids)} ids; weight spans {spans}")
            check(
                kept.finish_reason == "length" and kept.weight_version == "step-1", "kept request survived the update"
            )
            after = await client.generate(prompt_ids=prompt, sampling=greedy, server=0)
            check(
                after.weight_version == "step-1" and not np.allclose(after.logprobs, base.logprobs),
                "new weights serve new logprobs",
            )

        print("\n5. MoE routed experts (router replay) with delta replay")
        moe_config = ClientConfig(
            backend="reference", base_url=moe_urls, model="tiny-qwen3-moe", tokenizer=str(models.moe)
        )
        async with Client(moe_config) as moe:
            result = await moe.generate(
                messages=[{"role": "user", "content": "route me"}],
                sampling=SamplingParams(max_tokens=6, seed=seed),
                return_routed_experts=True,
            )
            assert result.routed_experts is not None
            experts = result.routed_experts.experts
            print(f"  routed_experts {experts.dtype} {experts.shape} = [tokens, layers, top_k] from position 0")
            check(experts.shape[0] == len(result.token_ids) - 1, "one routing row per routed token")
            nxt = await moe.generate(
                prompt_ids=list(result.token_ids),
                sampling=SamplingParams(max_tokens=4, seed=seed),
                return_routed_experts=True,
                routed_experts_start=len(result.token_ids) - 1,
            )
            assert nxt.routed_experts is not None
            check(nxt.routed_experts.start == len(result.token_ids) - 1, "delta replay starts at the new tokens")
    print(f"\ndemo finished in {time.perf_counter() - started:.1f} s")


def run_demo(*, models_dir: str | None = None, seed: int = 0) -> int:
    """Run the demo; returns the process exit status."""
    try:
        asyncio.run(_demo(Path(models_dir) if models_dir else default_models_dir(seed=seed), seed))
    except DemoFailure as exc:
        print(f"  FAILED  {exc}")
        return 1
    return 0
