"""Answer pieces in the shapes of the captures (Dynamo 1.6.1 frontend over its vLLM worker).

Logprob orderings, from the captures: a chat ``top_logprobs`` list and a completions ``top_logprobs`` dict
hold the sampled token first, then the best tokens other than it, ``k`` in all when the sampled token is among
the best ``k``, else ``k + 1``. ``prompt_logprobs`` rows hold the prompt token first, then the best ``k`` others,
each with its ``rank``. The OpenAI channel carries float32 values at float32 precision, ``engine_data`` the
same values as doubles. Routed experts: ``{data: base64 of little-endian int32, shape, start, dtype}``.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from backends_dynamo_testing._text import Text
from backends_testkit.engine import EngineOutput

__all__ = [
    "chat_logprob_entry",
    "completion_logprobs_block",
    "engine_data",
    "f32",
    "f32_double",
    "prompt_logprob_rows",
    "routed_record",
    "token_string",
]

_PLACEHOLDER = -9999.0


def f32(value: float) -> float:
    """A float32 value as the OpenAI channel prints it (shortest float32 text)."""
    return max(float(str(np.float32(value))), _PLACEHOLDER)


def f32_double(value: float) -> float:
    """A float32 value as ``engine_data`` prints it (the double of the float32)."""
    return max(float(np.float32(value)), _PLACEHOLDER)


def token_string(text: Text, token_id: int, as_ids: bool) -> str:
    """A token as the frontend names it: ``token_id:<id>`` with ``return_tokens_as_token_ids``, else its text."""
    return f"token_id:{token_id}" if as_ids else text.token(token_id)


def _alternatives(token: int, logprob: float, top: Sequence[tuple[int, float]], k: int) -> list[tuple[int, float]]:
    return [(token, logprob), *[(t, lp) for t, lp in top[:k] if t != token]][: k + 1]


def chat_logprob_entry(
    text: Text, token: int, logprob: float, top: Sequence[tuple[int, float]], k: int, as_ids: bool
) -> dict[str, Any]:
    """One ``choices[].logprobs.content[]`` entry (the sampled token carries its ``token_id``)."""

    def item(t: int, lp: float) -> dict[str, Any]:
        name = token_string(text, t, as_ids)
        return {"token": name, "logprob": f32(lp), "bytes": list(name.encode())}

    entry = item(token, logprob)
    entry = {"token": entry["token"], "logprob": entry["logprob"], "token_id": token, "bytes": entry["bytes"]}
    entry["top_logprobs"] = [item(t, lp) for t, lp in _alternatives(token, logprob, top, k)]
    return entry


def completion_logprobs_block(text: Text, out: EngineOutput, k: int, as_ids: bool) -> dict[str, Any]:
    """A completions choice's legacy ``logprobs`` block (dict keys collide on equal token text, as on vLLM)."""
    assert out.logprobs is not None
    tops = out.top_logprobs or [[] for _ in out.completion_ids]
    rows = []
    for token, logprob, top in zip(out.completion_ids, out.logprobs, tops, strict=True):
        rows.append(
            {token_string(text, t, as_ids): f32_double(lp) for t, lp in _alternatives(token, float(logprob), top, k)}
        )
    return {
        "tokens": [token_string(text, t, as_ids) for t in out.completion_ids],
        "token_logprobs": [f32(lp) for lp in out.logprobs],
        "top_logprobs": rows,
        "text_offset": [],
    }


def prompt_logprob_rows(out: EngineOutput, k: int) -> list[dict[str, dict[str, float | int]] | None]:
    """``prompt_logprobs``: ``null`` for the first token, then per position the prompt token and the best ``k``
    others, each ``{logprob, rank}`` (the engine was asked for the full distribution, to know ranks)."""
    assert out.prompt_logprobs is not None and out.prompt_top_logprobs is not None
    rows: list[dict[str, dict[str, float | int]] | None] = [None]
    for i in range(1, len(out.prompt_ids)):
        ranking = out.prompt_top_logprobs[i]
        ids = [t for t, _ in ranking]
        actual = out.prompt_ids[i]
        row = {str(actual): {"logprob": f32_double(float(out.prompt_logprobs[i])), "rank": ids.index(actual) + 1}}
        for rank, (t, lp) in enumerate(ranking[:k], start=1):
            row.setdefault(str(t), {"logprob": f32_double(lp), "rank": rank})
        rows.append(row)
    return rows


def routed_record(experts: npt.NDArray[np.int32], start: int = 0) -> dict[str, Any]:
    """``routed_experts`` as the vLLM worker puts it in ``engine_data``."""
    array = np.ascontiguousarray(experts, dtype="<i4")
    return {
        "data": base64.b64encode(array.tobytes()).decode(),
        "shape": list(array.shape),
        "start": start,
        "dtype": "int32",
    }


def engine_data(out: EngineOutput, *, logprobs: bool, prompt_logprobs: int | None, single: bool) -> dict[str, Any]:
    """The vLLM worker's ``engine_data`` record of a finished request (``single``: of ``n == 1``; with more
    samples the record holds one of them and no ``kv_cache_hit``, as captured)."""
    data: dict[str, Any] = {"prompt_token_ids": list(out.prompt_ids)}
    if single:
        data["kv_cache_hit"] = {"prompt_tokens": len(out.prompt_ids), "reused_tokens": out.num_cached_tokens}
    if prompt_logprobs is not None:
        data["prompt_logprobs"] = prompt_logprob_rows(out, prompt_logprobs)
    data["completion_token_ids"] = list(out.completion_ids)
    data["finished"] = True
    if logprobs and out.logprobs is not None:
        data["completion_logprobs"] = [f32_double(float(lp)) for lp in out.logprobs]
    if out.routed_experts is not None:
        data["routed_experts"] = routed_record(out.routed_experts)
    return data
