"""The driver contract: every hook a backend may implement, and the only place hooks are declared.

Call order for one generation::

    prepare_request (wrappers may rewrite) ──> render (messages -> ids; core default) ──>
    post_generate (async: payload -> server -> raw JSON) ──> parse_response (raw -> results)

A streamed generation (``Client.stream``) calls ``post_generate_stream`` instead of the last two.
``teacher_logprobs`` and the ``admin_*`` family are called on demand. ``observe`` sees every finished call.

Rules every hook follows:

* All specs but ``observe``, ``tool_parsers``, ``reasoning_parsers`` and ``fronts`` are ``firstresult``: one backend is
  registered per client, and its answer is the answer. Returning ``None`` declines (only meaningful for hooks
  with a core default). Those three ask every implementation (backend, cross-cutting plugins, core defaults).
* Sync hooks are pure (no I/O). Async hooks do I/O only through the :class:`~backends_core.server.Server`
  they are given, which maps every HTTP failure to a :mod:`backends_core.errors` type.
* Required hooks: ``post_generate`` and ``parse_response``. Every other hook is optional; the optional
  hooks a backend implements are its *capabilities*, and calling a missing one raises
  :class:`~backends_core.errors.UnsupportedOperationError`.
* Arguments are passed by keyword; an implementation may accept any subset of them.
* ``options`` is whatever the backend's ``validate_backend_options`` returned (the raw mapping if it has
  none and the mapping is empty).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from backends_core.config import ClientConfig
    from backends_core.events import Event
    from backends_core.fronts import Front
    from backends_core.parsing import ReasoningParserFactory, ToolParserFactory
    from backends_core.server import Server
    from backends_core.types import (
        DistributedGroup,
        GenerateRequest,
        GenerateResult,
        LoraAdapter,
        Message,
        PauseMode,
        ServerState,
        StreamDelta,
        TeacherLogprobs,
        TeacherRequest,
        TensorSpec,
        TransferPlan,
    )

#: pluggy project name; implementation markers are stored as ``backends_core_impl`` on functions.
PROJECT_NAME = "backends_core"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

#: Hooks every backend must implement.
REQUIRED_HOOKS = frozenset({"post_generate", "parse_response"})
#: Hooks that are not backend capabilities (core defaults, cross-cutting plugins, test support).
INFRASTRUCTURE_HOOKS = frozenset(
    {
        "render",
        "prepare_request",
        "observe",
        "validate_backend_options",
        "tool_parsers",
        "weight_transfer_plan",
        "reasoning_parsers",
        "sampling_features",
        "image_refusal",
        "fronts",
    }
)
#: Hooks whose every implementation is called (the rest are ``firstresult``).
COLLECTING_HOOKS = frozenset({"observe", "tool_parsers", "reasoning_parsers", "fronts"})

__all__ = [
    "admin_abort",
    "admin_destroy_weight_transfer",
    "admin_flush_cache",
    "admin_health",
    "admin_init_weight_transfer",
    "admin_load_lora",
    "admin_pause",
    "admin_ready",
    "admin_resume",
    "admin_sleep",
    "admin_state",
    "admin_unload_lora",
    "admin_update_weights",
    "admin_update_weights_distributed",
    "admin_wake",
    "fronts",
    "image_refusal",
    "observe",
    "parse_response",
    "post_generate",
    "post_generate_stream",
    "prepare_request",
    "reasoning_parsers",
    "render",
    "sampling_features",
    "teacher_logprobs",
    "tokenize_messages",
    "tool_parsers",
    "validate_backend_options",
    "weight_transfer_plan",
]


# -- Configuration --------------------------------------------------------------------------------


@hookspec(firstresult=True)
def validate_backend_options(options: Mapping[str, Any], config: ClientConfig) -> Any:
    """Validate ``ClientConfig.backend_options`` and return the backend's typed options object.

    Called once when a :class:`~backends_core.Client` opens. Mode: sync, pure. Required: no; without it,
    a non-empty ``backend_options`` is a :class:`~backends_core.errors.ConfigError` (nothing is silently
    ignored).

    :param options: the raw ``backend_options`` mapping.
    :param config: the client's configuration.
    :returns: the options object later passed to every hook as ``options``.
    Raises: :class:`~backends_core.errors.ConfigError` naming each bad key (``$.backend_options.<key>``).

    .. versionadded:: 0.1
    """


# -- Request pipeline -----------------------------------------------------------------------------


@hookspec(firstresult=True)
def prepare_request(request: GenerateRequest, config: ClientConfig) -> GenerateRequest | None:
    """Last chance to rewrite a request before it is sent (cache salts, priorities, request ids).

    Called once per generate call, after rendering. Mode: sync, pure. Required: no (the core returns the
    request unchanged). Cross-cutting plugins implement it as ``@hookimpl(wrapper=True)``: ``request =
    yield`` gives the inner result, and what the wrapper returns replaces it, so several wrappers chain.

    :param request: the request about to be sent (already holds ``prompt_ids``).
    :param config: the client's configuration.
    :returns: the request to send.
    Raises: :class:`~backends_core.errors.InvalidRequestError`.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def render(
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None,
    chat_template_kwargs: Mapping[str, Any],
    add_generation_prompt: bool,
    tokenizer: Any,
    config: ClientConfig,
) -> list[int] | None:
    """Render chat messages to prompt token ids with the model's chat template.

    Called for ``generate(messages=...)`` and by the multi-turn bridge. Mode: sync, pure. Required: no: the
    core's default (``trylast``) applies the tokenizer's chat template; implement it only when the server
    expects something else.

    :param messages: chat messages (``role``, ``content``, ``tool_calls``, ``reasoning_content``...).
    :param tools: tool schemas to render into the prompt, or ``None``.
    :param chat_template_kwargs: extra template variables (e.g. ``enable_thinking``).
    :param add_generation_prompt: end with the assistant header so the model answers.
    :param tokenizer: the transformers tokenizer of ``config.tokenizer``.
    :param config: the client's configuration.
    :returns: prompt token ids.
    Raises: :class:`~backends_core.errors.RenderError`.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
async def post_generate(server: Server, request: GenerateRequest, config: ClientConfig, options: Any) -> Any:
    """Build the server's wire payload for ``request``, send it, and return the decoded JSON body.

    Called once per generate call. Mode: async I/O through ``server``. Required: yes.

    :param server: the server chosen for this call.
    :param request: prompt ids, sampling and per-request fields; every sampling field must be sent
        explicitly. With ``sampling.n > 1`` and a seed, sample ``i`` must be drawn with seed ``seed + i`` (what
        ``Client.generate_group`` promises): ask the engine for ``n`` samples when it seeds them that way, else
        send ``n`` single requests to ``server``.
    :param config: the client's configuration (``model`` is the default served model name).
    :param options: the validated backend options.
    :returns: the decoded response body, handed to :func:`parse_response` unchanged.
    Raises: :class:`~backends_core.errors.InvalidRequestError` (not expressible for this server);
        :class:`~backends_core.errors.RequestError` subclasses come from ``server.request``.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def sampling_features(config: ClientConfig, options: Any) -> Collection[str] | None:
    """The optional sampling features this backend's engine honours, from
    :data:`~backends_core.types.SAMPLING_FEATURES`: ``"stop"`` (stop strings), ``"logit_bias"``, ``"extra"``
    (engine fields passed through, which the backend validates by name) and ``"structured.<kind>"`` per
    structured-output kind (``json_schema``, ``regex``, ``choice``, ``grammar``).

    Called once when the client opens. Mode: sync, pure. Required: no; without it the backend honours none of
    them. A request using a feature outside the answer raises
    :class:`~backends_core.errors.UnsupportedOperationError` before anything is sent, so no field is ever
    silently dropped.

    :param config: the client's configuration.
    :param options: the validated backend options (a feature may depend on them).
    :returns: feature names.
    Raises: nothing; a name outside :data:`~backends_core.types.SAMPLING_FEATURES` makes the client refuse the
        backend (:class:`~backends_core.errors.BackendValidationError`).

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def image_refusal(config: ClientConfig, options: Any) -> str | None:
    """Why this backend, configured so, cannot send images, or ``None`` when it can.

    A backend that sends images puts ``GenerateRequest.images`` on the wire with the prompt collapsed to one
    placeholder per image (:func:`backends_core.images.collapse` of ``prompt_ids`` over ``image_spans``), and its
    :func:`parse_response` reports the prompt ids the engine ran (each image widened) with each image's span,
    proven by :func:`backends_core.images.check_expansion`. Whether the *model* takes images is the core's check
    (its ``config.json`` names an image placeholder id).

    Called once when the client opens. Mode: sync, pure. Required: no; without it every image part is refused.
    A request with an image is refused before anything is sent with
    :class:`~backends_core.errors.UnsupportedOperationError` carrying this reason.

    :param config: the client's configuration.
    :param options: the validated backend options (a transport may carry images, another not).
    :returns: the reason, naming the route or engine version, or ``None``.
    Raises: nothing; an answer that is neither a string nor ``None`` makes the client refuse the backend
        (:class:`~backends_core.errors.BackendValidationError`).

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def parse_response(
    raw: Any, request: GenerateRequest, server_url: str, config: ClientConfig, options: Any
) -> list[GenerateResult] | None:
    """Turn a raw generate response into one :class:`~backends_core.types.GenerateResult` per sample.

    Mode: sync, pure (golden-file testable). Required: yes. The result must hold exactly one finite
    float32 logprob per completion id taken from the engine's own channel, and routed experts decoded with
    :func:`backends_core.routed_experts.decode_routed_experts` and trimmed to
    ``request.routed_experts_start``.

    :param raw: what :func:`post_generate` returned.
    :param request: the request that produced it.
    :param server_url: the server's base URL (recorded on each result).
    :param config: the client's configuration.
    :param options: the validated backend options.
    :returns: ``request.sampling.n`` results, in sample order.
    Raises: :class:`~backends_core.errors.ResponseParseError` naming the offending field.

    .. versionadded:: 0.1
    """


# -- Parsing completions back into messages ------------------------------------------------------------------


@hookspec
def fronts() -> Mapping[str, type[Front]] | None:
    """Router front kinds this plugin provides (``ClientConfig.front.kind``), by kind, each a
    :class:`~backends_core.fronts.Front` subclass whose ``kind`` is its key.

    Collected and merged like :func:`tool_parsers` (two plugins providing one kind is a
    :class:`~backends_core.errors.ConfigError`). Mode: sync, pure. Required: no. The core provides
    ``vllm-router``, ``sglang-router`` and ``static`` (:data:`~backends_core.fronts.BUILTIN_FRONTS`); the
    ``dynamo`` backend provides ``dynamo``.

    :returns: kind -> :class:`~backends_core.fronts.Front` subclass, or ``None`` for none.
    Raises: nothing (it only names classes).

    .. versionadded:: 0.3
    """


@hookspec
def tool_parsers() -> Mapping[str, ToolParserFactory] | None:
    """Tool-call parsers this plugin provides, by the name ``ClientConfig.tool_parser`` selects them with.

    Every implementation is called (the core's defaults, the backend, each cross-cutting plugin passed as
    ``Client(config, plugins=[...])``) and the answers are merged; two plugins providing one name is a
    :class:`~backends_core.errors.ConfigError`. Use vLLM's names (``--tool-call-parser``) where the format is
    one of vLLM's. Mode: sync, pure. Required: no. The core provides ``hermes``
    (:class:`~backends_core.parsing.HermesToolParser`).

    A factory takes the client's tokenizer and returns a :class:`~backends_core.parsing.ToolParser`: a callable
    ``parser(text) -> (content, [ParsedToolCall(name, arguments_json), ...])`` on the completion's text after
    any reasoning. It must drop nothing: text it cannot read as tool calls stays in ``content``.

    :returns: ``{name: factory}``, or ``None`` for none.
    Raises: nothing (a bad answer is reported as a :class:`~backends_core.errors.ConfigError` by the core).

    .. versionadded:: 0.2
    """


@hookspec
def reasoning_parsers() -> Mapping[str, ReasoningParserFactory] | None:
    """Reasoning parsers this plugin provides, by the name ``ClientConfig.reasoning_parser`` selects them with.

    Collected and merged like :func:`tool_parsers`; use vLLM's names (``--reasoning-parser``). Mode: sync, pure.
    Required: no. The core provides ``qwen3`` (:class:`~backends_core.parsing.Qwen3ReasoningParser`).

    A factory takes the client's tokenizer and returns a :class:`~backends_core.parsing.ReasoningParser`: a
    callable ``parser(text, *, prompt_ids) -> (reasoning | None, rest)`` on the completion's decoded text;
    ``prompt_ids`` tell whether the template's generation prompt opened (or closed) the reasoning block.

    :returns: ``{name: factory}``, or ``None`` for none.
    Raises: nothing (a bad answer is reported as a :class:`~backends_core.errors.ConfigError` by the core).

    .. versionadded:: 0.2
    """


@hookspec(firstresult=True)
def post_generate_stream(
    server: Server, request: GenerateRequest, config: ClientConfig, options: Any
) -> AsyncIterator[StreamDelta | GenerateResult] | None:
    """Send ``request`` as a streamed generation and follow its answer as the engine produces it.

    Called once per ``Client.stream`` call. Mode: an async generator doing I/O only through ``server.stream``
    (the server's own streaming form), opened in its body so that closing the generator early closes the stream
    and with it the connection, which makes the engine abort the request. Required: no (capability
    ``post_generate_stream``). ``request.sampling.n`` is 1.

    Yields one :class:`~backends_core.types.StreamDelta` per chunk that carries new completion ids (their
    logprobs from the engine's own channel, one finite value per id), then, once the server ended the stream,
    exactly one :class:`~backends_core.types.GenerateResult`: what :func:`parse_response` would have made of the
    same generation answered whole (same ids and logprobs as the deltas together, routed experts, finish reason,
    weight version...). Per-chunk mapping and the final assembly live in the backend's ``wire.py``.

    :param server: the server chosen for this call.
    :param request: as for :func:`post_generate`.
    :param config: the client's configuration.
    :param options: the validated backend options.
    :returns: an async iterator of the deltas, then the result (an async generator function's call).
    Raises: request errors from ``server.stream`` (before the first chunk, as :func:`post_generate` would; an error
        the server reports inside the stream through ``ResponseStream.error``);
        :class:`~backends_core.errors.ResponseParseError` naming the offending field of a chunk.

    .. versionadded:: 0.2
    """


# -- Teacher --------------------------------------------------------------------------------------


@hookspec(firstresult=True)
async def teacher_logprobs(
    server: Server, request: TeacherRequest, config: ClientConfig, options: Any
) -> TeacherLogprobs | None:
    """Score a given token sequence: the logprob of each token given its prefix.

    Mode: async I/O. Required: no (capability ``teacher_logprobs``).

    :param server: the server to ask.
    :param request: the ids to score and how many alternatives to return.
    :param config: the client's configuration.
    :param options: the validated backend options.
    :returns: float32 logprobs of length ``len(request.token_ids)`` with NaN at position 0.
    Raises: :class:`~backends_core.errors.ResponseParseError`; request errors from ``server``.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
async def tokenize_messages(
    server: Server,
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None,
    chat_template_kwargs: Mapping[str, Any],
    add_generation_prompt: bool,
    config: ClientConfig,
    options: Any,
) -> list[int] | None:
    """Ask the server to render and tokenize ``messages`` with *its* chat template and tokenizer.

    Used by ``Client.check_tokenizer`` to prove the trainer and the server agree. Mode: async I/O.
    Required: no (capability ``tokenize_messages``).

    :param server: the server to ask.
    :param messages: chat messages.
    :param tools: tool schemas rendered into the prompt, or ``None``.
    :param chat_template_kwargs: extra template variables.
    :param add_generation_prompt: end with the assistant header.
    :param config: the client's configuration.
    :param options: the validated backend options.
    :returns: the server's prompt token ids.
    Raises: request errors; :class:`~backends_core.errors.ResponseParseError`.

    .. versionadded:: 0.1
    """


# -- Admin ----------------------------------------------------------------------------------------
# Every admin hook: Mode: async I/O on the admin plane. Required: no. Returns normally only when the
# server confirmed the operation; any refusal raises (never "ok" on a failure).


@hookspec(firstresult=True)
async def admin_health(server: Server, config: ClientConfig, options: Any) -> bool | None:
    """Is the server process alive and answering?

    :param server: the server to ask.
    :param config: the client's configuration.
    :param options: the validated backend options.
    :returns: ``True`` when healthy, ``False`` when the server answered that it is unhealthy.
    Raises: request errors when it cannot be reached.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
async def admin_ready(server: Server, config: ClientConfig, options: Any) -> bool | None:
    """Can the server take generation requests now (model loaded, not paused or asleep)?

    :param server: the server to ask.
    :param config: the client's configuration.
    :param options: the validated backend options.
    :returns: ``True`` when ready.
    Raises: request errors when it cannot be reached.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
async def admin_pause(
    server: Server, mode: PauseMode, clear_cache: bool, config: ClientConfig, options: Any
) -> bool | None:
    """Stop scheduling generation.

    :param server: the server to pause.
    :param mode: ``"abort"`` ends in-flight requests now (finish reason ``abort``); ``"wait"`` returns once
        they complete; ``"keep"`` freezes them to continue after resume.
    :param clear_cache: also drop the prefix cache once paused (ignored with ``"keep"``, whose frozen requests
        still need their cache).
    :param config: the client's configuration.
    :param options: the validated backend options.
    :returns: ``True`` once the server confirmed the pause.
    Raises: :class:`~backends_core.errors.UnsupportedOperationError` for a mode the server lacks; request
        errors.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
async def admin_resume(server: Server, config: ClientConfig, options: Any) -> bool | None:
    """Resume scheduling after :func:`admin_pause`.

    :param server: the server to resume.
    :param config: the client's configuration.
    :param options: the validated backend options.
    :returns: ``True`` once confirmed.
    Raises: request errors.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
async def admin_flush_cache(server: Server, config: ClientConfig, options: Any) -> bool | None:
    """Drop the prefix (KV) cache so no stale entries survive a weight update.

    :param server: the server to flush.
    :param config: the client's configuration.
    :param options: the validated backend options.
    :returns: ``True`` once the server confirmed the flush.
    Raises: :class:`~backends_core.errors.ServerStatusError` when the server refuses (e.g. requests in flight).

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
async def admin_update_weights(
    server: Server, path: str, version: str | None, config: ClientConfig, options: Any
) -> bool | None:
    """Load new weights from a directory the server can read.

    :param server: the server to update.
    :param path: checkpoint directory as seen by the server.
    :param version: weight version to report afterwards, or ``None`` to leave it to the server.
    :param config: the client's configuration.
    :param options: the validated backend options.
    :returns: ``True`` once the server confirmed the load.
    Raises: request errors (a refused load is a :class:`~backends_core.errors.ServerStatusError`).

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
async def admin_init_weight_transfer(
    server: Server, group: DistributedGroup, config: ClientConfig, options: Any
) -> bool | None:
    """Join a trainer-to-server weight-transfer group (NCCL or similar).

    :param server: the server that joins.
    :param group: rendezvous address, world size, this server's rank offset, group name.
    :param config: the client's configuration.
    :param options: the validated backend options.
    :returns: ``True`` once the server joined.
    Raises: request errors.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
async def admin_destroy_weight_transfer(
    server: Server, group_name: str, config: ClientConfig, options: Any
) -> bool | None:
    """Leave a weight-transfer group joined with :func:`admin_init_weight_transfer` and free its resources.

    Not idempotent on every engine: SGLang refuses a group it does not have (also one already destroyed), so
    the fleet never retries it; an engine with a single, unnamed transfer engine per server (vLLM) ignores the
    name and confirms even when nothing was joined.

    :param server: the server that leaves.
    :param group_name: the group to leave (``DistributedGroup.group_name``).
    :param config: the client's configuration.
    :param options: the validated backend options.
    :returns: ``True`` once the server confirmed it left the group.
    Raises: :class:`~backends_core.errors.ServerStatusError` or
        :class:`~backends_core.errors.ServerRefusedError` when the server refuses (no such group, a weight
        update in progress, no transfer support); other request errors.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def weight_transfer_plan(
    tensors: Sequence[TensorSpec], bucket_bytes: int | None, config: ClientConfig, options: Any
) -> TransferPlan | None:
    """How this backend's engine receives ``tensors`` through a weight-transfer group: their broadcast order,
    their buckets, packed or not. This is what a trainer (``backends-trainer``) follows to send; it never
    imports torch.

    :param tensors: what the trainer will send, in the trainer's order.
    :param bucket_bytes: the packed bucket size the group was joined with (``DistributedGroup.bucket_bytes``),
        or ``None`` for one broadcast per tensor.
    :param config: the client's configuration.
    :param options: the validated backend options.
    :returns: the plan, or ``None`` when the backend does not receive distributed updates.
    Raises: :class:`~backends_core.errors.InvalidRequestError` for what the engine cannot receive (a dtype it
        has no name for, a packing it does not do).

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
async def admin_update_weights_distributed(
    server: Server,
    group_name: str,
    tensors: Sequence[TensorSpec],
    version: str | None,
    plan: TransferPlan | None,
    config: ClientConfig,
    options: Any,
) -> bool | None:
    """Receive named tensors through a group set up by :func:`admin_init_weight_transfer`.

    :param server: the server that receives.
    :param group_name: the group to receive on.
    :param tensors: name, dtype and shape of each tensor, in broadcast order.
    :param version: weight version to report afterwards, or ``None``.
    :param plan: the buckets the trainer sends (:func:`weight_transfer_plan`), or ``None``: one broadcast per
        tensor of ``tensors``, announced at once.
    :param config: the client's configuration.
    :param options: the validated backend options.
    :returns: ``True`` once the server applied them.
    Raises: request errors.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
async def admin_load_lora(server: Server, adapter: LoraAdapter, config: ClientConfig, options: Any) -> bool | None:
    """Load a LoRA adapter, or hot-swap it in place when ``adapter.replace`` and the name is loaded.

    :param server: the server to load on.
    :param adapter: name, path and replace flag.
    :param config: the client's configuration.
    :param options: the validated backend options.
    :returns: ``True`` once loaded.
    Raises: request errors (unknown path, duplicate name without ``replace``).

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
async def admin_unload_lora(server: Server, name: str, config: ClientConfig, options: Any) -> bool | None:
    """Unload a LoRA adapter by name.

    :param server: the server to unload from.
    :param name: the adapter's name.
    :param config: the client's configuration.
    :param options: the validated backend options.
    :returns: ``True`` once unloaded.
    Raises: request errors (unknown name).

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
async def admin_state(
    server: Server, config: ClientConfig, options: Any, fields: frozenset[str] | None
) -> ServerState | None:
    """Read the server's admin state: paused, sleeping, weight version, in-flight requests, LoRAs.

    :param server: the server to ask.
    :param config: the client's configuration.
    :param options: the validated backend options.
    :param fields: the :class:`~backends_core.types.ServerState` fields the caller needs (a weight sync's check:
        ``{"weight_version"}``), ``None`` for all: an implementation may read only those and leave the others
        ``None``, or read everything (one that does not name this argument is never given it).
    :returns: what the server exposes; unknown fields stay ``None``.
    Raises: request errors; :class:`~backends_core.errors.ResponseParseError`.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
async def admin_sleep(server: Server, level: int, config: ClientConfig, options: Any) -> bool | None:
    """Release accelerator memory (level 1: offload weights, level 2: discard them).

    :param server: the server to put to sleep.
    :param level: 1 or 2.
    :param config: the client's configuration.
    :param options: the validated backend options.
    :returns: ``True`` once asleep.
    Raises: request errors.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
async def admin_wake(server: Server, config: ClientConfig, options: Any) -> bool | None:
    """Wake a sleeping server.

    :param server: the server to wake.
    :param config: the client's configuration.
    :param options: the validated backend options.
    :returns: ``True`` once awake.
    Raises: request errors.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
async def admin_abort(
    server: Server, request_ids: Sequence[str] | None, config: ClientConfig, options: Any
) -> int | None:
    """Abort requests by the ids callers gave them, or all of them.

    :param server: the server to abort on.
    :param request_ids: caller-given ids (the backend adds any server-side prefix), or ``None`` for all.
    :param config: the client's configuration.
    :param options: the validated backend options.
    :returns: how many requests the server reports aborted (``-1`` when it does not say).
    Raises: request errors.

    .. versionadded:: 0.1
    """


# -- Observation ----------------------------------------------------------------------------------


@hookspec
def observe(event: Event) -> None:
    """See every finished call (metrics, tracing, logging). All implementations are called.

    Mode: sync; must not block or raise (an exception propagates to the caller). Required: no.

    :param event: what happened, where, how long it took, and the error if it failed.

    .. versionadded:: 0.1
    """
