"""backends: one client layer between RL trainers and LLM inference servers.

``backends_core`` defines the driver contract (pluggy hookspecs) and the runtime around it: config, HTTP
ownership, errors, multi-turn bridging, admin fan-out, CLI and the conformance kit. Backends are separate
distributions registered under the ``backends_core.backends`` entry-point group.
"""

from __future__ import annotations

from backends_core.client import Client, GenerateStream
from backends_core.config import AdminPolicy, ClientConfig, FleetPolicy, Limits, RetryPolicy, Timeouts
from backends_core.errors import (
    AdminError,
    BackendConflictError,
    BackendError,
    BackendLoadError,
    BackendNotFoundError,
    BackendValidationError,
    BridgeError,
    ConfigError,
    InvalidRequestError,
    NetworkError,
    RenderError,
    RequestError,
    RequestTimeout,
    ResponseParseError,
    ServerRefusedError,
    ServerStatusError,
    StaleServerError,
    TransportError,
    UnsupportedOperationError,
    WeightVersionMismatch,
)
from backends_core.events import Event
from backends_core.fleet import ServerOutcome, ServerReport, SyncReport
from backends_core.hookspecs import hookimpl
from backends_core.multiturn import BridgeStats, Conversation, extend_prompt
from backends_core.plugins import ENTRY_POINT_GROUP, BackendInfo, available_backends
from backends_core.routed_experts import align_routed_experts, decode_routed_experts
from backends_core.server import Refusal, Server, StatusHint, idempotent_requests
from backends_core.types import (
    DistributedGroup,
    GenerateRequest,
    GenerateResult,
    LoraAdapter,
    RoutedExperts,
    SamplingParams,
    ServerState,
    StreamDelta,
    TeacherLogprobs,
    TeacherRequest,
    TensorSpec,
    TokenizerCheck,
    TopLogprob,
    Usage,
    WeightVersionSpan,
)

__version__ = "0.1.0"

__all__ = [
    "AdminError",
    "AdminPolicy",
    "BackendConflictError",
    "BackendError",
    "BackendInfo",
    "BackendLoadError",
    "BackendNotFoundError",
    "BackendValidationError",
    "BridgeError",
    "BridgeStats",
    "Client",
    "ClientConfig",
    "ConfigError",
    "Conversation",
    "DistributedGroup",
    "ENTRY_POINT_GROUP",
    "Event",
    "FleetPolicy",
    "GenerateRequest",
    "GenerateResult",
    "GenerateStream",
    "InvalidRequestError",
    "Limits",
    "LoraAdapter",
    "NetworkError",
    "Refusal",
    "RenderError",
    "RequestError",
    "RequestTimeout",
    "ResponseParseError",
    "RetryPolicy",
    "RoutedExperts",
    "SamplingParams",
    "Server",
    "ServerOutcome",
    "ServerRefusedError",
    "ServerReport",
    "ServerState",
    "ServerStatusError",
    "StaleServerError",
    "StatusHint",
    "StreamDelta",
    "SyncReport",
    "TeacherLogprobs",
    "TeacherRequest",
    "TensorSpec",
    "Timeouts",
    "TokenizerCheck",
    "TopLogprob",
    "TransportError",
    "UnsupportedOperationError",
    "Usage",
    "WeightVersionMismatch",
    "WeightVersionSpan",
    "align_routed_experts",
    "available_backends",
    "decode_routed_experts",
    "extend_prompt",
    "hookimpl",
    "idempotent_requests",
]
