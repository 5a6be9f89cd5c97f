"""``POST /generate`` request checking, in SGLang 0.5.23's order and words.

1. The schema gate: unknown top-level keys are ignored, known ones are type-checked, and ``sampling_params``
   rejects unknown keys; failures are ``400 {"error": "<serde text>"}`` (``unknown field `max_tokens`, expected
   one of ...``, ``invalid type: integer `1`, expected a boolean``).
2. The request dataclass: exactly one of ``text`` / ``input_ids``, no empty ``input_ids``, batch shapes;
   failures are ``400 {"error": {"message": ...}}``.
3. Sampling-parameter ranges, with SGLang's limits, same form.

The result is one :class:`Job` per prompt. Features the emulator does not implement (sessions,
grammars, penalties other than neutral, hidden states, multimodal input) are refused with a 400 naming them,
never silently ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from backends_sglang_testing._replies import contract_error, message_error

__all__ = ["DEFAULT_MAX_NEW_TOKENS", "GenerateInput", "Job", "Sampling", "parse_generate"]

DEFAULT_MAX_NEW_TOKENS = 128

# kind names: "bool", "int", "number", "str", "map", "any", "list[<kind>]"; a tuple is a union; None is allowed
_SAMPLING: dict[str, tuple[str, ...]] = {
    "max_new_tokens": ("int",),
    "stop": ("str", "list[str]"),
    "stop_token_ids": ("list[int]",),
    "stop_regex": ("str", "list[str]"),
    "temperature": ("number",),
    "top_p": ("number",),
    "top_k": ("int",),
    "min_p": ("number",),
    "frequency_penalty": ("number",),
    "presence_penalty": ("number",),
    "repetition_penalty": ("number",),
    "min_new_tokens": ("int",),
    "n": ("int",),
    "json_schema": ("str",),
    "regex": ("str",),
    "ebnf": ("str",),
    "structural_tag": ("str",),
    "ignore_eos": ("bool",),
    "skip_special_tokens": ("bool",),
    "spaces_between_special_tokens": ("bool",),
    "no_stop_trim": ("bool",),
    "stream_interval": ("int",),
    "logit_bias": ("map",),
    "sampling_seed": ("int",),
    "custom_params": ("map",),
    "beam_width": ("int",),
    "watermark": ("any",),
    "choice": ("any",),
}
_TOP: dict[str, tuple[str, ...]] = {
    "text": ("str", "list[str]"),
    "input_ids": ("list[int]", "list[list[int]]"),
    "input_embeds": ("any",),
    "sampling_params": ("map", "list[map]"),
    "rid": ("str", "list[str]"),
    "stream": ("bool",),
    "return_logprob": ("bool", "list[bool]"),
    "logprob_start_len": ("int", "list[int]"),
    "top_logprobs_num": ("int", "list[int]"),
    "token_ids_logprob": ("list[int]", "list[list[int]]"),
    "return_text_in_logprobs": ("bool",),
    "return_routed_experts": ("bool",),
    "routed_experts_start_len": ("int",),
    "return_prompt_token_ids": ("bool",),
    "return_hidden_states": ("bool", "str"),
    "lora_path": ("str", "list[any]"),
    "session_params": ("map",),
    "cache_salt": ("str", "list[str]"),
    "extra_key": ("str", "list[str]"),
    "priority": ("int",),
    "custom_logit_processor": ("str", "list[str]"),
    "image_data": ("any",),
    "video_data": ("any",),
    "audio_data": ("any",),
}
_UNSUPPORTED_SAMPLING = ("stop_regex", "json_schema", "regex", "ebnf", "structural_tag", "custom_params", "choice")
_UNSUPPORTED_TOP = (
    "input_embeds",
    "session_params",
    "custom_logit_processor",
    "image_data",
    "video_data",
    "audio_data",
)
_EXPECTED = {"bool": "a boolean", "int": "i64", "number": "f64", "str": "a string", "map": "a map"}


@attrs.frozen(kw_only=True)
class Sampling:
    """One prompt's sampling parameters with SGLang's defaults applied."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    min_new_tokens: int = 0
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = None
    logit_bias: Mapping[int, float] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class Job:
    """One prompt of a (possibly batched) request; ``rids`` has one id per sample (``n``)."""

    input_ids: tuple[int, ...] | None
    text: str | None
    sampling: Sampling
    rids: tuple[str | None, ...]
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    token_ids_logprob: tuple[int, ...] | None
    lora: str | None


@attrs.frozen(kw_only=True)
class GenerateInput:
    """A checked ``/generate`` request."""

    jobs: tuple[Job, ...]
    batch: bool
    return_text_in_logprobs: bool
    return_routed_experts: bool
    routed_experts_start_len: int
    return_prompt_token_ids: bool
    stream: bool = False


# -- 1. the schema gate ---------------------------------------------------------------------------------


def _unexpected(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{str(value).lower()}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        return f'string "{value}"'
    return "sequence" if isinstance(value, list) else "map"


def _is(value: Any, kind: str) -> bool:
    if kind == "any":
        return True
    if kind.startswith("list["):
        inner = kind[5:-1]
        return isinstance(value, list) and all(_is(v, inner) for v in value)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    return isinstance(value, Mapping)  # "map"


def _expected(kinds: tuple[str, ...]) -> str:
    names = [_EXPECTED.get(k, "a sequence") for k in kinds]
    return " or ".join(dict.fromkeys(names))


def _gate(value: Any, kinds: tuple[str, ...]) -> None:
    if value is not None and not any(_is(value, k) for k in kinds):
        raise contract_error(f"invalid type: {_unexpected(value)}, expected {_expected(kinds)}")


def _gate_sampling(params: Any) -> None:
    if not isinstance(params, Mapping):
        return
    for key, value in params.items():
        if key not in _SAMPLING:
            expected = ", ".join(f"`{k}`" for k in _SAMPLING)
            raise contract_error(f"unknown field `{key}`, expected one of {expected}")
        _gate(value, _SAMPLING[key])


def _schema_gate(body: Mapping[str, Any]) -> None:
    for key, value in body.items():
        if key not in _TOP:
            continue  # unknown top-level keys are ignored
        _gate(value, _TOP[key])
        if key == "sampling_params":
            for params in value if isinstance(value, list) else [value]:
                _gate_sampling(params)


# -- 2. and 3. the request dataclass and sampling ranges ------------------------------------------------


def _per_prompt(value: Any, index: int, default: Any) -> Any:
    if isinstance(value, list):
        return value[index] if index < len(value) else default
    return default if value is None else value


def _range(ok: bool, message: str) -> None:
    if not ok:
        raise message_error(message)


def _sampling(params: Mapping[str, Any]) -> Sampling:
    p = {k: v for k, v in params.items() if v is not None}
    for key in _UNSUPPORTED_SAMPLING:
        if key in p:
            raise message_error(f"the SGLang emulator does not support sampling_params.{key}")
    bias: dict[int, float] = {}
    for key, value in (p.get("logit_bias") or {}).items():
        try:
            bias[int(key)] = float(value)
        except (TypeError, ValueError):
            raise message_error(f"logit_bias keys must be token ids, got {key!r}") from None
    for key, neutral in (("frequency_penalty", 0), ("presence_penalty", 0), ("repetition_penalty", 1)):
        if key in p and p[key] != neutral:
            raise message_error(f"the SGLang emulator's engine has no {key} (only the neutral {neutral})")
    stop = p.get("stop", ())
    s = Sampling(
        max_new_tokens=p.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS),
        min_new_tokens=p.get("min_new_tokens", 0),
        n=p.get("n", 1),
        temperature=float(p.get("temperature", 1.0)),
        top_p=float(p.get("top_p", 1.0)),
        top_k=p.get("top_k", -1),
        min_p=float(p.get("min_p", 0.0)),
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        stop_token_ids=tuple(p.get("stop_token_ids", ())),
        ignore_eos=p.get("ignore_eos", False),
        skip_special_tokens=p.get("skip_special_tokens", True),
        no_stop_trim=p.get("no_stop_trim", False),
        seed=p.get("sampling_seed"),
        logit_bias=bias,
    )
    _range(s.temperature >= 0, f"temperature must be non-negative, got {s.temperature}.")
    _range(0 < s.top_p <= 1, f"top_p must be in (0, 1], got {s.top_p}.")
    _range(0 <= s.min_p <= 1, f"min_p must be in [0, 1], got {s.min_p}.")
    _range(s.top_k == -1 or s.top_k >= 1, f"top_k must be -1 (disable), or at least 1, got {s.top_k}.")
    _range(s.max_new_tokens >= 0, f"max_new_tokens must be at least 0, got {s.max_new_tokens}.")
    _range(
        0 <= s.min_new_tokens <= s.max_new_tokens,
        f"min_new_tokens must be in [0, max_new_tokens({s.max_new_tokens})], got {s.min_new_tokens}.",
    )
    _range(s.n >= 1, f"n must be at least 1, got {s.n}.")
    return s


def _prompts(body: Mapping[str, Any]) -> tuple[list[tuple[tuple[int, ...] | None, str | None]], bool]:
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise message_error("Either text, input_ids or input_embeds should be provided, and only one of them.")
    if ids is not None:
        if not ids:
            raise message_error("input_ids cannot be empty.")
        if isinstance(ids[0], list):
            if any(not row for row in ids):
                raise message_error("input_ids cannot be empty.")
            return [(tuple(row), None) for row in ids], True
        return [(tuple(ids), None)], False
    if isinstance(text, list):
        return [(None, t) for t in text], True
    return [(None, text)], False


def _rids(rid: Any, index: int, batch: bool, n: int) -> tuple[str | None, ...]:
    base = rid[index] if isinstance(rid, list) else (f"{rid}_{index}" if batch and rid is not None else rid)
    if base is None:
        return (None,) * n
    return (base,) if n == 1 else tuple(f"{base}_{j}" for j in range(n))


def parse_generate(body: Any) -> GenerateInput:
    """Check a ``/generate`` body and normalise it to one :class:`Job` per prompt.

    :raises HttpError: the 400 SGLang answers.
    """
    if not isinstance(body, Mapping):
        raise contract_error(f"invalid type: {_unexpected(body)}, expected struct GenerateRequest")
    _schema_gate(body)
    for key in _UNSUPPORTED_TOP:
        if body.get(key) is not None:
            raise message_error(f"the SGLang emulator does not support {key}")
    if body.get("return_hidden_states"):
        raise message_error("the SGLang emulator does not support return_hidden_states")
    prompts, batch = _prompts(body)
    params = body.get("sampling_params") or {}
    if isinstance(params, list) and len(params) != len(prompts):
        raise message_error("The number of sampling_params should match the batch size.")
    rid = body.get("rid")
    if isinstance(rid, list) and (not batch or len(rid) != len(prompts)):
        raise message_error("The specified rids length mismatch with the batch_size for batch processing.")
    jobs = []
    for i, (ids, text) in enumerate(prompts):
        sampling = _sampling(params[i] if isinstance(params, list) else params)
        token_ids = body.get("token_ids_logprob")
        if isinstance(token_ids, list) and token_ids and isinstance(token_ids[0], list):
            token_ids = token_ids[i]
        jobs.append(
            Job(
                input_ids=ids,
                text=text,
                sampling=sampling,
                rids=_rids(rid, i, batch, sampling.n),
                return_logprob=bool(_per_prompt(body.get("return_logprob"), i, False)),
                logprob_start_len=int(_per_prompt(body.get("logprob_start_len"), i, -1)),
                top_logprobs_num=int(_per_prompt(body.get("top_logprobs_num"), i, 0)),
                token_ids_logprob=tuple(token_ids) if token_ids else None,
                lora=_per_prompt(body.get("lora_path"), i, None),
            )
        )
    if len({job.sampling.n for job in jobs}) > 1:
        raise message_error("The parallel_sample_num should be the same for all samples in sample params.")
    return GenerateInput(
        jobs=tuple(jobs),
        batch=batch,
        return_text_in_logprobs=bool(body.get("return_text_in_logprobs") or False),
        return_routed_experts=bool(body.get("return_routed_experts") or False),
        routed_experts_start_len=int(body.get("routed_experts_start_len") or 0),
        return_prompt_token_ids=bool(body.get("return_prompt_token_ids") or False),
        stream=bool(body.get("stream") or False),
    )
