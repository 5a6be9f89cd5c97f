"""Token sampling and log-probabilities over one row of logits (numpy, deterministic)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["GREEDY_TEMPERATURE", "log_softmax", "sample_token", "top_logprobs"]

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this sample greedily (argmax)."""

FloatArray = npt.NDArray[np.floating[Any]]


def log_softmax(logits: FloatArray) -> npt.NDArray[np.float64]:
    """Return ``log_softmax`` over the last axis, computed in float64."""
    x = np.asarray(logits, dtype=np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    out: npt.NDArray[np.float64] = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    return out


def top_logprobs(logprobs: npt.NDArray[np.float64], k: int) -> list[tuple[int, float]]:
    """Return the ``k`` most likely ``(token_id, logprob)`` pairs, best first (ties: lower id first)."""
    if k <= 0:
        return []
    k = min(k, logprobs.shape[-1])
    candidates = np.argpartition(-logprobs, k - 1)[:k]
    order = np.lexsort((candidates, -logprobs[candidates]))
    return [(int(candidates[i]), float(logprobs[candidates[i]])) for i in order]


def sample_token(
    logits: FloatArray,
    rng: np.random.Generator,
    *,
    temperature: float,
    top_k: int = -1,
    top_p: float = 1.0,
    min_p: float = 0.0,
    banned: Iterable[int] = (),
) -> int:
    """Pick the next token.

    Temperature scaling, then top-k, then min-p, then top-p (nucleus) filtering, then one draw from
    ``rng``. ``temperature < GREEDY_TEMPERATURE`` takes the argmax (lowest id on ties).

    :param logits: ``[vocab]`` raw logits.
    :param rng: the request's generator; exactly one ``rng.random()`` draw per sampled token.
    :param temperature: softmax temperature (``0`` = greedy).
    :param top_k: keep the ``k`` highest logits (``<= 0`` = off).
    :param top_p: keep the smallest set of tokens whose probability reaches ``top_p``.
    :param min_p: drop tokens whose probability is below ``min_p`` times the top probability.
    :param banned: ids that must not be sampled (e.g. EOS before ``min_tokens``).
    :returns: the sampled token id.
    """
    x = np.array(logits, dtype=np.float64)
    banned_ids = list(banned)
    if banned_ids:
        x[banned_ids] = -np.inf
    if temperature < GREEDY_TEMPERATURE:
        return int(np.argmax(x))
    x /= temperature
    if 0 < top_k < x.size:
        kth = np.partition(x, x.size - top_k)[x.size - top_k]
        x[x < kth] = -np.inf
    probs = np.exp(x - x.max())
    if min_p > 0.0:
        probs[probs < min_p * probs.max()] = 0.0
    if top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        keep = int(np.searchsorted(cumulative, top_p * cumulative[-1], side="left")) + 1
        probs[order[keep:]] = 0.0
    cdf = np.cumsum(probs)
    index = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return min(index, x.size - 1)
