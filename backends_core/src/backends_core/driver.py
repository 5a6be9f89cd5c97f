"""BackendDriver: the typed facade over the plugin manager. The rest of the core calls hooks only here.

It passes every spec argument by keyword, awaits async hooks, raises
:class:`~backends_core.errors.UnsupportedOperationError` for optional hooks the backend lacks, enforces the
result invariants every backend promises (one finite float32 logprob per completion id, ``n`` samples), and
reports each call to ``observe`` plugins.
"""

from __future__ import annotations

import contextlib
import difflib
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import attrs
import numpy as np
import pluggy

from backends_core import hookspecs
from backends_core.config import ClientConfig
from backends_core.errors import (
    BackendError,
    BackendValidationError,
    ConfigError,
    ResponseParseError,
    UnsupportedOperationError,
)
from backends_core.events import Event, EventKind
from backends_core.fronts import Front, merge_fronts
from backends_core.images import check_expansion
from backends_core.parsing import ReasoningParserFactory, ToolParserFactory, chosen_parser, merge_parsers
from backends_core.plugins import HookCall, implemented_hooks, make_plugin_manager
from backends_core.server import Server
from backends_core.types import (
    SAMPLING_FEATURES,
    DistributedGroup,
    GenerateRequest,
    GenerateResult,
    LoraAdapter,
    Message,
    PauseMode,
    SamplingParams,
    ServerState,
    StreamDelta,
    TeacherLogprobs,
    TeacherRequest,
    TensorSpec,
    TransferPlan,
)

__all__ = ["BackendDriver"]

T = TypeVar("T")

#: What a backend's code raises when a body is not the shape it expected: reported as a parse error of that body.
_BACKEND_BUGS = (KeyError, TypeError, ValueError, IndexError, AttributeError)
_FLOAT32 = np.dtype(np.float32)

#: Optional hooks that count as capabilities.
CAPABILITY_HOOKS = frozenset(
    name for name in hookspecs.__all__ if name not in hookspecs.REQUIRED_HOOKS | hookspecs.INFRASTRUCTURE_HOOKS
)


class BackendDriver:
    """One backend, loaded and validated, behind typed methods.

    :param config: the client's configuration; ``config.backend`` selects the backend.
    :param plugin: register this object as the backend instead of its entry point.
    :param extra_plugins: cross-cutting plugins registered next to the backend.
    """

    def __init__(
        self, config: ClientConfig, *, plugin: object | None = None, extra_plugins: Sequence[object] = ()
    ) -> None:
        self.config = config
        self.backend = config.backend
        self.pm: pluggy.PluginManager = make_plugin_manager(config.backend, plugin=plugin, extra_plugins=extra_plugins)
        # the hooks of every generate call, called without pluggy's per-call machinery (same semantics)
        self._prepare_request = HookCall(self.pm, "prepare_request")
        self._post_generate = HookCall(self.pm, "post_generate")
        self._parse_response = HookCall(self.pm, "parse_response")
        self._admin_calls: dict[str, HookCall] = {}  # the admin hooks, the same way, by name
        backend_plugin = self.pm.get_plugin(config.backend)
        #: Optional operations this backend implements (hook names).
        self.capabilities: frozenset[str] = implemented_hooks(self.pm, backend_plugin) & CAPABILITY_HOOKS
        self.options = self._validate_options(config.backend_options)
        #: Tool and reasoning parsers by name, from every plugin's ``tool_parsers`` / ``reasoning_parsers``.
        self.tool_parsers: dict[str, ToolParserFactory] = merge_parsers("tool", self.pm.hook.tool_parsers())
        self.reasoning_parsers: dict[str, ReasoningParserFactory] = merge_parsers(
            "reasoning", self.pm.hook.reasoning_parsers()
        )
        # an explicit name no installed parser has fails when the client is built; "auto" is decided on the chat
        # template when the tokenizer is loaded (Client.parsers)
        chosen_parser("tool", config.tool_parser, self.tool_parsers, "")
        chosen_parser("reasoning", config.reasoning_parser, self.reasoning_parsers, "")
        #: Optional sampling features the backend's engine honours (``sampling_features`` hook).
        self.sampling_features: frozenset[str] = self._sampling_features()
        #: Why images cannot be sent through this backend as configured (``image_refusal`` hook), ``None`` if they can.
        self.image_refusal: str | None = self._image_refusal()
        #: Router front kinds by ``FrontConfig.kind``, from every plugin's ``fronts`` hook.
        self.fronts: dict[str, type[Front]] = merge_fronts(self.pm.hook.fronts())
        self.front_kind()  # an unknown kind fails when the client is built

    def front_kind(self) -> type[Front] | None:
        """The class of ``config.front``'s kind (``None`` without a front).

        :raises ConfigError: no installed plugin provides that kind.
        """
        front = self.config.front
        if front is None:
            return None
        found = self.fronts.get(front.kind)
        if found is None:
            close = difflib.get_close_matches(front.kind, list(self.fronts), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                [f"unknown front kind {front.kind!r} (installed: {sorted(self.fronts)}){hint} @ $.front.kind"]
            )
        return found

    def _sampling_features(self) -> frozenset[str]:
        if not self.pm.hook.sampling_features.get_hookimpls():
            return frozenset()
        declared = self.pm.hook.sampling_features(config=self.config, options=self.options)
        features = frozenset(declared or ())
        unknown = sorted(features - SAMPLING_FEATURES)
        if unknown:
            raise BackendValidationError(
                self.backend,
                f"sampling_features declares unknown features {unknown}; known: {sorted(SAMPLING_FEATURES)}",
            )
        return features

    def _image_refusal(self) -> str | None:
        if not self.pm.hook.image_refusal.get_hookimpls():
            return f"backend {self.backend!r} does not send images"
        reason = self.pm.hook.image_refusal(config=self.config, options=self.options)
        if reason is not None and not isinstance(reason, str):
            raise BackendValidationError(
                self.backend, f"image_refusal returned {type(reason).__name__}, not str | None"
            )
        return reason

    def check_sampling(self, sampling: SamplingParams) -> None:
        """Refuse, before anything is sent, a sampling feature this backend's engine does not honour.

        :raises UnsupportedOperationError: naming the feature (``sampling.stop``, ``sampling.structured.regex``...).
        """
        missing = sorted(sampling.features - self.sampling_features)
        if missing:
            raise UnsupportedOperationError(
                self.backend,
                f"sampling.{missing[0]}",
                hint=f"it honours {sorted(self.sampling_features) or 'none of the optional sampling features'}",
            )

    def _validate_options(self, options: Mapping[str, Any]) -> Any:
        if not self.pm.hook.validate_backend_options.get_hookimpls():
            if options:
                raise ConfigError(
                    [f"backend {self.backend!r} takes no options, got {sorted(options)} @ $.backend_options"]
                )
            return dict(options)
        return self.pm.hook.validate_backend_options(options=dict(options), config=self.config)

    def supports(self, operation: str) -> bool:
        return operation in self.capabilities

    def require(self, operation: str) -> None:
        if operation not in self.capabilities:
            raise UnsupportedOperationError(self.backend, operation)

    def emit(
        self,
        kind: EventKind,
        operation: str,
        server: str | None,
        started: float,
        error: BaseException | None,
        **detail: object,
    ) -> None:
        if self.pm.hook.observe.get_hookimpls():
            self.pm.hook.observe(
                event=Event(
                    kind=kind,
                    operation=operation,
                    backend=self.backend,
                    server=server,
                    duration_s=time.perf_counter() - started,
                    error=error,
                    detail=detail,
                )
            )

    async def _observed(self, kind: EventKind, operation: str, server: Server, call: Callable[[], Awaitable[T]]) -> T:
        started = time.perf_counter()
        try:
            result = await call()
        except BaseException as exc:
            self.emit(kind, operation, server.base_url, started, exc)
            raise
        self.emit(kind, operation, server.base_url, started, None)
        return result

    # -- request pipeline --------------------------------------------------------------------------

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None,
        chat_template_kwargs: Mapping[str, Any],
        add_generation_prompt: bool,
        tokenizer: Any,
    ) -> list[int]:
        ids = self.pm.hook.render(
            messages=messages,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
            add_generation_prompt=add_generation_prompt,
            tokenizer=tokenizer,
            config=self.config,
        )
        return list(ids)

    def prepare_request(self, request: GenerateRequest) -> GenerateRequest:
        prepared = self._prepare_request(request=request, config=self.config)
        if not isinstance(prepared, GenerateRequest):
            raise TypeError(f"prepare_request returned {type(prepared).__name__}, expected GenerateRequest")
        return prepared

    async def generate(self, server: Server, request: GenerateRequest) -> list[GenerateResult]:
        """``post_generate`` then ``parse_response``, with the result invariants checked."""
        self.check_sampling(request.sampling)
        started = time.perf_counter()
        try:
            raw = await self._post_generate(server=server, request=request, config=self.config, options=self.options)
            results = self._parse(raw, request, server)
        except BaseException as exc:
            self.emit("generate", "generate", server.base_url, started, exc)
            raise
        self.emit(
            "generate",
            "generate",
            server.base_url,
            started,
            None,
            prompt_tokens=len(request.prompt_ids),
            completion_tokens=sum(len(r.completion_ids) for r in results),
        )
        return results

    async def generate_stream(
        self, server: Server, request: GenerateRequest
    ) -> AsyncIterator[StreamDelta | GenerateResult]:
        """``post_generate_stream``, checked: every delta as :func:`check_delta`, then the final result as
        :meth:`generate`'s, and the deltas together must be that result's ids and logprobs. Yields the deltas,
        then the result last. Closing it early closes the backend's stream (the server aborts the request)."""
        self.require("post_generate_stream")
        started = time.perf_counter()
        url = server.base_url
        events: AsyncIterator[StreamDelta | GenerateResult] = self.pm.hook.post_generate_stream(
            server=server, request=request, config=self.config, options=self.options
        )
        ids: list[int] = []
        logprobs: list[np.ndarray] = []
        result: GenerateResult | None = None
        try:
            while True:
                try:  # _parse_errors written out: this runs once per streamed event
                    event = await anext(events)
                except StopAsyncIteration:
                    break
                except BackendError:
                    raise
                except _BACKEND_BUGS as exc:
                    raise self._parse_error(exc, server) from exc
                if result is not None:
                    raise ResponseParseError("the stream went on after its final result", url=url)
                if isinstance(event, StreamDelta):
                    check_delta(event, where=f"stream delta {len(logprobs)}", url=url)
                    ids.extend(event.completion_ids)
                    logprobs.append(event.logprobs)
                    yield event
                elif isinstance(event, GenerateResult):
                    check_result(event, where="stream result", url=url)
                    check_prompt(request, event, where="stream result", url=url)
                    result = event
                else:
                    raise ResponseParseError(
                        f"backend {self.backend!r} streamed a {type(event).__name__}, expected StreamDelta or "
                        "GenerateResult",
                        url=url,
                    )
            if result is None:
                raise ResponseParseError("the stream ended without its final result", url=url)
            if result.completion_ids != tuple(ids):
                raise ResponseParseError(
                    f"stream result: its {len(result.completion_ids)} completion ids are not the {len(ids)} the "
                    "deltas carried",
                    url=url,
                )
            streamed = np.concatenate(logprobs) if logprobs else np.zeros(0, np.float32)
            if not np.array_equal(result.logprobs, streamed):
                raise ResponseParseError("stream result: its logprobs are not the ones the deltas carried", url=url)
        except GeneratorExit:  # the caller left early: not a failure of the server
            self.emit("generate", "stream", url, started, None, closed_early=True, completion_tokens=len(ids))
            raise
        except BaseException as exc:
            self.emit("generate", "stream", url, started, exc)
            raise
        finally:
            await events.aclose()  # type: ignore[attr-defined]  # an async generator
        self.emit(
            "generate",
            "stream",
            url,
            started,
            None,
            prompt_tokens=len(request.prompt_ids),
            completion_tokens=len(ids),
        )
        yield result

    @contextlib.contextmanager
    def _parse_errors(self, server: Server) -> Iterator[None]:
        """A backend bug tripped by an unexpected body (KeyError, IndexError...) is still a parse error of that
        body, never a raw exception from deep inside a backend."""
        try:
            yield
        except BackendError:
            raise
        except _BACKEND_BUGS as exc:
            raise self._parse_error(exc, server) from exc

    def _parse_error(self, exc: Exception, server: Server) -> ResponseParseError:
        return ResponseParseError(
            f"backend {self.backend!r} could not parse the body: {type(exc).__name__}: {exc}", url=server.base_url
        )

    def _parse(self, raw: Any, request: GenerateRequest, server: Server) -> list[GenerateResult]:
        with self._parse_errors(server):
            results = self._parse_response(
                raw=raw, request=request, server_url=server.base_url, config=self.config, options=self.options
            )
        if not isinstance(results, list) or len(results) != request.sampling.n:
            got = len(results) if isinstance(results, list) else type(results).__name__
            raise ResponseParseError(f"expected {request.sampling.n} sample(s), got {got}", url=server.base_url)
        for i, result in enumerate(results):
            check_result(result, where=f"sample {i}", url=server.base_url)
            check_prompt(request, result, where=f"sample {i}", url=server.base_url)
        return results

    async def teacher_logprobs(self, server: Server, request: TeacherRequest) -> TeacherLogprobs:
        self.require("teacher_logprobs")

        async def call() -> TeacherLogprobs:
            with self._parse_errors(server):
                result: TeacherLogprobs = await self.pm.hook.teacher_logprobs(
                    server=server, request=request, config=self.config, options=self.options
                )
            check_teacher(result, request, url=server.base_url)
            return _unscored_images(result, request)

        return await self._observed("teacher_logprobs", "teacher_logprobs", server, call)

    async def tokenize_messages(
        self,
        server: Server,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None,
        chat_template_kwargs: Mapping[str, Any],
        add_generation_prompt: bool,
    ) -> list[int]:
        self.require("tokenize_messages")

        async def call() -> list[int]:
            ids = await self.pm.hook.tokenize_messages(
                server=server,
                messages=messages,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
                add_generation_prompt=add_generation_prompt,
                config=self.config,
                options=self.options,
            )
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise ResponseParseError("tokenize_messages must return a list of token ids", url=server.base_url)
            return ids

        return await self._observed("generate", "tokenize_messages", server, call)

    # -- admin: one typed method per hook -----------------------------------------------------------

    async def _admin(self, server: Server, hook: pluggy.HookCaller, expect: type[T], **kwargs: Any) -> T:
        """Call an admin hook on ``server``: the backend must implement it and answer with an ``expect``."""
        self.require(hook.name)
        direct = self._admin_calls.get(hook.name)
        if direct is None:
            direct = self._admin_calls[hook.name] = HookCall(self.pm, hook.name)

        async def call() -> T:
            result = await direct(server=server, config=self.config, options=self.options, **kwargs)
            if result is None:
                raise ResponseParseError(
                    f"backend {self.backend!r} returned nothing from {hook.name}", url=server.admin_url
                )
            if not isinstance(result, expect):
                raise ResponseParseError(
                    f"backend {self.backend!r} returned {type(result).__name__} from {hook.name}, "
                    f"expected {expect.__name__}",
                    url=server.admin_url,
                )
            return result

        return await self._observed("admin", hook.name, server, call)

    async def admin_health(self, server: Server) -> bool:
        return await self._admin(server, self.pm.hook.admin_health, bool)

    async def admin_ready(self, server: Server) -> bool:
        return await self._admin(server, self.pm.hook.admin_ready, bool)

    async def admin_pause(self, server: Server, *, mode: PauseMode, clear_cache: bool) -> bool:
        return await self._admin(server, self.pm.hook.admin_pause, bool, mode=mode, clear_cache=clear_cache)

    async def admin_resume(self, server: Server) -> bool:
        return await self._admin(server, self.pm.hook.admin_resume, bool)

    async def admin_flush_cache(self, server: Server) -> bool:
        return await self._admin(server, self.pm.hook.admin_flush_cache, bool)

    async def admin_update_weights(self, server: Server, *, path: str, version: str | None) -> bool:
        return await self._admin(server, self.pm.hook.admin_update_weights, bool, path=path, version=version)

    async def admin_init_weight_transfer(self, server: Server, *, group: DistributedGroup) -> bool:
        return await self._admin(server, self.pm.hook.admin_init_weight_transfer, bool, group=group)

    async def admin_destroy_weight_transfer(self, server: Server, *, group_name: str) -> bool:
        return await self._admin(server, self.pm.hook.admin_destroy_weight_transfer, bool, group_name=group_name)

    async def admin_update_weights_distributed(
        self,
        server: Server,
        *,
        group_name: str,
        tensors: Sequence[TensorSpec],
        version: str | None,
        plan: TransferPlan | None = None,
    ) -> bool:
        return await self._admin(
            server,
            self.pm.hook.admin_update_weights_distributed,
            bool,
            group_name=group_name,
            tensors=tensors,
            version=version,
            plan=plan,
        )

    def weight_transfer_plan(self, tensors: Sequence[TensorSpec], *, bucket_bytes: int | None) -> TransferPlan:
        """The backend's plan for receiving ``tensors``; it must hold every tensor once, nothing else.

        ``weight_transfer_plan`` is an infrastructure hook, never a capability: a backend that receives
        distributed updates (``admin_update_weights_distributed``) plans them, and one without a plan refuses.
        """
        self.require("admin_update_weights_distributed")
        plan = self.pm.hook.weight_transfer_plan(
            tensors=list(tensors), bucket_bytes=bucket_bytes, config=self.config, options=self.options
        )
        if plan is None:
            raise UnsupportedOperationError(self.backend, "weight_transfer_plan")
        if not isinstance(plan, TransferPlan):
            raise ResponseParseError(
                f"backend {self.backend!r} returned {type(plan).__name__} from weight_transfer_plan, "
                "expected TransferPlan",
                url=None,
            )
        if sorted(t.name for t in plan.tensors) != sorted(t.name for t in tensors) or not all(plan.buckets):
            raise ResponseParseError(
                f"backend {self.backend!r} planned a weight transfer that does not hold every tensor once "
                "in non-empty buckets",
                url=None,
            )
        return plan

    async def admin_load_lora(self, server: Server, *, adapter: LoraAdapter) -> bool:
        return await self._admin(server, self.pm.hook.admin_load_lora, bool, adapter=adapter)

    async def admin_unload_lora(self, server: Server, *, name: str) -> bool:
        return await self._admin(server, self.pm.hook.admin_unload_lora, bool, name=name)

    async def admin_state(self, server: Server, *, fields: frozenset[str] | None = None) -> ServerState:
        return await self._admin(server, self.pm.hook.admin_state, ServerState, fields=fields)

    async def admin_sleep(self, server: Server, *, level: int) -> bool:
        return await self._admin(server, self.pm.hook.admin_sleep, bool, level=level)

    async def admin_wake(self, server: Server) -> bool:
        return await self._admin(server, self.pm.hook.admin_wake, bool)

    async def admin_abort(self, server: Server, *, request_ids: Sequence[str] | None) -> int:
        return await self._admin(server, self.pm.hook.admin_abort, int, request_ids=request_ids)


def check_result(result: GenerateResult, *, where: str, url: str | None) -> None:
    """Enforce what every backend promises about a sample; raise :class:`ResponseParseError` otherwise."""
    if not isinstance(result, GenerateResult):
        raise ResponseParseError(f"{where}: backend returned {type(result).__name__}, expected GenerateResult", url=url)
    ids = result.completion_ids
    if not (set(map(type, ids)) <= {int} and (not ids or min(ids) >= 0)):
        bad = next(t for t in ids if not (type(t) is int and t >= 0))
        raise ResponseParseError(f"{where}: completion id {bad!r} is not a token id", url=url)
    lp = result.logprobs
    if not isinstance(lp, np.ndarray) or lp.dtype != np.float32 or lp.ndim != 1:
        raise ResponseParseError(f"{where}: logprobs must be a 1-D float32 array", url=url)
    if lp.shape[0] != len(result.completion_ids):
        raise ResponseParseError(
            f"{where}: {lp.shape[0]} logprobs for {len(result.completion_ids)} completion ids", url=url
        )
    if lp.size and not np.isfinite(lp).all():
        bad = int(np.flatnonzero(~np.isfinite(lp))[0])
        raise ResponseParseError(f"{where}: logprob at completion position {bad} is {lp[bad]} (not finite)", url=url)
    if result.top_logprobs is not None and len(result.top_logprobs) != len(result.completion_ids):
        raise ResponseParseError(
            f"{where}: {len(result.top_logprobs)} top-logprob rows for {len(result.completion_ids)} ids", url=url
        )
    re = result.routed_experts
    if re is not None:
        expected = len(result.prompt_ids) + len(result.completion_ids) - 1 - re.start
        if re.experts.ndim != 3 or re.num_tokens != expected:
            raise ResponseParseError(
                f"{where}: routed_experts has shape {re.experts.shape} from position {re.start}; "
                f"expected {expected} rows",
                url=url,
            )


def check_delta(delta: StreamDelta, *, where: str, url: str | None) -> None:
    """Enforce what every backend promises about a streamed delta (as :func:`check_result` for a sample)."""
    ids = delta.completion_ids
    if not isinstance(ids, tuple) or not (set(map(type, ids)) <= {int} and (not ids or min(ids) >= 0)):
        bad = next((t for t in ids if not (type(t) is int and t >= 0)), ids)
        raise ResponseParseError(f"{where}: completion id {bad!r} is not a token id", url=url)
    lp = delta.logprobs
    if not isinstance(lp, np.ndarray) or (lp.dtype is not _FLOAT32 and lp.dtype != np.float32) or lp.ndim != 1:
        raise ResponseParseError(f"{where}: logprobs must be a 1-D float32 array", url=url)
    n = lp.shape[0]
    if n != len(ids):
        raise ResponseParseError(f"{where}: {n} logprobs for {len(ids)} completion ids", url=url)
    # a few values: their sum as Python floats is finite exactly when each is (float32 values cannot overflow a
    # float64 sum), cheaper than numpy's per-call overhead
    if n and not (math.isfinite(sum(lp.tolist())) if n <= 64 else np.isfinite(lp).all()):
        bad = int(np.flatnonzero(~np.isfinite(lp))[0])
        raise ResponseParseError(f"{where}: logprob at position {bad} of the delta is {lp[bad]} (not finite)", url=url)


def _unscored_images(result: TeacherLogprobs, request: TeacherRequest) -> TeacherLogprobs:
    """``result`` with NaN on every image placeholder: the model never predicts those ids (the vision encoder's
    output stands there), and engines score them differently (vLLM the placeholder id, SGLang its per-image pad
    values), so no backend reports a number there."""
    if not request.image_spans:
        return result
    logprobs = result.logprobs.copy()
    for span in request.image_spans:
        logprobs[span.start : span.end] = np.nan
    return attrs.evolve(result, logprobs=logprobs)


def check_teacher(result: TeacherLogprobs, request: TeacherRequest, *, url: str | None) -> None:
    """Enforce the teacher-logprob contract: float32, one per token, NaN at 0, finite elsewhere (a backend may
    leave image placeholders NaN; the client makes them NaN on every backend)."""
    if not isinstance(result, TeacherLogprobs):
        raise ResponseParseError(
            f"teacher_logprobs returned {type(result).__name__}, expected TeacherLogprobs", url=url
        )
    lp = result.logprobs
    if lp.dtype != np.float32 or lp.shape != (len(request.token_ids),):
        raise ResponseParseError(
            f"teacher logprobs must be float32 of shape ({len(request.token_ids)},), got {lp.dtype} {lp.shape}", url=url
        )
    scored = np.ones(len(lp), dtype=bool)
    scored[0] = False
    for span in request.image_spans:
        scored[span.start : span.end] = False
    if not np.isnan(lp[0]) or not np.isfinite(lp[scored]).all():
        raise ResponseParseError(
            "teacher logprobs must be NaN at position 0 and finite elsewhere (image placeholders excepted)", url=url
        )


def check_prompt(request: GenerateRequest, result: GenerateResult, *, where: str, url: str) -> None:
    """The result's prompt is the one sent: the same ids, or for a prompt with images the ids sent with each new
    image widened once by the engine and every known image at its known span (:func:`check_expansion`).

    :raises ResponseParseError: it is not.
    """
    if not request.images:
        if result.prompt_ids != request.prompt_ids:
            raise ResponseParseError(f"{where}: the prompt ids are not the ones sent", url=url)
        return
    if result.images != request.images:
        raise ResponseParseError(f"{where}: the result does not carry the request's images", url=url)
    check_expansion(
        request.prompt_ids,
        request.image_spans,
        result.prompt_ids,
        result.image_spans,
        images=len(request.images),
        where=where,
        server_url=url,
    )
