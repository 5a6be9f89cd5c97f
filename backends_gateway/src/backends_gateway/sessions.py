"""Sessions, branches and turns: what the gateway records of a harness's traffic, and how a new request finds the
turn whose exact ids it extends.

A **session** is one rollout (an agent run). Its turns form **branches**: a turn whose messages extend the
previous turn of a branch (that turn's prompt messages, then its reply, then anything new) continues that
branch, its prompt starting with that turn's exact prompt and completion ids. A request that extends an earlier
turn instead (the harness went back and edited a later message) starts a new branch from that turn, still on its
exact ids; one that extends no turn (compaction rewrote the history, the tools changed) starts a new branch
rendered whole. Nothing is ever re-tokenised silently: every branch is one exact token sequence.

Turns are found by a chain of digests over the messages as a template sees them (normal forms; an assistant
message without its reasoning, tool call ids or JSON spacing, which harnesses drop or rewrite), seeded with the
tools and template arguments; whether the reply may really be reused is then proven by the client (the stateless
extension), and a refusal starts a new branch rendered whole.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import orjson

from backends_core import BridgeError, GenerateResult, MessageSpan, RoutedExperts, SamplingParams, WeightVersionSpan
from backends_core.images import Image, ImageSpan, json_default
from backends_core.multiturn import normalize_message
from backends_core.multiturn.messages import images_of
from backends_gateway.fields import ToolChoice

__all__ = [
    "Branch",
    "SessionRecord",
    "SessionState",
    "TurnRecord",
    "TurnRequest",
    "chain_digests",
    "next_digest",
    "request_key",
]

_REASONING = ("reasoning_content", "reasoning")
STATUSES = ("open", "closed")
#: a session's counters, each 0 when it starts (a stored session written before a counter existed reads it as 0)
COUNTS = {"turns": 0, "bridged": 0, "branched": 0, "rerendered": 0, "undelivered": 0, "replayed": 0}


@attrs.frozen(kw_only=True)
class TurnRequest:
    """A turn as a harness asked for it, API-neutral."""

    messages: Sequence[Mapping[str, Any]]
    tools: Sequence[Mapping[str, Any]] | None = None
    sampling: SamplingParams
    chat_template_kwargs: Mapping[str, Any] | None = None
    return_routed_experts: bool = False
    metadata: Mapping[str, Any] = attrs.field(factory=dict)
    #: where each image part of ``messages`` is in the harness's request (``messages[1].content[2]``), in prompt
    #: order: a backend or model that takes no images is refused naming the first
    image_parts: tuple[str, ...] = ()
    #: the harness named no completion limit: ``sampling.max_tokens`` is a ceiling, lowered to what the prompt
    #: leaves of the model's context
    fit_context: bool = False
    #: the engine constrained to call tools (``tool_choice`` "required" or a named function)
    tool_choice: ToolChoice | None = None


def _ids(values: Any) -> npt.NDArray[np.int32]:
    return np.asarray(values, dtype=np.int32)


@attrs.frozen(kw_only=True, eq=False)
class TurnRecord:
    """One answered turn, as the store keeps it.

    :ivar parent: the turn whose exact prompt and completion ids this turn's prompt starts with (``None``:
        rendered whole).
    :ivar messages: the prompt's messages as the harness sent them.
    :ivar reply: the assistant message the harness was answered with (the parse of the completion).
    :ivar message_spans: which prompt ids belong to which message (``sampled``: ids an engine sampled).
    :ivar image_spans: where each image of the prompt's messages lies in ``prompt_ids``, as the engine widened it
        (the images themselves are the messages' image parts: :meth:`images`).
    """

    session: str
    turn: int
    branch: int
    parent: int | None
    created: float
    messages: Sequence[Mapping[str, Any]]
    tools: Sequence[Mapping[str, Any]] | None
    chat_template_kwargs: Mapping[str, Any] | None
    reply: Mapping[str, Any]
    prompt_ids: npt.NDArray[np.int32] = attrs.field(converter=_ids)
    completion_ids: npt.NDArray[np.int32] = attrs.field(converter=_ids)
    logprobs: npt.NDArray[np.float32]
    finish_reason: str
    weight_version: str | None
    weight_versions: tuple[WeightVersionSpan, ...]
    message_spans: tuple[MessageSpan, ...]
    server: str | None
    reused_ids: int
    routed_experts: RoutedExperts | None = None
    request: Mapping[str, Any] = attrs.field(factory=dict)
    image_spans: tuple[ImageSpan, ...] = ()
    #: whether the harness was answered with it: an answer that never reached its harness (the client went away
    #: as it was written) is kept, but is no training sample until a retry of the same request receives it
    delivered: bool = True
    #: the token id or string the engine said ended the completion (the reply's parse drops that token)
    stop_reason: int | str | None = None

    @classmethod
    def of(
        cls,
        result: GenerateResult,
        *,
        session: str,
        turn: int,
        branch: int,
        parent: int | None,
        request: TurnRequest,
        reply: Mapping[str, Any],
        model: str,
    ) -> TurnRecord:
        return cls(
            session=session,
            turn=turn,
            branch=branch,
            parent=parent,
            created=time.time(),
            messages=list(request.messages),
            tools=None if request.tools is None else list(request.tools),
            chat_template_kwargs=request.chat_template_kwargs,
            reply=dict(reply),
            prompt_ids=result.prompt_ids,
            completion_ids=result.completion_ids,
            logprobs=np.asarray(result.logprobs, dtype=np.float32),
            finish_reason=result.finish_reason,
            weight_version=result.weight_version,
            weight_versions=tuple(result.weight_versions),
            message_spans=tuple(result.message_spans),
            server=result.server,
            reused_ids=result.reused_ids,
            routed_experts=result.routed_experts,
            image_spans=tuple(result.image_spans),
            stop_reason=result.stop_reason,
            request={"model": model, "sampling": _sampling_json(request.sampling), **dict(request.metadata)},
        )

    def images(self) -> tuple[Image, ...]:
        """The images of the prompt's messages, in prompt order: the ones ``image_spans`` place."""
        return images_of(self.messages)

    def result(self) -> GenerateResult:
        """This turn as the client's :class:`GenerateResult`, to extend (``previous=``).

        :raises BridgeError: the prompt holds images without their spans (a turn kept by a gateway that recorded
            none): its ids cannot be extended, the turn starts a new branch rendered whole.
        """
        finish = self.finish_reason if self.finish_reason in ("stop", "length", "abort") else "stop"
        images = self.images()
        if len(images) != len(self.image_spans):
            raise BridgeError(
                "image_spans_missing",
                f"turn {self.turn} holds {len(images)} images but {len(self.image_spans)} image spans: its ids hold "
                "widened images whose places are not known",
            )
        return GenerateResult(
            prompt_ids=tuple(self.prompt_ids.tolist()),
            completion_ids=tuple(self.completion_ids.tolist()),
            logprobs=self.logprobs,
            finish_reason=finish,  # type: ignore[arg-type]
            weight_version=self.weight_version,
            weight_versions=self.weight_versions,
            server=self.server,
            message_spans=self.message_spans,
            reused_ids=self.reused_ids,
            images=images,
            image_spans=self.image_spans,
            stop_reason=self.stop_reason,
        )

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    def as_json(self) -> dict[str, Any]:
        """The turn as the trajectory route answers it."""
        out: dict[str, Any] = {
            "turn": self.turn,
            "branch": self.branch,
            "parent": self.parent,
            "created": self.created,
            "prompt_ids": self.prompt_ids.tolist(),
            "completion_ids": self.completion_ids.tolist(),
            "logprobs": self.logprobs.tolist(),
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            "weight_version": self.weight_version,
            "weight_versions": [attrs.asdict(s) for s in self.weight_versions],
            "message_spans": [attrs.asdict(s) for s in self.message_spans],
            "server": self.server,
            "reused_ids": self.reused_ids,
            "image_spans": [attrs.asdict(s) for s in self.image_spans],
            "images": [image.data_url() for image in self.images()],
            "messages": list(self.messages),
            "reply": dict(self.reply),
            "request": dict(self.request),
            "delivered": self.delivered,
        }
        if self.routed_experts is not None:
            out["routed_experts"] = {
                "start": self.routed_experts.start,
                "shape": list(self.routed_experts.experts.shape),
                "experts": self.routed_experts.experts.tolist(),
            }
        return out


def _sampling_json(sampling: SamplingParams) -> dict[str, Any]:
    out = attrs.asdict(sampling, recurse=False)
    out["logit_bias"] = {str(k): v for k, v in sampling.logit_bias.items()}
    out["extra"] = dict(sampling.extra)
    structured = sampling.structured
    out["structured"] = None if structured is None else {"kind": structured.kind, **attrs.asdict(structured)}
    return out


@attrs.frozen(kw_only=True)
class Branch:
    """One exact token sequence of a session.

    :ivar parent_branch: the branch it left (``None`` for the first).
    :ivar parent_turn: the turn whose exact ids it starts with (``None``: its first turn was rendered whole).
    :ivar reason: why it started: ``first``, ``edited`` (an earlier turn extended), ``rewritten`` (no turn
        extended: compaction, edited history, other tools), ``concurrent`` (two requests extended one turn at
        once), or the bridge's refusal (``assistant_mismatch``...).
    """

    session: str
    branch: int
    parent_branch: int | None
    parent_turn: int | None
    reason: str
    created: float

    def as_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.define(kw_only=True)
class SessionRecord:
    """A session's summary. ``counts``: ``turns``, ``bridged`` (prompt reused a turn's exact ids), ``branched``
    (a new branch started after the first), ``rerendered`` (a turn after the first rendered whole),
    ``undelivered`` (answers that never reached the harness, out of the training view), ``replayed`` (retries
    answered with the answer kept for an earlier attempt, nothing generated)."""

    id: str
    group: str | None = None
    status: str = "open"
    reward: float | None = None
    reward_info: Mapping[str, Any] | None = None
    created: float = attrs.field(factory=time.time)
    closed: float | None = None
    counts: dict[str, int] = attrs.field(factory=lambda: dict(COUNTS))
    #: the name of the harness key the session belongs to (None on a gateway without keys)
    owner: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "session": self.id,
            "group": self.group,
            "status": self.status,
            "reward": self.reward,
            "reward_info": self.reward_info,
            "created": self.created,
            "closed": self.closed,
            "owner": self.owner,
            **COUNTS,
            **self.counts,
        }


def _form(message: Mapping[str, Any]) -> dict[str, Any]:
    """What decides whether two messages render alike, as far as a harness's rewriting goes."""
    form = normalize_message(message)
    if form.get("role") == "assistant":
        for key in _REASONING:
            form.pop(key, None)
        calls = form.get("tool_calls")
        if calls:
            form["tool_calls"] = [{k: v for k, v in c.items() if k not in ("id", "type", "index")} for c in calls]
    return form


def next_digest(previous: bytes, message: Mapping[str, Any]) -> bytes:
    """The digest of a message list one message longer than the list ``previous`` identifies."""
    return hashlib.blake2b(
        previous + orjson.dumps(_form(message), option=orjson.OPT_SORT_KEYS, default=json_default), digest_size=16
    ).digest()


def request_key(digests: Sequence[bytes], sampling: SamplingParams) -> bytes:
    """What makes two requests the same request: the same messages (as the template sees them), tools, template
    arguments and sampling. A retry of a request is the same request."""
    return hashlib.blake2b(
        digests[-1] + orjson.dumps(_sampling_json(sampling), option=orjson.OPT_SORT_KEYS), digest_size=16
    ).digest()


def chain_digests(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    chat_template_kwargs: Mapping[str, Any] | None,
) -> list[bytes]:
    """``digests[i]`` identifies ``messages[: i + 1]`` under these tools and template arguments."""
    seed = orjson.dumps([tools or None, chat_template_kwargs or None], option=orjson.OPT_SORT_KEYS)
    h = hashlib.blake2b(seed, digest_size=16).digest()
    out = []
    for message in messages:
        h = next_digest(h, message)
        out.append(h)
    return out


@attrs.define(kw_only=True, eq=False)
class SessionState:
    """A session in the gateway's memory: its summary, its branches, the digest of each turn's messages and
    reply (to find the turn a request extends), and each branch's last turn (what a turn extends most often)."""

    record: SessionRecord
    branches: dict[int, Branch] = attrs.field(factory=dict)
    index: dict[bytes, int] = attrs.field(factory=dict)
    branch_of: dict[int, int] = attrs.field(factory=dict)
    tips: dict[int, TurnRecord] = attrs.field(factory=dict)
    claimed: set[int] = attrs.field(factory=set)  # branches whose tip a turn in flight is extending
    longest: int = 0  # ids of the session's longest sequence
    last_branch: int | None = None
    #: answered turns whose answer never reached the harness, by :func:`request_key`: a retry gets them
    orphans: dict[bytes, TurnRecord] = attrs.field(factory=dict)
    #: turns some later turn extends (their continuation exists): history that extends one is not guessed
    continued: set[int] = attrs.field(factory=set)
    #: whether the store has the session: a new one is kept with its first answered turn, so that a request
    #: refused or failed before it was answered leaves no session behind
    saved: bool = True
    #: requests placed in the session and not yet ended
    pending: int = 0
    #: turns admitted and not yet ended (generating, or being kept)
    planned: int = 0
    #: the number the next turn (branch) that starts gets: a turn knows its number and its branch's before it is
    #: generated (a stream's headers name them); a turn that fails gives its number back when no later one took one
    next_turn: int = 0
    next_branch: int = 0

    def key(self, turn: TurnRecord) -> bytes:
        return chain_digests([*turn.messages, turn.reply], turn.tools, turn.chat_template_kwargs)[-1]

    def add(self, turn: TurnRecord, digest: bytes | None = None) -> None:
        """Remember an answered turn."""
        self.index[digest if digest is not None else self.key(turn)] = turn.turn
        self.branch_of[turn.turn] = turn.branch
        self.next_turn = max(self.next_turn, turn.turn + 1)
        self.next_branch = max(self.next_branch, turn.branch + 1)
        if turn.parent is not None:
            self.continued.add(turn.parent)
        self.tips[turn.branch] = turn
        self.last_branch = turn.branch
        self.longest = max(self.longest, turn.length)

    def anchor(self, digests: Sequence[bytes], messages: Sequence[Mapping[str, Any]]) -> int | None:
        """The latest turn whose messages and reply the request's messages start with (``None``: none)."""
        for i in range(len(digests) - 1, -1, -1):
            if messages[i].get("role") == "assistant":
                turn = self.index.get(digests[i])
                if turn is not None:
                    return turn
        return None
