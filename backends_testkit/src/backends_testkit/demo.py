"""The main job: a tour of the whole API on the embedded default engine (or real servers), over real HTTP.

By default it builds the tiny models (cached), builds the backend's emulator (``backends_testkit.emulators``) over
the numpy reference engine, serves a two-server dense fleet and one MoE server on local ports, and drives them
through the public API as a trainer would: multi-turn token-in/token-out with a tool result, teacher logprobs,
LoRA, a weight sync with a request kept in flight, and routed experts. With ``urls`` it does the same against
real servers serving the tiny models. Every step checks what it shows; a broken invariant ends the demo with a
non-zero exit status.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import io
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path

import numpy as np

from backends_core import Client, ClientConfig, GenerateResult, LoraAdapter, SamplingParams
from backends_core.cli_common import EXIT_FAILED, emit, error_object, exit_code
from backends_core.errors import BackendError
from backends_testkit.emulators import NoEmulatorError, make_emulator
from backends_testkit.engine import ReferenceEngine
from backends_testkit.tinymodel import TinyModels, build_tiny_models, default_models_dir, write_perturbed_weights
from backends_testkit.watch import in_flight_or_ended

__all__ = ["DEFAULT_BACKEND", "DemoFailure", "run_demo", "run_demo_async"]

#: The backend whose emulator is the embedded default engine.
DEFAULT_BACKEND = "vllm"
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


#: Where a check that held is also reported (the JSON lines of ``backends demo --json``), if anywhere.
_on_check: contextvars.ContextVar[Callable[[str], None] | None] = contextvars.ContextVar("_on_check", default=None)


def check(condition: bool, what: str) -> None:
    if not condition:
        raise DemoFailure(what)
    print(f"  ok  {what}")
    report = _on_check.get()
    if report is not None:
        report(what)


@contextlib.asynccontextmanager
async def embedded_servers(
    backend: str, model_dir: Path, count: int, seed: int, *, routed_experts: bool = False
) -> AsyncIterator[list[str]]:
    """``count`` emulated servers of ``backend`` on free local ports; yields their URLs."""
    async with contextlib.AsyncExitStack() as stack:
        urls = []
        for i in range(count):
            engine = ReferenceEngine(model_dir, seed=seed + i)
            stack.push_async_callback(engine.aclose)
            try:
                emulator = make_emulator(backend, engine, routed_experts=routed_experts)
            except NoEmulatorError as exc:
                raise DemoFailure(f"{exc}: run the demo with --url") from None
            urls.append(await stack.enter_async_context(emulator.serve()))
        yield urls


async def _multi_turn(client: Client, seed: int) -> GenerateResult:
    print("\n1. multi-turn token-in/token-out with a tool result")
    conv = client.conversation(tools=TOOLS, server=0)
    sampling = SamplingParams(max_tokens=24, temperature=0.8, seed=seed)
    first = await conv.send([{"role": "user", "content": "Which files are in src?"}], sampling=sampling)
    print(f"  turn 1: {len(first.prompt_ids)} prompt ids -> {len(first.completion_ids)} completion ids")
    reply = client.parse_completion(first)
    calls = len(reply["tool_calls"] or ())
    print(f"  turn 1 parsed: {len(reply['content'])} characters of content, {calls} tool call(s)")
    second = await conv.send([{"role": "tool", "content": "main.py util.py"}], sampling=sampling)
    third = await conv.send([{"role": "user", "content": "Open main.py."}], sampling=sampling)
    for n, (before, after) in enumerate(((first, second), (second, third)), start=2):
        new = len(after.prompt_ids) - len(before.token_ids)
        print(f"  turn {n}: reused {len(before.token_ids)} exact ids, rendered {new} new ones")
    check(
        second.prompt_ids[: len(first.token_ids)] == first.token_ids
        and third.prompt_ids[: len(second.token_ids)] == second.token_ids,
        "every turn starts with the previous turn's exact ids",
    )
    stats = client.bridge_stats
    check(
        (stats.attempts, stats.successes, stats.failed, stats.rerendered) == (2, 2, 0, 0),
        "bridge attempts counted, no failures",
    )
    check(
        len(third.logprobs) == len(third.completion_ids) and bool(np.isfinite(third.logprobs).all()),
        "one finite float32 logprob per completion id",
    )
    return third


async def _teacher(client: Client, sample: GenerateResult) -> None:
    print("\n2. teacher logprobs of the sampled sequence")
    teacher = await client.teacher_logprobs(sample.token_ids, server=0)
    gap = float(np.abs(teacher.logprobs[len(sample.prompt_ids) :] - sample.logprobs).max())
    print(f"  max |teacher - generation| = {gap:.2e} over {len(sample.completion_ids)} tokens")
    check(gap < 1e-3 and bool(np.isnan(teacher.logprobs[0])), "teacher scores equal the sampling logprobs")


async def _undo(what: str, action: Callable[[], Awaitable[object]]) -> None:
    """Put the servers back after a step failed half-way. A failure of that is printed, not raised: the step's own
    failure is the one to report."""
    try:
        await action()
    except Exception as exc:
        print(f"  could not {what}: {type(exc).__name__}: {exc}")


async def _lora(client: Client, models: TinyModels, prompt: list[int]) -> None:
    print("\n3. LoRA load, generate, hot-swap, unload on every server")
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    base = await client.generate(prompt_ids=prompt, sampling=greedy, server=0)
    await client.admin.load_lora(LoraAdapter(name="tiny-lora", path=str(models.lora)))
    loaded = True
    try:
        tuned = await client.generate(prompt_ids=prompt, sampling=greedy, lora="tiny-lora", server=0)
        shift = abs(float(tuned.logprobs[0]) - float(base.logprobs[0]))
        check(shift > 1e-4, f"the adapter changes the first logprob by {shift:.3f}")
        await client.admin.load_lora(LoraAdapter(name="tiny-lora", path=str(models.lora), replace=True))
        await client.admin.unload_lora("tiny-lora")
        loaded = False
    finally:
        if loaded:
            await _undo("unload the LoRA adapter", lambda: client.admin.unload_lora("tiny-lora"))
    again = await client.generate(prompt_ids=prompt, sampling=greedy, server=0)
    check(bool(np.allclose(again.logprobs, base.logprobs, atol=1e-4)), "unloading restores the base model")


#: Tokens of the request the weight sync keeps in flight, one entry per attempt at catching it there: an attempt
#: whose request ends before the pause holds it proves nothing, and the next one is longer (the 64 prompt tokens
#: and 1600 more fit the tiny models' 2048 positions).
KEPT_TOKENS = (400, 800, 1600)
#: Seconds to wait for the server to report the kept request in flight, unless it ends first.
IN_FLIGHT_TIMEOUT_S = 120.0
#: Seconds the kept request may take to end (a hang guard, not a speed check).
FINISH_TIMEOUT_S = 600.0
#: Seconds between two state polls.
POLL_S = 0.005


async def _finished(task: asyncio.Task[GenerateResult], what: str) -> GenerateResult:
    done, _ = await asyncio.wait({task}, timeout=FINISH_TIMEOUT_S)
    if not done:
        task.cancel()
        raise DemoFailure(f"{what} did not end within {FINISH_TIMEOUT_S:.0f} s")
    return task.result()


async def _seen_in_flight(client: Client, server: int, task: asyncio.Task[GenerateResult]) -> bool:
    """Poll the fleet's state until ``server`` reports a request in flight (``True``; also when it does not count
    them) or the request ends first (``False``)."""
    try:
        return (
            await in_flight_or_ended(client, task, server=server, within=IN_FLIGHT_TIMEOUT_S, poll_s=POLL_S)
            is not False
        )
    except TimeoutError:
        if task.done():
            return False
        raise DemoFailure(
            f"{client.base_urls[server]} did not report the kept request in flight within {IN_FLIGHT_TIMEOUT_S:.0f} s, "
            "although it had not ended"
        ) from None


async def _holds(client: Client, server: int, task: asyncio.Task[GenerateResult]) -> bool:
    """Right after ``pause("keep")``: ``server`` still has the request in flight (where it counts them)."""
    in_flight = (await client.admin.state())[server].in_flight
    return in_flight != 0 and not task.done()


async def _pause_keeping_a_request(
    client: Client, prompt: list[int], seed: int, server: int
) -> tuple[asyncio.Task[GenerateResult], int, float]:
    """Start a long request on ``server`` and pause the fleet with mode "keep" while the server holds it. Returns
    the request's task, its length and when the pause began; the fleet is left paused.

    An attempt waits to see its request in flight, then pauses. Once a request ended before a state poll saw it (on
    a loaded machine a server can answer admin calls only after a whole generation), the next attempts pause one
    poll interval after starting theirs. Should every attempt miss, one more request is sent while the fleet is
    paused: it waits through the update instead of being frozen half-way, and the demo says so.
    """
    right_away = False
    for tokens in KEPT_TOKENS:
        sampling = SamplingParams(max_tokens=tokens, ignore_eos=True, seed=seed)
        task = asyncio.create_task(client.generate(prompt_ids=prompt, sampling=sampling, server=server))
        paused = False
        try:
            if right_away:
                # the request's body may still wait for its write on the event loop: let it reach the server first
                await asyncio.sleep(POLL_S)
            if right_away or await _seen_in_flight(client, server, task):
                started = time.perf_counter()
                await client.admin.pause("keep")
                paused = True
                if await _holds(client, server, task):
                    return task, tokens, started
                await client.admin.resume()
                paused = False
            right_away = True
            await _finished(task, f"the {tokens}-token request")
        except BaseException:
            task.cancel()
            if paused:
                await _undo("resume the fleet", client.admin.resume)
            raise
        print(f"  the {tokens}-token request ended before pause(keep) held it")
    tokens = KEPT_TOKENS[-1]
    print(
        f"  every request ended before the server answered the pause (a busy machine): the fleet is paused first "
        f"and a {tokens}-token request sent to wait through the update"
    )
    started = time.perf_counter()
    await client.admin.pause("keep")
    sampling = SamplingParams(max_tokens=tokens, ignore_eos=True, seed=seed)
    return asyncio.create_task(client.generate(prompt_ids=prompt, sampling=sampling, server=server)), tokens, started


async def _weight_sync(client: Client, models: TinyModels, prompt: list[int], seed: int) -> None:
    print("\n4. weight sync with a request kept in flight: pause(keep) -> update -> resume")
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    base = await client.generate(prompt_ids=prompt, sampling=greedy, server=0)
    new_weights = write_perturbed_weights(models.dense, Path(tempfile.mkdtemp()) / "step-1", seed=1, scale=0.3)
    original = (await client.admin.state())[0].weight_version or "base"
    kept_task, tokens, started = await _pause_keeping_a_request(client, prompt, seed, len(client.servers) - 1)
    changed = True  # from the update on, until the original weights are back
    try:
        try:
            await client.admin.update_weights(str(new_weights), version="step-1")
            states = await client.admin.state()
            check(all(s.paused and s.weight_version == "step-1" for s in states), "every server paused on step-1")
        except BaseException:
            await _undo("resume the fleet", client.admin.resume)
            raise
        await client.admin.resume()
        print(f"  fleet sync took {1000 * (time.perf_counter() - started):.0f} ms over {len(client.servers)} servers")
        kept = await _finished(kept_task, "the kept request")
        check(
            kept.finish_reason == "length" and len(kept.completion_ids) == tokens,
            "the kept request survived the update",
        )
        if kept.weight_versions:
            print(f"  its weight spans: {[(s.version, s.start, s.end) for s in kept.weight_versions]}")
        if "admin_flush_cache" in client.capabilities:
            await client.admin.flush_cache()
        after = await client.generate(prompt_ids=prompt, sampling=greedy, server=0)
        check(not np.allclose(after.logprobs, base.logprobs, atol=1e-4), "new weights serve new logprobs")
        report = await client.admin.weight_sync(path=str(models.dense), version=original, mode="wait")
        changed = False
        print(
            f"  weight_sync back to the original weights ({original}): {' -> '.join(report.phases)} "
            f"in {1000 * report.duration_s:.0f} ms"
        )
    finally:
        kept_task.cancel()
        if changed:
            await _undo(
                "reload the original weights",
                lambda: client.admin.weight_sync(path=str(models.dense), version=original, mode="wait"),
            )
    restored = await client.generate(prompt_ids=prompt, sampling=greedy, server=0)
    check(
        restored.completion_ids == base.completion_ids
        and bool(np.allclose(restored.logprobs, base.logprobs, atol=1e-5)),
        "reloading the original weights restores the logprobs exactly",
    )


async def _routed_experts(config: ClientConfig, seed: int) -> None:
    print("\n5. MoE routed experts (router replay) with delta replay")
    async with Client(config) as moe:
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


async def run_demo_async(
    *,
    backend: str = DEFAULT_BACKEND,
    urls: Sequence[str] = (),
    moe_url: str | None = None,
    model: str = "tiny-qwen3",
    models_dir: str | None = None,
    seed: int = 0,
) -> None:
    """The demo as a coroutine (see :func:`run_demo`): raises :class:`DemoFailure`, or the backend's error, when a
    step fails; the servers are left resumed, on their original weights, without the demo's adapter."""
    await _demo(backend, urls, moe_url, model, Path(models_dir) if models_dir else default_models_dir(seed=seed), seed)


async def _demo(
    backend: str, urls: Sequence[str], moe_url: str | None, model: str, models_dir: Path, seed: int
) -> None:
    started = time.perf_counter()
    models = build_tiny_models(models_dir, seed=seed)
    print(f"tiny models in {models.root}")
    async with contextlib.AsyncExitStack() as stack:
        if not urls:
            urls = await stack.enter_async_context(embedded_servers(backend, models.dense, 2, seed))
            moe_url = (
                await stack.enter_async_context(embedded_servers(backend, models.moe, 1, seed, routed_experts=True))
            )[0]
            where = "embedded emulators"
        else:
            where = "real servers"
        config = ClientConfig(
            backend=backend,
            base_url=list(urls),
            model=model,
            tokenizer=str(models.dense),
            tool_parser="hermes",
            reasoning_parser="qwen3",
        )
        async with Client(config) as client:
            caps = client.capabilities
            print(f"\nbackend {backend!r} over {len(client.servers)} {where}: {', '.join(client.base_urls)}")
            print("capabilities: " + ", ".join(sorted(caps)))
            if "admin_health" in caps:
                check(all(await client.admin.health()), "every server is healthy")
            sample = await _multi_turn(client, seed)
            if "teacher_logprobs" in caps:
                await _teacher(client, sample)
            prompt = list(sample.prompt_ids[:64])
            if {"admin_load_lora", "admin_unload_lora"} <= caps:
                await _lora(client, models, prompt)
            if {"admin_pause", "admin_resume", "admin_update_weights", "admin_state"} <= caps:
                await _weight_sync(client, models, prompt, seed)
        if moe_url:
            moe = ClientConfig(backend=backend, base_url=moe_url, model=f"{model}-moe", tokenizer=str(models.moe))
            await _routed_experts(moe, seed)
    print(f"\ndemo finished in {time.perf_counter() - started:.1f} s")


def run_demo(
    *,
    backend: str = DEFAULT_BACKEND,
    urls: Sequence[str] = (),
    moe_url: str | None = None,
    model: str = "tiny-qwen3",
    models_dir: str | None = None,
    seed: int = 0,
    json_lines: bool = False,
) -> int:
    """Run the demo; returns the process exit status: 0 when every check held, 1 when one did not or a server
    failed, 2 for a configuration error (the ``backends`` CLI's codes).

    :param json_lines: write one JSON object per line on stdout instead of the tour's prose:
        ``{"check": what, "ok": true}`` for each check that held, then ``{"demo": "finished", "backend", "checks",
        "duration_s"}``; a failure ends with ``{"demo": "failed", ...}`` on stdout and the error object of
        :func:`backends_core.cli_common.error_object` on stderr.
    """
    stdout = sys.stdout
    checks: list[str] = []
    started = time.perf_counter()

    def on_check(what: str) -> None:
        checks.append(what)
        emit(True, {"check": what, "ok": True}, file=stdout)

    def summary(outcome: str) -> dict[str, object]:
        return {
            "demo": outcome,
            "backend": backend,
            "checks": len(checks),
            "duration_s": round(time.perf_counter() - started, 3),
        }

    token = _on_check.set(on_check if json_lines else None)
    try:
        with contextlib.redirect_stdout(io.StringIO()) if json_lines else contextlib.nullcontext():
            asyncio.run(
                run_demo_async(
                    backend=backend, urls=urls, moe_url=moe_url, model=model, models_dir=models_dir, seed=seed
                )
            )
    except (DemoFailure, BackendError) as exc:
        what = str(exc) if isinstance(exc, DemoFailure) else f"{type(exc).__name__}: {exc}"
        if json_lines:
            emit(True, summary("failed"), file=stdout)
            emit(True, error_object(exc), file=sys.stderr)
        else:
            print(f"  FAILED  {what}")
        return EXIT_FAILED if isinstance(exc, DemoFailure) else exit_code(exc)
    finally:
        _on_check.reset(token)
    if json_lines:
        emit(True, summary("finished"), file=stdout)
    return 0
