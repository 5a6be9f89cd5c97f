"""ReferenceEngine: an asyncio, in-process inference engine over the numpy Qwen3 model.

It is the engine behind the backend HTTP emulators and the demo's embedded default engine. It
behaves like a small continuous-batching server: requests queue, are admitted into a running set,
get prefilled, then advance one decoded token per tick of a step loop that yields to the event loop
between ticks, so admin operations (pause / resume / abort / sleep / weight and LoRA loading) act on
requests that are genuinely in flight.

Semantics worth knowing:

* Returned logprobs are *raw*: ``log_softmax`` of the unmodified logits (vLLM's default), whatever
  the temperature / top-k / top-p / min-p used for sampling.
* ``pause("abort")`` finishes every running and queued request now (``finish_reason="abort"``,
  tokens so far); ``pause("wait")`` returns once running requests are done; ``pause("keep")`` freezes
  running requests, which continue after :meth:`ReferenceEngine.resume`. While paused (any mode) or
  asleep, new requests queue.
* :meth:`ReferenceEngine.load_weights` may be called at any time; it applies between two ticks.
  Requests in flight keep their KV cache and continue on the new weights (their
  ``weight_versions`` spans show the switch). The usual recipe is ``pause("wait")`` → load →
  ``update_weight_version`` → ``resume()``.
* The prefix cache reuses the KV of earlier finished sequences. It survives weight reloads unless
  flushed (``load_weights(..., flush_cache=True)``, the default, or :meth:`flush_cache`), exactly
  the stale-KV trap of real servers.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import uuid
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn

import attrs
import numpy as np
import numpy.typing as npt

from backends_testkit._engine_types import (
    DEFAULT_WEIGHT_VERSION,
    EngineError,
    EngineOutput,
    EngineRequest,
    EngineRequestError,
    EngineState,
    EngineStep,
    FinishReason,
    PauseMode,
    TopLogprobs,
    WeightSpan,
)
from backends_testkit._numpy_qwen3 import KVCache, LoraAdapter, Qwen3Model
from backends_testkit._prefix_cache import PrefixCache
from backends_testkit._sampling import log_softmax, sample_token, top_logprobs

__all__ = [
    "EngineError",
    "EngineOutput",
    "EngineRequest",
    "EngineRequestError",
    "EngineState",
    "EngineStep",
    "EngineStream",
    "FinishReason",
    "PauseMode",
    "ReferenceEngine",
    "WeightSpan",
]


@attrs.frozen
class _Lora:
    path: Path
    adapter: LoraAdapter
    generation: int


@attrs.define(eq=False)
class _Sequence:
    """Mutable per-request state, owned by the engine."""

    request: EngineRequest
    request_id: str
    future: asyncio.Future[EngineOutput]
    rng: np.random.Generator
    lora: _Lora | None
    tokens: list[int]
    cache: KVCache | None = None
    num_cached_tokens: int = 0
    completion: list[int] = attrs.Factory(list)
    logprobs: list[float] = attrs.Factory(list)
    top: TopLogprobs = attrs.Factory(list)
    prompt_logprobs: npt.NDArray[np.float32] | None = None
    prompt_top: TopLogprobs | None = None
    routed: list[npt.NDArray[np.int32]] = attrs.Factory(list)
    versions: list[str] = attrs.Factory(list)
    text: str = ""  # the completion's decoded text, kept only while stop strings are looked for
    stop_from: int = 0  # where stop strings may start in ``text``: past the text of the first min_tokens tokens
    #: set at every new token and at the end (streamed requests only)
    progress: asyncio.Event | None = None


class ReferenceEngine:
    """An asyncio inference engine over :class:`~backends_testkit._numpy_qwen3.Qwen3Model`.

    The step loop is an asyncio task started lazily on the running loop by the first request (or by
    :meth:`start` / ``async with``). All methods must be called from that loop's thread.
    """

    def __init__(self, model_dir: Path | str, *, seed: int = 0, max_model_len: int = 2048, max_batch: int = 64) -> None:
        """Load a model directory (``config.json``, ``model.safetensors``, optional ``generation_config.json``).

        :param model_dir: an HF-layout Qwen3 / Qwen3-MoE directory.
        :param seed: seed of the generator that seeds requests without their own seed.
        :param max_model_len: the longest prompt + completion.
        :param max_batch: the most requests decoded concurrently; others queue.
        """
        self._model_dir = Path(model_dir)
        self._model = Qwen3Model.load(self._model_dir)
        self._max_model_len = max_model_len
        self._max_batch = max_batch
        self._eos_token_ids = _read_eos_ids(self._model_dir)
        self._decoder: Any = None
        self._rng = np.random.Generator(np.random.PCG64(seed))
        self._weight_version = DEFAULT_WEIGHT_VERSION
        self._loras: dict[str, _Lora] = {}
        self._lora_generation = itertools.count()
        self._prefix_cache = PrefixCache()
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._pause_mode: PauseMode | None = None
        self._sleep_level: int | None = None
        self._sleep_mode: PauseMode = "abort"
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Event | None = None
        self._closed = False
        self._generated_tokens = 0

    # -- properties ----------------------------------------------------------------------------

    @property
    def model_dir(self) -> Path:
        """The directory the base model was loaded from."""
        return self._model_dir

    @property
    def model_name(self) -> str:
        """The model directory's name, e.g. ``tiny-qwen3``."""
        return self._model_dir.name

    @property
    def max_model_len(self) -> int:
        """The longest prompt + completion, in tokens."""
        return self._max_model_len

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding matrix: valid token ids are ``[0, vocab_size)``."""
        return self._model.config.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """EOS ids from ``config.json`` and ``generation_config.json`` (sorted, deduplicated)."""
        return self._eos_token_ids

    @property
    def is_moe(self) -> bool:
        """Whether the model has MoE layers (and can return routed experts)."""
        return self._model.config.is_moe

    @property
    def num_layers(self) -> int:
        """Number of decoder layers."""
        return self._model.config.num_layers

    @property
    def top_k(self) -> int:
        """Experts per token (``num_experts_per_tok``); 0 for dense models."""
        return self._model.config.num_experts_per_tok

    @property
    def weight_version(self) -> str:
        """The current weight version label."""
        return self._weight_version

    @property
    def loras(self) -> Mapping[str, Path]:
        """Loaded LoRA adapters: name → directory."""
        return {name: lora.path for name, lora in self._loras.items()}

    @property
    def generated_tokens(self) -> int:
        """Tokens sampled since the engine started, over every request (vLLM's ``generation_tokens_total``)."""
        return self._generated_tokens

    def state(self) -> EngineState:
        """Return a snapshot of the control state."""
        return EngineState(
            paused=self._pause_mode is not None,
            pause_mode=self._pause_mode,
            sleeping=self._sleep_level is not None,
            sleep_level=self._sleep_level,
            weight_version=self._weight_version,
            in_flight=len(self._running),
            queued=len(self._waiting),
            loras=tuple(self._loras),
        )

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the step loop on the running event loop (idempotent)."""
        self._ensure_loop()

    async def aclose(self) -> None:
        """Abort everything and stop the step loop. The engine cannot be used afterwards."""
        self._closed = True
        self.abort()
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])

    async def __aenter__(self) -> ReferenceEngine:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # -- requests ------------------------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> EngineOutput:
        """Queue a request and wait for it to finish.

        :raises EngineRequestError: when the request is invalid (nothing is queued then).
        :raises EngineError: when the engine is closed.
        """
        seq = self._submit(request)
        try:
            return await seq.future
        except asyncio.CancelledError:
            self._discard(seq)
            raise

    def generate_stream(self, request: EngineRequest) -> EngineStream:
        """Queue a request now and follow it as it runs: the :class:`EngineStream` reports an :class:`EngineStep`
        with the tokens since the previous one whenever there are new ones, then the :class:`EngineOutput` once it
        finished. Closing the stream before the end (the client left) aborts the request.

        :raises EngineRequestError: when the request is invalid (nothing is queued then).
        :raises EngineError: when the engine is closed.
        """
        return EngineStream(self, self._submit(request, stream=True))

    async def score(
        self,
        token_ids: tuple[int, ...] | list[int],
        *,
        top_k: int = 0,
        lora: str | None = None,
        return_routed_experts: bool = False,
    ) -> EngineOutput:
        """Teacher-score a sequence: the raw logprob of every token given the tokens before it.

        :param token_ids: the sequence.
        :param top_k: also return the top-k alternatives per position.
        :param lora: an optional loaded adapter.
        :param return_routed_experts: MoE models: also return the routing of positions ``0 .. n-2``.
        :returns: an output with ``prompt_logprobs`` (entry 0 NaN) and no completion.
        """
        return await self.generate(
            EngineRequest(
                prompt_ids=tuple(token_ids),
                max_tokens=0,
                prompt_logprobs=top_k,
                lora=lora,
                return_routed_experts=return_routed_experts,
            )
        )

    def abort(self, request_id: str | None = None) -> int:
        """Finish queued / running requests now with ``finish_reason="abort"``.

        :param request_id: the request to abort; ``None`` aborts all.
        :returns: how many requests were aborted.
        """
        victims = [
            seq for seq in (*self._running, *self._waiting) if request_id is None or seq.request_id == request_id
        ]
        for seq in victims:
            self._finish(seq, "abort")
        return len(victims)

    # -- control -------------------------------------------------------------------------------

    async def pause(self, mode: PauseMode = "abort") -> None:
        """Stop admitting requests; handle in-flight ones per ``mode`` (see the module docstring).

        :raises EngineRequestError: for an unknown mode.
        """
        if mode not in ("abort", "wait", "keep"):
            raise EngineRequestError(f"unknown pause mode {mode!r} (use abort, wait or keep)")
        self._pause_mode = mode
        await self._quiesce(mode)

    async def resume(self) -> None:
        """Resume admitting and stepping requests (a no-op when not paused)."""
        self._pause_mode = None
        self._kick()

    async def sleep(self, level: int = 1, *, mode: PauseMode = "abort") -> None:
        """Go to sleep: like :meth:`pause` with ``mode``, and the prefix cache is dropped.

        Nothing is freed (as on a CPU vLLM); requests queue until :meth:`wake`.

        :raises EngineRequestError: for a level outside 0..2 or an unknown mode.
        """
        if level not in (0, 1, 2) or mode not in ("abort", "wait", "keep"):
            raise EngineRequestError(f"bad sleep level {level!r} or mode {mode!r}")
        self._sleep_level, self._sleep_mode = level, mode
        await self._quiesce(mode)
        self._prefix_cache.clear()

    async def wake(self) -> None:
        """Wake up from :meth:`sleep` (a no-op when awake)."""
        self._sleep_level = None
        self._kick()

    def flush_cache(self) -> bool:
        """Drop the prefix cache, like SGLang's ``/flush_cache``.

        :returns: ``False`` (and nothing is flushed) while requests are running or queued.
        """
        if self._running or self._waiting:
            return False
        self._prefix_cache.clear()
        return True

    def load_weights(self, path: Path | str, *, flush_cache: bool = True, weight_version: str | None = None) -> None:
        """Replace the base weights with those of another model directory of the same architecture.

        Applies between two ticks; see the module docstring for in-flight requests.

        :param path: a directory with ``config.json`` and ``model.safetensors``.
        :param flush_cache: also drop the prefix cache (else stale KV may be reused, as on vLLM).
        :param weight_version: if given, the new weight version label.
        :raises EngineRequestError: when the directory cannot be loaded or its config differs.
        """
        try:
            model = Qwen3Model.load(path)
        except (OSError, ValueError, KeyError) as exc:
            raise EngineRequestError(f"cannot load weights from {path}: {exc}") from exc
        if model.config != self._model.config:
            raise EngineRequestError(f"weights in {path} have a different model config")
        self._model = model
        if flush_cache:
            self._prefix_cache.clear()
        if weight_version is not None:
            self._weight_version = weight_version

    def update_tensors(self, tensors: Mapping[str, npt.NDArray[Any]], *, flush_cache: bool = True) -> None:
        """Replace some base weights by HF name (what a distributed weight update delivers); the others stay.

        Applies between two ticks, like :meth:`load_weights`.

        :param flush_cache: also drop the prefix cache.
        :raises EngineRequestError: a name the model has no weight for, or a shape that does not fit it (nothing
            changes).
        """
        try:
            model = self._model.with_tensors(tensors)
        except ValueError as exc:
            raise EngineRequestError(f"cannot update the weights: {exc}") from exc
        self._model = model
        if flush_cache:
            self._prefix_cache.clear()

    def update_weight_version(self, version: str) -> None:
        """Set the weight version label reported by later outputs."""
        self._weight_version = version

    def load_lora(self, name: str, path: Path | str, *, replace: bool = False) -> None:
        """Load a PEFT LoRA adapter under ``name``.

        :raises EngineRequestError: if ``name`` is taken (and not ``replace``) or the adapter is invalid.
        """
        if name in self._loras and not replace:
            raise EngineRequestError(f"LoRA adapter {name!r} is already loaded")
        try:
            adapter = LoraAdapter.load(path, self._model.config, dtype=self._model.dtype)
        except (OSError, ValueError, KeyError) as exc:
            raise EngineRequestError(f"cannot load LoRA adapter from {path}: {exc}") from exc
        self._loras[name] = _Lora(path=Path(path), adapter=adapter, generation=next(self._lora_generation))

    def unload_lora(self, name: str) -> None:
        """Unload an adapter; requests already using it finish with it.

        :raises EngineRequestError: if no adapter has that name.
        """
        if self._loras.pop(name, None) is None:
            raise EngineRequestError(f"LoRA adapter {name!r} is not loaded")

    # -- internals: submission -----------------------------------------------------------------

    def _submit(self, request: EngineRequest, *, stream: bool = False) -> _Sequence:
        if self._closed:
            raise EngineError("the engine is closed")
        self._validate(request)
        loop = self._ensure_loop()
        request_id = request.request_id or uuid.uuid4().hex
        if any(seq.request_id == request_id for seq in (*self._running, *self._waiting)):
            raise EngineRequestError(f"request id {request_id!r} is already in flight")
        seed = request.seed if request.seed is not None else int(self._rng.integers(0, 2**63))
        seq = _Sequence(
            request=request,
            request_id=request_id,
            future=loop.create_future(),
            rng=np.random.Generator(np.random.PCG64(seed)),
            lora=self._loras[request.lora] if request.lora is not None else None,
            tokens=list(request.prompt_ids),
            progress=asyncio.Event() if stream else None,
        )
        self._waiting.append(seq)
        self._kick()
        return seq

    def _validate(self, r: EngineRequest) -> None:
        def fail(message: str) -> NoReturn:
            raise EngineRequestError(message)

        n = len(r.prompt_ids)
        if n == 0:
            fail("prompt_ids must not be empty")
        bad = [t for t in (*r.prompt_ids, *r.stop_token_ids, *r.logit_bias) if not 0 <= t < self.vocab_size]
        if bad:
            fail(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if r.max_tokens < 0:
            fail(f"max_tokens must be >= 0, got {r.max_tokens}")
        if n > self._max_model_len or (n == self._max_model_len and r.max_tokens > 0):
            fail(f"prompt of {n} tokens leaves no room in max_model_len={self._max_model_len}")
        if not 0 <= r.min_tokens <= r.max_tokens:
            fail(f"min_tokens must be in [0, max_tokens], got {r.min_tokens}")
        if not r.temperature >= 0.0:
            fail(f"temperature must be >= 0, got {r.temperature}")
        if not 0.0 < r.top_p <= 1.0:
            fail(f"top_p must be in (0, 1], got {r.top_p}")
        if not 0.0 <= r.min_p <= 1.0:
            fail(f"min_p must be in [0, 1], got {r.min_p}")
        for field in ("logprobs", "prompt_logprobs"):
            value = getattr(r, field)
            if value is not None and not 0 <= value <= self.vocab_size:
                fail(f"{field} must be in [0, {self.vocab_size}], got {value}")
        if r.return_routed_experts and not self.is_moe:
            fail(f"{self.model_name} is not a MoE model: it has no routed experts")
        if not 0 <= r.routed_experts_start < n:
            fail(f"routed_experts_start must be in [0, {n}), got {r.routed_experts_start}")
        if r.lora is not None and r.lora not in self._loras:
            fail(f"LoRA adapter {r.lora!r} is not loaded")
        if any(not isinstance(s, str) or not s for s in r.stop):
            fail(f"stop strings must be non-empty strings, got {list(r.stop)!r}")
        if r.stop and not (self._model_dir / "tokenizer.json").is_file():
            fail(f"stop strings need a tokenizer: {self._model_dir} has no tokenizer.json")

    # -- internals: the step loop --------------------------------------------------------------

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._loop is not loop:
            if self._loop is not loop:  # requests of a previous (closed) loop can never be answered
                self._waiting.clear()
                self._running.clear()
                self._drain_waiters.clear()
            self._loop, self._wakeup = loop, asyncio.Event()
            self._task = loop.create_task(self._run(), name=f"ReferenceEngine[{self.model_name}]")
        return loop

    def _kick(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    def _can_admit(self) -> bool:
        return self._pause_mode is None and self._sleep_level is None

    def _can_step(self) -> bool:
        return self._pause_mode in (None, "wait") and (self._sleep_level is None or self._sleep_mode == "wait")

    async def _run(self) -> None:
        assert self._wakeup is not None
        while True:
            if self._can_admit():
                while self._waiting and len(self._running) < self._max_batch:
                    self._running.append(self._waiting.popleft())
            stepped = False
            if self._can_step():
                for seq in list(self._running):
                    stepped = True
                    try:
                        self._step(seq)
                    except Exception as exc:  # an engine bug: fail this request, keep serving the others
                        self._running.remove(seq)
                        if not seq.future.done():
                            seq.future.set_exception(exc)
            self._notify_drained()
            if stepped:
                await asyncio.sleep(0)
            else:
                self._wakeup.clear()
                await self._wakeup.wait()

    async def _quiesce(self, mode: PauseMode) -> None:
        if mode == "abort":
            self.abort()
        elif mode == "wait" and self._running:
            waiter = self._ensure_loop().create_future()
            self._drain_waiters.append(waiter)
            self._kick()
            await waiter

    def _notify_drained(self) -> None:
        if not self._running:
            waiters, self._drain_waiters = self._drain_waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    def _discard(self, seq: _Sequence) -> None:
        if seq in self._running:
            self._running.remove(seq)
        elif seq in self._waiting:
            self._waiting.remove(seq)
        self._notify_drained()

    # -- internals: one step of one sequence ---------------------------------------------------

    def _step(self, seq: _Sequence) -> None:
        request = seq.request
        if seq.cache is None:
            self._start_sequence(seq)
        assert seq.cache is not None
        prefill = seq.cache.length < len(request.prompt_ids)
        want_prompt_logprobs = prefill and request.prompt_logprobs is not None
        new_tokens = seq.tokens[seq.cache.length :]
        result = self._model.forward(
            new_tokens, seq.cache, lora=seq.lora.adapter if seq.lora else None, all_logits=want_prompt_logprobs
        )
        if result.routed_experts is not None:
            seq.routed.append(result.routed_experts)
        if want_prompt_logprobs:
            self._record_prompt_logprobs(seq, result.logits[:-1])
        if len(seq.completion) >= request.max_tokens:  # max_tokens == 0: scoring only
            self._finish(seq, "length")
            return
        logits = result.logits[-1]
        banned: tuple[int, ...] = ()
        if len(seq.completion) < request.min_tokens:
            banned = request.stop_token_ids + (() if request.ignore_eos else self._eos_token_ids)
        biased = logits
        if request.logit_bias:
            biased = np.array(logits, dtype=np.float64)
            biased[list(request.logit_bias)] += np.fromiter(request.logit_bias.values(), dtype=np.float64)
        token = sample_token(
            biased,
            seq.rng,
            temperature=request.temperature,
            top_k=request.top_k,
            top_p=request.top_p,
            min_p=request.min_p,
            banned=banned,
        )
        seq.tokens.append(token)
        seq.completion.append(token)
        seq.versions.append(self._weight_version)
        self._generated_tokens += 1
        if request.logprobs is not None:
            logprobs = log_softmax(logits)
            seq.logprobs.append(float(logprobs[token]))
            seq.top.append(top_logprobs(logprobs, request.logprobs))
        if seq.progress is not None:
            seq.progress.set()
        if token in request.stop_token_ids or (not request.ignore_eos and token in self._eos_token_ids):
            self._finish(seq, "stop", stop_reason=token)
        elif (matched := self._stop_string(seq)) is not None:
            self._finish(seq, "stop", stop_reason=matched)
        elif len(seq.completion) >= request.max_tokens or len(seq.tokens) >= self._max_model_len:
            self._finish(seq, "length")

    def _stop_string(self, seq: _Sequence) -> str | None:
        """The stop string the last token completed, if any: the one ending first in the new text (ties: the
        first in ``stop``), searched only in text past the first ``min_tokens`` tokens, as vLLM's detokenizer
        does."""
        stop = seq.request.stop
        if not stop:
            return None
        if self._decoder is None:
            from tokenizers import Tokenizer

            self._decoder = Tokenizer.from_file(str(self._model_dir / "tokenizer.json"))
        previous = seq.text
        seq.text = self._decoder.decode(seq.completion, skip_special_tokens=True)
        if len(seq.completion) <= seq.request.min_tokens:
            seq.stop_from = len(seq.text)
            return None
        best: tuple[int, str] | None = None
        for candidate in stop:
            at = seq.text.find(candidate, max(seq.stop_from, len(previous) - len(candidate) + 1, 0))
            if at >= 0 and (best is None or at + len(candidate) < best[0]):
                best = (at + len(candidate), candidate)
        return None if best is None else best[1]

    def _start_sequence(self, seq: _Sequence) -> None:
        prompt = np.asarray(seq.request.prompt_ids, dtype=np.int64)
        hit = None
        if seq.request.prompt_logprobs is None:
            hit = self._prefix_cache.lookup(self._namespace(seq), prompt, max_length=prompt.size - 1)
        if hit is None:
            seq.cache = self._model.new_cache()
            return
        seq.cache, seq.num_cached_tokens = hit.cache, hit.length
        if hit.routed_experts is not None:
            seq.routed.append(hit.routed_experts)

    def _record_prompt_logprobs(self, seq: _Sequence, logits: npt.NDArray[Any]) -> None:
        prompt = seq.request.prompt_ids
        k = seq.request.prompt_logprobs or 0
        values = np.full(len(prompt), np.nan, dtype=np.float32)
        tops: TopLogprobs = [[]]
        if len(prompt) > 1:
            logprobs = log_softmax(logits)
            values[1:] = logprobs[np.arange(len(prompt) - 1), np.asarray(prompt[1:])]
            tops.extend(top_logprobs(row, k) for row in logprobs)
        seq.prompt_logprobs = values
        seq.prompt_top = tops if k > 0 else None

    def _namespace(self, seq: _Sequence) -> int:
        return -1 if seq.lora is None else seq.lora.generation

    def _finish(self, seq: _Sequence, reason: FinishReason, *, stop_reason: int | str | None = None) -> None:
        if seq in self._running:
            self._running.remove(seq)
        elif seq in self._waiting:
            self._waiting.remove(seq)
        routed = self._routed_rows(seq)
        if seq.cache is not None and reason != "abort":
            tokens = np.asarray(seq.tokens[: seq.cache.length], dtype=np.int64)
            full_routing = np.concatenate(seq.routed) if seq.routed else None
            self._prefix_cache.insert(self._namespace(seq), tokens, seq.cache, full_routing)
        request = seq.request
        output = EngineOutput(
            request_id=seq.request_id,
            prompt_ids=request.prompt_ids,
            completion_ids=tuple(seq.completion),
            finish_reason=reason,
            stop_reason=stop_reason,
            logprobs=np.asarray(seq.logprobs, dtype=np.float32) if request.logprobs is not None else None,
            top_logprobs=seq.top if request.logprobs else None,
            prompt_logprobs=seq.prompt_logprobs,
            prompt_top_logprobs=seq.prompt_top,
            routed_experts=routed,
            weight_version=self._weight_version,
            weight_versions=_spans(seq.versions),
            num_cached_tokens=seq.num_cached_tokens,
        )
        if not seq.future.done():
            seq.future.set_result(output)
        if seq.progress is not None:
            seq.progress.set()
        self._notify_drained()

    def _routed_rows(self, seq: _Sequence) -> npt.NDArray[np.int32] | None:
        request = seq.request
        if not request.return_routed_experts:
            return None
        shape = (0, self.num_layers, self.top_k)
        rows = np.concatenate(seq.routed) if seq.routed else np.zeros(shape, np.int32)
        end = len(request.prompt_ids) + len(seq.completion) - 1
        return np.ascontiguousarray(rows[request.routed_experts_start : end])


class EngineStream:
    """A queued request followed as it runs (:meth:`ReferenceEngine.generate_stream`); an async iterator of
    :class:`EngineStep` then the final :class:`EngineOutput`. :meth:`aclose` before the end aborts the request."""

    def __init__(self, engine: ReferenceEngine, seq: _Sequence) -> None:
        self._engine = engine
        self._seq = seq
        self._reported = 0
        self._ended = False

    @property
    def request_id(self) -> str:
        return self._seq.request_id

    def __aiter__(self) -> EngineStream:
        return self

    async def __anext__(self) -> EngineStep | EngineOutput:
        seq = self._seq
        progress = seq.progress
        assert progress is not None
        while not self._ended:
            start, end = self._reported, len(seq.completion)
            if end > start:
                self._reported = end
                logprobs = seq.request.logprobs is not None
                return EngineStep(
                    completion_ids=tuple(seq.completion[start:end]),
                    logprobs=np.asarray(seq.logprobs[start:end], dtype=np.float32) if logprobs else None,
                    top_logprobs=seq.top[start:end] if seq.request.logprobs else None,
                )
            if seq.future.done():
                self._ended = True
                return seq.future.result()
            progress.clear()
            try:
                await progress.wait()
            except asyncio.CancelledError:
                await self.aclose()
                raise
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Stop following; a request not finished yet is aborted."""
        self._ended = True
        if not self._seq.future.done():
            self._engine._discard(self._seq)
            self._seq.future.cancel()


def _spans(versions: list[str]) -> tuple[WeightSpan, ...]:
    spans: list[WeightSpan] = []
    for position, version in enumerate(versions):
        if spans and spans[-1].version == version:
            spans[-1] = WeightSpan(version=version, start=spans[-1].start, end=position + 1)
        else:
            spans.append(WeightSpan(version=version, start=position, end=position + 1))
    return tuple(spans)


def _read_eos_ids(model_dir: Path) -> tuple[int, ...]:
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        if not path.is_file():
            continue
        value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return tuple(sorted(ids))
