"""backends: one client layer between RL trainers and LLM inference servers.

``backends_core`` defines the driver contract (pluggy hookspecs) and the runtime around it: config, HTTP
ownership, errors, multi-turn bridging, admin fan-out, CLI and the conformance kit. Backends are separate
distributions registered under the ``backends_core.backends`` entry-point group.
"""

from __future__ import annotations

import logging

from backends_core.client import Client, GenerateStream
from backends_core.config import (
    AdminPolicy,
    ClientConfig,
    FleetPolicy,
    FrontConfig,
    Limits,
    RetryPolicy,
    StatelessPolicy,
    Timeouts,
)
from backends_core.errors import (
    AdminError,
    BackendConflictError,
    BackendError,
    BackendLoadError,
    BackendNotFoundError,
    BackendValidationError,
    BridgeError,
    ClientClosedError,
    ConfigError,
    FrontError,
    InvalidRequestError,
    MembershipError,
    NetworkError,
    ParserNotFoundError,
    RenderError,
    RequestError,
    RequestTimeout,
    ResponseParseError,
    RunningEventLoopError,
    ServerRefusedError,
    ServerStatusError,
    StaleServerError,
    TransferError,
    TransportError,
    UnsupportedOperationError,
    WeightVersionMismatch,
)
from backends_core.events import Event
from backends_core.fleet import FleetState, ServerOutcome, ServerReport, SyncReport
from backends_core.hookspecs import hookimpl
from backends_core.images import Image, ImageSpan
from backends_core.membership import Fleet, Member
from backends_core.multiturn import BridgeStats, Conversation, extend_prompt
from backends_core.multiturn.spans import loss_mask
from backends_core.plugins import ENTRY_POINT_GROUP, BackendInfo, available_backends
from backends_core.routed_experts import align_routed_experts, decode_routed_experts
from backends_core.server import Refusal, Server, StatusHint, idempotent_requests
from backends_core.sync_client import SyncAdmin, SyncClient, SyncConversation, SyncFleet, SyncGenerateStream
from backends_core.types import (
    SAMPLING_FEATURES,
    Choice,
    DistributedGroup,
    GenerateRequest,
    GenerateResult,
    Grammar,
    JsonSchema,
    LoraAdapter,
    MessageSpan,
    Regex,
    RoutedExperts,
    SamplingParams,
    ServerState,
    StreamDelta,
    Structured,
    TeacherLogprobs,
    TeacherRequest,
    TensorSpec,
    TokenizerCheck,
    TopLogprob,
    TransferPlan,
    Usage,
    WeightVersionSpan,
)

__version__ = "0.1.0"

# a library's loggers print nothing until the application configures logging (README: Logging)
logging.getLogger("backends_core").addHandler(logging.NullHandler())

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
    "Choice",
    "Client",
    "ClientClosedError",
    "ClientConfig",
    "ConfigError",
    "Conversation",
    "DistributedGroup",
    "ENTRY_POINT_GROUP",
    "Event",
    "Fleet",
    "FleetPolicy",
    "FleetState",
    "FrontConfig",
    "FrontError",
    "GenerateRequest",
    "GenerateResult",
    "GenerateStream",
    "Grammar",
    "Image",
    "ImageSpan",
    "InvalidRequestError",
    "JsonSchema",
    "Limits",
    "LoraAdapter",
    "Member",
    "MembershipError",
    "MessageSpan",
    "NetworkError",
    "ParserNotFoundError",
    "Refusal",
    "Regex",
    "RenderError",
    "RequestError",
    "RequestTimeout",
    "ResponseParseError",
    "RetryPolicy",
    "RoutedExperts",
    "RunningEventLoopError",
    "SAMPLING_FEATURES",
    "SamplingParams",
    "Server",
    "ServerOutcome",
    "ServerRefusedError",
    "ServerReport",
    "ServerState",
    "ServerStatusError",
    "StaleServerError",
    "StatelessPolicy",
    "StatusHint",
    "StreamDelta",
    "Structured",
    "SyncAdmin",
    "SyncClient",
    "SyncConversation",
    "SyncFleet",
    "SyncGenerateStream",
    "SyncReport",
    "TeacherLogprobs",
    "TeacherRequest",
    "TensorSpec",
    "Timeouts",
    "TokenizerCheck",
    "TopLogprob",
    "TransferError",
    "TransferPlan",
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
    "loss_mask",
]
