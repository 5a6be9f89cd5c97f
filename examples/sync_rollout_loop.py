"""A synchronous RL rollout loop on SyncClient: 50 steps of what a trainer does around its optimizer steps.

Each step samples a group of completions for a batch of prompts from worker threads (exact ids and one logprob per
id), scores a sample with the server as a teacher every few steps, runs a two-turn conversation that reuses the
first turn's exact ids every few steps, and every ``UPDATE_EVERY`` steps pauses the server keeping its requests,
loads the new checkpoint under a new weight version, flushes the prefix cache and resumes. No ``async``, no
``asyncio.run`` in the loop.

It runs against the embedded engine: the vLLM emulator over the test kit's numpy reference engine serving the tiny
models (built locally, cached), on a local port served by its own thread, which stands in for a vLLM server. A
trainer points ``base_url`` at its servers instead (``--url``: a vLLM server on this machine serving the tiny dense
model, whose checkpoints it can read). Every fact the loop relies on is checked with ``assert``::

    python examples/sync_rollout_loop.py [--models-dir DIR] [--steps 50] [--url http://127.0.0.1:8000]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from backends_core import ClientConfig, GenerateResult, SamplingParams, SyncClient
from backends_testkit.emulators import make_emulator
from backends_testkit.engine import ReferenceEngine
from backends_testkit.tinymodel import build_tiny_models, default_models_dir, write_perturbed_weights

STEPS = 50
#: Steps between two weight updates (the trainer's optimizer steps).
UPDATE_EVERY = 10
#: Prompts per step, sampled concurrently from that many threads, and samples per prompt (a GRPO group).
BATCH = 4
GROUP = 2
TEACHER_EVERY = 5
CONVERSATION_EVERY = 4
PROMPTS = [
    "What is 2+2?",
    "Name a prime number.",
    "Spell 'cat' backwards.",
    "Which is larger, 7 or 9?",
    "Say hello in French.",
    "What colour is the sky?",
]
#: The greedy request whose logprobs show which weights serve.
PROBE = SamplingParams(max_tokens=4, temperature=0.0)


@contextlib.contextmanager
def embedded_vllm_server(model_dir: Path) -> Iterator[str]:
    """The vLLM emulator over the reference engine on a free local port, served by an event loop on its own
    thread (a separate server, as far as the trainer can tell); yields its base URL."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="embedded-vllm", daemon=True)
    thread.start()
    engine = ReferenceEngine(model_dir, seed=0)
    serving = make_emulator("vllm", engine).serve()
    try:
        url = asyncio.run_coroutine_threadsafe(serving.__aenter__(), loop).result()
        try:
            yield url
        finally:
            asyncio.run_coroutine_threadsafe(serving.__aexit__(None, None, None), loop).result()
    finally:
        asyncio.run_coroutine_threadsafe(engine.aclose(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def rollout(client: SyncClient, prompt: str, seed: int) -> list[GenerateResult]:
    """One prompt's group of samples, with the facts the trainer relies on checked."""
    samples = client.generate_samples(
        messages=[{"role": "user", "content": prompt}],
        sampling=SamplingParams(n=GROUP, max_tokens=12, temperature=1.0, seed=seed),
    )
    assert len(samples) == GROUP
    for sample in samples:
        assert sample.prompt_ids == samples[0].prompt_ids  # one rendering of the prompt for the whole group
        assert sample.logprobs.dtype == np.float32 and len(sample.logprobs) == len(sample.completion_ids)
        assert bool(np.isfinite(sample.logprobs).all()) and bool((sample.logprobs <= 0).all())
        assert sample.token_ids == sample.prompt_ids + sample.completion_ids
    return samples


def reward(sample: GenerateResult) -> float:
    """A stand-in for the trainer's reward: the share of even completion ids."""
    return sum(1 for t in sample.completion_ids if t % 2 == 0) / max(len(sample.completion_ids), 1)


def run(models_dir: Path, steps: int, url: str | None = None) -> None:
    models = build_tiny_models(models_dir)
    checkpoints = Path(tempfile.mkdtemp(prefix="sync-rollout-"))
    with contextlib.ExitStack() as stack:
        if url is None:
            url = stack.enter_context(embedded_vllm_server(models.dense))
        config = ClientConfig(backend="vllm", base_url=url, model="tiny-qwen3", tokenizer=str(models.dense))
        with SyncClient(config) as client, ThreadPoolExecutor(BATCH) as workers:
            assert client.admin.health() == [True]
            version = started_on = client.admin.state()[0].weight_version
            probe_ids = client.render([{"role": "user", "content": PROMPTS[0]}])
            base = client.generate(prompt_ids=probe_ids, sampling=PROBE)
            tokens = 0
            for step in range(steps):
                prompts = [PROMPTS[(step + i) % len(PROMPTS)] for i in range(BATCH)]
                groups = list(workers.map(rollout, [client] * BATCH, prompts, range(step * BATCH, (step + 1) * BATCH)))
                for group in groups:
                    rewards = np.array([reward(s) for s in group])
                    advantages = rewards - rewards.mean()  # what a GRPO loss would weigh each sample's logprobs by
                    assert abs(float(advantages.sum())) < 1e-9
                    assert all(s.weight_version == version for s in group)  # sampled on the weights expected
                    tokens += sum(len(s.completion_ids) for s in group)
                if step % TEACHER_EVERY == 0:
                    sample = groups[0][0]
                    teacher = client.teacher_logprobs(sample.token_ids)
                    scored = teacher.logprobs[len(sample.prompt_ids) :]
                    assert bool(np.isnan(teacher.logprobs[0])) and len(scored) == len(sample.completion_ids)
                    assert float(np.abs(scored - sample.logprobs).max()) < 1e-3  # same weights, same numbers
                if step % CONVERSATION_EVERY == 0:
                    conversation = client.conversation()
                    first = conversation.send([{"role": "user", "content": prompts[0]}], sampling=PROBE)
                    second = conversation.send([{"role": "user", "content": "Why?"}], sampling=PROBE)
                    assert second.prompt_ids[: len(first.token_ids)] == first.token_ids  # exact ids, not re-rendered
                if (step + 1) % UPDATE_EVERY == 0 and step + 1 < steps:
                    # the optimizer step: a new checkpoint, loaded while the server is paused (keeping whatever is
                    # in flight); the prefix cache holds the old weights' KV, so it is flushed before resuming
                    version = f"step-{step + 1}"
                    path = write_perturbed_weights(models.dense, checkpoints / version, seed=step, scale=0.3)
                    assert client.admin.pause(mode="keep") == [True]
                    try:
                        assert client.admin.update_weights(str(path), version=version) == [True]
                        assert client.admin.flush_cache() == [True]
                    finally:
                        client.admin.resume()
                    state = client.admin.state()[0]
                    assert state.weight_version == version and not state.paused
                    moved = client.generate(prompt_ids=probe_ids, sampling=PROBE)
                    assert not np.allclose(moved.logprobs, base.logprobs, atol=1e-4)  # the new weights serve
                    print(f"step {step + 1:2d}: weights {version} loaded, {tokens} tokens sampled so far")
            # back to the weights the run started from: pause, load, flush, resume, verify, in one call
            original = started_on or "base"
            report = client.admin.weight_sync(path=str(models.dense), version=original, mode="wait")
            assert report.ok
            back = client.generate(prompt_ids=probe_ids, sampling=PROBE)
            assert back.completion_ids == base.completion_ids
            assert bool(np.allclose(back.logprobs, base.logprobs, atol=1e-5))
            assert client.bridge_stats.failed == 0
            print(f"{steps} steps, {tokens} tokens sampled, every check held")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--models-dir", type=Path, default=None, help="where the tiny models are built (cached)")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--url", help="a vLLM server serving the tiny dense model, instead of the embedded one")
    args = parser.parse_args(argv)
    run(args.models_dir or default_models_dir(), args.steps, args.url)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
