"""``driver.check_delta`` (finiteness of a small delta tested with one Python sum, the dtype by identity first)
against the numpy-only check kept here as the reference: the same deltas pass and the same error is raised, for
NaN and infinities anywhere, the largest float32 values, the sizes around the switch to numpy, other dtypes and
shapes, and bad ids."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from backends_core import ResponseParseError, StreamDelta
from backends_core.driver import check_delta

MAX32 = float(np.finfo(np.float32).max)


def reference(delta: Any, *, where: str, url: str | None) -> None:
    ids = delta.completion_ids
    if not isinstance(ids, tuple) or not (set(map(type, ids)) <= {int} and (not ids or min(ids) >= 0)):
        bad = next((t for t in ids if not (type(t) is int and t >= 0)), ids)
        raise ResponseParseError(f"{where}: completion id {bad!r} is not a token id", url=url)
    lp = delta.logprobs
    if not isinstance(lp, np.ndarray) or lp.dtype != np.float32 or lp.ndim != 1:
        raise ResponseParseError(f"{where}: logprobs must be a 1-D float32 array", url=url)
    if lp.shape[0] != len(ids):
        raise ResponseParseError(f"{where}: {lp.shape[0]} logprobs for {len(ids)} completion ids", url=url)
    if lp.size and not np.isfinite(lp).all():
        bad = int(np.flatnonzero(~np.isfinite(lp))[0])
        raise ResponseParseError(f"{where}: logprob at position {bad} of the delta is {lp[bad]} (not finite)", url=url)


def outcome(check: Any, delta: Any) -> str | None:
    try:
        check(delta, where="stream delta 3", url="http://s")
    except ResponseParseError as exc:
        return str(exc)
    return None


class Delta:
    """A delta as a backend might hand over anything (StreamDelta itself checks nothing)."""

    def __init__(self, ids: Any, logprobs: Any) -> None:
        self.completion_ids, self.logprobs = ids, logprobs


def cases() -> list[Any]:
    out: list[Any] = []
    for n in (0, 1, 2, 63, 64, 65, 200):
        base = -np.linspace(0.0, 5.0, n).astype(np.float32)
        out.append(StreamDelta(completion_ids=tuple(range(n)), logprobs=base))
        for bad in (np.nan, np.inf, -np.inf):
            for at in {0, n // 2, n - 1} if n else set():
                lp = base.copy()
                lp[at] = bad
                out.append(StreamDelta(completion_ids=tuple(range(n)), logprobs=lp))
        if n:
            out.append(StreamDelta(completion_ids=tuple(range(n)), logprobs=np.full(n, -MAX32, np.float32)))
            out.append(StreamDelta(completion_ids=tuple(range(n)), logprobs=np.full(n, MAX32, np.float32)))
    out += [
        Delta((1,), np.array([-0.5])),  # float64
        Delta((1,), np.array([[-0.5]], np.float32)),  # 2-D
        Delta((1,), np.array([-0.5], np.dtype(">f4"))),  # float32, other byte order
        Delta((1,), [-0.5]),  # not an array
        Delta((1, 2), np.array([-0.5], np.float32)),
        Delta((True,), np.array([-0.5], np.float32)),
        Delta((-1,), np.array([-0.5], np.float32)),
        Delta([1], np.array([-0.5], np.float32)),
    ]
    return out


@pytest.mark.parametrize("delta", cases())
def test_the_check_passes_and_refuses_what_the_numpy_check_does(delta: Any) -> None:
    assert outcome(check_delta, delta) == outcome(reference, delta)
