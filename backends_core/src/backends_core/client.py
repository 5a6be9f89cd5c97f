"""Client: the public entry point. Owns the HTTP clients, the backend driver and the tokenizer."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import ssl
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import attrs
import httpx
import numpy as np

from backends_core._http import AiohttpTransport
from backends_core.balancer import Balancer
from backends_core.config import ClientConfig
from backends_core.driver import BackendDriver
from backends_core.errors import (
    BridgeError,
    ConfigError,
    InvalidRequestError,
    RenderError,
    RequestError,
    StaleServerError,
    TransportError,
    UnsupportedOperationError,
)
from backends_core.fleet import Admin, ServedVersions
from backends_core.fronts import Front, FrontFleet
from backends_core.images import IMAGE_PART_TYPES, Image, ImageSpan, collapse, image_token_id, widen_position
from backends_core.membership import Fleet
from backends_core.multiturn import BridgeStats, Conversation
from backends_core.multiturn.extension import Extension, end_of_turn_ids, end_of_turn_stop_ids
from backends_core.multiturn.messages import as_plain, check_content_parts, normal_forms, normalize_messages
from backends_core.multiturn.prefix_cache import PrefixRenderCache
from backends_core.multiturn.rendering import load_tokenizer
from backends_core.multiturn.spans import rendered_spans
from backends_core.multiturn.turn_cache import TurnCache, extend_after_reply
from backends_core.parsing import AUTO, CompletionParser, chosen_parser
from backends_core.server import REQUEST_ID, Server
from backends_core.types import (
    GenerateRequest,
    GenerateResult,
    Grammar,
    Message,
    MessageSpan,
    SamplingParams,
    StreamDelta,
    TeacherLogprobs,
    TeacherRequest,
    TokenizerCheck,
)

__all__ = ["Client", "GenerateStream"]

log = logging.getLogger("backends_core.client")
#: Failover and cooldown: a server taken out of rotation, where its request went, a server back in rotation.
balance_log = logging.getLogger("backends_core.balancer")
#: Multi-turn: a session's messages re-rendered in full (``StatelessPolicy.on_break = "rerender"``).
multiturn_log = logging.getLogger("backends_core.multiturn")

#: The session key of the request being sent, for the session header hook.
_SESSION: contextvars.ContextVar[str | None] = contextvars.ContextVar("backends_session", default=None)


def _with_cache_salt(request: GenerateRequest, salt: str) -> GenerateRequest:
    """``attrs.evolve(request, cache_salt=salt)`` without checking again what ``request`` was checked for when it
    was built (its ids above all): a salt is any string, so the copy is as valid as the original."""
    salted = object.__new__(GenerateRequest)
    for field in _REQUEST_FIELDS:
        object.__setattr__(salted, field, getattr(request, field))
    object.__setattr__(salted, "cache_salt", salt)
    return salted


_REQUEST_FIELDS = tuple(field.name for field in attrs.fields(GenerateRequest))


def _transport_args(
    transport: httpx.AsyncBaseTransport | None, limits: httpx.Limits, verify: ssl.SSLContext | bool
) -> dict[str, Any]:
    """How an ``httpx.AsyncClient`` reaches the network: the caller's transport (testing seam), else
    :class:`AiohttpTransport` for ``http://`` and ``https://``, except for a scheme the environment sends through
    a proxy: that one stays on httpx's default transport, which reads the proxy settings (``trust_env``)."""
    if transport is not None:
        return {"transport": transport}
    proxies = urllib.request.getproxies()
    if "all" in proxies or ("http" in proxies and "https" in proxies):
        return {}
    ours = AiohttpTransport(limits=limits, verify=verify)
    if "http" in proxies or "https" in proxies:
        return {"mounts": {"https://" if "http" in proxies else "http://": ours}}
    return {"transport": ours}


class Client:
    """Async client for one backend over one server or a fleet.

    Use it as ``async with Client(config) as client:``; leaving the block closes every connection.

    :param config: what to talk to and how.
    :param transport: testing seam: an ``httpx.AsyncBaseTransport`` (e.g. ``httpx.MockTransport`` or an
        emulator) used instead of the network, for both planes.
    :param plugin: register this object as the backend instead of loading ``config.backend``'s entry point.
    :param plugins: cross-cutting plugins (metrics via ``observe``, ``prepare_request`` wrappers).
    :param tokenizer: a ready tokenizer, instead of loading ``config.tokenizer`` on first use.
    """

    def __init__(
        self,
        config: ClientConfig,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        plugin: object | None = None,
        plugins: Sequence[object] = (),
        tokenizer: Any = None,
    ) -> None:
        self.config = config
        self.driver = BackendDriver(config, plugin=plugin, extra_plugins=plugins)
        # credentials go only where they were configured: the data client carries the servers' own headers;
        # admin calls get theirs per request from Server (configured servers vs. hosts a backend discovers)
        headers = dict(config.headers)
        key = config.api_key()
        if key is not None:
            headers["authorization"] = f"Bearer {key}"
        admin_headers = dict(config.admin_headers)
        admin_key = config.admin_api_key()
        if admin_key is not None:
            admin_headers["authorization"] = f"Bearer {admin_key}"
        home_headers = {**headers, **admin_headers}
        t, lim = config.timeouts, config.limits
        tls: bool | ssl.SSLContext = (
            ssl.create_default_context(cafile=config.verify) if isinstance(config.verify, str) else config.verify
        )
        if tls is True:  # one verifying context for every pool (httpx loads the CA bundle per client: ~50 ms each)
            tls = httpx.create_ssl_context()
        front_kind = self.driver.front_kind()
        session_header = config.fleet.session_header
        if config.front is not None and front_kind is not None:  # the router's header, unless configured
            session_header = config.front.session_header or front_kind.session_header or ""

        async def add_session_header(request: httpx.Request) -> None:
            session = _SESSION.get()
            if session is not None and session_header:
                request.headers[session_header] = session

        data_limits = httpx.Limits(
            max_connections=lim.max_connections,
            max_keepalive_connections=lim.max_keepalive_connections,
            keepalive_expiry=lim.keepalive_expiry,
        )
        self._data = httpx.AsyncClient(
            **_transport_args(transport, data_limits, tls),
            verify=tls,
            headers=headers,
            event_hooks={"request": [add_session_header]},
            timeout=httpx.Timeout(connect=t.connect, read=t.read, write=t.write, pool=t.pool),
            limits=data_limits,
        )
        # every server gets its own small admin pool: control calls never queue behind generation streams
        admin_limits = httpx.Limits(max_connections=lim.admin_max_connections, keepalive_expiry=lim.keepalive_expiry)
        self._admin_clients: list[httpx.AsyncClient] = []
        secrets = {k for k in (key, admin_key) if k}
        fleet = config.fleet
        elastic = len(config.servers) > 1 or fleet.discovery is not None

        def make_server(base: str, admin: str, *, failover: bool = True) -> Server:
            admin_client = httpx.AsyncClient(
                **_transport_args(transport, admin_limits, tls),
                verify=tls,
                follow_redirects=False,
                timeout=httpx.Timeout(t.admin, connect=t.connect),
                limits=admin_limits,
            )
            self._admin_clients.append(admin_client)
            return Server(
                base_url=base,
                admin_url=admin,
                data_client=self._data,
                admin_client=admin_client,
                retry=config.retry,
                admin_retry=config.admin.retry_policy(config.retry),
                admin_timeout=t.admin,
                failover=failover,
                secrets=set(secrets),
                home_headers=home_headers,
                admin_headers=admin_headers,
                home=frozenset((base, admin)),
            )

        self._make_server = make_server
        #: Sticky-least-loaded server choice with health tracking (see :mod:`backends_core.balancer`); it holds
        #: the fleet's membership (which servers serve, join or are gone).
        self.balancer: Balancer[Server] = Balancer(
            [make_server(base, admin, failover=elastic) for base, admin in config.servers],
            slack=fleet.sticky_slack,
            cooldown=fleet.cooldown,
        )
        #: The weight version this client last set on every server (the fleet's version).
        self.weight_version: str | None = None
        #: The weight version each server serves as far as this client knows; requests are salted with it.
        self.versions = ServedVersions()
        #: Hot swaps of each adapter name done by this client: part of the cache salt of its requests.
        self._swaps: dict[str, int] = {}
        self._lookups: dict[int, asyncio.Future[None]] = {}
        self._tokenizer = tokenizer
        self._parser: CompletionParser | None = None
        self._parsers: dict[str, str | None] | None = None
        self._turns = TurnCache(config.stateless, parse=self.parse_completion)
        #: the last ``template_stop`` call: (parameters given, end-of-turn ids, the resolved parameters)
        self._template_stop_memo: tuple[SamplingParams, tuple[int, ...], SamplingParams] | None = None
        #: Multi-turn bridge counters shared by every conversation of this client.
        self.bridge_stats = BridgeStats()
        #: The router in front of the replicas (``config.front``), or ``None``.
        self.front: Front | None = None
        self.front_fleet: FrontFleet | None = None
        #: Membership at run time: servers join (caught up first) and leave (drained); behind a front, the
        #: replicas it lists.
        self.fleet: Fleet
        if front_kind is not None and config.front is not None:
            front_server = self.servers[0]
            front_server.front = front_kind.kind
            self.front = front_kind(front_server, config.front)
            self.fleet = self.front_fleet = fleet_view = FrontFleet(self, self.front)
            members: Callable[[], Sequence[Server]] = fleet_view.admin_servers
            extra: dict[str, Any] = {
                "sync": fleet_view.sync,
                "everyone": fleet_view.everyone,
                "label": fleet_view.label,
                "standing": fleet_view.standing,
            }
        else:
            self.fleet = Fleet(self)
            members, extra = (lambda: [self.servers[i] for i in self.balancer.serving()]), {}
        #: Admin operations over every server (behind a front: every replica it lists).
        self.admin = Admin(
            self.driver,
            self.servers,
            policy=config.admin,
            on_version=self._remember_version,
            versions=self.versions,
            on_swap=self._swapped,
            members=members,
            **extra,
        )

    async def __aenter__(self) -> Client:
        self.fleet.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop refreshing the membership and close every connection pool."""
        await self.fleet._stop()
        await self._data.aclose()
        for admin_client in self._admin_clients:
            await admin_client.aclose()

    @property
    def servers(self) -> list[Server]:
        """Every server this client has had, by index (indices stay valid when members join or leave): the
        configured ones in config order, then the ones that joined. :attr:`base_urls` lists those serving."""
        return self.balancer.servers

    @property
    def base_urls(self) -> list[str]:
        """The base URLs of the servers serving, in order of joining (the configured ones in config order)."""
        return [self.servers[i].base_url for i in self.balancer.serving()]

    @property
    def backend(self) -> str:
        return self.driver.backend

    @property
    def capabilities(self) -> frozenset[str]:
        """Optional operations the backend implements (hook names, e.g. ``admin_pause``)."""
        return self.driver.capabilities

    @property
    def tokenizer(self) -> Any:
        """The chat-template tokenizer, loaded offline on first use from ``config.tokenizer`` (or ``model``)."""
        if self._tokenizer is None:
            source = self.config.tokenizer or self.config.model
            if source is None:
                raise ConfigError(
                    ["rendering messages needs a tokenizer: set tokenizer to a local directory @ $.tokenizer"]
                )
            self._tokenizer = load_tokenizer(source)
        return self._tokenizer

    @property
    def render_cache(self) -> PrefixRenderCache:
        """The default render's prefix cache: its ``stats`` (:class:`~backends_core.multiturn.prefix_cache.
        RenderStats`), ``enabled = False`` to tokenize every prompt whole. A backend with its own ``render`` hook
        does not use it."""
        defaults = self.driver.pm.get_plugin("backends_core.defaults")
        assert defaults is not None  # every plugin manager carries the core defaults
        cache: PrefixRenderCache = defaults.prefix_cache
        return cache

    def parse_completion(self, result: GenerateResult) -> dict[str, Any]:
        """The assistant message ``result``'s completion is, as the chat template would render it back.

        The completion is decoded with this client's tokenizer (special tokens kept, its end-of-turn or EOS
        terminator dropped), then split by the parsers :attr:`parsers` names (``config.reasoning_parser`` and
        ``config.tool_parser``, ``"auto"`` chosen from the chat template; see :mod:`backends_core.parsing`).

        :returns: ``{"role": "assistant", "content": str, "reasoning_content": str | None, "tool_calls": list |
            None}``; ``reasoning_content`` is ``None`` without a reasoning parser or a reasoning block,
            ``tool_calls`` is ``None`` without a tool parser or calls, else OpenAI's form: ``[{"id", "type":
            "function", "function": {"name", "arguments": <the JSON text>}}]``. Each call's ``id`` is derived from
            the completion, so parsing the same result twice gives equal messages.
        :raises InvalidRequestError: ``result`` is not a :class:`GenerateResult`.
        :raises ConfigError: no tokenizer is configured.
        """
        if not isinstance(result, GenerateResult):
            raise InvalidRequestError(f"parse_completion takes a GenerateResult, got {type(result).__name__}")
        return self._completion_parser().parse(result)

    def _completion_parser(self) -> CompletionParser:
        if self._parser is None:
            chosen = self.parsers
            driver = self.driver
            self._parser = CompletionParser(
                self.tokenizer,
                tool_parser=None if chosen["tool"] is None else driver.tool_parsers[chosen["tool"]],
                reasoning_parser=None if chosen["reasoning"] is None else driver.reasoning_parsers[chosen["reasoning"]],
            )
        return self._parser

    def tool_call_grammar(self, names: Sequence[str], *, single: bool = False) -> Grammar | None:
        """A structured-output constraint (:class:`Grammar`) under which the engine can only answer with calls of
        the tools ``names``, written as :meth:`parse_completion` reads them (one call if ``single``): how
        ``tool_choice`` "required" or a named function is honoured. ``None``: the tool parser in use offers no
        grammar (a third-party parser without ``call_grammar``), or there is none.

        :raises InvalidRequestError: no names.
        """
        if not names:
            raise InvalidRequestError("tool_call_grammar needs at least one tool name")
        grammar = self._completion_parser().call_grammar(list(names), single=single)
        return None if grammar is None else Grammar(grammar)

    @property
    def parsers(self) -> dict[str, str | None]:
        """The parsers :meth:`parse_completion` uses, ``{"tool": name | None, "reasoning": name | None}``:
        ``config.tool_parser`` / ``reasoning_parser`` as configured, with ``"auto"`` decided on the tokenizer's
        chat template (loading the tokenizer). An ``"auto"`` that finds no known convention is logged once."""
        if self._parsers is None:
            template = getattr(self.tokenizer, "chat_template", None) or ""
            chosen: dict[str, str | None] = {}
            for kind, name, installed in (
                ("tool", self.config.tool_parser, self.driver.tool_parsers),
                ("reasoning", self.config.reasoning_parser, self.driver.reasoning_parsers),
            ):
                chosen[kind] = chosen_parser(kind, name, installed, template)
                if name == AUTO and chosen[kind] is None:
                    log.info(
                        "%s_parser 'auto': no installed %s parser knows this chat template's convention (installed: "
                        "%s); %s text stays in the content",
                        kind,
                        kind,
                        sorted(installed),
                        "tool-call" if kind == "tool" else "reasoning",
                    )
            self._parsers = chosen
        return dict(self._parsers)

    def server_index(self, which: int | str) -> int:
        """Index of a serving server given by index or base URL.

        :raises InvalidRequestError: no such server, or it is not serving (joining: not caught up yet; gone).
        """
        if isinstance(which, int):
            if not 0 <= which < len(self.servers):
                raise InvalidRequestError(f"server index {which} out of range (have {len(self.servers)})")
            index = which
        else:
            url = which.rstrip("/")
            found = [i for i, s in enumerate(self.servers) if s.base_url == url]
            if not found:
                raise InvalidRequestError(f"no server {which!r} in this client (have {self.base_urls})")
            index = next((i for i in found if self.balancer.states[i] == "serving"), found[-1])
        state = self.balancer.states[index]
        if state != "serving":
            why = "it is joining and not caught up yet" if state == "joining" else "it left the fleet"
            raise InvalidRequestError(f"server {self.servers[index].base_url} gets no requests: {why}")
        return index

    def server(self, which: int | str | None = None, *, session: str | None = None) -> Server:
        """A server by index or base URL, or (``None``) the balancer's pick for ``session``."""
        if which is None:
            return self.servers[self.balancer.pick(session=session)]
        return self.servers[self.server_index(which)]

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Prompt ids for ``messages`` as this backend renders them."""
        return self.driver.render(
            list(messages),
            tools=tools,
            chat_template_kwargs=dict(chat_template_kwargs or {}),
            add_generation_prompt=add_generation_prompt,
            tokenizer=self.tokenizer,
        )

    def _build_request(
        self,
        *,
        messages: Sequence[Message] | None,
        prompt_ids: Sequence[int] | None,
        sampling: SamplingParams | None,
        tools: Sequence[Mapping[str, Any]] | None,
        chat_template_kwargs: Mapping[str, Any] | None,
        session: str | None = None,
        previous: Previous | None = None,
        images: tuple[Image, ...] = (),
        image_spans: tuple[ImageSpan, ...] = (),
        context_length: int | None = None,
        **fields: Any,
    ) -> tuple[GenerateRequest, Callable[[GenerateResult], GenerateResult] | None]:
        """The request, and for a prompt rendered from messages what each result gets: its message spans and how
        many leading ids were reused (``None`` for ``prompt_ids``)."""
        if (messages is None) == (prompt_ids is None):
            raise InvalidRequestError("give exactly one of messages= or prompt_ids=")
        attribute = None
        if messages is not None:
            if images or image_spans:
                raise InvalidRequestError("images= and image_spans= go with prompt_ids=; messages carry their images")
            plain = [as_plain(m) for m in messages]
            images = check_content_parts(plain)
            if images:
                self._check_images(plain)
            reused: Extension | None = None
            if previous is not None:
                reused = self._extend_previous(
                    _previous_result(previous),
                    plain,
                    images,
                    tools=tools,
                    chat_template_kwargs=chat_template_kwargs,
                    request_id=fields.get("request_id"),
                )
            elif session is not None and self.config.stateless.enabled:
                reused = self._reuse_turns(
                    session,
                    plain,
                    images,
                    tools=tools,
                    chat_template_kwargs=chat_template_kwargs,
                    request_id=fields.get("request_id"),
                )
            if reused is None:
                ids: Sequence[int] = self.render(plain, tools=tools, chat_template_kwargs=chat_template_kwargs)
                message_spans: MessageSpans = self._spans_of(plain, ids, tools, chat_template_kwargs)
            else:
                ids = reused.ids
                message_spans = reused.spans or ()
            known = 0
            if images:
                fields["images"] = images
                fields["image_spans"] = self._image_placement(ids, images, reused.image_spans if reused else ())
                known = len(fields["image_spans"])
            attribute = _attribution(message_spans, reused.reused if reused is not None else 0, known)
            fields["messages"] = tuple(plain)
            fields["tools"] = tuple(tools) if tools else None
            sampling = self.template_stop(sampling, chat_template_kwargs=chat_template_kwargs)
        else:
            assert prompt_ids is not None
            if isinstance(prompt_ids, str | bytes):
                raise InvalidRequestError(f"prompt_ids must be a sequence of ints, got {type(prompt_ids).__name__}")
            if previous is not None:
                raise InvalidRequestError("previous= extends a conversation given as messages=, not prompt_ids=")
            ids = prompt_ids  # checked by GenerateRequest, which keeps the caller's tuple as it is
            if images or image_spans:
                if not images:
                    raise InvalidRequestError("image_spans= without images=")
                where = f"images[{len(image_spans)}]" if len(images) > len(image_spans) else "images[0]"
                if self.driver.image_refusal is not None:
                    raise UnsupportedOperationError(self.backend, f"images ({where})", hint=self.driver.image_refusal)
                fields["images"] = images
                fields["image_spans"] = self._image_placement(ids, images, image_spans)
        sampling = _required(sampling)
        if context_length is not None:
            sampling = _fit(sampling, len(ids), context_length)
        request = GenerateRequest(prompt_ids=ids, sampling=sampling, **fields)
        return self.driver.prepare_request(request), attribute

    def _check_images(self, messages: list[dict[str, Any]]) -> None:
        """Refuse images this backend, transport or model cannot take, naming the first image part.

        :raises UnsupportedOperationError: the backend or its transport sends no images.
        :raises InvalidRequestError: the model declares no image placeholder.
        """
        where = next(
            f"messages[{i}].content[{j}]"
            for i, m in enumerate(messages)
            if isinstance(m.get("content"), list | tuple)
            for j, part in enumerate(m["content"])
            if isinstance(part, Mapping) and part.get("type") in IMAGE_PART_TYPES
        )
        if self.driver.image_refusal is not None:
            raise UnsupportedOperationError(self.backend, f"images ({where})", hint=self.driver.image_refusal)
        if self._image_token() is None:
            raise InvalidRequestError(
                f"{where} is an image, but the model of tokenizer {self.config.tokenizer!r} takes none: its "
                "config.json names no image placeholder (image_token_id)"
            )

    def _image_token(self) -> int | None:
        return image_token_id(self.config.tokenizer) if self.config.tokenizer else None

    def _image_placement(
        self, ids: Sequence[int], images: tuple[Image, ...], known: tuple[ImageSpan, ...]
    ) -> tuple[ImageSpan, ...]:
        """``known`` (the spans of the images ``ids`` already hold widened), after checking that every other image is
        exactly one placeholder id in ``ids``.

        :raises InvalidRequestError: the model declares no image placeholder, or a known span is not one run of it.
        :raises RenderError: not exactly one placeholder per new image (the chat template wrote another count, or
            the ids were widened already).
        """
        pad = self._image_token()
        if pad is None:
            raise InvalidRequestError(
                f"the model of tokenizer {self.config.tokenizer!r} takes no images: its config.json names no image "
                "placeholder (image_token_id)"
            )
        for k, span in enumerate(known):
            if span.end > len(ids) or set(ids[span.start : span.end]) != {pad}:
                raise InvalidRequestError(f"image_spans[{k}] {span} is not a run of the image placeholder {pad}")
        wire = collapse(ids, known)
        found = sum(1 for t in wire if t == pad)
        if found != len(images):
            raise RenderError(
                f"the prompt holds {found} image placeholders (id {pad}) outside the known spans for {len(images)} "
                f"images ({len(known)} of them known): each image needs exactly one, never an already widened run"
            )
        return known

    def _spans_of(
        self,
        messages: list[dict[str, Any]],
        ids: Sequence[int],
        tools: Sequence[Mapping[str, Any]] | None,
        chat_template_kwargs: Mapping[str, Any] | None,
    ) -> Callable[[], tuple[MessageSpan, ...]]:
        """The spans of ``ids`` rendered whole from ``messages``, computed when first read (empty where the
        backend's own ``render`` hook built ids that are not the template text's encoding)."""

        memo: list[tuple[MessageSpan, ...]] = []  # one computation for every sample of a group

        def spans() -> tuple[MessageSpan, ...]:
            if not memo:
                found = rendered_spans(
                    self.tokenizer,
                    messages,
                    ids,
                    tools=tools,
                    chat_template_kwargs=chat_template_kwargs,
                    end_of_turn=self._end_of_turn(chat_template_kwargs),
                )
                memo.append(found or ())
            return memo[0]

        return spans

    def _end_of_turn(self, chat_template_kwargs: Mapping[str, Any] | None) -> str | None:
        """The chat template's end-of-turn text (probed once per template), ``None`` where it has none."""
        try:
            return end_of_turn_ids(self.tokenizer, chat_template_kwargs)[0]
        except BridgeError:
            return None

    def template_stop(
        self, sampling: SamplingParams | None, *, chat_template_kwargs: Mapping[str, Any] | None = None
    ) -> SamplingParams:
        """``sampling`` for a prompt rendered with the chat template: unless ``stop_token_ids`` was given (even
        empty), it stops at the template's end-of-turn token(s) (:func:`~backends_core.multiturn.extension.
        end_of_turn_stop_ids`), so a model whose EOS differs from its template's end of turn still ends its turn
        there. The model's EOS stops it too (``ignore_eos`` aside).

        :raises InvalidRequestError: the template has no end of turn to find (pass ``stop_token_ids``).
        """
        sampling = _required(sampling)
        if sampling.stop_token_ids is not None:
            return sampling
        try:
            ids = end_of_turn_stop_ids(self.tokenizer, chat_template_kwargs)
        except BridgeError as exc:
            raise InvalidRequestError(
                f"cannot find the chat template's end-of-turn token ({exc}); pass sampling.stop_token_ids explicitly"
            ) from exc
        last = self._template_stop_memo
        if last is not None and last[0] is sampling and last[1] == ids:
            return last[2]  # the same parameters again (a batch's): the same resolved copy, checked once
        resolved = attrs.evolve(sampling, stop_token_ids=ids)
        self._template_stop_memo = (sampling, ids, resolved)
        return resolved

    def _reuse_turns(
        self,
        session: str,
        messages: list[dict[str, Any]],
        images: tuple[Image, ...],
        *,
        tools: Sequence[Mapping[str, Any]] | None,
        chat_template_kwargs: Mapping[str, Any] | None,
        request_id: str | None = None,
    ) -> Extension | None:
        """The prompt reusing this session's earlier turn, ``None`` to render in full (first turn, or a break
        the policy says to re-render). Counted in :attr:`bridge_stats`."""
        if not self._turns.turns(session):
            return None
        return self._bridged(
            lambda stats: self._turns.prompt_ids(
                self.tokenizer, session, messages, tools=tools, chat_template_kwargs=chat_template_kwargs, stats=stats
            ),
            f"session {session}",
            len(messages),
            images,
            request_id,
            session=session,
        )

    def _extend_previous(
        self,
        previous: GenerateResult,
        messages: list[dict[str, Any]],
        images: tuple[Image, ...],
        *,
        tools: Sequence[Mapping[str, Any]] | None,
        chat_template_kwargs: Mapping[str, Any] | None,
        request_id: str | None = None,
    ) -> Extension | None:
        """The prompt for ``messages`` reusing ``previous``'s exact ids (the stateless extension), ``None`` to
        render in full where the policy says to re-render a break. Counted in :attr:`bridge_stats`."""

        def extend(stats: BridgeStats) -> Extension:
            normalized = normal_forms(messages)
            replies = [i for i, m in enumerate(normalized) if m["role"] == "assistant"]
            if not replies:
                raise BridgeError(
                    "no_prefix",
                    "previous= was given but the messages hold no assistant message to be its completion's reply",
                )
            return extend_after_reply(
                self.tokenizer,
                normalized,
                replies[-1],
                previous,
                self.parse_completion,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
                stats=stats,
            )

        return self._bridged(extend, "previous=", len(messages), images, request_id)

    def _bridged(
        self,
        extend: Callable[[BridgeStats], Extension | None],
        what: str,
        count: int,
        images: tuple[Image, ...],
        request_id: str | None,
        **event: Any,
    ) -> Extension | None:
        """``extend()`` counted in :attr:`bridge_stats`; a break raises, or re-renders where the policy says so.

        An extension whose ids hold other images than the first of ``images`` (the history's, in order) is a break
        (``image_changed``): those ids hold the expansion of the images they were generated with."""
        stats = self.bridge_stats
        stats.attempts += 1
        started = time.perf_counter()
        try:
            found = extend(stats)
            if found is not None and tuple(images[: len(found.images)]) != found.images:
                raise BridgeError(
                    "image_changed",
                    f"the history holds {len(images)} images whose first {len(found.images)} are not the images "
                    "of the turn being extended: its ids hold those images' expansion",
                )
        except BridgeError as exc:
            stats.failures[exc.reason] += 1
            self.driver.emit("bridge", "stateless", None, started, exc, reason=exc.reason, **event)
            if self.config.stateless.on_break == "raise":
                raise
            stats.rerendered += 1
            multiturn_log.warning("%s: re-rendering all %d messages (%s) [request %s]", what, count, exc, request_id)
            return None
        stats.successes += 1
        self.driver.emit("bridge", "stateless", None, started, None, **event)
        return found

    async def generate_samples(
        self,
        *,
        messages: Sequence[Message] | None = None,
        prompt_ids: Sequence[int] | None = None,
        sampling: SamplingParams | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int | None = None,
        lora: str | None = None,
        return_routed_experts: bool = False,
        routed_experts_start: int = 0,
        model: str | None = None,
        server: int | str | None = None,
        session: str | None = None,
        previous: Previous | None = None,
        images: Sequence[Image] = (),
        image_spans: Sequence[ImageSpan] = (),
        context_length: int | None = None,
    ) -> list[GenerateResult]:
        """Generate ``sampling.n`` samples for one prompt; see :meth:`generate` for the arguments."""
        request, attribute = self._build_request(
            messages=messages,
            prompt_ids=prompt_ids,
            sampling=sampling,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
            request_id=request_id,
            cache_salt=cache_salt,
            priority=priority,
            lora=lora,
            return_routed_experts=return_routed_experts,
            routed_experts_start=routed_experts_start,
            model=model,
            session=session,
            previous=previous,
            images=tuple(images),
            image_spans=tuple(image_spans),
            context_length=context_length,
        )
        results = await self.send(request, server=server, session=session)
        if attribute is not None:
            results = [attribute(r) for r in results]
        if session is not None and messages is not None and len(results) == 1 and self.config.stateless.enabled:
            self._turns.remember(session, normalize_messages(messages), results[0])
        return results

    async def send(
        self, request: GenerateRequest, *, server: int | str | None = None, session: str | None = None
    ) -> list[GenerateResult]:
        """Send an already built request to a pinned server, or to the balancer's pick for ``session``.

        A request that certainly never reached its server (connection refused, connect timeout) fails over to
        the next healthy server and that server is taken out for the cooldown; a request that may have reached
        the engine is never re-sent: its error is raised.

        Requests without a ``cache_salt`` are salted with the weight version their server serves as far as this
        client knows (:attr:`versions`: set by its weight updates, refreshed by state checks and by answers that
        report another version). A server that could not be reached, or where a weight change failed, is asked
        for its version before it serves again: if it serves other weights than the fleet (the version this
        client set, else the one every other server is known to serve), it is taken out for the cooldown and the
        request goes elsewhere (:class:`StaleServerError` when it was pinned or the last one left); it stays in
        doubt, whatever a state check reads, until such a check passes.
        """
        self.driver.check_sampling(request.sampling)  # before a server is picked or asked anything
        pinned = None if server is None else self.server_index(server)
        tried: set[int] = set()
        token = _SESSION.set(session)
        named = REQUEST_ID.set(request.request_id)
        try:
            while True:
                index, sent = await self._route(request, pinned=pinned, session=session, tried=tried)
                target = self.servers[index]
                self.balancer.acquire(index)
                try:
                    results = await self.driver.generate(target, sent)
                except RequestError as exc:
                    if self._failed(index, exc, pinned=pinned, tried=tried):
                        raise
                    continue
                except BaseException:
                    self.balancer.release(index, ok=False)
                    raise
                self._served(index, results[-1])
                return results
        finally:
            REQUEST_ID.reset(named)
            _SESSION.reset(token)

    async def _route(
        self, request: GenerateRequest, *, pinned: int | None, session: str | None, tried: set[int]
    ) -> tuple[int, GenerateRequest]:
        """The server for the next attempt at ``request`` (``pinned``, else the balancer's pick among those not
        ``tried``) once its weights are known to be the fleet's, and the request as sent there (salted)."""
        self.fleet.start()
        if self.front_fleet is not None and self.front_fleet.front.server.replicas is None:
            await self.front_fleet.listed()
        while True:
            if pinned is not None and self.balancer.states[pinned] != "serving":
                raise InvalidRequestError(f"server {self.servers[pinned].base_url} left the fleet")
            index = pinned if pinned is not None else self.balancer.pick(session=session, exclude=frozenset(tried))
            target = self.servers[index]
            if self.versions.in_doubt(target):
                await self._look_up_version(target)
                stale = self._stale(index)
                if stale is not None:  # stays in doubt: looked at again after the cooldown
                    self.balancer.take_out(index)
                    tried.add(index)
                    if pinned is not None or self.balancer.exhausted(tried):
                        raise stale
                    balance_log.warning(
                        "%s; out of rotation for %g s (cooldown); request %s goes to another server",
                        stale,
                        self.balancer.cooldown,
                        request.request_id,
                    )
                    continue
                self.versions.trust(target)
            salt = self.config.fleet.salt_with_weight_version and request.cache_salt is None
            return index, (self._salted(request, target) if salt else request)

    def _failed(self, index: int, exc: RequestError, *, pinned: int | None, tried: set[int]) -> bool:
        """Account for an attempt on server ``index`` that failed with ``exc``; whether ``exc`` must be raised
        (it may have reached the engine, the server was pinned, or no server is left) rather than failed over."""
        down = isinstance(exc, TransportError)
        self.balancer.release(index, ok=False, reachable=not down)
        tried.add(index)
        if down:  # whatever comes back on this address is looked at again before it serves
            self.versions.forget(self.servers[index])
        if exc.maybe_processed:
            fate = "may have reached the engine: not sent again"
        elif pinned is not None:
            fate = "was pinned to it: not sent elsewhere"
        elif self.balancer.exhausted(tried):
            fate = "has no other server left to try"
        else:
            fate = "fails over to another server"
        if down:
            balance_log.warning(
                "%s unreachable (%s): out of rotation for %g s (cooldown); request %s %s",
                self.servers[index].base_url,
                type(exc.__cause__ or exc).__name__,
                self.balancer.cooldown,
                REQUEST_ID.get(),
                fate,
            )
        return fate != "fails over to another server"

    def _served(self, index: int, result: GenerateResult) -> None:
        """Account for an answered attempt on server ``index``."""
        back = self.balancer.load[index].failures
        self.balancer.release(index, ok=True)
        target = self.servers[index]
        if back:
            balance_log.info(
                "%s answered again after %d failure(s): back in rotation [request %s]",
                target.base_url,
                back,
                result.request_id,
            )
        served = result.weight_version
        if served is not None and served != self.versions.get(target):
            self.versions.set(target, served)  # it moved on: later requests get the new salt

    def _salted(self, request: GenerateRequest, server: Server) -> GenerateRequest:
        """``request`` with a cache salt naming the weights ``server`` serves and any hot swap of its adapter."""
        version = self.versions.get(server)
        swaps = self._swaps.get(request.lora) if request.lora is not None else None
        if version is None and swaps is None:
            return request
        salt = f"weights:{version}" if version is not None else ""
        if swaps is not None:
            salt += f"|lora:{request.lora}#{swaps}"
        return _with_cache_salt(request, salt)

    async def _look_up_version(self, server: Server) -> None:
        """Learn the weight version ``server`` serves (its ``admin_state``; one lookup however many requests
        wait for it); unknown when it cannot say."""
        lookup = self._lookups.get(id(server))
        if lookup is None:
            lookup = self._lookups[id(server)] = asyncio.ensure_future(self._read_version(server))
            lookup.add_done_callback(lambda _: self._lookups.pop(id(server), None))
        await asyncio.shield(lookup)

    async def _read_version(self, server: Server) -> None:
        if self.front is not None and server is self.front.server:
            # a router answers admin_state from one replica at best: the fleet's version is the one this client
            # set on every replica (the replicas' own versions are checked before each admin operation)
            self.versions.set(server, self.weight_version)
            return
        if "admin_state" not in self.driver.capabilities:
            self.versions.set(server, None)
            return
        (outcome,) = await self.admin.outcomes([server]).state()
        if not outcome.ok:
            self.versions.set(server, None)
            log.warning(
                "%s: weight version unknown (admin_state failed: %s); its requests are not salted",
                server.base_url,
                outcome.error,
            )

    def _stale(self, index: int) -> StaleServerError | None:
        """An error if server ``index`` serves other weights than the fleet: the version this client set, else
        the one version every other server is known to serve. ``None`` when it matches or cannot be told."""
        expected = self.weight_version
        if expected is None:
            others = {
                v
                for i in self.balancer.serving()
                if i != index and (v := self.versions.get(self.servers[i])) is not None
            }
            expected = others.pop() if len(others) == 1 else None
        target = self.servers[index]
        reported = self.versions.get(target)
        if expected is None or reported is None or reported == expected:
            return None
        return StaleServerError(target.base_url, expected=expected, reported=reported)

    async def generate(
        self,
        *,
        messages: Sequence[Message] | None = None,
        prompt_ids: Sequence[int] | None = None,
        sampling: SamplingParams | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int | None = None,
        lora: str | None = None,
        return_routed_experts: bool = False,
        routed_experts_start: int = 0,
        model: str | None = None,
        server: int | str | None = None,
        session: str | None = None,
        previous: Previous | None = None,
        images: Sequence[Image] = (),
        image_spans: Sequence[ImageSpan] = (),
        context_length: int | None = None,
    ) -> GenerateResult:
        """Generate one sample, token in / token out.

        :param messages: chat messages, rendered with the chat template (exclusive with ``prompt_ids``).
        :param prompt_ids: exact prompt token ids (exclusive with ``messages``).
        :param sampling: sampling parameters (``n`` must be 1; use :meth:`generate_samples` for more).
        :param tools: tool schemas rendered into the prompt.
        :param chat_template_kwargs: extra template variables (``enable_thinking``...).
        :param request_id: passed through to the server (tracing, abort).
        :param cache_salt: isolate prefix-cache entries.
        :param priority: scheduling priority where supported.
        :param lora: a loaded adapter's name.
        :param return_routed_experts: ask for MoE routing (router replay).
        :param routed_experts_start: first absolute position whose routing is wanted.
        :param model: served model name (default ``config.model``).
        :param server: pin to a server (index or base URL); default: the balancer's pick.
        :param session: a session key (conversation, trajectory): its requests stick to one healthy, not
            overloaded server, and the key is sent as the ``X-Session-ID`` header (``config.fleet``) for
            external routers. With ``config.stateless`` on, the client also remembers the session's turns and
            reuses their exact ids when ``messages`` extends one.
        :param previous: the stateless extension: the previous turn, as its :class:`GenerateResult` or a pair
            ``(prompt_ids, completion_ids)``, where ``messages`` is the whole history as the caller holds it and
            its last assistant message is that turn's reply. The previous ids are reused verbatim and only the
            messages after the reply are rendered, with the same proofs, counts and failures as a session's turns
            (:class:`BridgeError` with ``assistant_mismatch``, ``history_rewritten``...); nothing is kept in the
            client. A result then carries ``message_spans`` only when ``previous`` carried them (a
            :class:`GenerateResult` of this client does).
        :param images: with ``prompt_ids``: the prompt's images in order (messages carry their own).
        :param image_spans: with ``prompt_ids``: the spans of the first images, already widened in ``prompt_ids`` (a
            result's ``image_spans``); every later image is one placeholder id.
        :param context_length: the model's context (prompt and completion ids at most): ``sampling.max_tokens`` is
            then a ceiling, lowered to the room the prompt leaves (for a caller whose user named no limit: "as
            many as the model allows"); a prompt that leaves no room is refused, nothing sent.
        :raises InvalidRequestError: bad arguments (nothing is sent).
        :raises RenderError: the chat template rejected ``messages``.
        :raises RequestError: the server could not be reached or answered non-2xx.
        :raises ResponseParseError: the answer does not match the wire shape or breaks an invariant.
        """
        if sampling is not None and _required(sampling).n != 1:
            raise InvalidRequestError(
                f"generate returns one sample but sampling.n = {sampling.n}; use generate_samples"
            )
        results = await self.generate_samples(
            messages=messages,
            prompt_ids=prompt_ids,
            sampling=sampling,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
            request_id=request_id,
            cache_salt=cache_salt,
            priority=priority,
            lora=lora,
            return_routed_experts=return_routed_experts,
            routed_experts_start=routed_experts_start,
            model=model,
            server=server,
            session=session,
            previous=previous,
            images=images,
            image_spans=image_spans,
            context_length=context_length,
        )
        return results[0]

    async def generate_group(
        self,
        *,
        n: int,
        messages: Sequence[Message] | None = None,
        prompt_ids: Sequence[int] | None = None,
        sampling: SamplingParams | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int | None = None,
        lora: str | None = None,
        return_routed_experts: bool = False,
        routed_experts_start: int = 0,
        model: str | None = None,
        server: int | str | None = None,
        session: str | None = None,
        previous: Previous | None = None,
    ) -> list[GenerateResult]:
        """A group of ``n`` samples of one prompt (GRPO and its kin): one rendering, one server (its prefix cache
        holds the prompt once), identical prompt ids in every result.

        Sample ``i`` is drawn with seed ``sampling.seed + i`` on every backend, so it equals what
        :meth:`generate` with that seed returns (where the engine is deterministic), whether the backend asks the
        engine for ``n`` samples at once or sends ``n`` single requests to the same server; with
        ``sampling.seed=None`` the samples are unseeded. Other arguments as in :meth:`generate`; ``sampling.n``
        must be 1 (the group size is ``n``).

        :raises InvalidRequestError: ``n`` is not a positive int, or ``sampling.n`` is not 1 (nothing is sent).
        """
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InvalidRequestError(f"generate_group needs n >= 1 (an int), got {n!r}")
        sampling = _required(sampling)
        if sampling.n != 1:
            raise InvalidRequestError(
                f"generate_group takes the group size as n= ({n}); sampling.n must stay 1, got {sampling.n}"
            )
        results = await self.generate_samples(
            messages=messages,
            prompt_ids=prompt_ids,
            sampling=attrs.evolve(sampling, n=n),
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
            request_id=request_id,
            cache_salt=cache_salt,
            priority=priority,
            lora=lora,
            return_routed_experts=return_routed_experts,
            routed_experts_start=routed_experts_start,
            model=model,
            server=server,
            session=session,
            previous=previous,
        )
        return results

    def stream(
        self,
        *,
        messages: Sequence[Message] | None = None,
        prompt_ids: Sequence[int] | None = None,
        sampling: SamplingParams | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int | None = None,
        lora: str | None = None,
        return_routed_experts: bool = False,
        routed_experts_start: int = 0,
        model: str | None = None,
        server: int | str | None = None,
        session: str | None = None,
        previous: Previous | None = None,
        context_length: int | None = None,
    ) -> GenerateStream:
        """Generate one sample and see its tokens as the engine produces them::

            async with client.stream(prompt_ids=ids, sampling=sampling) as s:
                async for delta in s:  # StreamDelta: .completion_ids, .logprobs (float32)
                    if should_stop(delta):
                        break  # leaving the block aborts the request on the server
            result = s.result  # after a full loop: what generate() would have returned

        Takes :meth:`generate`'s arguments and follows its rules: the request is built and checked here (bad
        input raises before anything is sent), the server is picked the same way (session stickiness, weight
        version checks, salting), and a stream that failed before delivering anything fails over like
        :meth:`generate`; once it delivered a delta it never does. Leaving the block before the stream's end
        (``break``, an exception, cancellation) closes the stream, and the engine aborts the request.

        :raises UnsupportedOperationError: the backend has no streaming (``post_generate_stream``).
        :raises InvalidRequestError: bad arguments, ``sampling.n`` other than 1.
        """
        self.driver.require("post_generate_stream")
        if sampling is not None and _required(sampling).n != 1:
            raise InvalidRequestError(f"stream returns one sample but sampling.n = {sampling.n}")
        request, attribute = self._build_request(
            messages=messages,
            prompt_ids=prompt_ids,
            sampling=sampling,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
            request_id=request_id,
            cache_salt=cache_salt,
            priority=priority,
            lora=lora,
            return_routed_experts=return_routed_experts,
            routed_experts_start=routed_experts_start,
            model=model,
            session=session,
            previous=previous,
            context_length=context_length,
        )
        self.driver.check_sampling(request.sampling)  # before a server is picked or asked anything
        plain = None
        if session is not None and messages is not None and self.config.stateless.enabled:
            plain = normalize_messages(messages)

        def remember(result: GenerateResult) -> GenerateResult:
            if attribute is not None:
                result = attribute(result)
            if plain is not None and session is not None:
                self._turns.remember(session, plain, result)
            return result

        pinned = None if server is None else self.server_index(server)
        return GenerateStream(self, request, pinned=pinned, session=session, on_result=remember)

    async def teacher_logprobs(
        self,
        token_ids: Sequence[int],
        *,
        top_logprobs: int = 0,
        lora: str | None = None,
        model: str | None = None,
        server: int | str | None = None,
        images: Sequence[Image] = (),
        image_spans: Sequence[ImageSpan] = (),
    ) -> TeacherLogprobs:
        """Score ``token_ids``: float32 logprob of every token given its prefix; position 0 holds NaN.

        A sequence with images is scored with them: give a result's ``images`` and ``image_spans`` (every image
        widened in ``token_ids`` as the engine widened it; the engine must widen them the same way again).

        :raises UnsupportedOperationError: the backend cannot score, or cannot send images.
        """
        self.driver.require("teacher_logprobs")
        if images and self.driver.image_refusal is not None:
            raise UnsupportedOperationError(self.backend, "images (teacher_logprobs)", hint=self.driver.image_refusal)
        request = TeacherRequest(
            token_ids=list(token_ids),
            top_logprobs=top_logprobs,
            lora=lora,
            model=model,
            images=images,
            image_spans=image_spans,
        )
        chosen = self.server(server)
        if request.images and self.versions.get(chosen) is not None:
            request = attrs.evolve(request, cache_salt=f"weights:{self.versions.get(chosen)}")
        return await self.driver.teacher_logprobs(chosen, request)

    async def check_tokenizer(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
        server: int | str | None = None,
    ) -> TokenizerCheck:
        """Render ``messages`` locally and on the server and compare the ids, so a trainer whose chat template
        or tokenizer differs from the server's is caught before it poisons training.

        :raises UnsupportedOperationError: the backend's server has no tokenize route.
        """
        plain = [as_plain(m) for m in messages]
        if check_content_parts(plain):
            raise InvalidRequestError(
                "check_tokenizer compares the client's and the server's text rendering: give messages without images"
            )
        kwargs = dict(chat_template_kwargs or {})
        local = self.render(
            plain, tools=tools, chat_template_kwargs=kwargs, add_generation_prompt=add_generation_prompt
        )
        remote = await self.driver.tokenize_messages(
            self.server(server),
            plain,
            tools=tools,
            chat_template_kwargs=kwargs,
            add_generation_prompt=add_generation_prompt,
        )
        if local == remote:
            return TokenizerCheck(match=True, local_ids=tuple(local), server_ids=tuple(remote))
        at = next(
            (i for i, (a, b) in enumerate(zip(local, remote, strict=False)) if a != b), min(len(local), len(remote))
        )

        def token(ids: list[int]) -> str | None:
            return self.tokenizer.decode([ids[at]]) if at < len(ids) else None

        return TokenizerCheck(
            match=False,
            local_ids=tuple(local),
            server_ids=tuple(remote),
            first_difference=at,
            local_token=token(local),
            server_token=token(remote),
        )

    def _remember_version(self, version: str) -> None:
        self.weight_version = version
        if self.front is not None:  # every replica behind it switched: its answers come from that version
            self.versions.set(self.front.server, version)

    def _swapped(self, adapter: str) -> None:
        self._swaps[adapter] = self._swaps.get(adapter, 0) + 1

    def conversation(
        self,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        server: int | str | None = None,
    ) -> Conversation:
        """Start a multi-turn conversation that reuses each turn's exact ids (see :class:`Conversation`)."""
        return Conversation(self, tools=tools, chat_template_kwargs=chat_template_kwargs, server=server)


class GenerateStream:
    """One streamed generation (:meth:`Client.stream`): an async context manager and, inside it, an async
    iterator of :class:`~backends_core.types.StreamDelta`. Once the loop ran to its end, :attr:`result` holds the
    :class:`~backends_core.types.GenerateResult`. Iterate it once."""

    def __init__(
        self,
        client: Client,
        request: GenerateRequest,
        *,
        pinned: int | None,
        session: str | None,
        on_result: Callable[[GenerateResult], GenerateResult] | None = None,
    ) -> None:
        self._client = client
        #: The request as built (before salting).
        self.request = request
        self._pinned = pinned
        self._session = session
        self._on_result = on_result
        self._tried: set[int] = set()
        self._index: int | None = None
        self._events: AsyncIterator[StreamDelta | GenerateResult] | None = None
        self._delivered = False
        self._ended = False
        self._result: GenerateResult | None = None

    @property
    def result(self) -> GenerateResult:
        """The whole sample, as :meth:`Client.generate` returns it.

        :raises InvalidRequestError: the stream has not run to its end (not iterated to the end, left early, or
            failed).
        """
        if self._result is None:
            raise InvalidRequestError(
                "the stream has no result: iterate it to its end first (a stream left early or failed has none)"
            )
        return self._result

    @property
    def server(self) -> str | None:
        """The base URL of the server generating it (``None`` before the first delta was asked for)."""
        return None if self._index is None else self._client.servers[self._index].base_url

    async def __aenter__(self) -> GenerateStream:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def __aiter__(self) -> GenerateStream:
        return self

    async def __anext__(self) -> StreamDelta:
        client = self._client
        while not self._ended:
            if self._events is None:
                index, sent = await client._route(
                    self.request, pinned=self._pinned, session=self._session, tried=self._tried
                )
                client.balancer.acquire(index)
                self._index = index
                self._events = client.driver.generate_stream(client.servers[index], sent)
            assert self._index is not None
            token = _SESSION.set(self._session)  # read when the request is sent (the session header)
            named = REQUEST_ID.set(self.request.request_id)
            try:
                event = await anext(self._events)
            except RequestError as exc:
                await self._drop_events()
                if self._delivered:  # it started: the engine had it, never re-sent
                    client.balancer.release(self._index, ok=False, reachable=not isinstance(exc, TransportError))
                    self._ended = True
                    raise
                if client._failed(self._index, exc, pinned=self._pinned, tried=self._tried):
                    self._ended = True
                    raise
                continue
            except BaseException:
                await self._drop_events()
                client.balancer.release(self._index, ok=False)
                self._ended = True
                raise
            finally:
                REQUEST_ID.reset(named)
                _SESSION.reset(token)
            if isinstance(event, GenerateResult):
                await self._drop_events()
                self._ended = True
                client._served(self._index, event)
                self._result = event if self._on_result is None else self._on_result(event)
                break
            self._delivered = True
            return event
        raise StopAsyncIteration

    async def _drop_events(self) -> None:
        events, self._events = self._events, None
        if events is not None:
            await events.aclose()  # type: ignore[attr-defined]  # an async generator

    async def aclose(self) -> None:
        """Leave the stream: before its end, this closes it and the server aborts the request."""
        if self._events is not None:
            try:
                await self._drop_events()
            finally:
                if not self._ended and self._index is not None:
                    self._client.balancer.release(self._index, ok=False)
                self._ended = True
        self._ended = True


def _fit(sampling: SamplingParams, prompt: int, context_length: int) -> SamplingParams:
    """``sampling`` with ``max_tokens`` lowered to the room a prompt of ``prompt`` ids leaves in the context."""
    room = context_length - prompt
    if room < 1:
        raise InvalidRequestError(
            f"the prompt is {prompt} ids: it leaves no room for a completion in the model's context of "
            f"{context_length} ids"
        )
    if sampling.max_tokens <= room:
        return sampling
    return attrs.evolve(sampling, max_tokens=room, min_tokens=min(sampling.min_tokens, room))


def _required(sampling: SamplingParams | None) -> SamplingParams:
    """``sampling``, which a generation needs for its ``max_tokens`` (no default is right for every trainer).

    :raises InvalidRequestError: ``sampling`` is missing or not a :class:`SamplingParams` (nothing is sent).
    """
    if sampling is None:
        raise InvalidRequestError(
            "sampling=SamplingParams(max_tokens=...) is required: max_tokens has no default (a silent one would "
            "cut every completion at it)"
        )
    if not isinstance(sampling, SamplingParams):
        raise InvalidRequestError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    return sampling


#: The previous turn given to ``previous=``: its result, or its ``(prompt_ids, completion_ids)``.
Previous = GenerateResult | tuple[Sequence[int], Sequence[int]]


def _previous_result(previous: Previous) -> GenerateResult:
    """``previous`` as a result: an id pair becomes one whose finish reason is what its last id says (an end of
    turn or another special token stopped it; anything else was cut short), which the bridge closes accordingly.

    :raises InvalidRequestError: ``previous`` is neither a :class:`GenerateResult` nor a pair of id sequences.
    """
    if isinstance(previous, GenerateResult):
        return previous
    if not isinstance(previous, tuple | list) or len(previous) != 2:
        raise InvalidRequestError(
            "previous must be the previous turn's GenerateResult or a pair (prompt_ids, completion_ids), got "
            f"{type(previous).__name__}"
        )
    try:
        prompt = GenerateRequest(prompt_ids=previous[0], sampling=SamplingParams(max_tokens=1)).prompt_ids
        completion = GenerateRequest(prompt_ids=previous[1], sampling=SamplingParams(max_tokens=1)).prompt_ids
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"previous: {exc}") from exc
    return GenerateResult(
        prompt_ids=prompt,
        completion_ids=completion,
        logprobs=np.zeros(len(completion), np.float32),
        finish_reason="stop",
    )


MessageSpans = tuple[MessageSpan, ...] | Callable[[], tuple[MessageSpan, ...]]


def _attribution(spans: MessageSpans, reused: int, known: int) -> Callable[[GenerateResult], GenerateResult]:
    """What each result of a rendered prompt gets: its message spans and how many leading ids were reused.

    The spans were found on the ids sent, where every image after the first ``known`` was one placeholder; the
    result holds the engine's ids, so they move past each such image's whole span.
    """

    def attribute(result: GenerateResult) -> GenerateResult:
        new = result.image_spans[known:]
        if not new:
            return attrs.evolve(result, message_spans=spans, reused_ids=reused)

        def widened() -> tuple[MessageSpan, ...]:
            found = spans() if callable(spans) else spans
            return tuple(
                attrs.evolve(s, start=widen_position(s.start, new), end=widen_position(s.end, new)) for s in found
            )

        return attrs.evolve(result, message_spans=widened, reused_ids=reused)

    return attribute
