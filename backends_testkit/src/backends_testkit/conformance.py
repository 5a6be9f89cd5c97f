"""The conformance suite every backend subclasses (fsspec style: abstract test classes).

A backend's whole obligation::

    class TestAcme(BackendConformance):
        backend_name = "acme"
        expected_capabilities = {"teacher_logprobs", "admin_health"}

        def emulator_transport(self, engine):
            return AcmeEmulator(engine).transport()   # acme's wire format over the reference engine

By default every test runs in-process against the emulator, over the numpy reference engine on the tiny
models. With ``pytest --backend-url http://host:port --backend acme [--backend-model NAME] [--backend-moe]``
the same tests run against a real server (marked ``live``); tests that need to reach inside the engine or a
MoE model skip with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, ClassVar, NoReturn, TypeVar

import attrs
import httpx
import numpy as np
import pytest
import pytest_asyncio

from backends_core import (
    SAMPLING_FEATURES,
    AdminError,
    BackendError,
    Choice,
    Client,
    ClientConfig,
    GenerateResult,
    Grammar,
    InvalidRequestError,
    JsonSchema,
    LoraAdapter,
    NetworkError,
    Regex,
    RequestTimeout,
    ResponseParseError,
    RetryPolicy,
    SamplingParams,
    ServerRefusedError,
    ServerStatusError,
    StreamDelta,
    UnsupportedOperationError,
    available_backends,
)
from backends_core.client import GenerateStream
from backends_core.driver import CAPABILITY_HOOKS, BackendDriver
from backends_core.hookspecs import REQUIRED_HOOKS
from backends_core.images import collapse, image_token_id
from backends_core.multiturn.rendering import encode, render_text
from backends_core.plugins import implemented_hooks, make_plugin_manager
from backends_testkit.emulators import make_emulator
from backends_testkit.engine import ReferenceEngine
from backends_testkit.fakes import fault_transport
from backends_testkit.tinymodel import TinyModels, write_perturbed_weights
from backends_testkit.watch import in_flight_or_ended

__all__ = ["BackendConformance"]

T = TypeVar("T")

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}]
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
#: Tokens of the generation a pause or abort test catches in flight at its first attempt, and at every attempt
#: that catches it with pause("keep") (see "catching a generation in flight" below).
LONG = 1000
#: Tokens of the generations of later attempts that wait to see theirs in flight (prompt + 2000 fits the tiny
#: models' 2048 positions): an attempt whose act landed after the generation ended proves nothing and is repeated
#: with a longer generation.
LONGEST = 2000
#: Attempts at catching a generation in flight before a pause or abort test gives its verdict. Where the server's
#: admin plane lags its engine, an attempt catches its generation about every other time (vLLM's OpenAI completions
#: route on a two-core machine loaded with two more CPU hogs): ten attempts leave about one failure in a thousand.
CATCH_ATTEMPTS = 10
#: Seconds to wait for the server to report nothing in flight before a test starts its generation (what an
#: earlier test abandoned runs to its end first).
IDLE_TIMEOUT_S = 300.0
#: Seconds to wait for the server to report a started generation in flight, unless the generation ends first.
IN_FLIGHT_TIMEOUT_S = 300.0
#: Seconds to wait for a generation to end: a hang guard, not a speed check (a 2000-token generation on a loaded
#: two-core machine takes tens of seconds).
FINISH_TIMEOUT_S = 600.0
#: Seconds a generation caught by ``pause("wait")`` may take to arrive once the pause returned (it ended on the
#: engine before the pause was confirmed); one still running then is held, not drained.
WAIT_ARRIVAL_S = 30.0
#: Seconds a ``pause("keep")`` is held before the generation counts as frozen. A correct server never ends it while
#: paused, however long this is; the window only bounds what a pause that freezes nothing could hide.
FREEZE_WINDOW_S = 0.2
#: Where the server does not report in-flight requests, a started generation gets this long to reach the engine
#: before the act (nothing can be observed; an attempt it misses is repeated like any other).
UNOBSERVED_START_S = 0.3
#: Seconds between two state polls.
POLL_S = 0.005
#: Pauses with mode "keep" an attempt may take to find the server holding its generation, when the server's admin
#: plane lags its engine (a pause that lands before the generation reached the engine holds nothing yet).
KEEP_PULSES = 20
#: Where the suite reads the engine's own token counter (:meth:`BackendConformance.engine_generated_tokens`): seconds
#: without a new token after ``pause("keep")`` returned before the engine counts as stopped.
ENGINE_FROZEN_S = 2.0


async def _drain(stream: GenerateStream) -> GenerateResult:
    """Run a stream to its end; its result."""
    async with stream:
        async for _ in stream:
            pass
    return stream.result


class Attempts:
    """What the attempts of a pause or abort test saw, and the verdict when none of them proved the behaviour.

    Each attempt without proof either says something against the server (the act landed on the generation and
    did not have its effect, or the generation ended while it should have been held) or nothing (it ended before it
    could be caught). Some attempt against the server fails the test; attempts that all said nothing mean the
    server's admin plane lagged every generation, and the test is skipped saying so: on a machine that loaded the
    act cannot be observed (a lagging server that ignores the act is not told from a working one).
    """

    def __init__(self, act: str) -> None:
        self.act = act
        self.seen: list[str] = []
        self.evidence = False

    def inconclusive(self, what: str) -> None:
        self.seen.append(f"{len(self.seen) + 1}: {what}")

    def against(self, what: str) -> None:
        self.inconclusive(what)
        self.evidence = True

    def verdict(self, failure: str) -> NoReturn:
        observed = "; ".join(self.seen)
        if self.evidence:
            raise AssertionError(f"{failure} ({len(self.seen)} tries): {observed}")
        pytest.skip(
            f"{self.act} could not be observed: every generation of {len(self.seen)} tries ended before it was "
            f"caught in flight ({observed}). The server's admin plane lags its generations (vLLM's API server on a "
            "loaded machine answers nothing until it has relayed a generation's outputs)"
        )


class BackendConformance:
    """Abstract suite. Subclasses set :attr:`backend_name`, :attr:`expected_capabilities` and implement
    :meth:`emulator_transport`; the rest is optional."""

    #: The backend's entry-point name.
    backend_name: ClassVar[str]
    #: Optional hooks the backend claims (``teacher_logprobs``, ``admin_pause``...).
    expected_capabilities: ClassVar[set[str] | frozenset[str]] = frozenset()
    #: The backend returns MoE routed experts (checked on the MoE model).
    supports_routed_experts: ClassVar[bool] = False
    #: Register this object as the backend instead of its entry point (in-process backends).
    plugin: ClassVar[object | None] = None
    #: The server reproduces a seeded sample (SGLang on the CPU does not without deterministic inference).
    deterministic_seeds: ClassVar[bool] = True
    #: A live run's MoE server has routed experts enabled (else ``--backend-moe`` says so).
    live_moe: ClassVar[bool] = False
    #: ``ClientConfig.backend_options`` for every client of the suite.
    backend_options: ClassVar[dict[str, Any]] = {}
    #: The engine's token count when the generation being caught started (``None`` where it cannot be read), and
    #: that generation's length.
    _engine_start: int | None = None
    _generation_tokens: int = 0

    def emulator_transport(self, engine: ReferenceEngine) -> httpx.AsyncBaseTransport:
        """An httpx transport serving this backend's wire format over ``engine``: by default the emulator its
        distribution registers (:mod:`backends_testkit.emulators`), with routed experts on MoE engines."""
        return httpx.MockTransport(make_emulator(self.backend_name, engine, routed_experts=engine.is_moe).handle)

    def served_model_name(self, engine: ReferenceEngine) -> str:
        """The model name the emulator serves (sent as ``ClientConfig.model``)."""
        return engine.model_name

    # -- fixtures -------------------------------------------------------------------------------------

    @pytest.fixture
    def live_url(self, request: pytest.FixtureRequest) -> str | None:
        url: str | None = request.config.getoption("--backend-url")
        only: str | None = request.config.getoption("--backend")
        if url and only and only != self.backend_name:
            pytest.skip(f"--backend-url targets backend {only!r}, not {self.backend_name!r}")
        return url

    @pytest.fixture(params=["dense"])
    def model_kind(self, request: pytest.FixtureRequest) -> str:
        return str(request.param)

    @pytest_asyncio.fixture
    async def engine(
        self, tiny_models: TinyModels, model_kind: str, live_url: str | None
    ) -> AsyncIterator[ReferenceEngine]:
        engine = ReferenceEngine(tiny_models.moe if model_kind == "moe" else tiny_models.dense, seed=0)
        try:
            yield engine
        finally:
            await engine.aclose()

    def make_config(
        self, engine: ReferenceEngine, live_url: str | None, request: pytest.FixtureRequest, **overrides: Any
    ) -> ClientConfig:
        model = request.config.getoption("--backend-model") if live_url else None
        fields: dict[str, Any] = {
            "backend": self.backend_name,
            "base_url": live_url or "http://emulator.test",
            "model": model or self.served_model_name(engine),
            "tokenizer": str(engine.model_dir),
            "backend_options": dict(self.backend_options),
            "retry": RetryPolicy(attempts=1),
        }
        fields.update(overrides)
        return ClientConfig(**fields)

    @pytest_asyncio.fixture
    async def client(
        self, engine: ReferenceEngine, live_url: str | None, request: pytest.FixtureRequest
    ) -> AsyncIterator[Client]:
        config = self.make_config(engine, live_url, request)
        transport = None if live_url else self.emulator_transport(engine)
        async with Client(config, transport=transport, plugin=self.plugin) as client:
            yield client

    @pytest.fixture
    def faulty_client(self, engine: ReferenceEngine, request: pytest.FixtureRequest) -> Any:
        def make(kind: str) -> Client:
            config = self.make_config(engine, None, request)
            return Client(config, transport=fault_transport(kind), plugin=self.plugin)

        return make

    async def engine_generated_tokens(self) -> int | None:
        """Tokens the engine behind the live server has generated since it started, from the engine's own counters;
        ``None`` where the suite cannot read them (the default).

        A live subclass implements it where the engine exports such a counter. Then a ``pause("keep")`` counts as
        holding a generation only once that count stopped part-way through it: a front end that relays an answer
        the engine already finished still reports the request in flight, and the generation then ends while the
        server is paused without saying anything against the pause."""
        return None

    def needs(self, *capabilities: str) -> None:
        missing = [c for c in capabilities if c not in self.expected_capabilities]
        if missing:
            pytest.skip(f"{self.backend_name} does not declare {', '.join(missing)}")

    # -- loading and the contract ---------------------------------------------------------------------

    def test_entry_point_is_installed_and_loads(self) -> None:
        if self.plugin is not None:
            pm = make_plugin_manager(self.backend_name, plugin=self.plugin)
        else:
            assert self.backend_name in {b.name for b in available_backends()}
            pm = make_plugin_manager(self.backend_name)
        hooks = implemented_hooks(pm, pm.get_plugin(self.backend_name))
        assert hooks >= REQUIRED_HOOKS

    def test_capabilities_are_as_declared(self) -> None:
        pm = make_plugin_manager(self.backend_name, plugin=self.plugin)
        assert implemented_hooks(pm, pm.get_plugin(self.backend_name)) & CAPABILITY_HOOKS == set(
            self.expected_capabilities
        )

    @pytest.mark.asyncio
    async def test_missing_optional_operations_raise_unsupported(self, client: Client) -> None:
        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "teacher_logprobs": lambda: client.teacher_logprobs(PROMPT),
            "admin_health": client.admin.health,
            "admin_ready": client.admin.ready,
            "admin_pause": lambda: client.admin.pause("abort"),
            "admin_resume": client.admin.resume,
            "admin_flush_cache": client.admin.flush_cache,
            "admin_update_weights": lambda: client.admin.update_weights("/nonexistent"),
            "admin_init_weight_transfer": lambda: client.admin.init_weight_transfer(None),  # type: ignore[arg-type]
            "admin_destroy_weight_transfer": lambda: client.admin.destroy_weight_transfer("g"),
            "admin_update_weights_distributed": lambda: client.admin.update_weights_distributed("g", []),
            "admin_load_lora": lambda: client.admin.load_lora(LoraAdapter(name="x", path="/x")),
            "admin_unload_lora": lambda: client.admin.unload_lora("x"),
            "admin_state": client.admin.state,
            "tokenize_messages": lambda: client.check_tokenizer(MESSAGES),
            "admin_sleep": client.admin.sleep,
            "admin_wake": client.admin.wake,
            "admin_abort": client.admin.abort,
            "post_generate_stream": lambda: _drain(
                client.stream(prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=16))
            ),
        }
        assert set(calls) == CAPABILITY_HOOKS
        for name in sorted(CAPABILITY_HOOKS - set(self.expected_capabilities)):
            with pytest.raises(UnsupportedOperationError) as info:
                await calls[name]()
            assert info.value.operation == name and info.value.backend == self.backend_name

    # -- generation -----------------------------------------------------------------------------------

    @staticmethod
    def check_sample(result: GenerateResult, prompt: list[int] | tuple[int, ...], max_tokens: int) -> None:
        assert list(result.prompt_ids) == list(prompt)
        assert 1 <= len(result.completion_ids) <= max_tokens
        assert result.logprobs.dtype == np.float32
        assert result.logprobs.shape == (len(result.completion_ids),)
        assert np.isfinite(result.logprobs).all() and (result.logprobs <= 0).all()
        assert result.finish_reason in ("stop", "length")
        if result.usage is not None:
            assert result.usage.prompt_tokens == len(prompt)
            assert result.usage.completion_tokens == len(result.completion_ids)

    @pytest.mark.asyncio
    async def test_generate_round_trip_from_ids(self, client: Client) -> None:
        result = await client.generate(prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=8, seed=3))
        self.check_sample(result, PROMPT, 8)

    @pytest.mark.asyncio
    async def test_generate_round_trip_from_messages(self, client: Client) -> None:
        result = await client.generate(messages=MESSAGES, sampling=SamplingParams(max_tokens=6, seed=1))
        self.check_sample(result, client.render(MESSAGES), 6)

    @pytest.mark.asyncio
    async def test_same_seed_same_tokens(self, client: Client) -> None:
        if not self.deterministic_seeds:
            pytest.skip(f"{self.backend_name}: seeded sampling is not reproducible on this server")
        sampling = SamplingParams(max_tokens=8, seed=11, temperature=1.0)
        a = await client.generate(prompt_ids=PROMPT, sampling=sampling)
        b = await client.generate(prompt_ids=PROMPT, sampling=sampling)
        assert a.completion_ids == b.completion_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)

    @pytest.mark.asyncio
    async def test_max_tokens_and_ignore_eos_give_length(self, client: Client) -> None:
        result = await client.generate(
            prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=5, ignore_eos=True, seed=0)
        )
        assert len(result.completion_ids) == 5 and result.finish_reason == "length"

    @pytest.mark.asyncio
    async def test_greedy_is_the_argmax_of_top_logprobs(self, client: Client) -> None:
        result = await client.generate(
            prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=4, temperature=0.0, top_logprobs=3)
        )
        assert result.top_logprobs is not None and len(result.top_logprobs) == len(result.completion_ids)
        for token, lp, row in zip(result.completion_ids, result.logprobs, result.top_logprobs, strict=True):
            assert len(row) == 3
            assert [a.logprob for a in row] == sorted((a.logprob for a in row), reverse=True)
            assert row[0].token_id == token
            assert abs(row[0].logprob - float(lp)) < 1e-4

    @pytest.mark.asyncio
    async def test_n_samples_come_back_one_result_each(self, client: Client) -> None:
        results = await client.generate_samples(prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=4, n=3, seed=5))
        assert len(results) == 3
        for r in results:
            self.check_sample(r, PROMPT, 4)

    # -- teacher --------------------------------------------------------------------------------------

    @pytest.mark.asyncio
    async def test_teacher_logprobs_equal_generation_logprobs(self, client: Client) -> None:
        self.needs("teacher_logprobs")
        sampled = await client.generate(
            prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=8, temperature=1.0, top_p=1.0, top_k=-1, seed=2)
        )
        teacher = await client.teacher_logprobs(sampled.token_ids)
        assert teacher.logprobs.dtype == np.float32 and teacher.logprobs.shape == (len(sampled.token_ids),)
        assert np.isnan(teacher.logprobs[0]) and np.isfinite(teacher.logprobs[1:]).all()
        np.testing.assert_allclose(teacher.logprobs[len(PROMPT) :], sampled.logprobs, atol=1e-4)

    @pytest.mark.asyncio
    async def test_teacher_top_logprobs(self, client: Client) -> None:
        self.needs("teacher_logprobs")
        teacher = await client.teacher_logprobs(PROMPT, top_logprobs=2)
        assert teacher.top_logprobs is not None and len(teacher.top_logprobs) == len(PROMPT)
        assert teacher.top_logprobs[0] == ()
        for row, lp in zip(teacher.top_logprobs[1:], teacher.logprobs[1:], strict=True):
            assert len(row) == 2
            assert row[0].logprob >= row[1].logprob
            assert float(lp) <= row[0].logprob + 1e-4  # the most likely token bounds the actual one

    # -- routed experts -------------------------------------------------------------------------------

    @pytest.mark.asyncio
    @pytest.mark.parametrize("model_kind", ["moe"], indirect=True)
    async def test_routed_experts_cover_every_routed_token(
        self, client: Client, engine: ReferenceEngine, request: pytest.FixtureRequest, live_url: str | None
    ) -> None:
        if not self.supports_routed_experts:
            pytest.skip(f"{self.backend_name} does not return routed experts")
        if live_url and not (self.live_moe or request.config.getoption("--backend-moe", default=False)):
            pytest.skip("live server: pass --backend-moe when it serves a MoE model with routing enabled")
        sampling = SamplingParams(max_tokens=6, ignore_eos=True, seed=4)
        full = await client.generate(prompt_ids=PROMPT, sampling=sampling, return_routed_experts=True)
        assert full.routed_experts is not None
        experts = full.routed_experts.experts
        assert experts.shape == (len(full.token_ids) - 1, engine.num_layers, engine.top_k)
        assert full.routed_experts.start == 0
        assert (experts >= 0).all()
        start = len(PROMPT) - 2
        delta = await client.generate(
            prompt_ids=PROMPT, sampling=sampling, return_routed_experts=True, routed_experts_start=start
        )
        assert delta.routed_experts is not None and delta.routed_experts.start == start
        assert delta.routed_experts.experts.shape[0] == len(delta.token_ids) - 1 - start
        np.testing.assert_array_equal(delta.routed_experts.experts[:2], experts[start : start + 2])

    # -- failures -------------------------------------------------------------------------------------

    @pytest.mark.asyncio
    @pytest.mark.parametrize(
        ("fault", "error"),
        [
            ("malformed", ResponseParseError),
            ("not_json", ResponseParseError),
            ("status_500", ServerStatusError),
            ("timeout", RequestTimeout),
            ("refused", NetworkError),
        ],
    )
    async def test_failures_map_to_typed_errors(self, faulty_client: Any, fault: str, error: type[Exception]) -> None:
        async with faulty_client(fault) as client:
            with pytest.raises(error) as info:
                await client.generate(prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=2))
            if fault == "status_500":
                assert "engine exploded" in str(info.value)
            if "teacher_logprobs" in self.expected_capabilities:
                with pytest.raises(error):
                    await client.teacher_logprobs(PROMPT)
            if "admin_health" in self.expected_capabilities and fault in ("status_500", "timeout", "refused"):
                with pytest.raises(AdminError) as admin_info:
                    await client.admin.health()
                assert isinstance(admin_info.value.results[0].error, error)

    # -- admin ----------------------------------------------------------------------------------------

    @pytest.mark.asyncio
    async def test_health_ready_and_state(self, client: Client) -> None:
        self.needs("admin_health")
        assert await client.admin.health() == [True]
        if "admin_ready" in self.expected_capabilities:
            assert await client.admin.ready() == [True]
        if "admin_state" in self.expected_capabilities:
            (state,) = await client.admin.state()
            assert state.paused in (False, None)

    # -- catching a generation in flight --------------------------------------------------------------
    #
    # Every pause and abort test needs a generation in flight on the engine when its act lands, and no client can
    # order the two: the act travels through the server's admin plane, which a loaded machine can delay past the
    # generation's last token. An attempt first waits (with a deadline) until the server shows the generation in
    # flight and then acts. When the server's state showed nothing before the generation ended, its admin plane
    # lags its engine (vLLM's API server under CPU load answers nothing until it has relayed a generation's
    # outputs), and later attempts catch the generation with pause("keep") instead: paused right after it starts,
    # and resumed and paused again until the server holds it, the generation produces no outputs the admin plane
    # could fall behind on. The act then lands on the held generation (the wait test resumes it first). Caught that
    # way, a generation counts as held when the server still reports requests in flight after the pause: vLLM counts
    # only requests its engine stepped (none steps while paused with "keep"), so it was running; a server that also
    # counts requests queued behind the pause gives the keep test a weaker proof there.
    #
    # Each attempt gives proof of the behaviour, a clear failure, or nothing (the generation ended before the act
    # could tell anything), and an attempt that gives nothing is repeated with a longer generation, up to
    # CATCH_ATTEMPTS times. A server that ignores the act leaves every attempt without proof and fails with what
    # each attempt saw.

    @staticmethod
    def catch_tokens(attempt: int, hold: bool = False) -> int:
        """Tokens of the generation of catch attempt ``attempt`` (1-based), caught with pause("keep") or not."""
        return LONG if attempt == 1 or hold else max(LONG, LONGEST)

    def _observes_in_flight(self) -> bool:
        return "admin_state" in self.expected_capabilities

    async def _wait_idle(self, client: Client) -> None:
        """Return once the server reports no request in flight (at once where it does not report them)."""
        if not self._observes_in_flight():
            return
        deadline = asyncio.timeout(IDLE_TIMEOUT_S)
        state = None
        try:
            async with deadline:
                while True:
                    (state,) = await client.admin.state()
                    if not state.in_flight:
                        return
                    await asyncio.sleep(POLL_S)
        except TimeoutError:
            if not deadline.expired():
                raise
            raise AssertionError(
                f"the server still reports requests in flight {IDLE_TIMEOUT_S:.0f} s after the test began waiting "
                f"for it to be idle (last state: {state}): something left a generation running or the count is stuck"
            ) from None

    async def _in_flight_or_ended(self, client: Client, task: asyncio.Task[GenerateResult]) -> bool:
        """Wait until the server reports a request in flight (``True``) or the generation ends first (``False``).

        A state poll still unanswered when the generation ends is abandoned: a lagging admin plane may answer only
        after the whole generation."""
        if not self._observes_in_flight():
            done, _ = await asyncio.wait({task}, timeout=UNOBSERVED_START_S)
            return not done
        try:
            seen = await in_flight_or_ended(client, task, within=IN_FLIGHT_TIMEOUT_S, poll_s=POLL_S)
        except TimeoutError:
            raise AssertionError(
                f"the server did not report the generation in flight within {IN_FLIGHT_TIMEOUT_S:.0f} s although it "
                "had not ended"
            ) from None
        if seen is None:  # this server does not count them after all
            done, _ = await asyncio.wait({task}, timeout=UNOBSERVED_START_S)
            return not done
        return seen

    async def _held(self, client: Client, task: asyncio.Task[GenerateResult]) -> bool | None:
        """Right after ``pause("keep")`` returned: ``True`` when the server holds the generation, ``False`` when it
        does not although the generation was in flight, ``None`` when the pause proves nothing about it.

        The server must report itself paused. Where the suite reads the engine's token counter, the generation is
        held once the count stopped part-way through it (``None`` when the engine had made none of its tokens or
        all of them: the pause landed before it started or after it ended on the engine); elsewhere it is held
        while it has not ended (nor, where the server counts them, left its requests in flight)."""
        if self._observes_in_flight():
            (state,) = await client.admin.state()
            assert state.paused is True, f"the server does not report the pause('keep') it confirmed: {state}"
            if state.in_flight == 0 and self._engine_start is None:
                return False
        if self._engine_start is not None:
            made = await self._engine_settled() - self._engine_start
            if not 0 < made < self._generation_tokens:
                return None
        return not task.done()

    async def _engine_settled(self) -> int:
        """The engine's token count once it made no token for :data:`ENGINE_FROZEN_S` (within
        :data:`FINISH_TIMEOUT_S`: a paused engine stops at once, a running generation ends)."""
        last, since = await self.engine_generated_tokens(), time.monotonic()
        deadline = since + FINISH_TIMEOUT_S
        while time.monotonic() - since < ENGINE_FROZEN_S:
            assert time.monotonic() < deadline, f"the engine kept generating for {FINISH_TIMEOUT_S:.0f} s while paused"
            await asyncio.sleep(POLL_S * 10)
            count = await self.engine_generated_tokens()
            if count != last:
                last, since = count, time.monotonic()
        assert last is not None
        return last

    async def _hold_with_keep(self, client: Client, task: asyncio.Task[GenerateResult]) -> bool:
        """Pause with mode "keep" until the server holds the generation (``True``, the server left paused) or the
        generation has ended (``False``, the server resumed). A pause that lands before the generation reached the
        engine holds nothing yet: resumed and paused again, at most :data:`KEEP_PULSES` times."""
        for _ in range(KEEP_PULSES):
            await client.admin.pause("keep")
            try:
                if await self._held(client, task):
                    return True
            except BaseException:
                await client.admin.resume()
                raise
            await client.admin.resume()
            if task.done():
                return False
        return False

    async def _catch(
        self, client: Client, tokens: int, *, request_id: str | None = None, hold: bool = False
    ) -> tuple[asyncio.Task[GenerateResult], str]:
        """From an idle server, start a ``tokens``-token generation and catch it in flight. Returns its task and
        how it was caught: ``"running"`` (the server showed it in flight before it ended), ``"held"`` (``hold``:
        held by ``pause("keep")``, the server left paused; see above), or ``"missed"`` (it ended first)."""
        await self._wait_idle(client)
        self._engine_start, self._generation_tokens = await self.engine_generated_tokens(), tokens
        sampling = SamplingParams(max_tokens=tokens, ignore_eos=True, seed=9)
        task = asyncio.create_task(client.generate(prompt_ids=PROMPT, sampling=sampling, request_id=request_id))
        try:
            if hold:
                return task, "held" if await self._hold_with_keep(client, task) else "missed"
            return task, "running" if await self._in_flight_or_ended(client, task) else "missed"
        except BaseException:
            task.cancel()
            raise

    @staticmethod
    async def _result(task: asyncio.Task[GenerateResult], what: str) -> GenerateResult:
        """The generation's result, or an AssertionError naming ``what`` after :data:`FINISH_TIMEOUT_S`."""
        done, _ = await asyncio.wait({task}, timeout=FINISH_TIMEOUT_S)
        if not done:
            task.cancel()
            raise AssertionError(f"{what} did not end within {FINISH_TIMEOUT_S:.0f} s")
        return task.result()

    @staticmethod
    def _ran_to_the_end(result: GenerateResult, tokens: int) -> bool:
        return result.finish_reason == "length" and len(result.completion_ids) == tokens

    @staticmethod
    def _missed(hold: bool) -> str:
        return "ended " + ("before a pause('keep') held it" if hold else "before the server showed it in flight")

    async def _catch_in_flight(
        self,
        client: Client,
        what: str,
        act: Callable[[asyncio.Task[GenerateResult], str | None], Awaitable[T]],
        *,
        request_id: str | None = None,
    ) -> tuple[GenerateResult, T, int]:
        """Run ``act()`` while a generation is in flight (running, or held by ``pause("keep")``: resumed after the
        act); return the generation's result, what ``act`` returned and the generation's length.

        An attempt whose generation ended before it was caught, or still ran to its full length, is repeated (see
        above). An act that the server really ignores leaves every attempt at full length: an AssertionError after
        the last (see :class:`Attempts`).
        """
        attempts = Attempts(what)
        hold = False
        for attempt in range(1, CATCH_ATTEMPTS + 1):
            tokens = self.catch_tokens(attempt, hold)
            rid = None if request_id is None else f"{request_id}-{attempt}"
            generation = f"the {tokens}-token generation of attempt {attempt}"
            task, caught = await self._catch(client, tokens, request_id=rid, hold=hold)
            try:
                if caught == "missed":
                    await self._result(task, generation)
                    attempts.inconclusive(self._missed(hold))
                    hold = True
                    continue
                try:
                    acted = await act(task, rid)
                finally:
                    if caught == "held":
                        await client.admin.resume()
                result = await self._result(task, generation)
            finally:
                task.cancel()
            if not self._ran_to_the_end(result, tokens):
                return result, acted, tokens
            attempts.against(f"ran to its full {tokens} tokens after {what} reached the {caught} generation")
            hold = True  # the act may have been delayed past the end: act on a held generation from now on
        attempts.verdict(f"{what} never ended a generation in flight")

    @pytest.mark.asyncio
    async def test_pause_abort_ends_in_flight_requests(self, client: Client) -> None:
        self.needs("admin_pause", "admin_resume")

        async def pause_abort(task: asyncio.Task[GenerateResult], rid: str | None) -> None:
            try:
                await client.admin.pause("abort")
            finally:
                await client.admin.resume()

        result, _, tokens = await self._catch_in_flight(client, "pause('abort')", pause_abort)
        assert result.finish_reason == "abort", f"pause('abort') ended the generation with {result.finish_reason!r}"
        assert len(result.completion_ids) < tokens
        assert len(result.logprobs) == len(result.completion_ids)

    @pytest.mark.asyncio
    async def test_pause_wait_lets_in_flight_requests_finish(self, client: Client) -> None:
        """``pause("wait")`` returns once the generation in flight has ended, at its full length, and the server
        stays paused: the generation arrives without a resume."""
        self.needs("admin_pause", "admin_resume")
        attempts = Attempts("pause('wait')")
        hold = False
        for attempt in range(1, CATCH_ATTEMPTS + 1):
            tokens = self.catch_tokens(attempt, hold)
            what = f"the {tokens}-token generation of attempt {attempt}"
            task, caught = await self._catch(client, tokens, hold=hold)
            try:
                if caught == "held":  # let it run again: the pause must find it running
                    await client.admin.resume()
                if caught == "missed" or task.done():
                    await self._result(task, what)
                    attempts.inconclusive(self._missed(hold) if caught == "missed" else "ended before the pause")
                    hold = hold or caught == "missed"
                    continue
                await client.admin.pause("wait")
                try:
                    done, _ = await asyncio.wait({task}, timeout=WAIT_ARRIVAL_S)
                    if done:
                        result = task.result()
                        assert self._ran_to_the_end(result, tokens), (
                            f"pause('wait') did not let the generation finish: {result.finish_reason!r} after "
                            f"{len(result.completion_ids)} of {tokens} tokens"
                        )
                        await self._wait_drained_while_paused(client)
                        return
                finally:
                    await client.admin.resume()
                # held while paused: frozen instead of drained, or it reached the engine only after the pause
                result = await self._result(task, what)
                assert self._ran_to_the_end(result, tokens), (
                    f"the generation held by pause('wait') ended with {result.finish_reason!r} after "
                    f"{len(result.completion_ids)} of {tokens} tokens once resumed"
                )
                attempts.against(f"still running {WAIT_ARRIVAL_S:.0f} s after pause('wait') returned")
            finally:
                task.cancel()
        attempts.verdict("pause('wait') never let a generation in flight finish while paused")

    async def _wait_drained_while_paused(self, client: Client) -> None:
        """After a ``pause("wait")`` whose generation arrived: the server reports itself paused and, within
        :data:`IDLE_TIMEOUT_S`, nothing in flight (a front end's count may lag the answer it relays)."""
        if not self._observes_in_flight():
            return
        (state,) = await client.admin.state()
        assert state.paused is True, f"the server does not report the pause('wait') it confirmed: {state}"
        await self._wait_idle(client)

    @pytest.mark.asyncio
    async def test_pause_keep_freezes_and_resume_continues(self, client: Client) -> None:
        """``pause("keep")`` returns with the generation in flight still held (it does not end while paused), and
        after ``resume()`` it runs to its full length."""
        self.needs("admin_pause", "admin_resume")
        attempts = Attempts("pause('keep')")
        hold = False
        for attempt in range(1, CATCH_ATTEMPTS + 1):
            tokens = self.catch_tokens(attempt, hold)
            what = f"the {tokens}-token generation of attempt {attempt}"
            task, caught = await self._catch(client, tokens, hold=hold)
            frozen = False
            try:
                if caught == "missed":
                    attempts.inconclusive(self._missed(hold))
                    hold = True
                else:
                    try:
                        if caught == "running":
                            await client.admin.pause("keep")
                        held = True if caught == "held" else await self._held(client, task)
                        if held:
                            done, _ = await asyncio.wait({task}, timeout=FREEZE_WINDOW_S)
                            frozen = not done
                    finally:
                        await client.admin.resume()
                    if held is None:
                        attempts.inconclusive("the engine had made none or all of its tokens when the pause held")
                        hold = True
                    elif not frozen:
                        attempts.against("ended while paused" if held else "ended before the pause returned")
                result = await self._result(task, what)
            finally:
                task.cancel()
            assert self._ran_to_the_end(result, tokens), (
                f"pause('keep') and resume() cut the generation short: {result.finish_reason!r} after "
                f"{len(result.completion_ids)} of {tokens} tokens"
            )
            if frozen:
                return
        attempts.verdict("no generation stayed frozen while the server was paused with mode 'keep'")

    @pytest.mark.asyncio
    async def test_update_weights_changes_logprobs_and_reloading_restores_them(
        self, client: Client, engine: ReferenceEngine, tmp_path: Path, live_url: str | None
    ) -> None:
        self.needs("admin_update_weights")
        sampling = SamplingParams(max_tokens=4, temperature=0.0)
        flush = "admin_flush_cache" in self.expected_capabilities
        original = None
        if "admin_state" in self.expected_capabilities:
            (state,) = await client.admin.state()
            original = state.weight_version
        before = await client.generate(prompt_ids=PROMPT, sampling=sampling)
        new_weights = write_perturbed_weights(engine.model_dir, tmp_path / "step-1", seed=1, scale=0.5)
        try:
            await client.admin.update_weights(str(new_weights), version="step-1")
            if flush:
                await client.admin.flush_cache()
            changed = await client.generate(prompt_ids=PROMPT, sampling=sampling)
            assert changed.weight_version in ("step-1", None)
            assert changed.completion_ids != before.completion_ids or not np.allclose(
                changed.logprobs, before.logprobs, atol=1e-3
            )
            if "admin_state" in self.expected_capabilities:
                (state,) = await client.admin.state()
                assert state.weight_version == "step-1"
        finally:  # the same server serves the next tests: put the original weights (and version) back
            await client.admin.update_weights(str(engine.model_dir), version=original or "base")
            if flush:
                await client.admin.flush_cache()
        restored = await client.generate(prompt_ids=PROMPT, sampling=sampling)
        assert restored.completion_ids == before.completion_ids
        np.testing.assert_allclose(restored.logprobs, before.logprobs, atol=1e-5)

    @pytest.mark.asyncio
    async def test_flush_cache_is_confirmed(self, client: Client) -> None:
        self.needs("admin_flush_cache")
        await client.generate(prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=2))
        assert await client.admin.flush_cache() == [True]

    @pytest.mark.asyncio
    async def test_lora_load_use_hot_swap_and_unload(self, client: Client, tiny_models: TinyModels) -> None:
        self.needs("admin_load_lora", "admin_unload_lora")
        sampling = SamplingParams(max_tokens=4, temperature=0.0, top_logprobs=1)
        base = await client.generate(prompt_ids=PROMPT, sampling=sampling)
        await client.admin.load_lora(LoraAdapter(name="tiny", path=str(tiny_models.lora)))
        loaded = True
        try:
            tuned = await client.generate(prompt_ids=PROMPT, sampling=sampling, lora="tiny")
            assert tuned.completion_ids != base.completion_ids or not np.allclose(
                tuned.logprobs, base.logprobs, atol=1e-4
            )
            with pytest.raises(AdminError) as duplicate:  # a duplicate name without replace is refused
                await client.admin.load_lora(LoraAdapter(name="tiny", path=str(tiny_models.lora)))
            # refused with an error status, or with a 2xx whose body says it did not happen (Dynamo)
            assert isinstance(duplicate.value.results[0].error, ServerStatusError | ServerRefusedError)
            await client.admin.load_lora(LoraAdapter(name="tiny", path=str(tiny_models.lora), replace=True))
            if "admin_state" in self.expected_capabilities:
                (state,) = await client.admin.state()
                assert state.loras is None or "tiny" in state.loras
            await client.admin.unload_lora("tiny")
            loaded = False
        finally:
            if loaded:  # a check above failed: the next tests on this server must not find the adapter
                with contextlib.suppress(Exception):
                    await client.admin.unload_lora("tiny")
        with pytest.raises((ServerStatusError, InvalidRequestError)):  # refused by the server or by a pre-flight
            await client.generate(prompt_ids=PROMPT, sampling=sampling, lora="tiny")

    @pytest.mark.asyncio
    async def test_sleep_and_wake(self, client: Client) -> None:
        self.needs("admin_sleep", "admin_wake")
        await client.admin.sleep(1)
        try:
            if "admin_state" in self.expected_capabilities:
                (state,) = await client.admin.state()
                assert state.sleeping in (True, None)
        finally:
            await client.admin.wake()
        result = await client.generate(prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=2))
        assert len(result.completion_ids) >= 1

    @pytest.mark.asyncio
    async def test_abort_by_request_id(self, client: Client) -> None:
        self.needs("admin_abort")

        async def abort(task: asyncio.Task[GenerateResult], rid: str | None) -> list[int]:
            assert rid is not None
            return await client.admin.abort([rid])

        result, counts, _ = await self._catch_in_flight(
            client, "abort(request_ids)", abort, request_id="conformance-abort"
        )
        assert result.finish_reason == "abort" and counts[0] in (1, -1)

    # -- parse_completion: completions parsed back into assistant messages ---------------------
    # Parsing is the core's (the client's tokenizer and parsers), so every backend passes it once its completions
    # are exact; these checks hold a backend's completions to the round trip an agent loop relies on.

    @contextlib.asynccontextmanager
    async def _parsing_client(
        self, engine: ReferenceEngine, live_url: str | None, request: pytest.FixtureRequest
    ) -> AsyncIterator[Client]:
        config = self.make_config(engine, live_url, request, tool_parser="hermes", reasoning_parser="qwen3")
        transport = None if live_url else self.emulator_transport(engine)
        async with Client(config, transport=transport, plugin=self.plugin) as client:
            yield client

    @pytest.mark.asyncio
    async def test_parse_completion_returns_an_assistant_message(
        self, engine: ReferenceEngine, live_url: str | None, request: pytest.FixtureRequest
    ) -> None:
        async with self._parsing_client(engine, live_url, request) as client:
            result = await client.generate(messages=MESSAGES, sampling=SamplingParams(max_tokens=12, seed=1))
            message = client.parse_completion(result)
        assert set(message) == {"role", "content", "reasoning_content", "tool_calls"}
        assert message["role"] == "assistant" and isinstance(message["content"], str)
        assert message["reasoning_content"] is None or isinstance(message["reasoning_content"], str)
        for call in message["tool_calls"] or ():
            assert call["type"] == "function" and isinstance(call["id"], str) and call["id"]
            assert isinstance(call["function"]["name"], str)
            assert isinstance(json.loads(call["function"]["arguments"]), dict)

    @pytest.mark.asyncio
    @pytest.mark.parametrize("seed", [1, 6])
    async def test_parsed_completion_renders_back_to_the_sampled_ids(
        self, engine: ReferenceEngine, live_url: str | None, request: pytest.FixtureRequest, seed: int
    ) -> None:
        kwargs = {"enable_thinking": False}  # the prompt closes the think block: the reply is what follows it
        async with self._parsing_client(engine, live_url, request) as client:
            result = await client.generate(
                messages=MESSAGES,
                sampling=SamplingParams(max_tokens=6, seed=seed, temperature=1.0),
                chat_template_kwargs=kwargs,
            )
            message = client.parse_completion(result)
            tok = client.tokenizer
            # the sample without the stop token that ended it (the template writes its own end of turn there)
            body = list(result.completion_ids[:-1] if result.finish_reason == "stop" else result.completion_ids)
            sampled = tok.decode(body, skip_special_tokens=False)
            if "<think>" in sampled or "</think>" in sampled:
                pytest.skip(
                    f"seed {seed}: the sample holds think markup after a closed think block, which the template "
                    "cannot produce"
                )
            text = render_text(tok, [*MESSAGES, message], add_generation_prompt=False, chat_template_kwargs=kwargs)
        expected = tok.decode(list(result.prompt_ids), skip_special_tokens=False) + sampled
        assert text == expected + "<|im_end|>\n"  # the same text, closed by the template's end of turn
        # where the tokenizer writes that text as the sampled ids (on the emulator these seeds' samples are such), the
        # re-render is the sampled ids; a sample that splits a character or a word otherwise can only match as text
        canonical = encode(tok, expected) == [*result.prompt_ids, *body]
        assert canonical or live_url is not None
        if canonical:
            assert encode(tok, text)[: len(result.prompt_ids) + len(body)] == [*result.prompt_ids, *body]

    # -- SyncClient -----------------------------------------------------------------------------------

    def test_sync_client_from_plain_code_and_from_threads(
        self, engine: ReferenceEngine, live_url: str | None, request: pytest.FixtureRequest
    ) -> None:
        """The blocking client over this backend: two calls in a row from plain code (where a second
        ``asyncio.run`` of an async client's call fails), calls from four threads at once, teacher scores and an
        admin call where the backend has them, and every call refused once it is closed."""
        # imported here, to keep this section in one piece
        from concurrent.futures import ThreadPoolExecutor

        from backends_core import ClientClosedError, SyncClient

        config = self.make_config(engine, live_url, request)
        transport = None if live_url else self.emulator_transport(engine)
        with SyncClient(config, transport=transport, plugin=self.plugin) as client:
            for _ in range(2):
                first = client.generate(prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=4, seed=5))
                self.check_sample(first, PROMPT, 4)

            def sample(seed: int) -> GenerateResult:
                return client.generate(prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=3, seed=seed))

            with ThreadPoolExecutor(4) as pool:
                for result in pool.map(sample, range(4)):
                    self.check_sample(result, PROMPT, 3)
            if "teacher_logprobs" in self.expected_capabilities:
                teacher = client.teacher_logprobs(first.token_ids)
                assert teacher.logprobs.shape == (len(first.token_ids),)
            if "admin_health" in self.expected_capabilities:
                assert client.admin.health() == [True]
        with pytest.raises(ClientClosedError):
            client.generate(prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=1))

    # -- open sampling: stop strings, logit bias, refusals before sending, extra fields --
    # A backend declares the optional sampling features its engine honours with the ``sampling_features``
    # hook; subclasses list them in ``expected_sampling_features``. Every feature it does not declare must
    # raise ``UnsupportedOperationError`` before anything is sent.

    #: The optional sampling features the backend declares (``sampling_features`` hook).
    expected_sampling_features: ClassVar[frozenset[str]] = frozenset()

    def needs_sampling(self, *features: str) -> None:
        missing = [f for f in features if f not in self.expected_sampling_features]
        if missing:
            pytest.skip(f"{self.backend_name} does not declare sampling {', '.join(missing)}")

    @pytest_asyncio.fixture
    async def counted_client(
        self, engine: ReferenceEngine, live_url: str | None, request: pytest.FixtureRequest
    ) -> AsyncIterator[tuple[Client, list[httpx.Request]]]:
        """A client and the requests that reached the emulator (always empty against a live server: only the
        error is checked there)."""
        sent: list[httpx.Request] = []
        config = self.make_config(engine, live_url, request)
        transport = None if live_url else _Counting(self.emulator_transport(engine), sent)
        async with Client(config, transport=transport, plugin=self.plugin) as client:
            yield client, sent

    def test_sampling_features_are_as_declared(self) -> None:
        config = ClientConfig(
            backend=self.backend_name, base_url="http://emulator.test", backend_options=dict(self.backend_options)
        )
        assert BackendDriver(config, plugin=self.plugin).sampling_features == self.expected_sampling_features

    @pytest.mark.asyncio
    async def test_undeclared_sampling_features_raise_before_sending(
        self, counted_client: tuple[Client, list[httpx.Request]]
    ) -> None:
        client, sent = counted_client
        samples = {
            "stop": SamplingParams(max_tokens=16, stop=["x"]),
            "logit_bias": SamplingParams(max_tokens=16, logit_bias={1: 1.0}),
            "extra": SamplingParams(max_tokens=16, extra={"skip_special_tokens": True}),
            "structured.json_schema": SamplingParams(max_tokens=16, structured=JsonSchema({"type": "object"})),
            "structured.regex": SamplingParams(max_tokens=16, structured=Regex("[0-9]+")),
            "structured.choice": SamplingParams(max_tokens=16, structured=Choice(["yes", "no"])),
            "structured.grammar": SamplingParams(max_tokens=16, structured=Grammar('root ::= "a"')),
        }
        assert set(samples) == SAMPLING_FEATURES
        for feature in sorted(SAMPLING_FEATURES - self.expected_sampling_features):
            with pytest.raises(UnsupportedOperationError) as info:
                await client.generate(prompt_ids=PROMPT, sampling=samples[feature])
            assert info.value.operation == f"sampling.{feature}"
        assert sent == []

    @pytest.mark.asyncio
    async def test_extra_with_an_unknown_or_modelled_key_raises_before_sending(
        self, counted_client: tuple[Client, list[httpx.Request]]
    ) -> None:
        self.needs_sampling("extra")
        client, sent = counted_client
        with pytest.raises(InvalidRequestError, match="no_such_engine_field"):
            await client.generate(
                prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=16, extra={"no_such_engine_field": 1})
            )
        with pytest.raises(InvalidRequestError, match="max_tokens"):
            SamplingParams(max_tokens=16, extra={"max_tokens": 3})
        assert sent == []

    @pytest.mark.asyncio
    async def test_stop_string_ends_generation_at_the_string(self, client: Client) -> None:
        self.needs_sampling("stop")
        # without ignore_eos, which Dynamo 1.6.1 lets override stop strings
        greedy = SamplingParams(max_tokens=16, temperature=0.0)
        free = await client.generate(prompt_ids=PROMPT, sampling=greedy)
        found = _first_new_text(client.tokenizer, free.completion_ids)
        if found is None:
            pytest.skip("the greedy completion has no token that adds new printable text to stop on")
        k, stop = found
        result = await client.generate(prompt_ids=PROMPT, sampling=attrs.evolve(greedy, stop=[stop]))
        # the token that completes the string ends the completion, and stays in it
        assert result.completion_ids == free.completion_ids[:k]
        assert result.finish_reason == "stop" and result.stop_reason == stop
        np.testing.assert_allclose(result.logprobs, free.logprobs[:k], atol=1e-4)

    @pytest.mark.asyncio
    async def test_logit_bias_steers_sampling(self, client: Client) -> None:
        self.needs_sampling("logit_bias")
        favoured = 100
        result = await client.generate(
            prompt_ids=PROMPT,
            sampling=SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logit_bias={favoured: 100.0}),
        )
        assert result.completion_ids == (favoured,) * 3

    # -- streaming --------------------------------------------------------------------------------------
    #
    # ``Client.stream`` over the backend's ``post_generate_stream`` (capability ``post_generate_stream``): the deltas
    # together are the result, the result is what generate returns, a stream left early is aborted on the server,
    # and a failure before the first delta is the error generate raises.

    @pytest.mark.asyncio
    async def test_stream_deltas_make_up_the_result_generate_returns(self, client: Client) -> None:
        self.needs("post_generate_stream")
        sampling = SamplingParams(max_tokens=12, temperature=0.0, seed=5, ignore_eos=True)
        whole = await client.generate(prompt_ids=PROMPT, sampling=sampling)
        async with client.stream(prompt_ids=PROMPT, sampling=sampling) as stream:
            deltas = [delta async for delta in stream]
        result = stream.result
        assert deltas and all(isinstance(d, StreamDelta) and d.completion_ids for d in deltas)
        for delta in deltas:
            assert delta.logprobs.dtype == np.float32 and delta.logprobs.shape == (len(delta.completion_ids),)
            assert np.isfinite(delta.logprobs).all()
        assert sum((d.completion_ids for d in deltas), ()) == result.completion_ids
        np.testing.assert_array_equal(np.concatenate([d.logprobs for d in deltas]), result.logprobs)
        self.check_sample(result, PROMPT, 12)
        assert result.completion_ids == whole.completion_ids
        np.testing.assert_allclose(result.logprobs, whole.logprobs, atol=1e-4)
        assert (result.finish_reason, result.stop_reason) == (whole.finish_reason, whole.stop_reason)
        assert result.weight_version == whole.weight_version
        assert result.usage is not None and whole.usage is not None
        assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (
            whole.usage.prompt_tokens,
            whole.usage.completion_tokens,
        )

    @pytest.mark.asyncio
    async def test_stream_from_messages_and_its_result_needs_the_whole_loop(self, client: Client) -> None:
        self.needs("post_generate_stream")
        async with client.stream(messages=MESSAGES, sampling=SamplingParams(max_tokens=6, seed=1)) as stream:
            with pytest.raises(InvalidRequestError, match="no result"):
                stream.result  # noqa: B018
            ids = [t async for delta in stream for t in delta.completion_ids]
        self.check_sample(stream.result, client.render(MESSAGES), 6)
        assert tuple(ids) == stream.result.completion_ids

    @pytest.mark.asyncio
    @pytest.mark.parametrize("model_kind", ["moe"], indirect=True)
    async def test_stream_routed_experts_arrive_with_the_result(
        self, client: Client, request: pytest.FixtureRequest, live_url: str | None
    ) -> None:
        self.needs("post_generate_stream")
        if not self.supports_routed_experts:
            pytest.skip(f"{self.backend_name} does not return routed experts")
        if live_url and not (self.live_moe or request.config.getoption("--backend-moe", default=False)):
            pytest.skip("this live server has no routed experts")
        sampling = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        try:
            stream = client.stream(prompt_ids=PROMPT, sampling=sampling, return_routed_experts=True)
        except InvalidRequestError as exc:  # a transport whose streamed form carries no routing says so
            pytest.skip(str(exc))
        try:
            async with stream:
                async for _ in stream:
                    pass
        except InvalidRequestError as exc:
            pytest.skip(str(exc))
        whole = await client.generate(prompt_ids=PROMPT, sampling=sampling, return_routed_experts=True)
        routed = stream.result.routed_experts
        assert routed is not None and whole.routed_experts is not None
        assert routed.start == whole.routed_experts.start
        np.testing.assert_array_equal(routed.experts, whole.routed_experts.experts)

    @pytest.mark.asyncio
    async def test_leaving_a_stream_early_aborts_it_on_the_server(self, client: Client) -> None:
        """The stream of a LONGEST-token generation is left after its first delta, and a CLOCK-token generation sent
        after it is the clock: had the left one run on, it would still have most of its tokens to go when the
        clock's generation ends, so the server reporting nothing in flight then proves the abort. A count still
        above 0 after a second clock generation is evidence against (no count lags two generations); one that
        reaches 0 only then says nothing (a lagging count), and the attempt is repeated (see Attempts)."""
        self.needs("post_generate_stream")
        if not self._observes_in_flight():
            pytest.skip(f"{self.backend_name} does not report requests in flight")

        async def in_flight() -> int:
            (state,) = await client.admin.state()
            return state.in_flight or 0

        await left_stream_is_aborted(client, in_flight, idle=lambda: self._wait_idle(client))

    @pytest.mark.asyncio
    @pytest.mark.parametrize(
        ("fault", "error"),
        [
            ("status_500", ServerStatusError),
            ("refused", NetworkError),
            ("timeout", RequestTimeout),
            ("not_json", ResponseParseError),
        ],
    )
    async def test_stream_failing_before_its_first_delta_raises_what_generate_raises(
        self, faulty_client: Any, fault: str, error: type[Exception]
    ) -> None:
        self.needs("post_generate_stream")
        async with faulty_client(fault) as client:
            with pytest.raises(BackendError) as generated:
                await client.generate(prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=2))
            with pytest.raises(BackendError) as streamed:
                await _drain(client.stream(prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=2)))
        assert type(streamed.value) is type(generated.value) and isinstance(streamed.value, error)
        if fault == "status_500":
            assert "engine exploded" in str(streamed.value)

    # -- groups (generate_group) ----------------------------------------------------------------------
    # A group is n samples of one prompt on one server; sample i is drawn with seed + i whether the backend asks
    # the engine for n samples or sends n single requests, so it equals generate() with that seed.

    @pytest.mark.asyncio
    async def test_group_sample_i_is_generate_with_seed_plus_i(self, client: Client) -> None:
        if not self.deterministic_seeds:
            pytest.skip(f"{self.backend_name}: seeded sampling is not reproducible on this server")
        sampling = SamplingParams(max_tokens=6, temperature=1.0, seed=40, ignore_eos=True)
        group = await client.generate_group(prompt_ids=PROMPT, n=4, sampling=sampling)
        assert len(group) == 4
        for i, sample in enumerate(group):
            self.check_sample(sample, PROMPT, 6)
            alone = await client.generate(prompt_ids=PROMPT, sampling=attrs.evolve(sampling, seed=40 + i))
            assert sample.completion_ids == alone.completion_ids, f"sample {i} is not the sample of seed {40 + i}"
            np.testing.assert_allclose(sample.logprobs, alone.logprobs, atol=1e-5)

    @pytest.mark.asyncio
    async def test_group_from_messages_shares_one_rendering_and_one_server(self, client: Client) -> None:
        group = await client.generate_group(messages=MESSAGES, n=3, sampling=SamplingParams(max_tokens=4))
        prompt = client.render(MESSAGES)
        assert len(group) == 3
        for sample in group:
            self.check_sample(sample, prompt, 4)
        assert len({sample.server for sample in group}) == 1

    @pytest.mark.asyncio
    async def test_group_sizes_are_checked_before_sending(self, client: Client) -> None:
        with pytest.raises(InvalidRequestError, match="n >= 1"):
            await client.generate_group(prompt_ids=PROMPT, n=0, sampling=SamplingParams(max_tokens=16))
        with pytest.raises(InvalidRequestError, match=r"sampling\.n must stay 1"):
            await client.generate_group(prompt_ids=PROMPT, n=2, sampling=SamplingParams(max_tokens=16, n=2))

    # -- content parts --------------------------------------------------------------------------------
    # OpenAI content parts reach the chat template as the engine's chat route hands them over (the texts joined
    # with "\n" for templates that read content as a string, like the tiny models'): never an empty turn. Parts
    # that are not text are refused before anything is sent.

    PARTS: ClassVar[list[dict[str, Any]]] = [
        {"role": "system", "content": [{"type": "text", "text": "You are terse."}]},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Name three"}, {"type": "input_text", "text": "colors."}],
        },
    ]
    JOINED: ClassVar[list[dict[str, Any]]] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three\ncolors."},
    ]

    @pytest.mark.asyncio
    async def test_content_parts_render_as_their_joined_text(self, client: Client) -> None:
        prompt = client.render(self.PARTS)
        assert prompt == client.render(self.JOINED)
        assert "colors" in client.tokenizer.decode(prompt)
        sampling = SamplingParams(max_tokens=4, temperature=0.0)
        from_parts = await client.generate(messages=self.PARTS, sampling=sampling)
        self.check_sample(from_parts, prompt, 4)
        if self.deterministic_seeds:
            from_text = await client.generate(messages=self.JOINED, sampling=sampling)
            assert from_parts.completion_ids == from_text.completion_ids

    #: The server's tokenize route renders content parts as the client does (SGLang's joins text parts with " ").
    tokenize_joins_parts_like_vllm: ClassVar[bool] = True

    @pytest.mark.asyncio
    async def test_content_parts_render_as_the_servers_chat_route_renders_them(self, client: Client) -> None:
        self.needs("tokenize_messages")
        if not self.tokenize_joins_parts_like_vllm:
            pytest.skip(f"{self.backend_name}'s chat route joins content parts otherwise (see its README)")
        check = await client.check_tokenizer(self.PARTS)
        assert check.match, (check.first_difference, check.local_token, check.server_token)
        assert "colors" in client.tokenizer.decode(list(check.server_ids))

    @pytest.mark.asyncio
    async def test_an_unreadable_image_is_refused_before_sending(
        self, counted_client: tuple[Client, list[httpx.Request]]
    ) -> None:
        client, sent = counted_client
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        messages = [*self.JOINED[:1], {"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}]
        with pytest.raises(
            InvalidRequestError, match=r"messages\[1\]\.content\[1\]\.image_url\.url is not an encoded image"
        ):
            await client.generate(messages=messages, sampling=SamplingParams(max_tokens=2))
        with pytest.raises(InvalidRequestError, match=r"messages\[1\]\.content\[1\]"):
            await client.generate_group(messages=messages, n=2, sampling=SamplingParams(max_tokens=2))
        assert sent == []

    @pytest.mark.asyncio
    async def test_an_image_is_refused_before_sending_or_run_exactly_once_expanded(
        self, counted_client: tuple[Client, list[httpx.Request]]
    ) -> None:
        """The rule for images on every backend: refused before anything is sent, naming the part, or the result's
        prompt ids are the rendered ids with the image's one placeholder widened by the engine, and nothing else."""
        client, sent = counted_client
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + TINY_PNG}}
        messages = [*self.JOINED[:1], {"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}]
        if client.driver.image_refusal is not None or image_token_id(client.config.tokenizer or "") is None:
            with pytest.raises((UnsupportedOperationError, InvalidRequestError), match=r"messages\[1\]\.content\[1\]"):
                await client.generate(messages=messages, sampling=SamplingParams(max_tokens=2))
            assert sent == []
            return
        rendered = client.render(messages)
        result = await client.generate(messages=messages, sampling=SamplingParams(max_tokens=2))
        (span,) = result.image_spans
        assert collapse(result.prompt_ids, result.image_spans) == tuple(rendered)
        assert set(result.prompt_ids[span.start : span.end]) == {rendered[span.start]}


#: A 2x2 RGB PNG (red, green, blue, white), base64.
TINY_PNG = (
    "iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAFklEQVR4nGP4z8DA8J+BkYHh////DAAe9gT9Ce00PgAAAABJRU5ErkJggg=="
)


class _Counting(httpx.AsyncBaseTransport):
    """Passes requests to ``inner`` and records each one that gets there."""

    def __init__(self, inner: httpx.AsyncBaseTransport, sent: list[httpx.Request]) -> None:
        self.inner, self.sent = inner, sent

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(request)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def _first_new_text(tokenizer: Any, ids: tuple[int, ...]) -> tuple[int, str] | None:
    """``(k, text)``: the first token ``k - 1`` (from the second on) whose decoded text is printable, not
    whitespace, and new (absent from the text before it), so a stop on ``text`` ends the completion after ``k``
    tokens exactly."""
    for k in range(2, len(ids) + 1):
        before = tokenizer.decode(list(ids[: k - 1]), skip_special_tokens=True)
        after = tokenizer.decode(list(ids[:k]), skip_special_tokens=True)
        piece = after[len(before) :]
        if (
            after.startswith(before)
            and piece.strip()
            and piece.isprintable()
            and "\ufffd" not in after
            and piece not in before
            and after.find(piece) == len(before)
        ):
            return k, piece
    return None


#: Tokens of the clock generation of the early-exit tests (far fewer than the left stream's LONGEST).
CLOCK = 200


async def left_stream_is_aborted(
    client: Client, in_flight: Callable[[], Awaitable[int]], *, idle: Callable[[], Awaitable[None]]
) -> None:
    """Leave a LONGEST-token stream after its first delta and prove with CLOCK-token generations that the server
    stopped it (see ``test_leaving_a_stream_early_aborts_it_on_the_server``). ``in_flight`` reads the server's
    count of requests in flight; ``idle`` returns once it is 0 (with its own deadline)."""
    attempts = Attempts("leaving a stream early")
    long = SamplingParams(max_tokens=LONGEST, ignore_eos=True, temperature=1.0)
    clock = SamplingParams(max_tokens=CLOCK, ignore_eos=True)
    for attempt in range(1, CATCH_ATTEMPTS + 1):
        await idle()
        async with client.stream(prompt_ids=PROMPT, sampling=long) as stream:
            async for delta in stream:
                assert delta.completion_ids
                break
        counts = []
        for _ in range(2):
            ticked = await asyncio.wait_for(client.generate(prompt_ids=PROMPT, sampling=clock), FINISH_TIMEOUT_S)
            assert len(ticked.completion_ids) == CLOCK
            counts.append(await in_flight())
            if counts[-1] == 0:
                break
        if counts[0] == 0:
            return
        if counts[-1] == 0:
            attempts.inconclusive(f"attempt {attempt}: {counts[0]} in flight after one clock generation, 0 after two")
            continue
        await idle()
        attempts.against(f"attempt {attempt}: still {counts} in flight after two clock generations")
        break
    attempts.verdict("a stream left early was still in flight when shorter generations sent after it ended")
