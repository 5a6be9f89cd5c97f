"""Client: the public entry point. Owns the HTTP clients, the backend driver and the tokenizer."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

import httpx

from backends_core._http import Server
from backends_core.bridge import BridgeStats, Conversation
from backends_core.config import ClientConfig
from backends_core.driver import BackendDriver
from backends_core.errors import ConfigError, InvalidRequestError
from backends_core.fleet import Admin
from backends_core.rendering import load_tokenizer
from backends_core.types import (
    GenerateRequest,
    GenerateResult,
    Message,
    SamplingParams,
    TeacherLogprobs,
    TeacherRequest,
)

__all__ = ["Client"]


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
        headers = dict(config.headers)
        key = config.api_key()
        if key is not None:
            headers["authorization"] = f"Bearer {key}"
        t, lim = config.timeouts, config.limits
        self._data = httpx.AsyncClient(
            transport=transport,
            headers=headers,
            timeout=httpx.Timeout(connect=t.connect, read=t.read, write=t.write, pool=t.pool),
            limits=httpx.Limits(
                max_connections=lim.max_connections,
                max_keepalive_connections=lim.max_keepalive_connections,
                keepalive_expiry=lim.keepalive_expiry,
            ),
        )
        self._admin_http = httpx.AsyncClient(
            transport=transport,
            headers=headers,
            timeout=httpx.Timeout(t.admin, connect=t.connect),
            limits=httpx.Limits(max_connections=lim.admin_max_connections, keepalive_expiry=lim.keepalive_expiry),
        )
        #: One handle per configured server, in config order.
        self.servers: list[Server] = [
            Server(
                base_url=base,
                admin_url=admin,
                data_client=self._data,
                admin_client=self._admin_http,
                retry=config.retry,
                admin_timeout=t.admin,
            )
            for base, admin in config.servers
        ]
        self._in_flight = {id(s): 0 for s in self.servers}
        self._rotation = itertools.count()
        self._tokenizer = tokenizer
        #: Multi-turn bridge counters shared by every conversation of this client.
        self.bridge_stats = BridgeStats()
        #: Admin operations over every server.
        self.admin = Admin(self.driver, self.servers)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close both connection pools."""
        await self._data.aclose()
        await self._admin_http.aclose()

    @property
    def base_urls(self) -> list[str]:
        """The servers' base URLs, in config order."""
        return [s.base_url for s in self.servers]

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

    def server(self, which: int | str | None = None) -> Server:
        """Pick a server: by index or base URL, or (``None``) the one with the fewest requests in flight."""
        if which is None:
            start = next(self._rotation)
            n = len(self.servers)
            order = [self.servers[(start + i) % n] for i in range(n)]
            return min(order, key=lambda s: self._in_flight[id(s)])
        if isinstance(which, int):
            if not 0 <= which < len(self.servers):
                raise InvalidRequestError(f"server index {which} out of range (have {len(self.servers)})")
            return self.servers[which]
        for s in self.servers:
            if s.base_url == which.rstrip("/"):
                return s
        raise InvalidRequestError(f"no server {which!r} in this client (have {[s.base_url for s in self.servers]})")

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
        **fields: Any,
    ) -> GenerateRequest:
        if (messages is None) == (prompt_ids is None):
            raise InvalidRequestError("give exactly one of messages= or prompt_ids=")
        if messages is not None:
            ids = self.render(messages, tools=tools, chat_template_kwargs=chat_template_kwargs)
            fields["messages"] = tuple(messages)
            fields["tools"] = tuple(tools) if tools else None
        else:
            assert prompt_ids is not None
            if isinstance(prompt_ids, str | bytes) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt_ids
            ):
                raise InvalidRequestError("prompt_ids must be a sequence of ints")
            ids = list(prompt_ids)
        request = GenerateRequest(prompt_ids=ids, sampling=sampling or SamplingParams(), **fields)
        return self.driver.prepare_request(request)

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
    ) -> list[GenerateResult]:
        """Generate ``sampling.n`` samples for one prompt; see :meth:`generate` for the arguments."""
        request = self._build_request(
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
        )
        return await self.send(request, server=server)

    async def send(self, request: GenerateRequest, *, server: int | str | None = None) -> list[GenerateResult]:
        """Send an already built request (the bridge and fleets use this)."""
        target = self.server(server)
        self._in_flight[id(target)] += 1
        try:
            return await self.driver.generate(target, request)
        finally:
            self._in_flight[id(target)] -= 1

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
        :param server: pin to a server (index or base URL); default: least busy.
        :raises InvalidRequestError: bad arguments (nothing is sent).
        :raises RenderError: the chat template rejected ``messages``.
        :raises RequestError: the server could not be reached or answered non-2xx.
        :raises ResponseParseError: the answer does not match the wire shape or breaks an invariant.
        """
        if sampling is not None and sampling.n != 1:
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
        )
        return results[0]

    async def teacher_logprobs(
        self,
        token_ids: Sequence[int],
        *,
        top_logprobs: int = 0,
        lora: str | None = None,
        model: str | None = None,
        server: int | str | None = None,
    ) -> TeacherLogprobs:
        """Score ``token_ids``: float32 logprob of every token given its prefix; position 0 holds NaN.

        :raises UnsupportedOperationError: the backend cannot score.
        """
        self.driver.require("teacher_logprobs")
        request = TeacherRequest(token_ids=list(token_ids), top_logprobs=top_logprobs, lora=lora, model=model)
        return await self.driver.teacher_logprobs(self.server(server), request)

    def conversation(
        self,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        server: int | str | None = None,
    ) -> Conversation:
        """Start a multi-turn conversation that reuses each turn's exact ids (see :class:`Conversation`)."""
        return Conversation(self, tools=tools, chat_template_kwargs=chat_template_kwargs, server=server)
