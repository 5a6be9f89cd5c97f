"""The gateway's errors: each says what a harness did wrong (or what the engine did) and which HTTP status answers
it. A route turns one into its API's error shape (:mod:`backends_gateway.openai_chat` for OpenAI's)."""

from __future__ import annotations

from backends_core import (
    BackendError,
    InvalidRequestError,
    NetworkError,
    RenderError,
    RequestError,
    RequestTimeout,
    ResponseParseError,
    ServerRefusedError,
    ServerStatusError,
    StaleServerError,
    UnsupportedOperationError,
)

__all__ = ["GatewayError", "Overloaded", "from_backend_error"]


class GatewayError(Exception):
    """A request the gateway answers with an error.

    :param status: the HTTP status.
    :param message: what was wrong, naming the field where one was.
    :param kind: the API's error type (``invalid_request_error``, ``not_found_error``, ``rate_limit_error``,
        ``server_error``...).
    :param param: the request field at fault, as a path (``messages[2].content``), or ``None``.
    :param code: a stable machine-readable code (``unsupported_parameter``, ``session_closed``...).
    """

    def __init__(
        self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None, code: str
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code


class Overloaded(GatewayError):
    """The gateway is at a limit that frees by itself (requests in flight, open sessions): try again after
    ``retry_after`` seconds (sent as ``Retry-After``)."""

    def __init__(self, message: str, *, retry_after: int, code: str) -> None:
        super().__init__(429, message, kind="rate_limit_error", code=code)
        self.retry_after = retry_after


def from_backend_error(exc: BackendError) -> GatewayError:
    """The answer to a library error raised while serving a turn.

    An engine failure after the request may have reached the engine is never retried here (the client already
    follows the exactly-once rule: a generation that may have run is never re-sent), and the message says so.
    """
    if isinstance(exc, RenderError):
        return GatewayError(400, f"the chat template refused the messages: {exc}", param="messages", code="render")
    if isinstance(exc, UnsupportedOperationError):
        return GatewayError(400, str(exc), code="unsupported_operation")
    if isinstance(exc, InvalidRequestError):
        return GatewayError(400, str(exc), code="invalid_request")
    if isinstance(exc, StaleServerError):
        return GatewayError(503, str(exc), kind="server_error", code="stale_server")
    if isinstance(exc, ResponseParseError):
        return GatewayError(502, f"the engine's answer could not be read: {exc}", kind="server_error", code="engine")
    if isinstance(exc, RequestError):
        sent = " (it may have run: it was not re-sent)" if exc.maybe_processed else ""
        if isinstance(exc, ServerRefusedError):
            return GatewayError(400, f"the engine refused the request: {exc}", code="engine_refused")
        if isinstance(exc, ServerStatusError):
            if exc.status_code == 429:
                return Overloaded(f"the engine is overloaded: {exc}", retry_after=1, code="engine_overloaded")
            if 400 <= exc.status_code < 500:
                return GatewayError(400, f"the engine refused the request: {exc}", code="engine_refused")
            return GatewayError(502, f"the engine failed{sent}: {exc}", kind="server_error", code="engine")
        if isinstance(exc, RequestTimeout):
            return GatewayError(504, f"the engine timed out{sent}: {exc}", kind="server_error", code="engine_timeout")
        if isinstance(exc, NetworkError):
            return GatewayError(502, f"the engine is unreachable{sent}: {exc}", kind="server_error", code="engine")
        return GatewayError(502, f"the request to the engine failed{sent}: {exc}", kind="server_error", code="engine")
    return GatewayError(500, f"{type(exc).__name__}: {exc}", kind="server_error", code="internal")
