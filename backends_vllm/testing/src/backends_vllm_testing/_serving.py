"""The generation routes, ``POST /v1/completions`` and ``POST /inference/v1/generate``, over the engine.

Behaviour reproduced from the vLLM 0.32 captures:

* ids: completions answer ``cmpl-<request_id>`` and abort per prompt as ``cmpl-<request_id>-<index>``;
  generate answers and aborts as ``generate-tokens-<request_id>`` (random 16 hex digits without an id);
* ``/v1/completions`` fills omitted ``temperature`` / ``top_k`` / ``top_p`` / ``min_p`` from the model's
  ``generation_config.json`` (the trap); ``/inference/v1/generate`` never does, and an omitted
  ``max_tokens`` there fills the context;
* ``n`` samples with a seed use ``seed + i``; EOS stops report ``stop_reason: null``, other stop ids the id;
* logprob shapes and orderings as described in :mod:`._formatting`;
* ``stream: true`` (one prompt, ``n`` 1): Server-Sent Events as vLLM sends them, one chunk per engine step with its
  new ``token_ids`` and logprobs, the finish reason (and ``weight_versions``, routed experts on generate) on the
  chunk of the last token, a usage chunk with ``stream_options.include_usage``, then ``[DONE]``; a client that
  leaves aborts the engine request.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from backends_testkit.engine import EngineOutput, EngineRequest, EngineStep, EngineStream, ReferenceEngine
from backends_vllm_testing._errors import HttpError, bad_request, not_found
from backends_vllm_testing._formatting import Detokenizer, Position, npy_base64
from backends_vllm_testing._protocol import COMPLETION_REQUEST, GENERATE_REQUEST, NEUTRAL, SAMPLING_PARAMS

__all__ = ["MAX_LOGPROBS", "Serving"]

MAX_LOGPROBS = 20
"""vLLM's default ``--max-logprobs``."""

VERSION = "0.32.0"
_GENERATION_CONFIG_FIELDS = ("temperature", "top_k", "top_p", "min_p")
_GREEDY_TEMPERATURE = 1e-5
"""vLLM's (and the reference engine's) threshold below which sampling is greedy."""


@attrs.frozen
class _Sampling:
    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    max_tokens: int | None
    min_tokens: int
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    logprobs: int | None
    prompt_logprobs: int | None
    logprob_token_ids: tuple[int, ...]
    stop: tuple[str, ...] = ()
    logit_bias: Mapping[int, float] = attrs.field(factory=dict)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    value = json.loads(path.read_text(encoding="utf-8"))
    return value if isinstance(value, dict) else {}


def _random_id() -> str:
    return uuid.uuid4().hex[:16]


class Serving:
    """Generation state shared by the emulator's routes: the engine, the tokenizer and the in-flight ids."""

    def __init__(
        self,
        engine: ReferenceEngine,
        *,
        served_model_name: str,
        max_model_len: int,
        return_routed_experts: bool,
        generation_config_defaults: bool,
        exact_ranks: bool = True,
    ) -> None:
        self.engine = engine
        self.exact_ranks = exact_ranks
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.return_routed_experts = return_routed_experts and engine.is_moe
        self.detok = Detokenizer(engine.model_dir)
        config = _read_json(engine.model_dir / "config.json")
        eos = config.get("eos_token_id")
        self.primary_eos: int | None = eos if isinstance(eos, int) else (eos[0] if eos else None)
        self.num_experts = int(config.get("num_experts") or 0)
        generation_config = _read_json(engine.model_dir / "generation_config.json")
        self.generation_defaults: dict[str, Any] = (
            {k: generation_config[k] for k in _GENERATION_CONFIG_FIELDS if generation_config.get(k) is not None}
            if generation_config_defaults
            else {}
        )
        self.fingerprint = f"vllm-{VERSION}-{uuid.uuid5(uuid.NAMESPACE_URL, served_model_name).hex[:8]}"
        #: server-side request id (what ``/abort_requests`` takes) -> engine request ids in flight
        self.in_flight: dict[str, list[str]] = {}
        #: every engine request submitted, newest last (a spy for tests)
        self.engine_requests: deque[EngineRequest] = deque(maxlen=1000)
        #: ``"<path>: <field>"`` of request fields vLLM would ignore (it only logs them)
        self.ignored_fields: deque[str] = deque(maxlen=1000)
        self._counter = itertools.count()

    # -- shared checks -----------------------------------------------------------------------------------

    def resolve_model(self, name: str | None) -> tuple[str, str | None]:
        """``(response model name, LoRA adapter or None)``; an unknown name is vLLM's 404."""
        if name is None or name == self.served_model_name:
            return self.served_model_name, None
        if name in self.engine.loras:
            return name, name
        raise not_found(f"The model `{name}` does not exist. Valid aliases: {self.served_model_name}.", "model")

    def _ignored(self, path: str, names: Sequence[str]) -> None:
        self.ignored_fields.extend(f"{path}: {name}" for name in names)

    @staticmethod
    def _neutral(values: Mapping[str, Any], prefix: str = "") -> None:
        for name, allowed in NEUTRAL.items():
            if name in values and values[name] not in allowed:
                raise bad_request(
                    f"The vLLM emulator does not implement '{prefix}{name}' (got {values[name]!r}); "
                    f"only its neutral value {allowed[0]!r} is accepted.",
                    f"{prefix}{name}",
                )

    def _logprobs_count(self, value: int | None, name: str, kind: str) -> int | None:
        if value is None:
            return None
        if value == -1:
            value = self.engine.vocab_size
        if value < 0:
            raise bad_request(
                f"{name} must be non-negative or -1, got {value}. (parameter={name}, value={value})", name
            )
        if value > MAX_LOGPROBS:
            raise bad_request(
                f"Requested {kind} logprobs of {value}, which is greater than max allowed: {MAX_LOGPROBS} "
                f"(parameter={name}, value={value})",
                name,
            )
        return value

    def _sampling(self, values: Mapping[str, Any], *, defaults: Mapping[str, Any]) -> _Sampling:
        def pick(name: str, fallback: Any) -> Any:
            value = values.get(name)
            if value is None:
                value = defaults.get(name, fallback)
            return value

        def fail(name: str, message: str, value: Any) -> HttpError:
            return bad_request(f"{message} (parameter={name}, value={value})", name)

        n = int(values.get("n", 1))
        temperature = float(pick("temperature", 1.0))
        top_p = float(pick("top_p", 1.0))
        top_k = int(pick("top_k", 0))
        min_p = float(pick("min_p", 0.0))
        max_tokens = values.get("max_tokens")
        min_tokens = int(values.get("min_tokens") or 0)
        if n < 1:
            raise fail("n", f"n must be at least 1, got {n}.", n)
        if temperature < 0:
            raise fail("temperature", f"temperature must be non-negative, got {temperature}.", temperature)
        if not 0.0 < top_p <= 1.0:
            raise fail("top_p", f"top_p must be in (0, 1], got {top_p}.", top_p)
        if top_k < -1:
            raise fail("top_k", f"top_k must be 0 or -1 (disable), or at least 1, got {top_k}.", top_k)
        if not 0.0 <= min_p <= 1.0:
            raise fail("min_p", f"min_p must be in [0, 1], got {min_p}.", min_p)
        if max_tokens is not None and max_tokens < 1:
            raise fail("max_tokens", f"max_tokens must be at least 1, got {max_tokens}.", max_tokens)
        if min_tokens < 0:
            raise fail("min_tokens", f"min_tokens must be greater than or equal to 0, got {min_tokens}.", min_tokens)
        if max_tokens is not None and min_tokens > max_tokens:
            raise fail(
                "min_tokens",
                f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.",
                min_tokens,
            )
        extra = tuple(values.get("logprob_token_ids") or ())
        stop_ids = tuple(values.get("stop_token_ids") or ())
        stop = self._stop_strings(values.get("stop"))
        for token in (*extra, *stop_ids):
            if not 0 <= token < self.engine.vocab_size:
                raise bad_request(f"Token id {token} is out of vocabulary")
        return _Sampling(
            n=n,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k if top_k > 0 else -1,
            min_p=min_p,
            seed=values.get("seed"),
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            stop_token_ids=stop_ids,
            ignore_eos=bool(values.get("ignore_eos", False)),
            logprobs=self._logprobs_count(values.get("logprobs"), "logprobs", "sample"),
            prompt_logprobs=self._logprobs_count(values.get("prompt_logprobs"), "prompt_logprobs", "prompt"),
            logprob_token_ids=extra,
            stop=stop,
            logit_bias=self._logit_bias(values.get("logit_bias")),
        )

    @staticmethod
    def _stop_strings(value: Any) -> tuple[str, ...]:
        """vLLM's ``stop``: a string or a list of strings; an empty one is refused."""
        if value is None:
            return ()
        strings = (value,) if isinstance(value, str) else tuple(value)
        if not all(isinstance(x, str) for x in strings):
            raise bad_request("stop must be a string or a list of strings.", "stop")
        if any(not x for x in strings):
            raise bad_request("stop cannot contain an empty string.", "stop")
        return strings

    def _logit_bias(self, value: Any) -> dict[int, float]:
        """vLLM's ``logit_bias``: token ids (JSON keys) to biases, clamped to [-100, 100]; ids must be in the
        vocabulary."""
        if not value:
            return {}
        if not isinstance(value, Mapping):
            raise bad_request("logit_bias must be an object of token id to bias.", "logit_bias")
        out: dict[int, float] = {}
        for key, bias in value.items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                raise bad_request(
                    f"logit_bias contains key(s) that cannot be converted to int: {key!r}", "logit_bias"
                ) from None
            out[token] = min(100.0, max(-100.0, float(bias)))
        invalid = [t for t in out if not 0 <= t < self.engine.vocab_size]
        if invalid:
            raise bad_request(
                f"token_id(s) {invalid} in logit_bias contain out-of-vocab token ids. Vocabulary size: "
                f"{self.engine.vocab_size}",
                "logit_bias",
            )
        return out

    def _max_tokens(self, prompt: Sequence[int], max_tokens: int | None) -> int:
        if not prompt:
            raise bad_request("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
        bad = [t for t in prompt if not 0 <= t < self.engine.vocab_size]
        if bad:
            raise bad_request(f"Token id {max(bad, key=abs)} is out of vocabulary")
        n, limit = len(prompt), self.max_model_len
        if n > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, your prompt contains {n} input "
                "tokens, which exceeds this limit even without any output tokens. Please reduce the length of the "
                f"input prompt. (parameter=input_tokens, value={n})",
                "input_tokens",
            )
        wanted = limit - n if max_tokens is None else max_tokens
        if wanted < 1 or n + wanted > limit:
            wanted = max(wanted, 1)
            raise bad_request(
                f"'max_tokens' or 'max_completion_tokens' is too large: {wanted}. This model's maximum context "
                f"length is {limit} tokens and your request has {n} input tokens ({wanted} > {limit} - {n}). "
                f"(parameter=max_tokens, value={wanted})",
                "max_tokens",
            )
        return wanted

    @staticmethod
    def _priority(priority: int) -> None:
        if priority != 0:
            raise bad_request(f"Got priority {priority} but Priority scheduling is not enabled.", "priority")

    def _routing_start(self, start: int, prompt: Sequence[int]) -> int:
        if self.return_routed_experts and start >= len(prompt):
            raise bad_request(
                f"routed_experts_prompt_start ({start}) must be smaller than the prompt length ({len(prompt)})",
                "routed_experts_prompt_start",
            )
        return start

    def _logprobs_depth(self, s: _Sampling) -> int | None:
        """How much of each sampled position's distribution to ask the engine for: enough to show the top-k and
        to know the sampled token's rank. Greedy tokens rank 1 and top-k samples rank <= k (plus any ids banned
        by ``min_tokens``); otherwise only the whole distribution tells the rank."""
        full = self.engine.vocab_size
        if s.logprobs is None and not s.logprob_token_ids:
            return None
        if s.logprob_token_ids:
            return full
        if s.logit_bias and self.exact_ranks:  # biased sampling: the raw rank can be anything
            bound = full
        elif not self.exact_ranks or (s.temperature < _GREEDY_TEMPERATURE and s.min_tokens == 0):
            bound = 1
        elif s.top_k > 0:
            bound = s.top_k + (len(s.stop_token_ids) + len(self.engine.eos_token_ids) if s.min_tokens else 0)
        else:
            bound = full
        return min(full, max(s.logprobs or 0, bound))

    def _prompt_depth(self, k: int | None) -> int | None:
        if k is None:
            return None
        return self.engine.vocab_size if self.exact_ranks else max(k, 1)

    def _requests(
        self,
        server_id: str,
        prompt: Sequence[int],
        s: _Sampling,
        *,
        max_tokens: int,
        lora: str | None,
        routing_start: int,
        prompt_k: int | None,
    ) -> list[EngineRequest]:
        depth = self._logprobs_depth(s)
        return [
            EngineRequest(
                prompt_ids=tuple(prompt),
                max_tokens=max_tokens,
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=s.top_k,
                min_p=s.min_p,
                seed=None if s.seed is None else (s.seed + i) % 2**64,
                stop_token_ids=s.stop_token_ids,
                stop=s.stop,
                logit_bias=s.logit_bias,
                ignore_eos=s.ignore_eos,
                min_tokens=min(s.min_tokens, max_tokens),
                logprobs=depth,
                prompt_logprobs=self._prompt_depth(prompt_k),
                return_routed_experts=self.return_routed_experts,
                routed_experts_start=routing_start if self.return_routed_experts else 0,
                lora=lora,
                request_id=f"{server_id}#{next(self._counter)}",
            )
            for i in range(s.n)
        ]

    async def _run(self, server_id: str, requests: list[EngineRequest]) -> list[EngineOutput]:
        self.engine_requests.extend(requests)
        engine_ids = [r.request_id for r in requests if r.request_id is not None]
        self.in_flight.setdefault(server_id, []).extend(engine_ids)
        try:
            results = await asyncio.gather(*(self.engine.generate(r) for r in requests), return_exceptions=True)
        finally:
            left = [i for i in self.in_flight.get(server_id, []) if i not in engine_ids]
            if left:
                self.in_flight[server_id] = left
            else:
                self.in_flight.pop(server_id, None)
        outputs: list[EngineOutput] = []
        for result in results:
            if isinstance(result, BaseException):
                raise result
            outputs.append(result)
        return outputs

    def abort(self, server_ids: Sequence[str] | None) -> int:
        """Abort by server-side ids (unknown ids are silently ignored), or everything; returns vLLM's count:
        the number of ids sent, or of tracked requests."""
        targets = list(self.in_flight) if server_ids is None else list(server_ids)
        for server_id in targets:
            for engine_id in self.in_flight.get(server_id, ()):
                self.engine.abort(engine_id)
        return len(targets)

    def _stop_reason(self, out: EngineOutput, s: _Sampling) -> int | str | None:
        if out.stop_reason is None or (out.stop_reason == self.primary_eos and not s.ignore_eos):
            return None
        return out.stop_reason

    def _routed(self, out: EngineOutput) -> str | None:
        if out.routed_experts is None:
            return None
        return npy_base64(out.routed_experts, self.num_experts)

    def _prompt_positions(self, out: EngineOutput) -> list[Position | None] | None:
        if out.prompt_top_logprobs is None or out.prompt_logprobs is None:
            return None
        fallbacks = out.prompt_logprobs.tolist() if not self.exact_ranks else [None] * len(out.prompt_logprobs)
        return [None, *(Position(row, fb) for row, fb in zip(out.prompt_top_logprobs[1:], fallbacks[1:], strict=True))]

    def _positions(self, out: EngineOutput, count: int) -> list[Position]:
        rows = (out.top_logprobs or [])[:count]
        if self.exact_ranks or out.logprobs is None:
            return [Position(row) for row in rows]
        return [Position(row, fb) for row, fb in zip(rows, out.logprobs.tolist(), strict=False)]

    @staticmethod
    def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        return {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        }

    # -- /v1/completions ---------------------------------------------------------------------------------

    def _prompts(self, prompt: Any) -> list[list[int]]:
        if prompt is None:
            raise bad_request("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
        if isinstance(prompt, str):
            return [self.detok.encode(prompt)]
        if prompt and all(isinstance(p, str) for p in prompt):
            return [self.detok.encode(p) for p in prompt]
        if prompt and all(isinstance(p, list) for p in prompt):
            return [list(p) for p in prompt]
        return [list(prompt)]

    async def completions(self, body: Any) -> dict[str, Any] | AsyncGenerator[dict[str, Any], None]:
        values, ignored = COMPLETION_REQUEST(body, ("body",))
        self._ignored("/v1/completions", ignored)
        self._neutral(values)
        model_name, lora = self.resolve_model(values["model"])
        echo = bool(values["echo"])
        requested_max = values["max_tokens"]
        echo_only = echo and requested_max == 0  # vLLM generates one token and shows only the prompt
        s = self._sampling(
            {**values, "max_tokens": 1 if echo_only else requested_max}, defaults=self.generation_defaults
        )
        self._priority(values["priority"])
        prompts = self._prompts(values["prompt"])
        limits = [self._max_tokens(p, s.max_tokens) for p in prompts]
        starts = [self._routing_start(values["routed_experts_prompt_start"], p) for p in prompts]
        echo_k = s.logprobs if echo else None
        prompt_k = s.prompt_logprobs if s.prompt_logprobs is not None else echo_k
        rid = values["request_id"] or _random_id()
        if values["stream"]:
            self._stream_shape(len(prompts), s)
            server_id = f"cmpl-{rid}-0"
            (request,) = self._requests(
                server_id, prompts[0], s, max_tokens=limits[0], lora=lora, routing_start=starts[0], prompt_k=None
            )
            return self._completions_stream(
                server_id, f"cmpl-{rid}", model_name, prompts[0], request, s, values, self._follow(server_id, request)
            )
        runs = [
            self._run(
                f"cmpl-{rid}-{i}",
                self._requests(
                    f"cmpl-{rid}-{i}",
                    prompt,
                    s,
                    max_tokens=limit,
                    lora=lora,
                    routing_start=start,
                    prompt_k=prompt_k,
                ),
            )
            for i, (prompt, limit, start) in enumerate(zip(prompts, limits, starts, strict=True))
        ]
        per_prompt = await asyncio.gather(*runs)
        return_ids = bool(values["return_token_ids"])
        choices: list[dict[str, Any]] = []
        completion_tokens = 0
        for prompt, outputs in zip(prompts, per_prompt, strict=True):
            for out in outputs:
                completion_tokens += len(out.completion_ids)
                choices.append(
                    self._completion_choice(
                        len(choices), prompt, out, s, values, echo=echo, echo_only=echo_only, prompt_k=prompt_k
                    )
                )
                if not return_ids:
                    choices[-1]["token_ids"] = choices[-1]["prompt_token_ids"] = None
        return {
            "id": f"cmpl-{rid}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": self.fingerprint,
            "usage": self._usage(sum(len(p) for p in prompts), completion_tokens),
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }

    def _completion_choice(
        self,
        index: int,
        prompt: Sequence[int],
        out: EngineOutput,
        s: _Sampling,
        values: Mapping[str, Any],
        *,
        echo: bool,
        echo_only: bool,
        prompt_k: int | None,
    ) -> dict[str, Any]:
        completion = () if echo_only else out.completion_ids
        text = self.detok.text(completion, skip_special_tokens=values["skip_special_tokens"])
        prompt_positions = self._prompt_positions(out)
        logprobs = None
        if s.logprobs is not None or s.logprob_token_ids:
            ids: list[int] = list(completion)
            positions: list[Position | None] = [*self._positions(out, len(completion))]
            if echo and prompt_positions is not None:
                ids, positions = [*prompt, *ids], [*prompt_positions, *positions]
            logprobs = self.detok.legacy(
                ids,
                positions,
                s.logprobs or 0,
                extra=s.logprob_token_ids,
                as_token_ids=bool(values["return_tokens_as_token_ids"]),
            )
        if echo:
            text = self.detok.text(prompt, skip_special_tokens=False) + text
        prompt_logprobs = None
        if prompt_k is not None and prompt_positions is not None:
            prompt_logprobs = self.detok.prompt_logprobs(prompt, prompt_positions, prompt_k)
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": out.finish_reason,
            "stop_reason": self._stop_reason(out, s),
            "token_ids": list(completion),
            "prompt_logprobs": prompt_logprobs,
            "prompt_token_ids": list(prompt),
            "routed_experts": self._routed(out),
        }

    # -- /inference/v1/generate --------------------------------------------------------------------------

    async def generate(self, body: Any) -> dict[str, Any] | AsyncGenerator[dict[str, Any], None]:
        values, ignored = GENERATE_REQUEST(body, ("body",))
        self._ignored("/inference/v1/generate", ignored)
        params, ignored_params = SAMPLING_PARAMS(values["sampling_params"], ("body", "sampling_params"))
        self._ignored("/inference/v1/generate", [f"sampling_params.{name}" for name in ignored_params])
        self._neutral(values)
        self._neutral(params, "sampling_params.")
        model_name, lora = self.resolve_model(values["model"])
        s = self._sampling(params, defaults={})
        self._priority(values["priority"])
        mode = values["output_mode"]
        if s.stop and not params["detokenize"]:
            raise bad_request(
                "stop strings are only supported when detokenize is True. Set detokenize=True to use stop.",
                "sampling_params.stop",
            )
        if mode == "text" and not params["detokenize"]:
            raise bad_request("output_mode 'text' needs sampling_params.detokenize to be true", "output_mode")
        prompt = values["token_ids"]
        max_tokens = self._max_tokens(prompt, s.max_tokens)
        if params["routed_experts_prompt_start"] < 0:
            raise bad_request("routed_experts_prompt_start must be >= 0", "sampling_params.routed_experts_prompt_start")
        start = self._routing_start(params["routed_experts_prompt_start"], prompt)
        server_id = f"generate-tokens-{values['request_id'] or _random_id()}"
        requests = self._requests(
            server_id,
            prompt,
            s,
            max_tokens=max_tokens,
            lora=lora,
            routing_start=start,
            prompt_k=s.prompt_logprobs,
        )
        if values["stream"]:
            self._stream_shape(1, s)
            return self._generate_stream(
                server_id, prompt, requests[0], s, mode, params, values, self._follow(server_id, requests[0])
            )
        outputs = await self._run(server_id, requests)
        first = outputs[0]
        prompt_positions = self._prompt_positions(first)
        prompt_logprobs = None
        if s.prompt_logprobs is not None and prompt_positions is not None:
            prompt_logprobs = self.detok.prompt_logprobs(prompt, prompt_positions, s.prompt_logprobs)
        return {
            "request_id": server_id,
            "model": model_name,
            "created": int(time.time()),
            "usage": self._usage(len(prompt), sum(len(o.completion_ids) for o in outputs)),
            "prompt_logprobs": prompt_logprobs,
            "prompt_token_id_logprobs": None,
            "prompt_token_ids": list(prompt) if values["return_token_ids"] else None,
            "mm_placeholders": None,
            "metrics": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "output_mode": mode,
            "choices": [self._generate_choice(i, out, s, mode, params) for i, out in enumerate(outputs)],
        }

    def _generate_choice(
        self, index: int, out: EngineOutput, s: _Sampling, mode: str, params: Mapping[str, Any]
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": index,
            "finish_reason": out.finish_reason,
            "stop_reason": self._stop_reason(out, s),
            "token_ids": list(out.completion_ids),
            "routed_experts": self._routed(out),
            "sampling_mask": None,
            "weight_versions": [{"version": w.version, "start": w.start, "end": w.end} for w in out.weight_versions],
        }
        if mode == "text":
            choice["text"] = self.detok.text(out.completion_ids, skip_special_tokens=params["skip_special_tokens"])
        logprobs = None
        if s.logprobs is not None or s.logprob_token_ids:
            positions = self._positions(out, len(out.completion_ids))
            k, extra = s.logprobs or 0, s.logprob_token_ids
            content = (
                self.detok.text_content(out.completion_ids, positions, k, extra)
                if mode == "text"
                else self.detok.generate_content(out.completion_ids, positions, k, extra)
            )
            logprobs = {"content": content}
        choice["logprobs"] = logprobs
        return choice

    # -- streaming ---------------------------------------------------------------------------------------

    @staticmethod
    def _stream_shape(prompts: int, s: _Sampling) -> None:
        if prompts != 1 or s.n != 1:
            raise bad_request(
                f"The vLLM emulator streams one prompt with n = 1 (got {prompts} prompt(s), n = {s.n}).", "stream"
            )

    def _follow(self, server_id: str, request: EngineRequest) -> EngineStream:
        """The engine request queued now (a refusal is an error before streaming), tracked for abort."""
        stream = self.engine.generate_stream(request)
        self.engine_requests.append(request)
        assert request.request_id is not None
        self.in_flight.setdefault(server_id, []).append(request.request_id)
        return stream

    def _forget(self, server_id: str, request: EngineRequest) -> None:
        left = [i for i in self.in_flight.get(server_id, []) if i != request.request_id]
        if left:
            self.in_flight[server_id] = left
        else:
            self.in_flight.pop(server_id, None)

    def _step_positions(self, step: EngineStep) -> list[Position]:
        rows = step.top_logprobs or []
        if self.exact_ranks or step.logprobs is None:
            return [Position(row) for row in rows]
        return [Position(row, fb) for row, fb in zip(rows, step.logprobs.tolist(), strict=False)]

    @staticmethod
    async def _steps(
        steps: EngineStream,
    ) -> AsyncGenerator[tuple[list[int], EngineStep | None, EngineOutput | None], None]:
        """``(ids, step, output)`` as vLLM reports them: the last step's tokens come with the output (the chunk of
        the last token carries the finish reason); an output without tokens left (an abort) comes alone."""
        held: EngineStep | None = None
        try:
            async for event in steps:
                if isinstance(event, EngineStep):
                    if held is not None:
                        yield list(held.completion_ids), held, None
                    held = event
                    continue
                yield (list(held.completion_ids) if held else []), held, event
                return
        finally:
            await steps.aclose()

    async def _generate_stream(
        self,
        server_id: str,
        prompt: Sequence[int],
        request: EngineRequest,
        s: _Sampling,
        mode: str,
        params: Mapping[str, Any],
        values: Mapping[str, Any],
        steps: EngineStream,
    ) -> AsyncGenerator[dict[str, Any], None]:
        first = True
        generated = 0
        options = values["stream_options"] or {}
        try:
            async for ids, step, out in self._steps(steps):
                generated += len(ids)
                choice: dict[str, Any] = {
                    "index": 0,
                    "finish_reason": out.finish_reason if out else None,
                    "stop_reason": self._stop_reason(out, s) if out else None,
                    "token_ids": ids,
                    "routed_experts": self._routed(out) if out else None,
                    "sampling_mask": None,
                    "weight_versions": [
                        {"version": w.version, "start": w.start, "end": w.end} for w in out.weight_versions
                    ]
                    if out
                    else None,
                }
                if mode == "text":
                    choice["text"] = self.detok.text(ids, skip_special_tokens=params["skip_special_tokens"])
                logprobs = None
                if s.logprobs is not None and step is not None:
                    positions = self._step_positions(step)
                    k = s.logprobs or 0
                    content = (
                        self.detok.text_content(ids, positions, k, s.logprob_token_ids)
                        if mode == "text"
                        else self.detok.generate_content(ids, positions, k, s.logprob_token_ids)
                    )
                    logprobs = {"content": content}
                elif s.logprobs is not None:
                    logprobs = {"content": []}
                choice["logprobs"] = logprobs
                chunk: dict[str, Any] = {"request_id": server_id, "usage": None}
                if first and values["return_token_ids"]:
                    chunk["prompt_token_ids"] = list(prompt)
                first = False
                chunk["output_mode"] = mode
                chunk["choices"] = [choice]
                yield chunk
            if options.get("include_usage"):
                yield {
                    "request_id": server_id,
                    "usage": self._usage_sent(len(prompt), generated),
                    "output_mode": mode,
                    "choices": [],
                }
        finally:
            await steps.aclose()
            self._forget(server_id, request)

    async def _completions_stream(
        self,
        server_id: str,
        response_id: str,
        model_name: str,
        prompt: Sequence[int],
        request: EngineRequest,
        s: _Sampling,
        values: Mapping[str, Any],
        steps: EngineStream,
    ) -> AsyncGenerator[dict[str, Any], None]:
        created = int(time.time())
        first = True
        generated = 0
        offset = 0
        options = values["stream_options"] or {}
        return_ids = bool(values["return_token_ids"])
        try:
            async for ids, step, out in self._steps(steps):
                generated += len(ids)
                text = self.detok.text(ids, skip_special_tokens=values["skip_special_tokens"])
                logprobs = None
                if s.logprobs is not None or s.logprob_token_ids:
                    positions = self._step_positions(step) if step is not None else []
                    logprobs = self.detok.legacy(
                        ids,
                        [*positions],
                        s.logprobs or 0,
                        extra=s.logprob_token_ids,
                        as_token_ids=bool(values["return_tokens_as_token_ids"]),
                    )
                    logprobs["text_offset"] = [offset + o for o in logprobs["text_offset"]]
                offset += len(text)
                yield {
                    "id": response_id,
                    "object": "text_completion",
                    "created": created,
                    "model": model_name,
                    "choices": [
                        {
                            "index": 0,
                            "text": text,
                            "logprobs": logprobs,
                            "finish_reason": out.finish_reason if out else None,
                            "stop_reason": self._stop_reason(out, s) if out else None,
                            "prompt_token_ids": list(prompt) if first and return_ids else None,
                            "token_ids": ids if return_ids else None,
                        }
                    ],
                }
                first = False
            if options.get("include_usage"):
                yield {
                    "id": response_id,
                    "object": "text_completion",
                    "created": created,
                    "model": model_name,
                    "choices": [],
                    "usage": self._usage_sent(len(prompt), generated),
                    "system_fingerprint": self.fingerprint,
                }
        finally:
            await steps.aclose()
            self._forget(server_id, request)

    @staticmethod
    def _usage_sent(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        """The usage of a stream's last chunk (vLLM leaves out the null details there)."""
        return {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
        }
