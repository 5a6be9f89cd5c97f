"""The gateway's core, independent of any wire: a turn asked for (:class:`TurnRequest`) is placed in its session
and branch, generated token-in/token-out through a :class:`~backends_core.Client` (extending the exact ids of
the turn it continues, pinned to that session's server), parsed into the assistant message, and kept durably
before it is answered. The routes (:mod:`backends_gateway.app`) only translate wires.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import orjson

from backends_core import (
    BackendError,
    BridgeError,
    Client,
    ConfigError,
    GenerateResult,
    SamplingParams,
    UnsupportedOperationError,
)
from backends_core.images import image_token_id
from backends_gateway.errors import GatewayError, Overloaded, from_backend_error
from backends_gateway.fields import CompletionLimit
from backends_gateway.roles import TemplateRoles
from backends_gateway.sessions import (
    STATUSES,
    Branch,
    SessionRecord,
    SessionState,
    TurnRecord,
    TurnRequest,
    chain_digests,
    next_digest,
    request_key,
)
from backends_gateway.store import Store
from backends_gateway.trajectory import trajectory_json

__all__ = ["CompletionLimit", "Gateway", "GatewayLimits", "Served", "Started", "TextDelta", "model_context_length"]

log = logging.getLogger("backends_gateway")
_SESSION_ID = re.compile(r"[A-Za-z0-9._:@-]{1,128}")
#: a session or group of a harness key as the gateway names it: ``<key name>~<the harness's name>``
_OWNED_ID = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]{0,63})~([A-Za-z0-9._:@-]{1,128})")
OWNER_SEPARATOR = "~"


@attrs.frozen(kw_only=True)
class GatewayLimits:
    """What one gateway process takes at most.

    :param max_body_bytes: a request body's size.
    :param max_sessions: open sessions held at once (a new one past it is answered 429).
    :param max_turns_per_session: answered turns of one session.
    :param max_tokens_per_session: a session's longest sequence plus a turn's ``max_tokens``.
    :param max_in_flight: turns generating at once (past it: 429 with ``Retry-After``).
    :param max_completion_tokens: a turn's completion at most (``None``: the model's context length); a request
        naming more is refused, one naming none may use what its prompt leaves of the context.
    :param context_length: the served model's context, prompt and completion (``None``: ``max_position_embeddings``
        of the model's ``config.json`` beside the tokenizer). A request that cannot fit is refused by name.
    :param retry_after_s: the ``Retry-After`` of a 429.
    :param idle_timeout_s: a connection that has not sent a whole request's headers for this long (its first
        request, or the next on a kept-alive connection) is closed: a client that trickles its headers, or opens
        connections it never uses, holds none of the process's file descriptors for longer.
    :param body_timeout_s: a request's body must have arrived this long after its headers (408 otherwise).
    """

    max_body_bytes: int = 16 << 20
    max_sessions: int = 100_000
    max_turns_per_session: int = 1024
    max_tokens_per_session: int = 1 << 20
    max_in_flight: int = 4096
    max_completion_tokens: int | None = None
    context_length: int | None = None
    retry_after_s: int = 1
    idle_timeout_s: int = 75
    body_timeout_s: int = 60


@attrs.frozen(kw_only=True)
class TextDelta:
    """Streamed text of the reply: ``kind`` is ``"content"`` or ``"reasoning"``."""

    kind: str
    text: str


@attrs.frozen(kw_only=True)
class Started:
    """A streamed turn's first event: the session it joined (sent before any text); ``replay``: the turn a retry
    is answered with (nothing is generated)."""

    session: str
    #: the numbers the turn and its branch will have (``-1``: unknown)
    turn: int = -1
    branch: int = -1
    replay: TurnRecord | None = None


@attrs.frozen(kw_only=True, eq=False)
class Served:
    """An answered turn: the reply as the harness gets it, and its record (already durable)."""

    session: str
    record: TurnRecord
    result: GenerateResult
    message: Mapping[str, Any]
    #: the request's :func:`~backends_gateway.sessions.request_key` (what a retry of it sends again)
    key: bytes = b""
    owner: str | None = None


@attrs.define(kw_only=True)
class _Plan:
    """Where a turn goes: the turn it extends (``None``: rendered whole) and its branch (``None``: a new one,
    started by ``reason``)."""

    previous: TurnRecord | None
    branch: int | None
    reason: str | None
    parent_branch: int | None
    digests: list[bytes]
    key: bytes = b""
    #: the numbers the turn (and the new branch it starts, when ``branch`` is ``None``) will have
    turn: int = -1
    new_branch: int = -1


def _key_of(turn: TurnRecord) -> bytes:
    """The :func:`~backends_gateway.sessions.request_key` of the request ``turn`` answered, from what it keeps."""
    digests = chain_digests(turn.messages, turn.tools, turn.chat_template_kwargs)
    sampling = turn.request.get("sampling") or {}
    return hashlib.blake2b(digests[-1] + orjson.dumps(sampling, option=orjson.OPT_SORT_KEYS), digest_size=16).digest()


def _check_choice(request: TurnRequest, result: GenerateResult, message: Mapping[str, Any]) -> None:
    """A forced tool choice answered without a call: the engine did not keep to the grammar it was given (a reply
    cut by ``max_tokens`` is answered as it is, incomplete)."""
    if request.tool_choice is not None and result.finish_reason == "stop" and not message.get("tool_calls"):
        raise GatewayError(
            502,
            f"the engine answered {request.tool_choice.param} with no tool call it could read, although it was "
            f"constrained to the tool-call markup: {str(message.get('content'))!r:.200}",
            kind="server_error",
            param=request.tool_choice.param,
            code="tool_choice_unmet",
        )


def model_context_length(tokenizer: str | None) -> int | None:
    """``max_position_embeddings`` of the model's ``config.json`` beside ``tokenizer`` (a directory), ``None``
    when there is none (a multimodal config keeps it in its ``text_config``)."""
    if not tokenizer:
        return None
    path = Path(tokenizer) / "config.json"
    try:
        config = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    for where in (config, config.get("text_config") or {}):
        value = where.get("max_position_embeddings") if isinstance(where, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def new_session_id(owner: str | None = None) -> str:
    """A name for a session no request named: unguessable, and in ``owner``'s names (see :func:`owned_name`)."""
    return uuid.uuid4().hex if owner is None else owned_name(owner, uuid.uuid4().hex)


def owned_name(owner: str, name: str) -> str:
    """The gateway's name for a session or group that the key ``owner`` calls ``name``.

    Each harness key names its sessions and groups in names of its own, so that no key can learn which names
    another uses (a turn to another key's ``run-1`` starts its own ``run-1``), take a name another will use, or add
    sessions to another's group. The trainer, which sees every key's sessions, names them ``team-a~run-1``."""
    return f"{owner}{OWNER_SEPARATOR}{name}"


def owner_named(name: str) -> str | None:
    """The key whose names ``name`` is one of (:func:`owned_name`); ``None``: a name of the gateway's own."""
    matched = _OWNED_ID.fullmatch(name)
    return None if matched is None else matched[1]


def _names_a_session(value: str, *, owned: bool = True) -> bool:
    """1-128 of ``[A-Za-z0-9._:@-]``, not only dots (``.`` and ``..`` are path steps in a URL, which clients and
    proxies rewrite); ``owned``: or such a name in a key's names (:func:`owned_name`)."""
    matched = _OWNED_ID.fullmatch(value) if owned else None
    plain = value if matched is None else matched[2]
    return _SESSION_ID.fullmatch(plain) is not None and plain.strip(".") != ""


def check_session_id(value: str, where: str, *, owned: bool = True) -> str:
    """``value`` if it names a session (or group); else a 400 naming ``where``. ``owned``: a name in a key's names
    (``team-a~run-1``, as the trainer sees them) is one too."""
    if not _names_a_session(value, owned=owned):
        raise GatewayError(
            400,
            f"{where} must match [A-Za-z0-9._:@-]{{1,128}} and not be only dots, got {value[:160]!r}",
            param=where,
            code="session_id",
        )
    return value


def _no_session(session: str) -> GatewayError:
    return GatewayError(404, f"no session {session!r}", kind="not_found_error", param="session", code="not_found")


class Gateway:
    """Sessions over one client and one store.

    :param client: an open :class:`~backends_core.Client` (any backend, fleet or router front) with the stateless
        turn cache off (``stateless=StatelessPolicy(enabled=False)``): the gateway keeps the turns and extends them
        itself (``previous=``), and a turn that cannot reuse the ids it should starts a new branch, never a
        re-render inside one.
    :param store: where turns are kept (:class:`~backends_gateway.SQLiteStore` by default in the CLI).
    :param limits: see :class:`GatewayLimits`.
    """

    def __init__(self, client: Client, store: Store, *, limits: GatewayLimits | None = None) -> None:
        if client.config.stateless.enabled:
            raise ConfigError(
                "the gateway keeps each session's turns itself: give it a client whose config has "
                "stateless=StatelessPolicy(enabled=False) (backends gateway does this for you)"
            )
        self.client = client
        self.store = store
        self.limits = limits or GatewayLimits()
        self._sessions: dict[str, SessionState] = {}
        # open sessions of the store not (yet) in memory: what an earlier run left open counts toward max_sessions
        self._dormant: set[str] = set()
        self._loading: dict[str, asyncio.Future[SessionState | None]] = {}
        # a turn's digest -> the open sessions holding it (for requests naming none)
        self._joined: dict[bytes, set[str]] = {}
        # (owner, request key) -> the session holding an answer no harness received (a retry naming no session)
        self._orphans: dict[tuple[str | None, bytes], str] = {}
        self._in_flight = 0
        #: requests naming no session whose history could not be placed in one open session for sure (it matched
        #: several, or a turn another request already continued): each started a session of its own
        self.unplaced = 0
        self.roles: TemplateRoles | None = None
        self.context_length: int | None = None
        self._context_source = ""
        self.started = time.time()

    @property
    def open_sessions(self) -> int:
        """Open sessions: in this process's memory, and those the store held open when it started."""
        return len(self._sessions) + len(self._dormant)

    @property
    def model(self) -> str | None:
        """The served model name (``config.model``)."""
        return self.client.config.model

    @property
    def completion_limit(self) -> CompletionLimit:
        """What a turn's completion may be at most, and why."""
        cap = self.limits.max_completion_tokens
        context = self.context_length
        if cap is not None and (context is None or cap <= context):
            return CompletionLimit(
                tokens=cap, why=f"the gateway's max_completion_tokens ({cap}; --max-completion-tokens)"
            )
        if context is None:
            return CompletionLimit(tokens=1 << 20, why="no context length is known")
        return CompletionLimit(
            tokens=context, why=f"the served model's context length ({context} ids{self._context_source})"
        )

    async def open(self) -> None:
        """Open the store, then load the tokenizer and probe its template (a missing or broken one fails here,
        naming its path, not at the first turn)."""
        await self.store.open()
        try:
            try:
                self.client.tokenizer  # noqa: B018  (loading it is the point)
            except BackendError as exc:
                raise ConfigError(
                    f"the gateway cannot start: the tokenizer {self.client.config.tokenizer!r} does not load: {exc}"
                ) from exc
            self.roles = TemplateRoles.probe(self.client)
        except BaseException:
            await self.store.aclose()
            raise
        stored = await self.store.list_sessions(status="open", limit=self.limits.max_sessions)
        self._dormant = {record.id for record in stored}
        self.context_length, self._context_source = self.limits.context_length, "; --context-length"
        if self.context_length is None:
            self.context_length = model_context_length(self.client.config.tokenizer)
            self._context_source = "; max_position_embeddings of the model's config.json, or --context-length"

    async def aclose(self) -> None:
        await self.store.aclose()

    async def __aenter__(self) -> Gateway:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- sessions ------------------------------------------------------------------------------------------

    def _join(self, digest: bytes, session: str) -> None:
        self._joined.setdefault(digest, set()).add(session)

    def _leave(self, digest: bytes, session: str) -> None:
        holders = self._joined.get(digest)
        if holders is not None:
            holders.discard(session)
            if not holders:
                del self._joined[digest]

    async def _load(self, session: str) -> SessionState | None:
        """A stored session into memory (after a restart, or one another process wrote); ``None``: unknown."""
        record = await self.store.get_session(session)
        if record is None:
            return None
        state = SessionState(record=record)
        for branch in await self.store.branches(session):
            state.branches[branch.branch] = branch
            state.next_branch = max(state.next_branch, branch.branch + 1)
        for turn in await self.store.turns(session):
            digest = state.key(turn)
            state.add(turn, digest)
            if record.status == "open":
                self._join(digest, session)
                if not turn.delivered:
                    key = _key_of(turn)
                    state.orphans[key] = turn
                    self._orphans[(record.owner, key)] = session
        return state

    async def state(self, session: str) -> SessionState | None:
        """The session, from memory or the store; ``None`` if unknown."""
        state = self._sessions.get(session)
        if state is not None:
            return state
        pending = self._loading.get(session)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[SessionState | None] = asyncio.get_running_loop().create_future()
        self._loading[session] = future
        try:
            state = await self._load(session)
            if state is not None and state.record.status == "open":
                self._sessions[session] = state
                self._dormant.discard(session)
            future.set_result(state)
            return state
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: a waiter re-raises it
            raise
        finally:
            del self._loading[session]

    async def _create(self, session: str, group: str | None, owner: str | None) -> SessionState:
        if self.open_sessions >= self.limits.max_sessions:
            raise Overloaded(
                f"{self.open_sessions} sessions are open (the gateway's max_sessions): close finished sessions "
                "(POST /v1/sessions/{id}/close) or retry later",
                retry_after=self.limits.retry_after_s,
                code="too_many_sessions",
            )
        state = SessionState(record=SessionRecord(id=session, group=group, owner=owner), saved=False)
        self._sessions[session] = state
        return state

    async def _named(self, session: str, group: str | None, owner: str | None) -> SessionState:
        state = await self.state(session)
        if state is None:
            named_for = owner_named(session)
            if named_for is not None and named_for != owner:  # a key's name only that key starts a session by
                raise _no_session(session)
            state = self._sessions.get(session) or await self._create(session, group, owner)
        if state.record.owner != owner:
            raise _no_session(session)
        return state

    def _guess(
        self, owner: str | None, digests: Sequence[bytes], messages: Sequence[Mapping[str, Any]]
    ) -> SessionState | None:
        """The open session of ``owner`` whose turn the history extends, when exactly one can be: ``None`` when
        none can, or when it would be a guess (several sessions hold that turn, or another request already
        continued it: two rollouts of one task look alike until they differ), counted in :attr:`unplaced`."""
        for i in range(len(digests) - 1, -1, -1):
            if messages[i].get("role") != "assistant":
                continue
            holders = [
                state
                for name in self._joined.get(digests[i], ())
                if (state := self._sessions.get(name)) is not None and state.record.owner == owner
            ]
            if not holders:
                continue
            if len(holders) == 1:
                state = holders[0]
                turn = state.index.get(digests[i])
                if turn is not None and turn not in state.continued and state.branch_of.get(turn) not in state.claimed:
                    return state
            self.unplaced += 1
            log.info("a request naming no session extends a turn of %d sessions: it starts its own", len(holders))
            return None
        return None

    async def _session_for(
        self,
        session: str | None,
        harness_session: str | None,
        group: str | None,
        owner: str | None,
        digests: Sequence[bytes],
        key: bytes,
        messages: Sequence[Mapping[str, Any]],
    ) -> SessionState:
        if session is not None:
            state = await self._named(session, group, owner)
        elif harness_session is not None:
            try:
                state = await self._named(harness_session, group, owner)
            except GatewayError:  # another key's session of that name: this harness's turns are not its
                state = await self._create(new_session_id(owner), group, owner)
        else:
            orphaned = self._sessions.get(self._orphans.get((owner, key), ""))
            found = orphaned if orphaned is not None and key in orphaned.orphans else None
            if found is None:
                found = self._guess(owner, digests, messages)
            state = found if found is not None else await self._create(new_session_id(owner), group, owner)
        record = state.record
        if record.status != "open":
            raise GatewayError(409, f"session {record.id} is closed", param="session", code="session_closed")
        if group is not None and record.group != group:
            raise GatewayError(
                400,
                f"session {record.id} is in group {record.group!r}, not {group!r}",
                param="X-Session-Group",
                code="group_mismatch",
            )
        return state

    def _plan(self, state: SessionState, request: TurnRequest, digests: list[bytes], key: bytes) -> _Plan:
        anchor = state.anchor(digests, request.messages)
        if anchor is None:
            if not state.branch_of:
                return _Plan(previous=None, branch=None, reason="first", parent_branch=None, digests=digests, key=key)
            return _Plan(
                previous=None,
                branch=None,
                reason="rewritten",
                parent_branch=state.last_branch,
                digests=digests,
                key=key,
            )
        branch = state.branch_of[anchor]
        tip = state.tips[branch]
        if tip.turn == anchor and branch not in state.claimed:
            state.claimed.add(branch)
            return _Plan(previous=tip, branch=branch, reason=None, parent_branch=None, digests=digests, key=key)
        if tip.turn == anchor:  # another turn in flight extends this tip: both keep its ids, this one branches
            return _Plan(previous=tip, branch=None, reason="concurrent", parent_branch=branch, digests=digests, key=key)
        return _Plan(previous=None, branch=None, reason="edited", parent_branch=branch, digests=digests, key=key)

    async def _previous(self, state: SessionState, plan: _Plan, anchor_turn: int | None) -> None:
        """Fill ``plan.previous`` for a new branch extending a turn that is no branch's tip (from the store)."""
        if anchor_turn is None:
            return
        for turn in await self.store.turns(state.record.id):
            if turn.turn == anchor_turn:
                plan.previous = turn
                return

    def _check_limits(self, state: SessionState, request: TurnRequest) -> None:
        limits = self.limits
        turns = state.record.counts["turns"] + state.planned  # those generating count: admission is atomic
        if turns >= limits.max_turns_per_session:
            raise GatewayError(
                400,
                f"session {state.record.id} has {turns} turns (answered or generating), the gateway's "
                f"max_turns_per_session",
                param="session",
                code="session_turn_limit",
            )
        if state.longest + request.sampling.max_tokens > limits.max_tokens_per_session:
            raise GatewayError(
                400,
                f"session {state.record.id}'s longest sequence ({state.longest} ids) plus max_tokens "
                f"({request.sampling.max_tokens}) passes the gateway's max_tokens_per_session "
                f"({limits.max_tokens_per_session})",
                param="max_tokens",
                code="session_token_limit",
            )

    def _check_images(self, request: TurnRequest) -> None:
        """Refuse images this backend or model cannot take, naming the harness's first image part (the client
        refuses them too, but only knows the messages it is given, not where they were in the harness's request)."""
        if not request.image_parts:
            return
        where = request.image_parts[0]
        refusal = self.client.driver.image_refusal
        if refusal is not None:
            error = UnsupportedOperationError(self.client.backend, f"images ({where})", hint=refusal)
            raise GatewayError(400, str(error), param=where, code="unsupported_content")
        tokenizer = self.client.config.tokenizer
        if not tokenizer or image_token_id(tokenizer) is None:
            raise GatewayError(
                400,
                f"{where} is an image, but the served model takes none: its config.json (beside the tokenizer "
                f"{tokenizer!r}) names no image placeholder (image_token_id)",
                param=where,
                code="unsupported_content",
            )

    def _admit(self) -> None:
        if self._in_flight >= self.limits.max_in_flight:
            raise Overloaded(
                f"{self._in_flight} turns are generating (the gateway's max_in_flight)",
                retry_after=self.limits.retry_after_s,
                code="too_many_requests",
            )

    def adapt(self, request: TurnRequest) -> TurnRequest:
        """``request`` with its messages mapped onto the roles the template renders (:mod:`backends_gateway.roles`)."""
        if self.roles is None:
            raise RuntimeError("the gateway is not open (async with Gateway(...) or await gateway.open())")
        messages = self.roles.adapt(request.messages)
        if list(messages) != list(request.messages):
            request = attrs.evolve(request, messages=messages)
        if request.tool_choice is not None:
            request = attrs.evolve(request, sampling=self._constrained(request))
        return request

    def _constrained(self, request: TurnRequest) -> SamplingParams:
        """The request's sampling, the engine constrained to the template's tool-call markup (its tool choice).

        :raises GatewayError: the tool parser offers no grammar, the engine takes none, or the request also asks
            for a response format (400, naming the tool choice).
        """
        choice = request.tool_choice
        assert choice is not None
        names = [choice.name] if choice.name is not None else [t["function"]["name"] for t in request.tools or ()]
        if request.sampling.structured is not None:
            raise GatewayError(
                400,
                f"{choice.param} forces a tool call and the request also asks for a response format: send one",
                param=choice.param,
                code="unsupported_parameter",
            )
        grammar = self.client.tool_call_grammar(names, single=choice.single)
        if grammar is None:
            raise GatewayError(
                400,
                f"{choice.param} cannot be enforced: the tool parser {self.client.parsers['tool']!r} gives no "
                "grammar of its markup to constrain the engine to (send 'auto')",
                param=choice.param,
                code="unsupported_parameter",
            )
        sampling = attrs.evolve(request.sampling, structured=grammar)
        try:
            self.client.driver.check_sampling(sampling)
        except UnsupportedOperationError as exc:
            raise GatewayError(
                400,
                f"{choice.param} cannot be enforced on this engine: it is honoured by constraining the engine to "
                f"the tool-call markup (a grammar), which {exc}",
                param=choice.param,
                code="unsupported_parameter",
            ) from exc
        return sampling

    async def _begin(
        self,
        request: TurnRequest,
        session: str | None,
        harness_session: str | None,
        group: str | None,
        owner: str | None,
        retry: bool,
    ) -> tuple[SessionState, _Plan, TurnRecord | None]:
        if session is not None:
            check_session_id(session, "session")
        if harness_session is not None and not _names_a_session(harness_session):
            harness_session = None  # a harness's own id this gateway cannot name a session by: history decides
        if group is not None:
            check_session_id(group, "X-Session-Group")
        self._check_images(request)
        digests = chain_digests(request.messages, request.tools, request.chat_template_kwargs)
        key = request_key(digests, request.sampling)
        state = await self._session_for(session, harness_session, group, owner, digests, key, request.messages)
        state.pending += 1
        try:
            replay = self._replayable(state, key, retry)
            if replay is not None:
                answered = _Plan(previous=None, branch=None, reason=None, parent_branch=None, digests=digests, key=key)
                return state, answered, replay
            plan = self._plan(state, request, digests, key)
            try:
                if plan.previous is None and plan.reason == "edited":
                    await self._previous(state, plan, state.anchor(digests, request.messages))
                # the limits are checked and the turn counted with no await between: concurrent requests cannot
                # all pass a check that only one of them may
                self._admit()
                self._check_limits(state, request)
            except BaseException:
                self._end(state, plan)
                raise
        except BaseException:
            self._leave_session(state)
            raise
        self._in_flight += 1
        state.planned += 1
        plan.turn = state.next_turn
        state.next_turn += 1
        self._number_branch(state, plan)
        return state, plan, None

    def _replayable(self, state: SessionState, key: bytes, retry: bool) -> TurnRecord | None:
        """The turn a retry of this request is answered with: one whose answer never reached its harness, or (for
        a request the harness marks as a retry) a branch's last turn asked exactly so."""
        orphan = state.orphans.get(key)
        if orphan is not None:
            return orphan
        if retry:
            for tip in state.tips.values():
                if tip.turn not in state.continued and _key_of(tip) == key:
                    return tip
        return None

    async def _mark(self, state: SessionState, turn: TurnRecord, *, delivered: bool, **counted: int) -> TurnRecord:
        """Keep whether ``turn`` reached its harness and the session's counters moved by ``counted``: in the store
        first, then in memory (a failed write changes nothing)."""
        record = state.record
        counts = dict(record.counts)
        for name, delta in counted.items():
            counts[name] = counts.get(name, 0) + delta
        marked = attrs.evolve(turn, delivered=delivered)
        written = attrs.evolve(record, counts=counts)
        if delivered == turn.delivered:
            await self.store.update_session(written)
        else:
            await self.store.set_delivered(marked, written)
        record.counts = counts
        if state.tips.get(turn.branch) is turn:
            state.tips[turn.branch] = marked
        return marked

    async def _replay(self, state: SessionState, key: bytes, turn: TurnRecord, owner: str | None) -> Served:
        """Answer a retry with a kept turn (nothing is generated); it is delivered now."""
        if turn.delivered:
            turn = await self._mark(state, turn, delivered=True, replayed=1)
        else:
            turn = await self._mark(state, turn, delivered=True, replayed=1, undelivered=-1)
            state.orphans.pop(key, None)
            self._orphans.pop((owner, key), None)
        result = turn.result()
        return Served(session=state.record.id, record=turn, result=result, message=turn.reply, key=key, owner=owner)

    async def undelivered(self, served: Served) -> None:
        """Keep that ``served``'s answer never reached its harness: out of the training view, and what a retry of
        the same request is answered with."""
        state = self._sessions.get(served.session)
        turn = served.record
        if state is None or not turn.delivered:
            return
        orphan = await self._mark(state, turn, delivered=False, undelivered=1)
        state.orphans[served.key] = orphan
        self._orphans[(served.owner, served.key)] = state.record.id
        log.info("session %s: turn %d never reached its harness: out of the training view", state.record.id, turn.turn)

    def _end(self, state: SessionState, plan: _Plan) -> None:
        if plan.branch is not None:
            state.claimed.discard(plan.branch)

    @staticmethod
    def _number_branch(state: SessionState, plan: _Plan) -> None:
        """Give the new branch a planned turn starts its number."""
        if plan.branch is None and plan.new_branch < 0:
            plan.new_branch = state.next_branch
            state.next_branch += 1

    @staticmethod
    def _unnumber(state: SessionState, plan: _Plan) -> None:
        """A planned turn kept nothing: its numbers go back when no later turn took one after them."""
        if plan.new_branch >= 0 and plan.new_branch == state.next_branch - 1 and plan.new_branch not in state.branches:
            state.next_branch -= 1
        if plan.turn >= 0 and plan.turn == state.next_turn - 1 and plan.turn not in state.branch_of:
            state.next_turn -= 1
        plan.turn = plan.new_branch = -1

    def _finish(self, state: SessionState, plan: _Plan) -> None:
        """A planned turn ended, kept or not."""
        self._in_flight -= 1
        state.planned -= 1
        self._end(state, plan)
        self._unnumber(state, plan)
        self._leave_session(state)

    def _leave_session(self, state: SessionState) -> None:
        """A request placed in ``state`` ended: a new session it answered nothing in is gone with it."""
        state.pending -= 1
        if not state.saved and state.pending == 0 and self._sessions.get(state.record.id) is state:
            del self._sessions[state.record.id]

    def _generate_args(self, state: SessionState, request: TurnRequest, plan: _Plan) -> dict[str, Any]:
        return {
            "messages": request.messages,
            "sampling": request.sampling,
            "tools": request.tools,
            "chat_template_kwargs": request.chat_template_kwargs,
            "return_routed_experts": request.return_routed_experts,
            "session": state.record.id,
            "previous": None if plan.previous is None else plan.previous.result(),
            "request_id": f"{state.record.id}-{uuid.uuid4().hex[:12]}",
            "context_length": self.context_length if request.fit_context else None,
        }

    def _refused(self, state: SessionState, plan: _Plan, exc: BridgeError) -> None:
        """The client refused to extend the planned turn: a new branch, rendered whole."""
        log.info("session %s: %s; the turn starts a new branch rendered whole", state.record.id, exc)
        self._end(state, plan)
        parent = plan.branch if plan.branch is not None else plan.parent_branch
        plan.previous, plan.branch, plan.reason, plan.parent_branch = None, None, exc.reason, parent
        self._number_branch(state, plan)

    async def _record(
        self,
        state: SessionState,
        plan: _Plan,
        request: TurnRequest,
        result: GenerateResult,
        message: Mapping[str, Any],
        owner: str | None,
    ) -> Served:
        record = state.record
        counts = dict(record.counts)
        new_branch = None
        if plan.branch is None:
            number = plan.new_branch
            new_branch = Branch(
                session=record.id,
                branch=number,
                parent_branch=plan.parent_branch,
                parent_turn=None if plan.previous is None else plan.previous.turn,
                reason=plan.reason or "first",
                created=time.time(),
            )
            state.branches[number] = new_branch
            if len(state.branches) > 1:
                counts["branched"] += 1
            branch = number
        else:
            branch = plan.branch
        if plan.previous is not None:
            counts["bridged"] += 1
        elif state.branch_of:
            counts["rerendered"] += 1
        turn = TurnRecord.of(
            result,
            session=record.id,
            turn=plan.turn,
            branch=branch,
            parent=None if plan.previous is None else plan.previous.turn,
            request=request,
            reply=message,
            model=self.model or "",
        )
        counts["turns"] += 1
        digest = next_digest(plan.digests[-1], message)  # the request's messages, then the reply
        before = (dict(record.counts), state.tips.get(branch), state.last_branch, state.longest)
        continued = turn.parent if turn.parent is not None and turn.parent not in state.continued else None
        record.counts = counts
        state.add(turn, digest)  # before the store answers, so a concurrent turn numbers after it
        creating = not state.saved
        state.saved = True
        try:
            if creating:
                await self.store.create_session(record)
                creating = False  # the store has it now, whatever happens to the turn
            await self.store.record_turn(turn, record, new_branch)
        except BaseException:  # not kept, so not answered: the session must not extend it
            record.counts, tip, state.last_branch, state.longest = before
            state.index.pop(digest, None)
            state.branch_of.pop(turn.turn, None)
            if continued is not None:
                state.continued.discard(continued)
            if tip is None:
                state.tips.pop(branch, None)
            else:
                state.tips[branch] = tip
            if new_branch is not None:
                state.branches.pop(new_branch.branch, None)
            if creating:
                state.saved = False
            raise
        self._join(digest, record.id)
        return Served(session=record.id, record=turn, result=result, message=message, key=plan.key, owner=owner)

    async def _keep(
        self,
        state: SessionState,
        plan: _Plan,
        request: TurnRequest,
        result: GenerateResult,
        message: Mapping[str, Any],
        owner: str | None,
    ) -> Served:
        """:meth:`_record`, run to its end even when the request is cancelled (its client went away): a generated
        turn is kept, as never delivered, so that memory and store agree and a retry gets it."""
        keeping = asyncio.ensure_future(self._record(state, plan, request, result, message, owner))
        try:
            return await asyncio.shield(keeping)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await self.undelivered(await keeping)
            raise

    # -- turns ---------------------------------------------------------------------------------------------

    async def turn(
        self,
        request: TurnRequest,
        *,
        session: str | None = None,
        harness_session: str | None = None,
        group: str | None = None,
        owner: str | None = None,
        retry: bool = False,
    ) -> Served:
        """Generate and keep one turn; returns once it is durable. ``owner``: the key sending it (a session belongs
        to the key that started it; another key's session is not found, and a name in a key's names,
        :func:`owned_name`, starts a session only for that key). ``harness_session``: the harness's own
        id for its conversation, the session when ``session`` names none. ``retry``: the harness says this
        request repeats one it sent (an SDK's retry header): answered with that turn if it was kept.

        :raises GatewayError: bad input (400), a closed session (409), a limit (429), an engine failure (5xx).
        """
        request = self.adapt(request)
        state, plan, replay = await self._begin(request, session, harness_session, group, owner, retry)
        if replay is not None:
            try:
                return await self._replay(state, plan.key, replay, owner)
            finally:
                self._leave_session(state)
        try:
            try:
                result = await self.client.generate(**self._generate_args(state, request, plan))
            except BridgeError as exc:
                self._refused(state, plan, exc)
                result = await self.client.generate(**self._generate_args(state, request, plan))
            message = self.client.parse_completion(result)
            _check_choice(request, result, message)
            return await self._keep(state, plan, request, result, message, owner)
        except BackendError as exc:
            raise from_backend_error(exc) from exc
        finally:
            self._finish(state, plan)

    async def stream_turn(
        self,
        request: TurnRequest,
        *,
        session: str | None = None,
        harness_session: str | None = None,
        group: str | None = None,
        owner: str | None = None,
        retry: bool = False,
    ) -> AsyncGenerator[Started | TextDelta | Served, None]:
        """Generate one turn as a stream: :class:`Started` (the session), :class:`TextDelta` s of the reply as it
        is sampled, then (once the turn is durable) the rest of the text the whole parse gives, then the
        :class:`Served` turn.

        Text is only sent once no later token can change how it parses: content once the reasoning block (if the
        template has one) is closed, never past a ``<`` that may open tool-call markup, never its trailing
        whitespace (a parser drops what separates the content from a call). The whole parse is checked against
        what was sent before the turn is kept: a turn whose answer could not be sent as parsed is not kept.
        Leaving the iterator early aborts the generation on the engine.
        """
        request = self.adapt(request)
        state, plan, replay = await self._begin(request, session, harness_session, group, owner, retry)
        if replay is not None:
            try:
                yield Started(session=state.record.id, turn=replay.turn, branch=replay.branch, replay=replay)
                served = await self._replay(state, plan.key, replay, owner)
                for kind, key in (("reasoning", "reasoning_content"), ("content", "content")):
                    if served.message.get(key):
                        yield TextDelta(kind=kind, text=served.message[key])
                yield served
            finally:
                self._leave_session(state)
            return
        try:
            try:  # built (and the bridge proven or refused) before the stream starts, so its headers are final
                stream = self.client.stream(**self._generate_args(state, request, plan))
            except BridgeError as exc:
                self._refused(state, plan, exc)
                stream = self.client.stream(**self._generate_args(state, request, plan))
            splitter = _Splitter(self.client, stream.request.prompt_ids)
            async with stream:
                # the engine's first answer comes before the stream starts: its refusal (a prompt past its context,
                # a field it does not take) is the route's HTTP error, not an event after a 200
                first = await anext(stream, None)
                branch = plan.branch if plan.branch is not None else plan.new_branch
                yield Started(session=state.record.id, turn=plan.turn, branch=branch)
                if first is not None:
                    for event in splitter.feed(first.completion_ids):
                        yield event
                    async for delta in stream:
                        for event in splitter.feed(delta.completion_ids):
                            yield event
            message = self.client.parse_completion(stream.result)
            _check_choice(request, stream.result, message)
            rest = splitter.finish(message)  # before the turn is kept: a stream that cannot end as parsed is no turn
            served = await self._keep(state, plan, request, stream.result, message, owner)
            for event in rest:
                yield event
            yield served
        except BackendError as exc:
            raise from_backend_error(exc) from exc
        finally:
            self._finish(state, plan)

    def prompt_ids(self, request: TurnRequest) -> list[int]:
        """The ids ``request``'s messages render to, as a turn rendered whole would send them.

        :raises GatewayError: the template refused the messages, or they hold an image (400): how many ids an
            image widens into is the engine's, known once a turn ran it.
        """
        if request.image_parts:
            where = request.image_parts[0]
            raise GatewayError(
                400,
                f"{where} is an image: its ids cannot be counted before the engine's image processor widened it",
                param=where,
                code="unsupported_content",
            )
        request = self.adapt(request)
        try:
            return self.client.render(
                request.messages, tools=request.tools, chat_template_kwargs=request.chat_template_kwargs
            )
        except BackendError as exc:
            raise from_backend_error(exc) from exc

    # -- the trainer's side ----------------------------------------------------------------------------------

    async def _known(self, session: str, owner: str | None = None) -> SessionRecord:
        """The session; ``owner``: only if it is that key's (``None``: any)."""
        check_session_id(session, "session")
        state = self._sessions.get(session)
        record = state.record if state is not None else await self.store.get_session(session)
        if record is None or (owner is not None and record.owner != owner):
            raise _no_session(session)
        return record

    async def find_turn(
        self, session: str, where: Callable[[TurnRecord], bool], *, owner: str | None = None
    ) -> TurnRecord | None:
        """The latest turn of ``session`` for which ``where`` holds (``None``: none): the branch tips first (the
        turn a harness continues is most often one), then the store. ``owner``: only that key's session.

        :raises GatewayError: 404 for an unknown session (or another key's).
        """
        await self._known(session, owner)
        state = self._sessions.get(session)
        if state is not None:
            for tip in state.tips.values():
                if where(tip):
                    return tip
        for turn in reversed(await self.store.turns(session)):
            if where(turn):
                return turn
        return None

    async def summary(self, session: str, *, owner: str | None = None) -> dict[str, Any]:
        return (await self._known(session, owner)).as_json()

    async def set_reward(self, session: str, reward: float, info: Mapping[str, Any] | None) -> dict[str, Any]:
        """Keep a session's reward (and ``info``, any JSON the store can write back): in the store first, then in
        memory, so a reward the store refuses changes nothing.

        :raises GatewayError: an unknown session (404), ``info`` the store cannot keep (400).
        """
        record = await self._known(session)
        kept = None if info is None else dict(info)
        if kept is not None:
            try:
                orjson.dumps(kept)
            except orjson.JSONEncodeError as exc:
                raise GatewayError(400, f"info cannot be kept: {exc}", param="info", code="invalid_value") from None
        await self.store.update_session(attrs.evolve(record, reward=reward, reward_info=kept))
        record.reward, record.reward_info = reward, kept
        return record.as_json()

    async def close(self, session: str) -> dict[str, Any]:
        """Close a session: no more turns join it; its trajectory is final."""
        record = await self._known(session)
        if record.status != "closed":
            closed = time.time()
            await self.store.update_session(attrs.evolve(record, status="closed", closed=closed))
            record.status, record.closed = "closed", closed
            self._dormant.discard(session)
            state = self._sessions.pop(session, None)
            if state is not None:
                for digest in state.index:
                    self._leave(digest, session)
                for key in state.orphans:
                    if self._orphans.get((record.owner, key)) == session:
                        del self._orphans[(record.owner, key)]
        return record.as_json()

    async def sessions(
        self, *, group: str | None, status: str | None, limit: int, after: float | None, owner: str | None = None
    ) -> list[dict[str, Any]]:
        """Session summaries (``owner``: only that key's)."""
        if status is not None and status not in STATUSES:
            raise GatewayError(
                400, f"status must be one of {list(STATUSES)}, got {status!r}", param="status", code="invalid_value"
            )
        records = await self.store.list_sessions(group=group, status=status, owner=owner, limit=limit, after=after)
        live = self._sessions
        return [(live[r.id].record if r.id in live else r).as_json() for r in records]

    async def trajectory(self, session: str) -> dict[str, Any]:
        record = await self._known(session)
        branches = await self.store.branches(session)
        turns = await self.store.turns(session)
        return trajectory_json(record, branches, turns)


class _Splitter:
    """The reply's text as far as it is settled, while the completion streams: re-parses the completion so far
    and releases only what no later token can change."""

    def __init__(self, client: Client, prompt_ids: Sequence[int]) -> None:
        self.client = client
        self.prompt_ids = tuple(prompt_ids)
        self.ids: list[int] = []
        self.parsed = 0  # ids parsed so far
        self.sent = {"reasoning": "", "content": ""}
        self.reasoned = client.parsers["reasoning"] is None

    def _parse(self) -> Mapping[str, Any]:
        partial = GenerateResult(
            prompt_ids=self.prompt_ids,
            completion_ids=tuple(self.ids),
            logprobs=np.zeros(len(self.ids), np.float32),
            finish_reason="length",
        )
        return self.client.parse_completion(partial)

    def _release(self, kind: str, text: str) -> TextDelta | None:
        sent = self.sent[kind]
        if len(text) > len(sent) and text.startswith(sent):
            self.sent[kind] = text
            return TextDelta(kind=kind, text=text[len(sent) :])
        return None

    def feed(self, ids: Sequence[int]) -> list[TextDelta]:
        self.ids.extend(ids)
        # each parse decodes the whole completion so far: parsing once per 1/32 of its length keeps a long stream's
        # parsing linear-ish (about 32 parses per doubling) while short ones still stream token by token
        if len(self.ids) - self.parsed < max(1, self.parsed // 32):
            return []
        self.parsed = len(self.ids)
        parsed = self._parse()
        out = []
        reasoning = parsed.get("reasoning_content")
        if reasoning is not None:
            self.reasoned = True
            event = self._release("reasoning", _settled(reasoning))
            if event is not None:
                out.append(event)
        if self.reasoned and not parsed.get("tool_calls"):
            content = parsed.get("content") or ""
            sent = self.sent["content"]
            cut = content.find("<", len(sent))
            event = self._release("content", _settled(content if cut < 0 else content[:cut]))
            if event is not None:
                out.append(event)
        return out

    def finish(self, message: Mapping[str, Any]) -> list[TextDelta]:
        out = []
        for kind, key in (("reasoning", "reasoning_content"), ("content", "content")):
            text = message.get(key) or ""
            sent = self.sent[kind]
            if not text.startswith(sent):
                raise GatewayError(
                    500,
                    f"the streamed {kind} {sent!r:.80} is not a prefix of the whole parse {text!r:.80}",
                    kind="server_error",
                    code="stream_parse",
                )
            if len(text) > len(sent):
                self.sent[kind] = text
                out.append(TextDelta(kind=kind, text=text[len(sent) :]))
        return out


def _settled(text: str) -> str:
    """``text`` without its trailing whitespace: what separates it from what comes next (a tool call, the end of
    a reasoning block) is the parser's to keep or drop, known only once the next text arrives."""
    return text.rstrip()
