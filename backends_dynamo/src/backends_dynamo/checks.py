"""What Dynamo 1.6.1 cannot do, refused before anything is sent (:class:`InvalidRequestError` naming the limit)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from backends_core.errors import InvalidRequestError
from backends_core.types import GenerateRequest, Message, TeacherRequest
from backends_dynamo._json import U32
from backends_dynamo.wire import MAX_STOP_TOKEN_IDS

__all__ = ["check_generation", "check_teacher", "served_name"]

_I32 = 2**31
_I64 = 2**63


def served_name(*candidates: str | None) -> str:
    """The first given model name (LoRA adapter, per-request model, ``ClientConfig.model``)."""
    for name in candidates:
        if name:
            return name
    raise InvalidRequestError("no model name: Dynamo needs one; set ClientConfig.model (or pass model=)")


def _ids(name: str, ids: Sequence[int]) -> None:
    bad = [t for t in ids if t >= U32]
    if bad:
        raise InvalidRequestError(f"{name} has token id {bad[0]}; Dynamo's token ids are u32 (< {U32})")


def _text_only(messages: Sequence[Message] | None) -> None:
    for i, message in enumerate(messages or ()):
        content = message.get("content")
        if isinstance(content, list):
            kinds = {part.get("type") for part in content if isinstance(part, Mapping)}
            if kinds - {"text"}:
                raise InvalidRequestError(
                    f"messages[{i}] has {sorted(str(k) for k in kinds - {'text'})} content: multimodal inputs cannot "
                    "be sent token-in to Dynamo (nvext.token_data carries text token ids only)"
                )


def check_generation(request: GenerateRequest, *, fan_out: bool) -> None:
    """Refuse a generation Dynamo would reject or mishandle.

    :raises InvalidRequestError: more than 32 stop token ids, ``n > 1`` without fan-out (Dynamo refuses ``n > 1``
        with completion ids), non-u32 ids, a priority outside i32, a seed that overflows i64, multimodal content.
    """
    s = request.sampling
    if len(s.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError(
            f"{len(s.stop_token_ids)} stop_token_ids: Dynamo 1.6.1 accepts at most {MAX_STOP_TOKEN_IDS}"
        )
    if s.n > 1 and not fan_out:
        raise InvalidRequestError(
            f"n={s.n}: Dynamo 1.6.1 refuses n > 1 together with completion token ids; "
            "set backend_options.fan_out_n = true to send n requests of one sample"
        )
    _ids("prompt_ids", request.prompt_ids)
    _ids("stop_token_ids", s.stop_token_ids)
    if request.priority is not None and not -_I32 <= request.priority < _I32:
        raise InvalidRequestError(f"priority {request.priority} does not fit nvext.agent_hints.priority (i32)")
    if s.seed is not None and not (s.seed >= -_I64 and s.seed + s.n - 1 < _I64):
        raise InvalidRequestError(f"seed {s.seed} (+ n - 1) does not fit an i64")
    _text_only(request.messages)


def check_teacher(request: TeacherRequest) -> None:
    """Refuse scoring ids Dynamo cannot take.

    :raises InvalidRequestError: a token id that is not u32.
    """
    _ids("token_ids", request.token_ids)
