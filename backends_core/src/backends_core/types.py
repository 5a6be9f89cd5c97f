"""Backend-neutral domain types: what callers pass in and what every backend hands back.

Wire shapes never appear here; each backend maps its server's JSON to these types in its own
converter. Arrays use numpy; classes holding arrays compare with ``np.array_equal``.
"""

from __future__ import annotations

import json
import math
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar, Literal

import attrs
import numpy as np
import numpy.typing as npt
import orjson

from backends_core.errors import InvalidRequestError
from backends_core.images import Image, ImageSpan

__all__ = [
    "SAMPLING_FEATURES",
    "Choice",
    "DistributedGroup",
    "FinishReason",
    "GenerateRequest",
    "GenerateResult",
    "Grammar",
    "JsonSchema",
    "LoraAdapter",
    "Message",
    "MessageSpan",
    "PauseMode",
    "Regex",
    "RoutedExperts",
    "SamplingParams",
    "ServerState",
    "StreamDelta",
    "Structured",
    "TeacherLogprobs",
    "TeacherRequest",
    "TensorSpec",
    "TokenizerCheck",
    "TopLogprob",
    "Usage",
    "WeightVersionSpan",
]

#: A chat message as the chat template sees it (``role``, ``content``, ``tool_calls``, ``reasoning_content``...).
Message = Mapping[str, Any]
#: Why generation stopped. ``"abort"`` means the server cut it short (pause with mode abort, explicit abort).
FinishReason = Literal["stop", "length", "abort"]
#: How a pause treats in-flight requests: finish them now (``abort``), let them complete first (``wait``),
#: or freeze them and continue after resume (``keep``).
PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES: tuple[PauseMode, ...] = ("abort", "wait", "keep")

_array_eq = attrs.cmp_using(
    eq=lambda a, b: a is b or (a is not None and b is not None and np.array_equal(a, b, equal_nan=True))
)


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise InvalidRequestError(message)


def text(value: Any, what: str) -> str:
    """``value`` if it is a string with something besides whitespace, else :class:`InvalidRequestError`."""
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequestError(f"{what} must be a non-empty string, got {value!r}")
    return value


def _text(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    text(value, attr.name)


def _int_tuple(value: Sequence[int] | None) -> tuple[int, ...]:
    """``value`` as a tuple of ints: the caller's tuple itself when it already holds only exact ints (one C pass
    over the types; a tuple is immutable, so sharing it is safe), else each item through ``int``."""
    if value is None:
        return ()
    if set(map(type, value)) <= {int}:
        return value if type(value) is tuple else tuple(value)
    return tuple(int(v) for v in value)


def _non_negative(ids: tuple[int, ...]) -> bool:
    return not ids or min(ids) >= 0


def _id_sequence(value: Any) -> tuple[Any, ...]:
    """Converter of token-id fields: a tuple as it is (immutable, so shared, not copied), any other sequence into
    one. The items are checked by :func:`_token_ids` once the object is built."""
    if type(value) is tuple:
        return value
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        raise InvalidRequestError(f"token ids must be a sequence of ints, got {type(value).__name__}")
    return tuple(value)


#: The bytes of a JSON array of non-negative integer literals, as orjson writes one.
_ID_ARRAY_BYTES = b"0123456789,[]"


def _token_ids(ids: tuple[Any, ...], what: str) -> tuple[int, ...]:
    """``ids`` when every item is a non-negative int, else a copy with integer types such as numpy's as ``int``;
    :class:`InvalidRequestError` naming the first item that is not a token id (a bool, a float, a negative).

    The usual case is decided by one C pass: orjson writes exact ints (and ``int`` subclasses other than ``bool``)
    as bare digits, and anything else with a sign, a ``.``/exponent, a letter or a quote, or refuses it."""
    try:
        if not orjson.dumps(ids).translate(None, _ID_ARRAY_BYTES):
            return ids
    except TypeError:  # numpy integers, ints beyond 64 bits, objects orjson does not know: looked at one by one
        pass
    out = []
    for i, v in enumerate(ids):
        try:
            if isinstance(v, bool):
                raise TypeError
            n = operator.index(v)
        except TypeError:
            raise InvalidRequestError(f"{what} must be a sequence of ints: item {i} is {v!r}") from None
        if n < 0:
            raise InvalidRequestError(f"{what} contains a negative token id: {n} at position {i}")
        out.append(n)
    return tuple(out)


# -- structured output ----------------------------------------------------------------------------------


def _json_object(value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise InvalidRequestError(f"structured JSON schema must be a mapping (a JSON object), got {value!r}")
    return dict(value)


@attrs.frozen
class JsonSchema:
    """Constrain the completion to JSON valid against ``schema`` (a JSON Schema object)."""

    kind: ClassVar[str] = "json_schema"
    schema: Mapping[str, Any] = attrs.field(converter=_json_object, hash=False)

    def __attrs_post_init__(self) -> None:
        try:
            json.dumps(self.schema, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(f"structured JSON schema is not JSON-serialisable: {exc}") from exc


@attrs.frozen
class Regex:
    """Constrain the completion's text to match ``pattern`` (each engine's regex dialect; keep to the common
    subset: classes, groups, alternation, quantifiers)."""

    kind: ClassVar[str] = "regex"
    pattern: str = attrs.field(validator=attrs.validators.instance_of(str))

    def __attrs_post_init__(self) -> None:
        _check(bool(self.pattern), "structured regex pattern must be a non-empty string")


def _str_tuple(value: Any) -> tuple[Any, ...]:
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, Sequence):
        raise InvalidRequestError(f"expected a string or a sequence of strings, got {value!r}")
    return tuple(value)


@attrs.frozen
class Choice:
    """Constrain the completion's text to exactly one of ``choices``."""

    kind: ClassVar[str] = "choice"
    choices: tuple[str, ...] = attrs.field(converter=_str_tuple)

    def __attrs_post_init__(self) -> None:
        _check(len(self.choices) > 0, "structured choice needs at least one choice")
        for i, c in enumerate(self.choices):
            _check(isinstance(c, str) and bool(c), f"structured choice [{i}] must be a non-empty string, got {c!r}")


@attrs.frozen
class Grammar:
    """Constrain the completion's text to a context-free grammar: EBNF in the engine's dialect (vLLM:
    xgrammar/guidance EBNF or Lark; SGLang: xgrammar EBNF, ``root ::= ...``)."""

    kind: ClassVar[str] = "grammar"
    grammar: str = attrs.field(validator=attrs.validators.instance_of(str))

    def __attrs_post_init__(self) -> None:
        _check(bool(self.grammar.strip()), "structured grammar must be a non-empty string")


#: One structured-output constraint.
Structured = JsonSchema | Regex | Choice | Grammar
_STRUCTURED_KINDS = (JsonSchema, Regex, Choice, Grammar)

#: Every optional sampling feature a backend may declare (its ``sampling_features`` hook): ``stop``,
#: ``logit_bias``, ``extra``, and ``structured.<kind>`` per structured-output kind.
SAMPLING_FEATURES = frozenset({"stop", "logit_bias", "extra", *(f"structured.{k.kind}" for k in _STRUCTURED_KINDS)})


def _stop_strings(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    strings = _str_tuple(value)
    for i, s in enumerate(strings):
        if not isinstance(s, str) or not s:
            raise InvalidRequestError(f"stop[{i}] must be a non-empty string, got {s!r}")
    return strings


def _optional_int_tuple(value: Sequence[int] | None) -> tuple[int, ...] | None:
    return None if value is None else _int_tuple(value)


#: The bias range every engine takes (OpenAI's; vLLM clamps to it, SGLang adds it unclamped).
LOGIT_BIAS_RANGE = (-100.0, 100.0)


def _logit_bias(value: Any) -> dict[int, float]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidRequestError(f"logit_bias must be a mapping token id -> bias, got {type(value).__name__}")
    out: dict[int, float] = {}
    low, high = LOGIT_BIAS_RANGE
    for token, bias in value.items():
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise InvalidRequestError(f"logit_bias key {token!r} must be a token id (an int >= 0)")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not math.isfinite(bias):
            raise InvalidRequestError(f"logit_bias[{token}] must be a finite number, got {bias!r}")
        if not low <= bias <= high:
            raise InvalidRequestError(f"logit_bias[{token}] = {bias!r} is outside [{low:g}, {high:g}]")
        out[token] = float(bias)
    return out


def _extra(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidRequestError(f"extra must be a mapping of engine sampling fields, got {type(value).__name__}")
    for key in value:
        if not isinstance(key, str) or not key:
            raise InvalidRequestError(f"extra keys must be non-empty strings, got {key!r}")
    return dict(value)


@attrs.frozen(kw_only=True)
class SamplingParams:
    """Sampling parameters. Every field is sent to the server explicitly, so what you ask is what runs
    (servers that fill unset fields from the model's ``generation_config`` never get the chance).

    :param max_tokens: completion tokens to generate at most (>= 1). Required: no default is right for every
        trainer (a silent 16, the OpenAI completions default, would train on cut-off completions), so
        ``SamplingParams()`` without it is a ``TypeError`` naming it.
    :param temperature: 0 means greedy.
    :param top_p: nucleus mass in (0, 1].
    :param top_k: keep the k most likely tokens; -1 disables.
    :param min_p: drop tokens below ``min_p`` × the top probability; 0 disables.
    :param seed: per-request sampling seed; ``None`` lets the server choose.
    :param n: samples per prompt; ``Client.generate`` needs 1, ``Client.generate_samples`` takes any.
    :param stop_token_ids: extra token ids that end generation (included in ``completion_ids``). ``None``
        (the default): generation from ``messages`` (and a conversation's turns) stops at the chat template's
        end-of-turn token(s) as well as the model's EOS; from ``prompt_ids``, at EOS only. A tuple, even
        empty, replaces the template's ids.
    :param ignore_eos: keep going past the model's end-of-sequence tokens.
    :param min_tokens: generate at least this many tokens before a stop can apply.
    :param top_logprobs: how many alternatives per position to return besides the sampled token (0 = none).
    :param repetition_penalty: 1.0 disables.
    :param presence_penalty: 0 disables.
    :param frequency_penalty: 0 disables.
    :param stop: strings that end generation once the completion's text contains one (a string or a
        sequence of non-empty strings). The engine checks the decoded text as tokens are produced; the token
        that completes the string stays in ``completion_ids`` (ids are never cut inside a token, so its text
        may run past the string) and ``stop_reason`` is the matched string.
    :param logit_bias: token id -> bias in [-100, 100] added to that token's logit before sampling. The
        returned logprobs stay the engine's own (see the README's Sampling section).
    :param structured: a structured-output constraint: :class:`JsonSchema`, :class:`Regex`,
        :class:`Choice` or :class:`Grammar`.
    :param extra: engine sampling fields this type does not model, passed through under the engine's own
        names; the backend refuses a key its engine does not know, or one that a modelled field sets.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    stop_token_ids: tuple[int, ...] | None = attrs.field(default=None, converter=_optional_int_tuple)
    ignore_eos: bool = False
    min_tokens: int = 0
    top_logprobs: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = attrs.field(default=(), converter=_stop_strings)
    logit_bias: Mapping[int, float] = attrs.field(factory=dict, converter=_logit_bias, hash=False)
    structured: Structured | None = None
    extra: Mapping[str, Any] = attrs.field(factory=dict, converter=_extra, hash=False)

    def __attrs_post_init__(self) -> None:
        _check(
            isinstance(self.max_tokens, int) and self.max_tokens >= 1,
            f"max_tokens must be an int >= 1, got {self.max_tokens!r}",
        )
        _check(
            math.isfinite(self.temperature) and self.temperature >= 0,
            f"temperature must be finite and >= 0, got {self.temperature!r}",
        )
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(self.top_k == -1 or self.top_k >= 1, f"top_k must be -1 (off) or >= 1, got {self.top_k!r}")
        _check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(self.n >= 1, f"n must be >= 1, got {self.n!r}")
        _check(
            0 <= self.min_tokens <= self.max_tokens, f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}"
        )
        _check(0 <= self.top_logprobs <= 20, f"top_logprobs must be in [0, 20], got {self.top_logprobs!r}")
        _check(self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        _check(_non_negative(self.stop_token_ids or ()), f"stop_token_ids must be >= 0, got {self.stop_token_ids!r}")
        _check(self.seed is None or isinstance(self.seed, int), f"seed must be an int or None, got {self.seed!r}")
        _check(
            self.structured is None or isinstance(self.structured, _STRUCTURED_KINDS),
            f"structured must be JsonSchema, Regex, Choice or Grammar, got {type(self.structured).__name__}",
        )
        modelled = [k for k in self.extra if k in _SAMPLING_FIELD_NAMES]
        _check(
            not modelled,
            f"extra key {modelled[0]!r} is a field of SamplingParams: set it there" if modelled else "",
        )

    @property
    def features(self) -> frozenset[str]:
        """The optional sampling features this request uses (names of :data:`SAMPLING_FEATURES`)."""
        used = set()
        if self.stop:
            used.add("stop")
        if self.logit_bias:
            used.add("logit_bias")
        if self.extra:
            used.add("extra")
        if self.structured is not None:
            used.add(f"structured.{self.structured.kind}")
        return frozenset(used)


_SAMPLING_FIELD_NAMES = frozenset(a.name for a in attrs.fields(SamplingParams))


def _resolved_sampling(value: SamplingParams) -> SamplingParams:
    """``value`` with ``stop_token_ids`` resolved: what a backend sends never holds ``None``."""
    if isinstance(value, SamplingParams) and value.stop_token_ids is None:
        return attrs.evolve(value, stop_token_ids=())
    return value


def _images(value: Iterable[Image]) -> tuple[Image, ...]:
    return tuple(value)


def _image_spans(value: Iterable[ImageSpan]) -> tuple[ImageSpan, ...]:
    return tuple(value)


def _check_images(images: tuple[Image, ...], spans: tuple[ImageSpan, ...], length: int) -> None:
    for k, image in enumerate(images):
        _check(isinstance(image, Image), f"images[{k}] must be a backends_core.Image, got {type(image).__name__}")
    _check(len(spans) <= len(images), f"{len(spans)} image spans for {len(images)} images")
    end = 0
    for k, span in enumerate(spans):
        _check(
            isinstance(span, ImageSpan) and end <= span.start < span.end <= length,
            f"image_spans[{k}] must be an ImageSpan after the previous one and inside the {length} ids, got {span!r}",
        )
        end = span.end


@attrs.frozen(kw_only=True)
class GenerateRequest:
    """One generation call after rendering: what a backend's ``post_generate`` turns into a wire payload.

    :param prompt_ids: the exact prompt token ids to send.
    :param sampling: sampling parameters; ``stop_token_ids=None`` is resolved to ``()`` here, so a backend always
        sends a tuple (the client resolves it to the template's end-of-turn ids first for rendered prompts).
    :param messages: the messages ``prompt_ids`` were rendered from (``None`` when the caller gave ids).
    :param tools: tool schemas rendered into the prompt, if any.
    :param request_id: caller-chosen id, passed through to the server for tracing and abort.
    :param cache_salt: isolates this request's prefix-cache entries (e.g. per weight version).
    :param priority: scheduling priority where the server supports it (lower runs first on vLLM).
    :param lora: name of a loaded LoRA adapter to generate with.
    :param return_routed_experts: ask for MoE routing of every token (router replay).
    :param routed_experts_start: first absolute token position whose routing is wanted (multi-turn delta
        replay). The result is trimmed to it even where the server cannot.
    :param model: served model name; ``None`` uses ``ClientConfig.model``.
    :param images: the images of the prompt, in prompt order (see :mod:`backends_core.images`): the first
        ``len(image_spans)`` are already widened in ``prompt_ids`` (reused from an earlier turn), every other one
        is one placeholder id.
    :param image_spans: the spans of the already-widened images in ``prompt_ids``.
    """

    prompt_ids: tuple[int, ...] = attrs.field(converter=_id_sequence)
    sampling: SamplingParams = attrs.field(converter=_resolved_sampling)
    messages: tuple[Message, ...] | None = None
    tools: tuple[Mapping[str, Any], ...] | None = None
    request_id: str | None = None
    cache_salt: str | None = None
    priority: int | None = None
    lora: str | None = None
    return_routed_experts: bool = False
    routed_experts_start: int = 0
    model: str | None = None
    images: tuple[Image, ...] = attrs.field(default=(), converter=_images)
    image_spans: tuple[ImageSpan, ...] = attrs.field(default=(), converter=_image_spans)

    def __attrs_post_init__(self) -> None:
        _check(len(self.prompt_ids) > 0, "prompt_ids is empty: a prompt needs at least one token")
        _check_images(self.images, self.image_spans, len(self.prompt_ids))
        ids = _token_ids(self.prompt_ids, "prompt_ids")
        if ids is not self.prompt_ids:
            object.__setattr__(self, "prompt_ids", ids)
        _check(
            0 <= self.routed_experts_start < len(self.prompt_ids) + self.sampling.max_tokens,
            f"routed_experts_start must be in [0, prompt+max_tokens), got {self.routed_experts_start}",
        )


@attrs.frozen(kw_only=True)
class TopLogprob:
    """One alternative at a position: token id, its logprob, and its rank when the server gives it."""

    token_id: int
    logprob: float
    rank: int | None = None


@attrs.frozen(kw_only=True)
class RoutedExperts:
    """MoE routing of a token range (router replay).

    :ivar experts: integer array ``[tokens, layers, top_k]``; row ``i`` is the routing of the token at
        absolute position ``start + i`` of prompt + completion. A server never routes the last sampled token,
        so a full result has ``len(prompt) + len(completion) - 1 - start`` rows.
    :ivar start: absolute position of row 0.
    """

    experts: npt.NDArray[np.integer[Any]] = attrs.field(eq=_array_eq)
    start: int = 0

    @property
    def num_tokens(self) -> int:
        return int(self.experts.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.experts.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.experts.shape[2])


@attrs.frozen(kw_only=True)
class Usage:
    """Token accounting reported by the server (``cached_tokens`` is ``None`` where unknown)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None


@attrs.frozen(kw_only=True)
class WeightVersionSpan:
    """Completion positions ``[start, end)`` generated under weight ``version`` (an update mid-request splits)."""

    version: str
    start: int
    end: int


@attrs.frozen
class MessageSpan:
    """Prompt positions ``[start, end)`` of one message of the messages a prompt was rendered from.

    :ivar message: the message's index in the messages sent; ``None`` for the trailing generation prompt (the
        template's header of the turn being generated).
    :ivar role: that message's role (``"assistant"`` for the generation prompt).
    :ivar sampled: the ids were sampled by the engine in an earlier turn and reused verbatim (a message may then
        have several spans: its template header, the sampled ids, the template's end of turn after them).
    """

    message: int | None
    role: str
    start: int
    end: int
    sampled: bool = False


@attrs.frozen(kw_only=True)
class GenerateResult:
    """One sample: exact ids, one finite logprob per completion id, and what the server said about it.

    :ivar logprobs: float32 ``[len(completion_ids)]``, the logprob of each completion id from the engine's
        own channel; always finite (a non-finite value is a parse error, never passed on).
    :ivar top_logprobs: per position, the requested alternatives (``None`` unless asked for).
    :ivar stop_reason: the stop token id (or stop string) that ended generation, if any.
    :ivar weight_version: the server's weight version when the sample finished.
    :ivar metadata: backend-specific facts about how the sample was served (Dynamo: ``worker_id``,
        ``timing``), never needed to use the result.
    :ivar message_spans: for a prompt rendered from messages, which prompt ids belong to which message:
        :class:`MessageSpan` s covering ``prompt_ids`` contiguously and in order (empty for ``prompt_ids=``).
    :ivar reused_ids: how many leading prompt ids were reused from the previous turn (0 when rendered whole).
    :ivar images: the prompt's images, in order (empty for a text prompt).
    :ivar image_spans: where each image lies in ``prompt_ids``, as the engine widened it: ``prompt_ids`` are the
        ids the engine ran, so a next turn extending ``token_ids`` reuses these exact spans.
    """

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    logprobs: npt.NDArray[np.float32] = attrs.field(eq=_array_eq)
    finish_reason: FinishReason
    stop_reason: int | str | None = None
    top_logprobs: tuple[tuple[TopLogprob, ...], ...] | None = None
    routed_experts: RoutedExperts | None = None
    weight_version: str | None = None
    weight_versions: tuple[WeightVersionSpan, ...] = ()
    usage: Usage | None = None
    request_id: str | None = None
    server: str | None = None
    metadata: Mapping[str, Any] = attrs.field(factory=dict)
    # the spans, or a function computing them on first read (attributing a prompt rendered whole costs renders of
    # its prefixes, which a caller that never reads them should not pay)
    _message_spans: tuple[MessageSpan, ...] | Callable[[], tuple[MessageSpan, ...]] = attrs.field(
        default=(), alias="message_spans", eq=False, repr=False
    )
    reused_ids: int = 0
    images: tuple[Image, ...] = ()
    image_spans: tuple[ImageSpan, ...] = ()

    @property
    def message_spans(self) -> tuple[MessageSpan, ...]:
        spans = self._message_spans
        if callable(spans):
            spans = spans()
            object.__setattr__(self, "_message_spans", spans)
        return spans

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Prompt followed by completion: the ids the next turn must start with."""
        return self.prompt_ids + self.completion_ids


@attrs.frozen(kw_only=True)
class StreamDelta:
    """The tokens one chunk of a streamed generation added (see ``Client.stream``).

    :ivar completion_ids: the new completion ids, in order.
    :ivar logprobs: float32 ``[len(completion_ids)]``, the logprob of each new id from the engine's own channel
        (checked like a result's: finite, one per id).
    """

    completion_ids: tuple[int, ...]
    logprobs: npt.NDArray[np.float32] = attrs.field(eq=_array_eq)


@attrs.frozen(kw_only=True)
class TeacherRequest:
    """Score ``token_ids`` under a model: the logprob of each token given everything before it.

    :param token_ids: the full sequence (prompt + completion) to score; at least two ids.
    :param top_logprobs: alternatives per position to return (0 = none).
    :param lora: adapter to score with, ``None`` for the base model.
    :param model: served model name; ``None`` uses ``ClientConfig.model``.
    :param images: the sequence's images in order, each already widened at its span in ``image_spans`` (a
        result's ``images`` and ``image_spans``).
    :param cache_salt: salts the images' identities (the client sets it to the weight version it knows the server
        serves, so no image is scored with vision features cached under other weights).
    """

    token_ids: tuple[int, ...] = attrs.field(converter=_id_sequence)
    top_logprobs: int = 0
    lora: str | None = None
    model: str | None = None
    request_id: str | None = None
    images: tuple[Image, ...] = attrs.field(default=(), converter=_images)
    image_spans: tuple[ImageSpan, ...] = attrs.field(default=(), converter=_image_spans)
    cache_salt: str | None = None

    def __attrs_post_init__(self) -> None:
        _check_images(self.images, self.image_spans, len(self.token_ids))
        _check(
            len(self.image_spans) == len(self.images),
            f"teacher scoring needs the span of every image: {len(self.images)} images, {len(self.image_spans)} spans",
        )
        _check(len(self.token_ids) >= 2, "teacher scoring needs at least two token ids (position 0 has no logprob)")
        ids = _token_ids(self.token_ids, "token_ids")
        if ids is not self.token_ids:
            object.__setattr__(self, "token_ids", ids)
        _check(0 <= self.top_logprobs <= 20, f"top_logprobs must be in [0, 20], got {self.top_logprobs!r}")


@attrs.frozen(kw_only=True)
class TeacherLogprobs:
    """Teacher scores of a sequence.

    :ivar logprobs: float32 ``[len(token_ids)]``. Position 0 has no prefix and therefore no logprob: it holds
        NaN, so it can never be mistaken for a score; ``logprobs[1:]`` is all finite but on image placeholders
        (the request's ``image_spans``), which the model does not predict: NaN there too.
    :ivar top_logprobs: per position (index 0 is empty), the requested alternatives.
    """

    token_ids: tuple[int, ...]
    logprobs: npt.NDArray[np.float32] = attrs.field(eq=_array_eq)
    top_logprobs: tuple[tuple[TopLogprob, ...], ...] | None = None
    weight_version: str | None = None

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> npt.NDArray[Any]:
        return self.logprobs if dtype is None else self.logprobs.astype(dtype)


@attrs.frozen(kw_only=True)
class TokenizerCheck:
    """Local rendering vs the server's, for the same messages.

    :ivar match: the two id lists are identical.
    :ivar first_difference: first position where they differ (``None`` when they match).
    :ivar local_token: the local token at that position, decoded (``None`` past the end).
    :ivar server_token: the server's token at that position, decoded with the local tokenizer.
    """

    match: bool
    local_ids: tuple[int, ...]
    server_ids: tuple[int, ...]
    first_difference: int | None = None
    local_token: str | None = None
    server_token: str | None = None


@attrs.frozen(kw_only=True)
class LoraAdapter:
    """A LoRA adapter on disk.

    :param name: the name requests use to select it.
    :param path: PEFT adapter directory, as seen by the server.
    :param replace: reload in place when ``name`` is already loaded (hot swap), instead of failing.
    """

    name: str = attrs.field(validator=_text)
    path: str = attrs.field(validator=_text)
    replace: bool = False


@attrs.frozen(kw_only=True)
class DistributedGroup:
    """A trainer-to-server weight-transfer group (NCCL or similar).

    :param master_address: rendezvous host.
    :param master_port: rendezvous port.
    :param world_size: trainer ranks + all server ranks.
    :param rank_offset: this server's first rank in the group.
    :param group_name: name both sides use.
    :param backend: collective backend, e.g. ``"nccl"``.
    :param bucket_bytes: the size of the packed buckets the trainer broadcasts, for engines that fix it when they
        join (vLLM's packed transfer); ``None``: one broadcast per tensor.
    """

    master_address: str = attrs.field(validator=_text)
    master_port: int
    world_size: int
    rank_offset: int
    group_name: str = attrs.field(default="weight_sync", validator=_text)
    backend: str = attrs.field(default="nccl", validator=_text)
    bucket_bytes: int | None = None


@attrs.frozen(kw_only=True)
class TensorSpec:
    """One tensor to receive through a distributed group: HF parameter name, dtype name, shape."""

    name: str = attrs.field(validator=_text)
    dtype: str = attrs.field(validator=_text)
    shape: tuple[int, ...] = attrs.field(converter=_int_tuple)

    @property
    def nbytes(self) -> int:
        """Its size in bytes.

        :raises InvalidRequestError: a dtype name outside :data:`DTYPE_BYTES`.
        """
        size = DTYPE_BYTES.get(self.dtype.removeprefix("torch."))
        if size is None:
            raise InvalidRequestError(
                f"tensor {self.name!r}: dtype {self.dtype!r} cannot be sent (known: {', '.join(DTYPE_BYTES)})"
            )
        count = 1
        for dim in self.shape:
            count *= dim
        return count * size


#: Bytes per element of the dtypes a weight transfer carries, by torch's name.
DTYPE_BYTES: Mapping[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


def _buckets(value: Iterable[Iterable[TensorSpec]]) -> tuple[tuple[TensorSpec, ...], ...]:
    return tuple(tuple(bucket) for bucket in value)


@attrs.frozen(kw_only=True)
class TransferPlan:
    """How an engine receives a distributed weight update, as its backend plans it: the tensors in broadcast
    order, cut into buckets.

    :param buckets: the tensors, in the order the trainer broadcasts them, in consecutive buckets.
    :param packed: each bucket travels as one ``uint8`` broadcast of its tensors' bytes concatenated in order;
        otherwise every tensor is its own broadcast in its own dtype (the buckets then only group the engine's
        calls).
    """

    buckets: tuple[tuple[TensorSpec, ...], ...] = attrs.field(converter=_buckets)
    packed: bool

    @property
    def tensors(self) -> list[TensorSpec]:
        """Every tensor in broadcast order."""
        return [t for bucket in self.buckets for t in bucket]


@attrs.frozen(kw_only=True)
class ServerState:
    """One server's admin state. ``None`` in a field means the server does not expose it."""

    paused: bool | None = None
    sleeping: bool | None = None
    weight_version: str | None = None
    in_flight: int | None = None
    loras: tuple[str, ...] | None = None
