"""Pieces of a Dynamo answer, each read and checked on its own: completion ids, logprobs, alternatives, stop and
finish reasons, routed experts, usage. :mod:`backends_dynamo.wire` puts them together (the rules are in its
docstring)."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from backends_core.routed_experts import ALLOWED_DTYPES, align_routed_experts, decode_routed_experts
from backends_core.types import FinishReason, GenerateRequest, RoutedExperts, TopLogprob, Usage
from backends_dynamo._json import U32, Node

__all__ = [
    "best_alternatives",
    "check_prompt",
    "completion_ids",
    "completion_logprobs",
    "engine_data",
    "f32",
    "finish_reason",
    "nvext_of",
    "routed_experts",
    "stop_reason",
    "top_logprobs",
    "usage",
]

_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort", "tool_calls": "stop"}
_TOKEN_ID_PREFIX = "token_id:"


def nvext_of(body: Node) -> Node:
    """``$.nvext`` (its value is ``None`` when the answer has none)."""
    return body.get("nvext", required=False)


def engine_data(nvext: Node) -> Node | None:
    """``nvext.engine_data``, the worker's own record, when present."""
    return nvext.get("engine_data") if nvext.has("engine_data") else None


def completion_ids(nvext: Node) -> tuple[int, ...]:
    """The completion ids: ``engine_data.completion_token_ids`` (checked against ``nvext.completion_token_ids``
    when both are there), else ``nvext.completion_token_ids``."""
    engine = engine_data(nvext)
    frontend = nvext.get("completion_token_ids").token_ids() if nvext.has("completion_token_ids") else None
    if engine is not None and engine.has("completion_token_ids"):
        ids = engine.get("completion_token_ids").token_ids()
        if frontend is not None and frontend != ids:
            raise engine.get("completion_token_ids").fail(
                f"the engine's ids {list(ids)} disagree with nvext.completion_token_ids {list(frontend)}"
            )
        return ids
    if frontend is not None:
        return frontend
    raise nvext.fail(
        "no completion token ids: neither nvext.engine_data.completion_token_ids nor nvext.completion_token_ids "
        "is in the answer (both were asked for in nvext.extra_fields)"
    )


def _token_id_of(node: Node) -> int:
    text = node.string()
    if not text.startswith(_TOKEN_ID_PREFIX) or not text[len(_TOKEN_ID_PREFIX) :].isdigit():
        raise node.fail(
            f"expected 'token_id:<id>', got {text!r}: the frontend ignored return_tokens_as_token_ids, so the "
            "alternatives cannot be identified (ask for top_logprobs=0)"
        )
    return int(text[len(_TOKEN_ID_PREFIX) :])


def _openai_logprobs(choice: Node, ids: tuple[int, ...], *, chat: bool) -> list[Node]:
    """The per-token logprob nodes of the OpenAI channel, checked to belong to ``ids`` one to one."""
    block = choice.get("logprobs", required=False)
    if block.value is None and not ids:
        return []  # a request aborted before its first token: nothing to align (seen live on the completions route)
    if block.value is None:
        raise block.fail(
            "no logprobs: the answer has neither nvext.engine_data.completion_logprobs nor OpenAI logprobs "
            "(the backend always asks for them; the Dynamo mocker never returns logprobs)"
        )
    if chat:
        entries = block.get("content").items()
        if len(entries) != len(ids):
            raise block.get("content").fail(f"{len(entries)} logprob entries for {len(ids)} completion ids")
        for i, (token, entry) in enumerate(zip(ids, entries, strict=True)):
            claimed = entry.get("token_id").integer() if entry.has("token_id") else token
            if claimed != token:
                message = f"logprob entry is for token {claimed} but completion id {i} is {token}"
                raise entry.get("token_id").fail(message)
        return [entry.get("logprob") for entry in entries]
    values = block.get("token_logprobs").items()
    tokens = block.get("tokens").items()
    if not len(values) == len(tokens) == len(ids):
        raise block.fail(f"{len(tokens)} tokens and {len(values)} logprobs for {len(ids)} completion ids")
    for i, (token, node) in enumerate(zip(ids, tokens, strict=True)):
        if isinstance(node.value, str) and node.value.startswith(_TOKEN_ID_PREFIX) and _token_id_of(node) != token:
            raise node.fail(f"logprob entry is for {node.value!r} but completion id {i} is {token}")
    return values


def completion_logprobs(nvext: Node, choice: Node, ids: tuple[int, ...], *, chat: bool) -> npt.NDArray[np.float32]:
    """float32 logprob of every completion id; the engine's ``completion_logprobs`` win over the OpenAI channel."""
    engine = engine_data(nvext)
    if engine is not None and engine.has("completion_logprobs"):
        nodes = engine.get("completion_logprobs").items()
        if len(nodes) != len(ids):
            raise engine.get("completion_logprobs").fail(f"{len(nodes)} logprobs for {len(ids)} completion ids")
    else:
        nodes = _openai_logprobs(choice, ids, chat=chat)
    return np.asarray([n.logprob() for n in nodes], dtype=np.float32)


def f32(node: Node) -> float:
    """A logprob at float32 precision: the OpenAI channel prints float32 digits, the engine record doubles of
    the same float32 values, and alternatives must compare equal whichever channel they came from."""
    return float(np.float32(node.logprob()))


def best_alternatives(candidates: list[TopLogprob], k: int, where: Node) -> tuple[TopLogprob, ...]:
    unique = {c.token_id: c for c in candidates}
    ranked = all(c.rank is not None for c in unique.values())
    ordered = sorted(unique.values(), key=lambda c: (c.rank or 0, -c.logprob) if ranked else (0, -c.logprob))
    top = tuple(ordered[:k])
    if len(top) < k or (ranked and [c.rank for c in top] != list(range(1, k + 1))):
        raise where.fail(f"expected the top {k} alternatives, got {len(unique)} (ranks {[c.rank for c in ordered]})")
    return top


def top_logprobs(choice: Node, count: int, k: int, *, chat: bool) -> tuple[tuple[TopLogprob, ...], ...]:
    """The ``k`` best alternatives at each of ``count`` positions, from ``token_id:<id>`` entries."""
    block = choice.get("logprobs")
    rows: list[tuple[TopLogprob, ...]] = []
    if chat:
        entries = block.get("content").items()
        for entry in entries:
            alts = [
                TopLogprob(token_id=_token_id_of(a.get("token")), logprob=f32(a.get("logprob")))
                for a in entry.get("top_logprobs").items()
            ]
            rows.append(best_alternatives(alts, k, entry.get("top_logprobs")))
    else:
        for row in block.get("top_logprobs").items():
            alts = [
                TopLogprob(token_id=_token_id_of(Node(key, f"{row.path} key", row.url)), logprob=f32(row.get(key)))
                for key in row.obj()
            ]
            rows.append(best_alternatives(alts, k, row))
    if len(rows) != count:
        raise block.fail(f"{len(rows)} rows of alternatives for {count} completion ids")
    return tuple(rows)


def stop_reason(nvext: Node) -> int | str | None:
    """``nvext.stop_reason``: the matched stop token id (int) or stop string; None for EOS and length."""
    if not nvext.has("stop_reason"):
        return None
    node = nvext.get("stop_reason")
    if isinstance(node.value, str):
        return node.value
    return node.integer(below=U32)


def finish_reason(
    choice: Node, request: GenerateRequest, ids: tuple[int, ...], reason: int | str | None, *, aborted: bool
) -> FinishReason:
    """The finish reason, with Dynamo's ``stop`` for aborted requests turned back into ``abort`` where it can
    only mean that (see the module docstring)."""
    node = choice.get("finish_reason")
    raw = node.string()
    if raw not in _FINISH:
        raise node.fail(f"finish_reason {raw!r} is not one of {sorted(_FINISH)}")
    finish = _FINISH[raw]
    if finish == "stop" and reason is None and (aborted or not ids or request.sampling.ignore_eos):
        return "abort"
    return finish


def _dtype(node: Node) -> np.dtype[Any]:
    name = node.string().removeprefix("torch.")
    try:
        dtype = np.dtype(name)
    except TypeError as exc:
        raise node.fail(f"unknown dtype {name!r}") from exc
    if dtype not in ALLOWED_DTYPES:
        raise node.fail(f"unsupported dtype {name!r}; expected one of {sorted(map(str, ALLOWED_DTYPES))}")
    return dtype


def routed_experts(nvext: Node, request: GenerateRequest, ids: tuple[int, ...]) -> RoutedExperts | None:
    """Routing from ``nvext.routed_experts`` or ``engine_data.routed_experts`` (``{data: base64, shape, start,
    dtype}``), trimmed client-side to ``request.routed_experts_start`` (Dynamo has no request field for it)."""
    if not request.return_routed_experts:
        return None
    engine = engine_data(nvext)
    if nvext.has("routed_experts"):
        field = nvext.get("routed_experts")
    elif engine is not None and engine.has("routed_experts"):
        field = engine.get("routed_experts")
    else:
        raise nvext.fail(
            "routed experts were asked for but the answer has none: Dynamo's vLLM worker returns them only for "
            "MoE models started with --enable-return-routed-experts (vLLM's CPU build cannot)"
        )
    if isinstance(field.value, str):  # a bare base64 payload: only a .npy file carries its own shape
        experts = decode_routed_experts(field.value, field=field.path)
        start = 0
    else:
        shape = [n.integer() for n in field.get("shape").items()]
        if len(shape) != 3:
            raise field.get("shape").fail(f"expected [tokens, layers, top_k], got {shape}")
        experts = decode_routed_experts(
            field.get("data").string(),
            num_layers=shape[1],
            top_k=shape[2],
            dtype=_dtype(field.get("dtype")),
            field=f"{field.path}.data",
        )
        if list(experts.shape) != shape:
            raise field.fail(f"data decodes to shape {list(experts.shape)}, the answer says {shape}")
        start = field.get("start").integer() if field.has("start") else 0
    return align_routed_experts(
        experts,
        total_tokens=len(request.prompt_ids) + len(ids),
        server_start=start,
        wanted_start=request.routed_experts_start,
        field=field.path,
    )


def check_prompt(nvext: Node, prompt: tuple[int, ...]) -> None:
    engine = engine_data(nvext)
    if engine is not None and engine.has("prompt_token_ids"):
        seen = engine.get("prompt_token_ids").token_ids()
        if seen != prompt:
            raise engine.get("prompt_token_ids").fail(
                f"the worker received {len(seen)} prompt ids that differ from the {len(prompt)} sent"
            )


def usage(body: Node, prompt: tuple[int, ...], completion_tokens: int) -> Usage:
    """Token accounting; ``usage.prompt_tokens`` must equal the number of prompt ids sent (token-in echo)."""
    node = body.get("usage", required=False)
    cached = None
    if node.value is not None:
        reported = node.get("prompt_tokens").integer()
        if reported != len(prompt):
            raise node.get("prompt_tokens").fail(
                f"the frontend counted {reported} prompt tokens but {len(prompt)} prompt ids were sent: it did not "
                "generate from nvext.token_data / the token-id prompt"
            )
        if node.has("prompt_tokens_details") and node.get("prompt_tokens_details").has("cached_tokens"):
            cached = node.get("prompt_tokens_details").get("cached_tokens").integer()
    return Usage(prompt_tokens=len(prompt), completion_tokens=completion_tokens, cached_tokens=cached)
