"""Data types of the reference engine: requests, outputs, state snapshots and errors."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import attrs
import numpy as np
import numpy.typing as npt

__all__ = [
    "DEFAULT_WEIGHT_VERSION",
    "EngineError",
    "EngineOutput",
    "EngineRequest",
    "EngineRequestError",
    "EngineState",
    "EngineStep",
    "FinishReason",
    "PauseMode",
    "TopLogprobs",
    "WeightSpan",
]

FinishReason = Literal["stop", "length", "abort"]
PauseMode = Literal["abort", "wait", "keep"]
TopLogprobs = list[list[tuple[int, float]]]

DEFAULT_WEIGHT_VERSION = "default"


class EngineError(Exception):
    """Base class of engine errors."""


class EngineRequestError(EngineError, ValueError):
    """The request (or admin call) is invalid: bad token ids, lengths, parameters or adapter names."""


def _int_tuple(values: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


def _str_tuple(values: Any) -> tuple[str, ...]:
    return tuple(values)


def _bias(values: Mapping[int, float]) -> dict[int, float]:
    return {int(k): float(v) for k, v in values.items()}


@attrs.frozen(kw_only=True)
class EngineRequest:
    """One generation request in token space.

    :ivar prompt_ids: the prompt token ids (non-empty, each ``< vocab_size``).
    :ivar max_tokens: the most completion tokens to generate (``0`` = only score the prompt).
    :ivar temperature: sampling temperature; ``0`` = greedy.
    :ivar top_k: keep the k most likely tokens (``<= 0`` = off).
    :ivar top_p: nucleus sampling threshold in ``(0, 1]``.
    :ivar min_p: drop tokens below ``min_p`` × the top probability.
    :ivar seed: seed of this request's sampler; ``None`` draws one from the engine's generator.
    :ivar stop_token_ids: extra ids that end generation (the matched id is kept in the output).
    :ivar stop: strings that end generation once the completion's decoded text (special tokens skipped) holds
        one, looked for in the text of tokens past ``min_tokens``; the token completing it is kept in the output.
    :ivar logit_bias: token id -> bias added to its logit before sampling (logprobs stay the raw ones).
    :ivar ignore_eos: keep going past EOS tokens.
    :ivar min_tokens: EOS / stop ids are not sampled before this many tokens.
    :ivar logprobs: ``None`` = no logprobs; ``0`` = the sampled token's; ``k`` = plus top-k alternatives.
    :ivar prompt_logprobs: same for prompt tokens.
    :ivar return_routed_experts: MoE models: return the experts chosen for every token.
    :ivar routed_experts_start: first absolute position whose routing is returned.
    :ivar lora: name of a loaded LoRA adapter.
    :ivar request_id: caller's id; a uuid is assigned when ``None``.
    """

    prompt_ids: tuple[int, ...] = attrs.field(converter=_int_tuple)
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_int_tuple)
    stop: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    logit_bias: Mapping[int, float] = attrs.field(factory=dict, converter=_bias, hash=False)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    return_routed_experts: bool = False
    routed_experts_start: int = 0
    lora: str | None = None
    request_id: str | None = None


@attrs.frozen(kw_only=True)
class WeightSpan:
    """Completion positions ``[start, end)`` that were generated with weight version ``version``."""

    version: str
    start: int
    end: int


@attrs.frozen(kw_only=True)
class EngineOutput:
    """A finished request.

    :ivar logprobs: ``float32 [len(completion_ids)]`` raw logprobs of the sampled tokens.
    :ivar top_logprobs: per completion token, the top-k ``(id, logprob)`` pairs, best first
        (only when ``logprobs >= 1``).
    :ivar prompt_logprobs: ``float32 [len(prompt_ids)]``, entry 0 is NaN.
    :ivar prompt_top_logprobs: per prompt token, top-k pairs (entry 0 empty; only when ``prompt_logprobs >= 1``).
    :ivar routed_experts: ``int32 [len(prompt)+len(completion)-1-start, layers, top_k]``; row ``i`` is
        the routing of the token at absolute position ``start + i`` (the last sampled token has none).
        A request aborted before its prefill has fewer rows (those computed).
    :ivar stop_reason: the EOS / stop token id, or the stop string, that ended the request, if any.
    :ivar weight_version: the engine's weight version when the request finished.
    :ivar weight_versions: spans of completion positions per weight version.
    :ivar num_cached_tokens: prompt tokens served from the prefix cache.
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    finish_reason: FinishReason
    stop_reason: int | str | None = None
    logprobs: npt.NDArray[np.float32] | None = None
    top_logprobs: TopLogprobs | None = None
    prompt_logprobs: npt.NDArray[np.float32] | None = None
    prompt_top_logprobs: TopLogprobs | None = None
    routed_experts: npt.NDArray[np.int32] | None = None
    weight_version: str = DEFAULT_WEIGHT_VERSION
    weight_versions: tuple[WeightSpan, ...] = ()
    num_cached_tokens: int = 0


@attrs.frozen(kw_only=True)
class EngineStep:
    """Tokens a streamed request produced since the previous step it reported.

    :ivar completion_ids: the new tokens.
    :ivar logprobs: their raw logprobs (``None`` unless the request asked for logprobs).
    :ivar top_logprobs: their top-k pairs (only when ``logprobs >= 1``).
    """

    completion_ids: tuple[int, ...]
    logprobs: npt.NDArray[np.float32] | None = None
    top_logprobs: TopLogprobs | None = None


@attrs.frozen(kw_only=True)
class EngineState:
    """A snapshot of the engine's control state."""

    paused: bool
    pause_mode: PauseMode | None
    sleeping: bool
    sleep_level: int | None
    weight_version: str
    in_flight: int
    queued: int
    loras: tuple[str, ...]
