"""An SGLang 0.5.23 HTTP server over the numpy reference engine, for tests and the demo.

Written on the test kit's :class:`~backends_testkit.emulator.EmulatorBase`: ``emulator.transport()`` answers
in-process, ``emulator.asgi()`` under an ASGI server, ``emulator.serve()`` on a real port.

Routes (method, auth level): ``/generate`` (POST, PUT; normal), ``/health`` ``/health_generate`` ``/ready`` (GET;
always open), ``/model_info`` ``/get_model_info`` ``/server_info`` ``/get_server_info`` ``/v1/models``
``/v1/loads`` (GET; normal), and the control routes (admin): ``/flush_cache`` (GET, POST), ``/abort_request``,
``/pause_generation``, ``/continue_generation``, ``/update_weights_from_disk``, ``/update_weight_version``,
``/begin_weight_update``, ``/end_weight_update``, ``/init_weights_update_group``,
``/destroy_weights_update_group``, ``/update_weights_from_distributed``, ``/update_weights_from_tensor``,
``/load_lora_adapter``, ``/unload_lora_adapter`` (POST), ``/release_memory_occupation``,
``/resume_memory_occupation`` (GET, POST).

Authentication follows SGLang's rule: with ``admin_api_key`` the control routes need it (the plain key is
refused there); with only ``api_key`` every route but the health ones needs that; ``401 {"error":
"Unauthorized"}`` otherwise. ``/health`` and ``/health_generate`` run a 1-token generation on SGLang, so they
answer 503 while generation is paused or the memory released (SGLang after its 20 s health timeout, the
emulator at once). Everything else SGLang serves (OpenAI routes, sessions, streaming, tokenize) is a 404 here.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import Any, NoReturn

import httpx

from backends_sglang_testing import _info
from backends_sglang_testing._control import Control
from backends_sglang_testing._generation import Generation, Limits
from backends_sglang_testing._protocol import parse_generate
from backends_sglang_testing._replies import contract_error, empty, json_reply, validation_error
from backends_sglang_testing._text import Text
from backends_sglang_testing._weights import WeightSource, WeightStore
from backends_testkit.emulator import GET, GET_POST, POST, EmulatorBase, Level, Route, sse_reply
from backends_testkit.engine import ReferenceEngine

__all__ = ["SglangEmulator"]

BodyHandler = Callable[[Any], Awaitable[httpx.Response]]


class _Crashed(Exception):
    """The emulated server died (an assertion SGLang's scheduler does not survive)."""


class SglangEmulator(EmulatorBase):
    """Serves SGLang's HTTP dialect for one engine.

    :param engine: the engine to serve (its ``max_model_len`` is the context length).
    :param enable_return_routed_experts: as ``--enable-return-routed-experts`` (MoE models).
    :param served_model_name: as ``--served-model-name`` (default: the model path).
    :param admin_api_key: as ``--admin-api-key``.
    :param api_key: as ``--api-key``.
    :param enable_lora: as ``--enable-lora``.
    :param max_total_num_tokens: KV pool size; with the context length it sets ``max_req_input_len``.
    :param max_running_requests: as ``--max-running-requests`` (reported only).
    :param weight_source: stands for the trainer of ``/update_weights_from_distributed``:
        ``(group_name, [(name, dtype, shape), ...]) -> {name: array}``.
    """

    def __init__(
        self,
        engine: ReferenceEngine,
        *,
        enable_return_routed_experts: bool = False,
        served_model_name: str | None = None,
        admin_api_key: str | None = None,
        api_key: str | None = None,
        enable_lora: bool = True,
        max_total_num_tokens: int = 131072,
        max_running_requests: int = 64,
        weight_source: WeightSource | None = None,
    ) -> None:
        super().__init__(engine, api_key=api_key, admin_api_key=admin_api_key)
        limits = Limits(context_len=engine.max_model_len, max_total_num_tokens=max_total_num_tokens)
        self.identity = _info.Identity(
            model_path=str(engine.model_dir),
            tokenizer_path=str(engine.model_dir),
            served_model_name=served_model_name,
            context_len=limits.context_len,
            max_total_num_tokens=max_total_num_tokens,
            max_req_input_len=limits.max_req_input_len,
            max_running_requests=max_running_requests,
            enable_lora=enable_lora,
            enable_return_routed_experts=enable_return_routed_experts,
            api_key_set=api_key is not None,
            admin_api_key_set=admin_api_key is not None,
        )
        self.generation = Generation(
            engine, Text(engine.model_dir), limits, routed_experts=enable_return_routed_experts
        )
        self.weights = WeightStore(engine.model_dir)
        self.control = Control(
            engine, self.generation, self.identity, self.weights, weight_source=weight_source, crash=self._crash
        )
        #: Why the emulated server died, once it has (every later request is refused).
        self.crashed: str | None = None

    def routes(self) -> dict[str, Route]:
        c = self.control

        def route(methods: frozenset[str], level: Level, handler: BodyHandler, *, contract: bool = False) -> Route:
            # /generate's body passes a schema gate first, which words a JSON error differently
            async def answer(request: httpx.Request) -> httpx.Response:
                return await handler(self._body(request, contract=contract))

            return Route(answer, methods=methods, level=level)

        routes: dict[str, Route] = {
            "/generate": route(frozenset({"POST", "PUT"}), "normal", self._generate, contract=True),
            "/health": route(GET, "open", self._health),
            "/health_generate": route(GET, "open", self._health),
            "/ready": route(GET, "open", self._ready),
            "/model_info": route(GET, "normal", self._info(_info.model_info)),
            "/get_model_info": route(GET, "normal", self._info(_info.model_info)),
            "/server_info": route(GET, "normal", self._info(_info.server_info)),
            "/get_server_info": route(GET, "normal", self._info(_info.server_info)),
            "/v1/models": route(GET, "normal", self._info(_info.models)),
            "/v1/loads": route(GET, "normal", self._info(_info.loads)),
            "/flush_cache": route(GET_POST, "admin", c.flush_cache),
            "/release_memory_occupation": route(GET_POST, "admin", c.release_memory_occupation),
            "/resume_memory_occupation": route(GET_POST, "admin", c.resume_memory_occupation),
        }
        for name in (
            "abort_request",
            "pause_generation",
            "continue_generation",
            "update_weights_from_disk",
            "update_weight_version",
            "begin_weight_update",
            "end_weight_update",
            "init_weights_update_group",
            "destroy_weights_update_group",
            "update_weights_from_distributed",
            "update_weights_from_tensor",
            "load_lora_adapter",
            "unload_lora_adapter",
        ):
            routes[f"/{name}"] = route(POST, "admin", getattr(c, name))
        return routes

    # -- serving ----------------------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Stop the engine and delete the checkpoints written for weight updates."""
        try:
            await super().aclose()
        finally:
            self.weights.close()

    async def handle(self, request: httpx.Request) -> httpx.Response:
        """Answer one request as SGLang would.

        :raises httpx.ConnectError: the emulated server has crashed.
        :raises httpx.RemoteProtocolError: this request crashed it.
        """
        if self.crashed is not None:
            raise httpx.ConnectError(f"connection refused: the emulated SGLang server died ({self.crashed})")
        response = await super().handle(request)
        if self.crashed is not None:
            raise httpx.RemoteProtocolError(f"Server disconnected without sending a response ({self.crashed})")
        return response

    def error_response(self, exc: Exception) -> httpx.Response | None:
        if isinstance(exc, _Crashed):
            raise httpx.RemoteProtocolError(f"Server disconnected without sending a response ({exc})") from exc
        return None

    @staticmethod
    def _body(request: httpx.Request, *, contract: bool) -> Any:
        if not request.content:
            return {}
        try:
            return json.loads(request.content)
        except ValueError as exc:
            raise (contract_error if contract else validation_error)(f"invalid JSON body: {exc}") from exc

    def _crash(self, reason: str) -> NoReturn:
        self.crashed = reason
        self.engine.abort()
        raise _Crashed(reason)

    # -- data and read-only routes ----------------------------------------------------------------------

    async def _generate(self, body: Any) -> httpx.Response:
        answer = await self.generation.generate(parse_generate(body))
        if isinstance(answer, AsyncGenerator):
            return sse_reply(answer, dumps=lambda value: json.dumps(value, separators=(",", ":")))
        return json_reply(200, answer)

    async def _health(self, body: Any) -> httpx.Response:
        state = self.engine.state()
        return empty(503 if state.paused or state.sleeping else 200)

    async def _ready(self, body: Any) -> httpx.Response:
        return empty(200)

    def _info(self, build: Callable[[_info.Identity, ReferenceEngine], Mapping[str, Any]]) -> BodyHandler:
        async def handler(body: Any) -> httpx.Response:
            return json_reply(200, build(self.identity, self.engine))

        return handler
