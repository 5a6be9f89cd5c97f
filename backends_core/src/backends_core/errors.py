"""Every exception backends raises, in one place.

::

    BackendError                                  base of everything this framework raises
    ├── ConfigError (ValueError)                  bad ClientConfig / backend_options; ``.messages`` has field paths
    │   └── ParserNotFoundError (LookupError)     tool_parser / reasoning_parser names no installed parser;
    │                                             ``.kind``, ``.name``, ``.available``
    ├── BackendNotFoundError (LookupError)        no installed backend has that name; lists installed ones,
    │                                             suggests close names, gives the ``pip install`` hint
    ├── BackendConflictError                      two distributions register the same backend name
    ├── BackendLoadError (ImportError)            the selected backend failed to import (chained)
    ├── BackendValidationError                    the backend's hooks don't fit the contract; ``.missing``
    ├── UnsupportedOperationError (NotImplementedError)
    │                                             optional hook not implemented; ``.backend``, ``.operation``
    ├── InvalidRequestError (ValueError)          a caller's arguments are wrong (checked before sending)
    │   └── MembershipError                       ``client.fleet``: no such member, already a member, or a
    │                                             removal that would leave no serving server
    ├── RenderError (ValueError)                  messages could not be rendered to prompt ids
    ├── BridgeError                               multi-turn: the new prompt cannot be proven to extend the
    │                                             previous turn's exact ids; ``.reason``
    ├── RequestError                              talking to a server failed; ``.method``, ``.url``
    │   ├── TransportError
    │   │   ├── RequestTimeout                    connect/read/write/pool timeout
    │   │   └── NetworkError                      connection refused/reset, protocol error
    │   ├── ServerStatusError                     non-2xx answer; ``.status_code``, ``.body`` (server's words)
    │   └── ServerRefusedError                    2xx answer that reports failure (``{"success": false}``); ``.body``
    ├── ResponseParseError (ValueError)           a 2xx body does not match the wire shape; ``.url``, ``.detail``
    ├── AdminError                                an admin operation failed on one or more servers;
    │                                             ``.results`` every server's outcome, ``.phases``, ``.state``
    ├── FrontError                                a router front cannot tell its replicas, or refused a
    │                                             registration; ``.front``, ``.kind``
    ├── WeightVersionMismatch                     a server reports another weight version than the one set
    ├── StaleServerError                          a server (back after being down) serves other weights than
    │                                             the fleet's version: it gets no requests until caught up
    ├── ClientClosedError (RuntimeError)          a call on a SyncClient after close() (or cut short by it)
    └── RunningEventLoopError (RuntimeError)      a SyncClient called from a thread running an event loop:
                                                  async code uses Client

Backends raise :class:`RenderError`, :class:`ResponseParseError`, :class:`InvalidRequestError`,
:class:`ServerRefusedError` and :class:`ConfigError` themselves; HTTP failures are mapped to
:class:`RequestError` subclasses at one choke point (:mod:`backends_core.server`), so a backend never constructs
them.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from backends_core.fleet import ServerOutcome

__all__ = [
    "AdminError",
    "BackendConflictError",
    "BackendError",
    "BackendLoadError",
    "BackendNotFoundError",
    "BackendValidationError",
    "BridgeError",
    "ClientClosedError",
    "ConfigError",
    "FrontError",
    "InvalidRequestError",
    "MembershipError",
    "NetworkError",
    "ParserNotFoundError",
    "RenderError",
    "RequestError",
    "RequestTimeout",
    "ResponseParseError",
    "RunningEventLoopError",
    "ServerRefusedError",
    "ServerStatusError",
    "StaleServerError",
    "TransferError",
    "TransportError",
    "UnsupportedOperationError",
    "WeightVersionMismatch",
]

#: The umbrella distribution's extras, used for the install hint of an unknown backend.
FIRST_PARTY_EXTRAS = ("vllm", "dynamo", "sglang")


class BackendError(Exception):
    """Base class of every error raised by backends."""


class ConfigError(BackendError, ValueError):
    """A configuration value is invalid.

    :ivar messages: one readable line per problem, each naming its field path (``$.timeouts.read``).
    """

    def __init__(self, messages: Sequence[str] | str, *, source: str | None = None) -> None:
        self.messages = [messages] if isinstance(messages, str) else list(messages)
        self.source = source
        where = f" in {source}" if source else ""
        super().__init__(f"invalid configuration{where}: " + "; ".join(self.messages))


class ParserNotFoundError(ConfigError, LookupError):
    """``ClientConfig.tool_parser`` or ``reasoning_parser`` names no installed parser.

    :ivar kind: ``"tool"`` or ``"reasoning"``.
    :ivar name: the name asked for.
    :ivar available: the installed names of that kind.
    """

    def __init__(self, kind: str, name: str, available: Sequence[str]) -> None:
        self.kind = kind
        self.name = name
        self.available = sorted(available)
        installed = ", ".join(repr(n) for n in self.available) or "none"
        super().__init__([f"no {kind} parser named {name!r} is installed (installed: {installed}) @ $.{kind}_parser"])


class BackendNotFoundError(BackendError, LookupError):
    """No installed backend is registered under the requested name."""

    def __init__(self, name: str, available: Iterable[str]) -> None:
        self.name = name
        self.available = sorted(available)
        self.suggestions = difflib.get_close_matches(name, self.available, n=3, cutoff=0.6)
        parts = [f"no backend named {name!r} is installed"]
        parts.append("installed: " + (", ".join(self.available) if self.available else "none"))
        if self.suggestions:
            parts.append("did you mean " + " or ".join(repr(s) for s in self.suggestions) + "?")
        if name in FIRST_PARTY_EXTRAS:
            parts.append(f'install it with: pip install "backends[{name}]"')
        else:
            parts.append(f'first-party backends install with: pip install "backends[{",".join(FIRST_PARTY_EXTRAS)}]"')
        super().__init__("; ".join(parts))


class BackendConflictError(BackendError):
    """Two installed distributions register the same backend name."""

    def __init__(self, name: str, distributions: Sequence[str]) -> None:
        self.name = name
        self.distributions = list(distributions)
        super().__init__(
            f"backend name {name!r} is registered by several distributions: {', '.join(self.distributions)}; "
            "uninstall all but one"
        )


class BackendLoadError(BackendError, ImportError):
    """The selected backend's entry point failed to import; the original error is chained."""

    def __init__(self, name: str, target: str, cause: BaseException) -> None:
        self.backend = name
        self.target = target
        super().__init__(f"backend {name!r} ({target}) failed to load: {type(cause).__name__}: {cause}")


class BackendValidationError(BackendError):
    """The backend does not satisfy the driver contract (bad hook signature, missing required hooks)."""

    def __init__(self, backend: str, message: str, *, missing: Sequence[str] = ()) -> None:
        self.backend = backend
        self.missing = list(missing)
        super().__init__(f"backend {backend!r} is invalid: {message}")


class UnsupportedOperationError(BackendError, NotImplementedError):
    """The backend does not implement this optional operation."""

    def __init__(self, backend: str, operation: str, *, hint: str | None = None) -> None:
        self.backend = backend
        self.operation = operation
        msg = f"backend {backend!r} does not support {operation!r}"
        super().__init__(msg + (f": {hint}" if hint else ""))


class InvalidRequestError(BackendError, ValueError):
    """The caller's arguments are invalid; raised before anything is sent."""


class MembershipError(InvalidRequestError):
    """A fleet membership change that cannot be made (``client.fleet.add`` / ``remove``): the URL is not a
    member, is one already, or its removal would leave no server to serve."""


class RenderError(BackendError, ValueError):
    """Messages could not be rendered into prompt token ids."""


class BridgeError(BackendError):
    """A multi-turn prompt could not be proven to extend the previous turn's exact token ids.

    :ivar reason: a short machine-readable key (also the counter name in ``BridgeStats``).
    """

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"multi-turn bridge failed ({reason}): {detail}")


class RequestError(BackendError):
    """Talking to a server failed.

    :ivar method: HTTP method of the failed request.
    :ivar url: full URL of the failed request.
    :ivar maybe_processed: ``False`` only when the request certainly never reached the server (connection
        refused, connect or pool timeout), so sending it elsewhere cannot duplicate work.
    """

    def __init__(self, message: str, *, method: str, url: str, maybe_processed: bool = True) -> None:
        self.method = method
        self.url = url
        self.maybe_processed = maybe_processed
        super().__init__(f"{message} ({method} {url})")


class TransportError(RequestError):
    """The request did not complete at the transport level."""


class RequestTimeout(TransportError):
    """A connect, read, write or pool timeout expired."""


class NetworkError(TransportError):
    """The connection failed (refused, reset, closed mid-response, protocol violation)."""


class ServerStatusError(RequestError):
    """The server answered with a non-2xx status.

    :ivar status_code: the HTTP status.
    :ivar body: the server's error body, decoded as JSON when possible, else text.
    """

    def __init__(self, *, method: str, url: str, status_code: int, body: Any, hint: str | None = None) -> None:
        self.status_code = status_code
        self.body = body
        self.hint = hint
        text = body if isinstance(body, str) else repr(body)
        if len(text) > 2000:
            text = text[:2000] + "…"
        message = f"server answered {status_code}: {text}"
        if hint:
            message += f"; hint: {hint}"
        super().__init__(message, method=method, url=url)


class ServerRefusedError(RequestError):
    """The server answered 2xx but its body says the operation did not happen (e.g. ``{"success": false}``).

    :ivar body: the server's answer.
    """

    def __init__(self, what: str, *, method: str, url: str, body: Any) -> None:
        self.body = body
        super().__init__(f"server refused {what}: {body!r}", method=method, url=url)


class ResponseParseError(BackendError, ValueError):
    """A 2xx response body does not have the expected wire shape.

    :ivar url: where the body came from (may be ``None`` when parsing offline).
    :ivar detail: what was wrong, naming the field path.
    """

    def __init__(self, detail: str, *, url: str | None = None) -> None:
        self.detail = detail
        self.url = url
        super().__init__(f"unexpected response{f' from {url}' if url else ''}: {detail}")


class AdminError(BackendError):
    """An admin operation failed on at least one server.

    The message names every server concerned: those that failed (with their error), those where the operation
    took effect, and, when the operation left the fleet in a state the caller must act on (servers left
    paused, mixed weights), that state.

    :ivar operation: the admin operation's name.
    :ivar results: every server's :class:`~backends_core.fleet.ServerOutcome`, successes included.
    :ivar phases: for a multi-step operation (``weight_sync``), every phase's outcomes, including the
        resume that ran after the failure.
    :ivar state: what the failure left behind and what to do about it, or ``None``.
    """

    def __init__(
        self,
        operation: str,
        results: Sequence[ServerOutcome[Any]],
        *,
        phases: Mapping[str, Sequence[ServerOutcome[Any]]] | None = None,
        state: str | None = None,
    ) -> None:
        self.operation = operation
        self.results = list(results)
        self.phases: dict[str, list[ServerOutcome[Any]]] = {k: list(v) for k, v in (phases or {}).items()}
        self.state = state
        failed = [r for r in self.results if r.error is not None]
        succeeded = [r.server for r in self.results if r.error is None]
        message = f"{operation} failed on {len(failed)} of {len(self.results)} server(s): " + " | ".join(
            f"{r.server}: {type(r.error).__name__}: {r.error}" for r in failed
        )
        if succeeded:
            message += f"; succeeded on {', '.join(succeeded)}"
        if state:
            message += f"; {state}"
        super().__init__(message)

    @property
    def failed(self) -> list[str]:
        """Servers where the operation failed."""
        return [r.server for r in self.results if r.error is not None]

    @property
    def succeeded(self) -> list[str]:
        """Servers where the operation took effect."""
        return [r.server for r in self.results if r.error is None]


class TransferError(BackendError):
    """The trainer's half of a distributed weight update failed: its broadcast, or what it was asked to send
    (a tensor the plan does not hold, a dtype or shape that disagrees with the announced spec)."""


class FrontError(BackendError):
    """A router front (``ClientConfig.front``) could not tell which replicas it routes to, or refused to add or
    remove one. An admin operation is refused with it rather than sent through the router, which would reach one
    replica only.

    :ivar front: the front's URL.
    :ivar kind: the front's kind (``FrontConfig.kind``).
    """

    def __init__(self, front: str, kind: str, detail: str) -> None:
        self.front = front
        self.kind = kind
        super().__init__(f"{kind} front {front}: {detail}")


class WeightVersionMismatch(BackendError):
    """A server reports another weight version than the one just set.

    :ivar expected: the version that was set.
    :ivar reported: the version the server reports.
    """

    def __init__(self, server: str, *, expected: str, reported: str | None) -> None:
        self.expected = expected
        self.reported = reported
        super().__init__(f"{server} reports weight version {reported!r}, expected {expected!r}")


class StaleServerError(BackendError):
    """A server serves other weights than the version this client set on the fleet (typically a server that
    went down and came back with its start-up weights); it gets no requests until it reports that version.

    :ivar server: its base URL.
    :ivar expected: the fleet's version.
    :ivar reported: the version the server reports.
    """

    def __init__(self, server: str, *, expected: str, reported: str) -> None:
        self.server = server
        self.expected = expected
        self.reported = reported
        super().__init__(
            f"{server} serves weight version {reported!r} but the fleet is on {expected!r}: it gets no requests "
            "until it is brought to that version (admin.update_weights or weight_sync); looked at again after "
            "fleet.cooldown"
        )


class ClientClosedError(BackendError, RuntimeError):
    """A :class:`~backends_core.sync_client.SyncClient` (or its admin or conversation) was called after
    ``close()``, or ``close()`` cut the call short while it ran (its server request was cancelled)."""


class RunningEventLoopError(BackendError, RuntimeError):
    """A :class:`~backends_core.sync_client.SyncClient` was called from a thread that runs an event loop (inside
    an ``async def``): blocking there would stall that loop, so the call is refused. Async code uses
    :class:`~backends_core.client.Client` and awaits it."""
