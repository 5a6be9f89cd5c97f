"""``POST /generate`` over the reference engine: admission checks, engine requests, SGLang's answer objects.

Reproduced from the 0.5.23 captures and notes:

* admission: LoRA adapters by name (``Got LoRA adapter that has never been loaded``), the context length
  (400s), ``max_req_input_len`` (400), ``logprob_start_len`` below the prompt length; then ``max_new_tokens`` is
  **silently clipped** to ``max_req_len - prompt - 1`` as SGLang's scheduler does;
* ``n > 1`` and batches answer a list (prompt-major), each sample with its own ``meta_info.id``
  (``<rid>_<j>`` for samples of a caller's ``rid``); every sample of ``n > 1`` is drawn with the request's one
  ``sampling_seed`` (the tokenizer manager copies the request's sampling params into each sample);
* logprob triples ``[logprob, token_id, text|null]``; prompt entries start at ``logprob_start_len`` and the entry
  at that position is null even when it has a logprob; ``-1`` gives an empty prompt list;
* finish reasons ``{"type": "length", "length"}`` / ``{"type": "stop", "matched"}`` / ``{"type": "abort", ...}``,
  stop strings matched on the decoded completion and trimmed from ``text`` (``no_stop_trim`` keeps them), a matched
  stop token kept in ``output_ids`` but not in ``text``;
* ``routed_experts``: base64 of little-endian int32 ``[prompt + completion - 1 - start, layers, top_k]``, only
  when the server was started with routing enabled;
* ``weight_versions`` spans, ``cached_tokens`` (and ``cached_tokens_details`` when non-zero).

Not reproduced: output logprobs are the engine's raw ``log_softmax`` (SGLang divides the logits by the
temperature first, and adds ``logit_bias`` to them); ``num_retractions`` is always 0.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import attrs
import numpy as np

from backends_sglang_testing._protocol import GenerateInput, Job
from backends_sglang_testing._replies import message_error
from backends_sglang_testing._text import Text
from backends_testkit.engine import (
    EngineOutput,
    EngineRequest,
    EngineRequestError,
    EngineStep,
    EngineStream,
    ReferenceEngine,
)

__all__ = ["Generation", "Limits"]


@attrs.frozen(kw_only=True)
class Limits:
    """SGLang's length limits: ``max_req_len = min(context_len - 1, max_total_num_tokens - 1)`` and
    ``max_req_input_len = max_req_len - 5``."""

    context_len: int
    max_total_num_tokens: int

    @property
    def max_req_len(self) -> int:
        return min(self.context_len - 1, self.max_total_num_tokens - 1)

    @property
    def max_req_input_len(self) -> int:
        return self.max_req_len - 5


@attrs.frozen
class _Sample:
    """One finished sample, after stop strings were applied."""

    rid: str
    completion: tuple[int, ...]
    finish: dict[str, Any]
    text: str
    cut: int  # completion tokens kept from the engine's output


class Generation:
    """The generation route's state: the engine, the tokenizer, limits and the ids of requests in flight."""

    def __init__(self, engine: ReferenceEngine, text: Text, limits: Limits, *, routed_experts: bool) -> None:
        self.engine = engine
        self.text = text
        self.limits = limits
        self.routed_experts = routed_experts
        self._in_flight: set[str] = set()

    # -- abort ------------------------------------------------------------------------------------------

    def abort(self, rid: str, *, abort_all: bool) -> int:
        """Abort every request in flight whose id starts with ``rid`` (SGLang's matching), or all."""
        if abort_all:
            return self.engine.abort()
        if not rid:
            return 0
        return sum(self.engine.abort(r) for r in list(self._in_flight) if r.startswith(rid))

    # -- admission --------------------------------------------------------------------------------------

    def _admit(self, job: Job, ids: Sequence[int], gen: GenerateInput) -> int:
        """Check one prompt; return its (clipped) ``max_new_tokens``."""
        if job.lora is not None and job.lora not in self.engine.loras:
            loaded = repr(dict.fromkeys(self.engine.loras).keys())
            raise message_error(
                f"Got LoRA adapter that has never been loaded: {job.lora}\nAll loaded adapters: {loaded}."
            )
        n, m, limits = len(ids), job.sampling.max_new_tokens, self.limits
        if n >= limits.context_len:
            raise message_error(
                f"The input ({n} tokens) is longer than the model's context length ({limits.context_len} tokens)."
            )
        if n + m >= limits.context_len:
            raise message_error(
                f"Requested token count exceeds the model's maximum context length of {limits.context_len} tokens. "
                f"You requested a total of {n + m} tokens: {n} tokens from the input messages and {m} tokens for "
                "the completion. Please reduce the number of tokens in the input messages or the completion to fit "
                "within the limit."
            )
        if n > limits.max_req_input_len:
            raise message_error(
                f"Input length ({n} tokens) exceeds the maximum allowed length ({limits.max_req_input_len} tokens). "
                "Use a shorter input or enable --allow-auto-truncate."
            )
        if job.return_logprob and job.logprob_start_len >= n:
            raise message_error(
                f"logprob_start_len ({job.logprob_start_len}) is higher than the number of input tokens ({n}). "
                "Request with a lower logprob_start_len."
            )
        if gen.return_routed_experts and self.routed_experts:
            if not self.engine.is_moe:
                raise message_error("return_routed_experts needs a MoE model")
            if not 0 <= gen.routed_experts_start_len < n:
                raise message_error(
                    f"routed_experts_start_len ({gen.routed_experts_start_len}) must be in [0, {n}) for this prompt"
                )
        return min(m, limits.max_req_len - n - 1)  # the scheduler's silent clip

    def _engine_request(
        self, job: Job, ids: Sequence[int], max_new: int, gen: GenerateInput, sample: int
    ) -> EngineRequest:
        s = job.sampling
        full = self.engine.vocab_size if job.token_ids_logprob else None
        want_prompt = job.return_logprob and job.logprob_start_len >= 0
        return EngineRequest(
            prompt_ids=tuple(ids),
            max_tokens=max_new,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            min_p=s.min_p,
            seed=s.seed,  # every sample of n > 1 gets the request's one seed: SGLang copies the sampling params
            stop_token_ids=s.stop_token_ids,
            stop=s.stop,
            logit_bias=s.logit_bias,
            ignore_eos=s.ignore_eos,
            min_tokens=min(s.min_new_tokens, max_new),
            logprobs=(full or job.top_logprobs_num) if job.return_logprob else None,
            prompt_logprobs=(full or job.top_logprobs_num) if want_prompt else None,
            return_routed_experts=gen.return_routed_experts and self.routed_experts,
            routed_experts_start=gen.routed_experts_start_len if gen.return_routed_experts else 0,
            lora=job.lora,
            request_id=job.rids[sample] or uuid.uuid4().hex,
        )

    # -- running ----------------------------------------------------------------------------------------

    async def _run(self, request: EngineRequest) -> EngineOutput:
        rid = request.request_id
        if rid is not None:
            self._in_flight.add(rid)
        try:
            return await self.engine.generate(request)
        except EngineRequestError as exc:
            raise message_error(str(exc)) from exc
        finally:
            if rid is not None:
                self._in_flight.discard(rid)

    async def generate(self, gen: GenerateInput) -> Any:
        """Run every prompt × ``n`` sample concurrently; return SGLang's JSON answer (or, for ``stream``, an
        async generator of its events)."""
        started = time.monotonic()
        prepared = []
        for job in gen.jobs:
            ids = list(job.input_ids) if job.input_ids is not None else self.text.encode(job.text or "")
            max_new = self._admit(job, ids, gen)
            requests = [self._engine_request(job, ids, max_new, gen, j) for j in range(job.sampling.n)]
            prepared.append((job, ids, requests))
        if gen.stream:
            if len(prepared) != 1 or len(prepared[0][2]) != 1:
                raise message_error("the SGLang emulator streams one prompt with n = 1")
            job, ids, (request,) = prepared[0]
            if job.sampling.stop:
                raise message_error("the SGLang emulator does not stream with stop strings")
            try:
                steps = self.engine.generate_stream(request)
            except EngineRequestError as exc:
                raise message_error(str(exc)) from exc
            return self._stream(job, ids, request, steps, gen, started)
        tasks = [asyncio.ensure_future(self._run(r)) for _, _, requests in prepared for r in requests]
        try:
            outputs = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            raise
        objects = []
        index = 0
        for job, ids, requests in prepared:
            for _ in requests:
                objects.append(self._answer(job, ids, outputs[index], gen, started))
                index += 1
        return objects if gen.batch or len(objects) > 1 else objects[0]

    async def _stream(
        self,
        job: Job,
        ids: Sequence[int],
        request: EngineRequest,
        steps: EngineStream,
        gen: GenerateInput,
        started: float,
    ) -> AsyncGenerator[Any, None]:
        """SGLang's default (cumulative) stream: every event holds the output so far, ``finish_reason`` null until
        the last, which is the whole answer."""
        rid = request.request_id
        assert rid is not None
        self._in_flight.add(rid)
        completion: list[int] = []
        logprobs: list[float] = []
        rows: list[Any] = []
        with_text = gen.return_text_in_logprobs
        try:
            async for event in steps:
                if isinstance(event, EngineStep):
                    completion += event.completion_ids
                    if event.logprobs is not None:
                        logprobs += event.logprobs.tolist()
                    rows += event.top_logprobs or []
                    meta: dict[str, Any] = {"id": rid, "finish_reason": None, "prompt_tokens": len(ids)}
                    meta.update(weight_version=self.engine.weight_version, num_retractions=0, reasoning_tokens=0)
                    meta.update(completion_tokens=len(completion), cached_tokens=0)
                    if job.return_logprob:
                        meta["output_token_logprobs"] = [
                            self._triple(lp, t, with_text) for lp, t in zip(logprobs, completion, strict=True)
                        ]
                        if job.top_logprobs_num:
                            meta["output_top_logprobs"] = [self._top(r, job.top_logprobs_num, with_text) for r in rows]
                    meta.update(cached_tokens_details=None, dp_rank=None, response_sent_to_client_ts=time.time())
                    yield {"output_ids": list(completion), "meta_info": meta}
                    continue
                yield self._answer(job, ids, event, gen, started)
        finally:
            await steps.aclose()
            self._in_flight.discard(rid)

    # -- answers ----------------------------------------------------------------------------------------

    def _finish(self, job: Job, out: EngineOutput) -> _Sample:
        """Finish reason and text of one engine output. The engine checks stop strings per token on the decoded
        completion; the token completing one stays in ``output_ids`` and the text is cut where the string
        starts (``no_stop_trim`` keeps it)."""
        completion, skip = out.completion_ids, job.sampling.skip_special_tokens
        shown = completion
        if out.finish_reason == "stop" and isinstance(out.stop_reason, str):
            decoded = self.text.decode(completion, skip_special_tokens=skip)
            at = decoded.find(out.stop_reason)
            text = decoded if job.sampling.no_stop_trim or at < 0 else decoded[:at]
            return _Sample(
                out.request_id, completion, {"type": "stop", "matched": out.stop_reason}, text, len(completion)
            )
        if out.finish_reason == "stop":
            finish: dict[str, Any] = {"type": "stop", "matched": out.stop_reason}
            shown = completion if job.sampling.no_stop_trim else completion[:-1]
        elif out.finish_reason == "abort":
            finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        else:
            finish = {"type": "length", "length": len(completion)}
        text = self.text.decode(shown, skip_special_tokens=skip)
        return _Sample(out.request_id, completion, finish, text, len(completion))

    def _triple(self, logprob: float | None, token: int, with_text: bool) -> list[Any]:
        return [logprob, token, self.text.token(token) if with_text else None]

    def _prompt_logprobs(self, job: Job, ids: Sequence[int], out: EngineOutput, with_text: bool) -> dict[str, Any]:
        start = job.logprob_start_len
        positions = range(start, len(ids)) if start >= 0 else range(0)
        values = out.prompt_logprobs
        rows = out.prompt_top_logprobs
        fields: dict[str, Any] = {
            "input_token_logprobs": [
                self._triple(None if i == start or values is None else float(values[i]), ids[i], with_text)
                for i in positions
            ]
        }
        if job.top_logprobs_num:
            fields["input_top_logprobs"] = [
                None if i == start or rows is None else self._top(rows[i], job.top_logprobs_num, with_text)
                for i in positions
            ]
        if job.token_ids_logprob:
            fields["input_token_ids_logprobs"] = [
                None if i == start or rows is None else self._chosen(rows[i], job.token_ids_logprob, with_text)
                for i in positions
            ]
        return fields

    def _top(self, row: Sequence[tuple[int, float]], k: int, with_text: bool) -> list[list[Any]]:
        return [self._triple(float(lp), token, with_text) for token, lp in row[:k]]

    def _chosen(self, row: Sequence[tuple[int, float]], wanted: Sequence[int], with_text: bool) -> list[list[Any]]:
        scores = dict(row)
        return [self._triple(float(scores[t]) if t in scores else None, t, with_text) for t in wanted]

    def _output_logprobs(self, job: Job, sample: _Sample, out: EngineOutput, with_text: bool) -> dict[str, Any]:
        values = out.logprobs if out.logprobs is not None else np.zeros(0, np.float32)
        rows = (out.top_logprobs or [])[: sample.cut]
        fields: dict[str, Any] = {
            "output_token_logprobs": [
                self._triple(float(values[i]), token, with_text) for i, token in enumerate(sample.completion)
            ],
            "output_token_logprobs_length": len(sample.completion),
        }
        if job.top_logprobs_num:
            fields["output_top_logprobs"] = [self._top(row, job.top_logprobs_num, with_text) for row in rows]
        if job.token_ids_logprob:
            fields["output_token_ids_logprobs"] = [self._chosen(row, job.token_ids_logprob, with_text) for row in rows]
        return fields

    def _answer(self, job: Job, ids: Sequence[int], out: EngineOutput, gen: GenerateInput, started: float) -> Any:
        sample = self._finish(job, out)
        with_text = gen.return_text_in_logprobs
        meta: dict[str, Any] = {
            "id": sample.rid,
            "finish_reason": sample.finish,
            "prompt_tokens": len(ids),
            "weight_version": out.weight_version,
            "num_retractions": 0,
        }
        if job.return_logprob:
            logprobs = {
                **self._prompt_logprobs(job, ids, out, with_text),
                **self._output_logprobs(job, sample, out, with_text),
            }
            order = (
                "input_token_logprobs",
                "output_token_logprobs",
                "output_token_logprobs_length",
                "input_top_logprobs",
                "output_top_logprobs",
                "input_token_ids_logprobs",
                "output_token_ids_logprobs",
            )
            meta.update((key, logprobs[key]) for key in order if key in logprobs)
        spans = [
            {"version": s.version, "start": s.start, "end": min(s.end, sample.cut)}
            for s in out.weight_versions
            if s.start < sample.cut
        ] or [{"version": out.weight_version, "start": 0, "end": 0}]
        cached = out.num_cached_tokens
        meta.update(
            reasoning_tokens=0,
            completion_tokens=len(sample.completion),
            cached_tokens=cached,
            weight_versions=spans,
            cached_tokens_details={"device": cached, "host": 0} if cached else None,
        )
        if out.routed_experts is not None:
            rows = len(ids) + len(sample.completion) - 1 - gen.routed_experts_start_len
            routing = np.ascontiguousarray(out.routed_experts[: max(rows, 0)], dtype="<i4")
            meta["routed_experts"] = base64.b64encode(routing.tobytes()).decode("ascii")
        meta.update(dp_rank=None, e2e_latency=time.monotonic() - started, response_sent_to_client_ts=time.time())
        answer: dict[str, Any] = {"text": sample.text, "output_ids": list(sample.completion), "meta_info": meta}
        if gen.return_prompt_token_ids:
            answer["prompt_token_ids"] = list(ids)
        return answer
