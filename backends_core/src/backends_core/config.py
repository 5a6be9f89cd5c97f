"""Client configuration: immutable attrs classes, loaded from mappings or TOML/JSON files through cattrs.

Every validation problem becomes one :class:`~backends_core.errors.ConfigError` whose ``messages`` name the
field path (``$.timeouts.read``), so a bad config file says exactly what to fix.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import attrs
import cattrs
from cattrs.gen import make_dict_structure_fn, override

from backends_core.converters import format_error, make_converter
from backends_core.errors import ConfigError

__all__ = [
    "ENVIRONMENT",
    "AdminPolicy",
    "ClientConfig",
    "FleetPolicy",
    "FrontConfig",
    "Limits",
    "RetryPolicy",
    "StatelessPolicy",
    "Timeouts",
]

#: The environment layer of :meth:`ClientConfig.load`: each variable and the field it sets. ``BACKENDS_URL``
#: holds one URL or several separated by commas or whitespace. ``BACKENDS_CONFIG`` (a file) and
#: ``BACKENDS_SECTION`` (its table) choose the file layer.
ENVIRONMENT: Mapping[str, str] = {
    "BACKENDS_URL": "base_url",
    "BACKENDS_BACKEND": "backend",
    "BACKENDS_MODEL": "model",
    "BACKENDS_TOKENIZER": "tokenizer",
}

#: How :meth:`ClientConfig.load` names a flag in its errors: the ``backends`` CLI's option for the field.
_FLAG_NAMES = {"base_url": "--url"}

_BACKEND_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


class _FieldError(ConfigError):
    """A validator's complaint about one field of an attrs class: reported at that field's path
    (``$.timeouts.read``), not at the class's (``$.timeouts``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _positive_or_none(name: str) -> Any:
    def check(_inst: Any, _attr: Any, value: float | None) -> None:
        if value is not None and not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
            raise _FieldError(name, f"{name} must be a positive number of seconds or null, got {value!r}")

    return check


def _at_least(minimum: float) -> Any:
    def check(_inst: Any, attr: Any, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= minimum:
            raise _FieldError(attr.name, f"{attr.name} must be a number >= {minimum}, got {value!r}")

    return check


def _fraction(_inst: Any, attr: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise _FieldError(attr.name, f"{attr.name} must be a number from 0 to 1, got {value!r}")


def _one_of(*choices: str) -> Any:
    def check(_inst: Any, attr: Any, value: Any) -> None:
        if value not in choices:
            raise _FieldError(attr.name, f"{attr.name} must be one of {list(choices)}, got {value!r}")

    return check


def _instance(cls: type) -> Any:
    def check(_inst: Any, attr: Any, value: Any) -> None:
        if not isinstance(value, cls):
            raise _FieldError(
                attr.name,
                f"{attr.name} must be a {cls.__name__}, got {type(value).__name__} "
                "(plain data goes through ClientConfig.from_mapping)",
            )

    return check


@attrs.frozen(kw_only=True)
class Timeouts:
    """Seconds to wait; ``None`` means no limit.

    :param connect: establishing a connection.
    :param read: waiting for a data-plane response (a long generation is legitimate: default 10 min).
    :param write: sending a request body.
    :param pool: waiting for a free connection from the pool.
    :param admin: whole admin request (weight updates on big models take long: default 30 min).
    """

    connect: float | None = attrs.field(default=10.0, validator=_positive_or_none("connect"))
    read: float | None = attrs.field(default=600.0, validator=_positive_or_none("read"))
    write: float | None = attrs.field(default=60.0, validator=_positive_or_none("write"))
    pool: float | None = attrs.field(default=600.0, validator=_positive_or_none("pool"))
    admin: float | None = attrs.field(default=1800.0, validator=_positive_or_none("admin"))


@attrs.frozen(kw_only=True)
class Limits:
    """Connection pool sizes. The admin plane has its own small pool so weight syncs never queue behind
    thousands of generation requests.

    :param max_connections: data-plane connections in use at once across all servers (a request beyond it waits
        for one, up to ``Timeouts.pool``); idle connections do not count, so at most ``max_connections +
        max_keepalive_connections`` are open.
    :param max_keepalive_connections: idle data-plane connections kept open for reuse, all servers together (the
        longest idle is closed when one more is released).
    :param keepalive_expiry: seconds an idle connection is kept; keep it below the server's own keep-alive.
    :param admin_max_connections: admin-plane connections per server (their own pool).
    """

    max_connections: int = attrs.field(default=1024, validator=_at_least(1))
    max_keepalive_connections: int = attrs.field(default=256, validator=_at_least(0))
    keepalive_expiry: float = attrs.field(default=4.0, validator=_at_least(0))
    admin_max_connections: int = attrs.field(default=4, validator=_at_least(1))


@attrs.frozen(kw_only=True)
class RetryPolicy:
    """Bounded retries, only where a retry cannot make an engine run a request twice.

    A request that never reached the server (connection refused, connect timeout) is always retried. An answered
    status is retried depending on what the request does:

    * requests safe to repeat (reads, teacher scoring, idempotent admin calls) on every ``retry_statuses``;
    * generation (and any other request that must not run twice) only on ``refused_statuses``, answers that
      say the request was not taken. A 502 or 504 comes from a gateway whose upstream may already have run the
      request: it is raised, unless ``resend_generation`` opts in to retrying it (duplicates possible).

    A retried answer carrying ``Retry-After`` (seconds or an HTTP date) waits what the server asked, at most
    ``max_backoff``; otherwise the wait is the exponential backoff, shortened by a random fraction of at most
    ``jitter`` so clients refused together do not come back together.

    :param attempts: total attempts, at least 1 (1 disables retries).
    :param backoff: seconds before the first retry; doubles each time.
    :param max_backoff: cap on one wait (``Retry-After`` included).
    :param retry_statuses: statuses retried for requests that are safe to repeat.
    :param refused_statuses: statuses that mean "not taken, try again": retried for every request.
    :param resend_generation: also retry generation on ``retry_statuses`` (it may then run twice on an engine).
    :param jitter: largest fraction of a backoff wait removed at random (0 waits exactly the backoff).
    :param resend_idempotent: also re-send requests that are safe to repeat after the connection failed once
        they were sent, or their answer timed out (the server may have run them; harmless only for those).
    """

    attempts: int = attrs.field(default=3, validator=_at_least(1))
    backoff: float = attrs.field(default=0.2, validator=_at_least(0))
    max_backoff: float = attrs.field(default=5.0, validator=_at_least(0))
    retry_statuses: tuple[int, ...] = attrs.field(default=(429, 502, 503, 504), converter=tuple)
    refused_statuses: tuple[int, ...] = attrs.field(default=(429, 503), converter=tuple)
    resend_generation: bool = False
    jitter: float = attrs.field(default=0.5, validator=_fraction)
    resend_idempotent: bool = False

    def statuses(self, *, idempotent: bool) -> tuple[int, ...]:
        """The answered statuses a request is retried on."""
        return self.retry_statuses if idempotent or self.resend_generation else self.refused_statuses

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        """Seconds to wait before retry number ``attempt`` (1-based).

        :param retry_after: the seconds the server asked for (``Retry-After``), if any: waited as asked, at most
            ``max_backoff``.
        """
        if retry_after is not None:
            return float(min(self.max_backoff, max(0.0, retry_after)))
        wait = min(self.max_backoff, self.backoff * 2 ** (attempt - 1))
        return float(wait * (1.0 - self.jitter * random.random()))


def _check_discovery(_inst: Any, _attr: Any, value: Any) -> None:
    try:
        _discovery(value)
    except ConfigError as exc:
        raise _FieldError("discovery", str(exc.messages[0])) from None


@attrs.frozen(kw_only=True)
class FleetPolicy:
    """How requests spread over servers (see :mod:`backends_core.balancer`).

    :param sticky_slack: a session stays on its server while that server carries at most this many more
        in-flight requests than the least-loaded one.
    :param cooldown: seconds a server that refused a connection stays out before it is probed again.
    :param session_header: header carrying the session key for external routers (empty: not sent).
    :param salt_with_weight_version: give requests without a ``cache_salt`` one derived from the weight
        version this client last set, so prefix-cache hits never cross a weight update.
    :param discovery: where the fleet's members come from while the client runs (``client.fleet``):
        ``"file:PATH"`` (one URL per line; blank lines and ``#`` comments skipped), ``"dns:HOST:PORT"`` (one
        ``http://IP:PORT`` server per A record of HOST), or a callable returning the URLs (it may be async).
        Servers it lists join (caught up first), servers it no longer lists leave (drained); ``None``: only
        ``base_url`` and ``client.fleet.add`` / ``remove``.
    :param refresh_interval: seconds between two refreshes of the membership (discovery, and catching up
        servers whose catch-up failed); ``None``: only on ``client.fleet.refresh()``.
    """

    sticky_slack: int = attrs.field(default=8, validator=_at_least(0))
    cooldown: float = attrs.field(default=5.0, validator=_at_least(0))
    session_header: str = "X-Session-ID"
    salt_with_weight_version: bool = True
    discovery: str | Callable[[], Any] | None = attrs.field(default=None, validator=_check_discovery)
    refresh_interval: float | None = attrs.field(default=30.0, validator=_positive_or_none("refresh_interval"))


def _urls(value: str | Sequence[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else list(value)
    out = []
    for url in items:
        if not isinstance(url, str):
            raise ConfigError(f"a server URL must be a string, got {url!r}")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"{url!r} is not an http(s) URL with a host")
        out.append(url.rstrip("/"))
    return tuple(out)


_FRONT_KIND = re.compile(r"^[a-z][a-z0-9_-]*$")


@attrs.frozen(kw_only=True)
class FrontConfig:
    """A router in front of the replicas (``ClientConfig.front``; see :mod:`backends_core.fronts`).

    With a front, ``base_url`` is the router: every data-plane request goes there with the router's session
    header and the router picks the replica; admin operations never go through it (a router sends an admin call
    to ONE replica) but to every replica directly, as the front lists them before each operation.

    :param kind: what the front is: ``"vllm-router"``, ``"sglang-router"``, ``"dynamo"`` (Dynamo's frontend),
        ``"static"`` (any router; the replicas listed in ``replicas``), or a kind a plugin provides (the
        ``fronts`` hook).
    :param workers_url: where the front lists its replicas, when not at ``base_url`` (Dynamo's frontend serves
        ``/v1/rl/workers`` on its own port, ``DYN_RL_PORT``).
    :param replicas: the replicas' URLs, for kind ``"static"`` only.
    :param evict_unreachable: a replica the router lists but that cannot be reached at all (connection refused or
        timed out: it serves nothing) is deregistered from a router that takes registrations, so the router stops
        sending it requests, and leaves the fleet; ``False``: it is only skipped by admin operations until it
        answers again (then caught up).
    :param session_header: the header carrying a session's key; ``None``: the one the router honours (see the
        kind's documentation; vllm-router honours ``x-session-id`` under ``--policy consistent_hash``,
        sglang-router ``X-SMG-Routing-Key`` under ``--policy manual``, Dynamo's frontend ``x-dynamo-session-id``
        when started with ``--router-session-affinity-ttl-secs``).
    """

    kind: str = attrs.field()
    workers_url: str | None = attrs.field(default=None)
    replicas: tuple[str, ...] = attrs.field(default=(), converter=_urls)
    session_header: str | None = attrs.field(default=None)
    evict_unreachable: bool = True

    @kind.validator
    def _check_kind(self, _attr: Any, value: Any) -> None:
        if not isinstance(value, str) or not _FRONT_KIND.match(value):
            raise ConfigError(
                f"front.kind must name a front (vllm-router, sglang-router, dynamo, static), got {value!r}"
            )

    @workers_url.validator
    def _check_workers_url(self, _attr: Any, value: str | None) -> None:
        if value is not None:
            _urls(value)

    @replicas.validator
    def _check_replicas(self, _attr: Any, value: tuple[str, ...]) -> None:
        if self.kind == "static" and not value:
            raise ConfigError("front kind 'static' needs the replicas' URLs in front.replicas")
        if self.kind != "static" and value:
            raise ConfigError(f"front.replicas is for kind 'static'; a {self.kind} front lists its replicas itself")

    @session_header.validator
    def _check_header(self, _attr: Any, value: str | None) -> None:
        if value is not None and not re.match(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$", value):
            raise ConfigError(f"front.session_header must be an HTTP header name, got {value!r}")

    @property
    def list_url(self) -> str | None:
        """``workers_url`` without a trailing slash."""
        return None if self.workers_url is None else self.workers_url.rstrip("/")


_DNS = re.compile(r"^dns:(?P<host>[A-Za-z0-9.-]+):(?P<port>[0-9]{1,5})$")


def _discovery(value: Any) -> str | Callable[[], Any] | None:
    """``value`` if it names a discovery source (see :class:`FleetPolicy`), else :class:`ConfigError`."""
    if value is None:
        return None
    if callable(value):
        source: Callable[[], Any] = value
        return source
    if isinstance(value, str):
        if value.startswith("file:") and value[5:].strip():
            return value
        dns = _DNS.match(value)
        if dns and 0 < int(dns["port"]) < 65536:
            return value
    raise ConfigError(
        f"discovery must be 'file:PATH', 'dns:HOST:PORT' or a callable returning server URLs, got {value!r}"
    )


def _deadlines(value: Mapping[str, float]) -> dict[str, float]:
    out = {}
    for op, seconds in dict(value).items():
        if not isinstance(seconds, int | float) or isinstance(seconds, bool) or not seconds > 0:
            raise _FieldError("deadlines", f"deadline of {op!r} must be a positive number of seconds, got {seconds!r}")
        out[op] = float(seconds)
    return out


@attrs.frozen(kw_only=True)
class AdminPolicy:
    """Deadlines and retries of admin operations.

    :param deadlines: seconds per operation name (``"update_weights"``, ``"pause"``...) for the whole
        operation on one server, retries included; operations not listed use ``timeouts.admin``. A
        72-minute weight apply is expressible: ``{"update_weights": 7200}``.
    :param retries: extra attempts of each admin request: for the requests of idempotent operations (health,
        ready, state, pause, resume, flush_cache, wake) after a transport failure or a 5xx, for every admin
        request after a refused connection or a refused status (``RetryPolicy.refused_statuses``).
    :param backoff: seconds before the first retry; doubles each time (``RetryPolicy.max_backoff`` and
        ``jitter`` apply, and ``Retry-After`` is honoured).
    """

    deadlines: Mapping[str, float] = attrs.field(factory=dict, converter=_deadlines)
    retries: int = attrs.field(default=2, validator=_at_least(0))
    backoff: float = attrs.field(default=0.5, validator=_at_least(0))

    def retry_policy(self, data: RetryPolicy) -> RetryPolicy:
        """The retry policy of the admin plane: ``data``'s, with this policy's attempts and backoff, every 5xx
        retried for requests safe to repeat, and those also re-sent after a failed connection or a timeout."""
        return attrs.evolve(
            data,
            attempts=1 + self.retries,
            backoff=self.backoff,
            retry_statuses=tuple(sorted({*data.retry_statuses, *range(500, 600)})),
            resend_idempotent=True,
        )


@attrs.frozen(kw_only=True)
class StatelessPolicy:
    """How ``generate(messages=..., session=...)`` reuses earlier turns.

    :param enabled: reuse exact ids of earlier turns of the same session.
    :param on_break: ``"raise"`` a :class:`BridgeError` when no reuse can be proven (default), or
        ``"rerender"`` the whole list, counted and logged.
    :param max_sessions: sessions remembered (least recently used forgotten).
    :param max_turns: turns remembered per session (oldest forgotten).
    """

    enabled: bool = True
    on_break: Literal["raise", "rerender"] = attrs.field(default="raise", validator=_one_of("raise", "rerender"))
    max_sessions: int = attrs.field(default=4096, validator=_at_least(1))
    max_turns: int = attrs.field(default=64, validator=_at_least(1))


def _parser_name(_inst: Any, attr: Any, value: Any) -> None:
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise _FieldError(attr.name, f"{attr.name} must be 'auto', 'none' or a parser name (vLLM's), got {value!r}")


def _check_backend(_inst: Any, _attr: Any, value: str) -> None:
    if not _BACKEND_NAME.match(value):
        raise _FieldError("backend", f"backend must match [a-z][a-z0-9_]* (an entry-point name), got {value!r}")


@attrs.frozen(kw_only=True)
class ClientConfig:
    """Everything a :class:`~backends_core.Client` needs.

    :param backend: installed backend name (its entry-point name), e.g. ``"vllm"``.
    :param base_url: one server URL or a list (a fleet); requests spread over them.
    :param admin_base_url: admin URL per server when admin routes live elsewhere; same length as ``base_url``.
    :param model: served model name sent with each request.
    :param tokenizer: local path (or cached name) of the tokenizer with the chat template; loaded offline.
        Needed only to render messages; ``None`` falls back to ``model``.
    :param api_key_var: name of the environment variable holding the bearer token (never the key itself;
        the key is never logged or shown in ``repr``).
    :param headers: extra headers on every request to the configured servers (``base_url`` and
        ``admin_base_url``); never sent to other hosts (e.g. Dynamo workers' system ports).
    :param admin_api_key_var: name of the environment variable holding the bearer token for admin calls; sent
        on every admin call, including hosts the backend reaches for admin routes (Dynamo workers), where it is
        the only token sent. On the configured servers it replaces ``api_key_var``'s token for admin calls.
    :param admin_headers: extra headers on every admin call, including those hosts.
    :param timeouts: see :class:`Timeouts`; a number sets ``read``.
    :param limits: see :class:`Limits`.
    :param retry: see :class:`RetryPolicy`.
    :param fleet: see :class:`FleetPolicy`.
    :param admin: see :class:`AdminPolicy`.
    :param stateless: see :class:`StatelessPolicy`.
    :param backend_options: backend-specific options, validated by the backend when the client opens.
    :param verify: TLS certificate verification: ``True`` (default; system CAs), a CA bundle path, or
        ``False`` to disable it (never the default).
    :param tool_parser: how ``Client.parse_completion`` finds tool calls: ``"auto"`` (default) the installed
        parser whose convention the chat template writes (``hermes`` for Qwen-style ``<tool_call>`` templates;
        a template with no known convention keeps tool-call text in the content, logged once), a parser name
        (vLLM's, ``"hermes"``), checked against the installed parsers (the ``tool_parsers`` hook) when the client
        is built, or ``"none"`` to keep tool-call markup in the content.
    :param reasoning_parser: how ``Client.parse_completion`` finds reasoning, likewise: ``"auto"`` (default;
        ``qwen3`` for ``<think>`` templates), a name (``"qwen3"``) or ``"none"``.
    :param front: a router in front of the replicas (see :class:`FrontConfig`): ``base_url`` is then the router's
        one URL, and admin operations go to every replica it lists.
    """

    backend: str = attrs.field(validator=_check_backend)
    base_url: tuple[str, ...] = attrs.field(converter=_urls)
    admin_base_url: tuple[str, ...] = attrs.field(default=(), converter=_urls)
    model: str | None = None
    tokenizer: str | None = None
    api_key_var: str | None = attrs.field(default=None)
    headers: Mapping[str, str] = attrs.field(factory=dict, converter=dict)
    admin_api_key_var: str | None = attrs.field(default=None)
    admin_headers: Mapping[str, str] = attrs.field(factory=dict, converter=dict)
    timeouts: Timeouts = attrs.field(factory=Timeouts, validator=_instance(Timeouts))
    limits: Limits = attrs.field(factory=Limits, validator=_instance(Limits))
    retry: RetryPolicy = attrs.field(factory=RetryPolicy, validator=_instance(RetryPolicy))
    fleet: FleetPolicy = attrs.field(factory=FleetPolicy, validator=_instance(FleetPolicy))
    admin: AdminPolicy = attrs.field(factory=AdminPolicy, validator=_instance(AdminPolicy))
    stateless: StatelessPolicy = attrs.field(factory=StatelessPolicy, validator=_instance(StatelessPolicy))
    backend_options: Mapping[str, Any] = attrs.field(factory=dict, converter=dict)
    verify: bool | str = True
    tool_parser: str | None = attrs.field(default="auto", validator=_parser_name)
    reasoning_parser: str | None = attrs.field(default="auto", validator=_parser_name)
    front: FrontConfig | None = attrs.field(default=None)

    @base_url.validator
    def _check_base_url(self, _attr: Any, value: tuple[str, ...]) -> None:
        if not value:
            raise _FieldError("base_url", "base_url needs at least one server URL")

    @front.validator
    def _check_front(self, _attr: Any, value: FrontConfig | None) -> None:
        if value is None:
            return
        if not isinstance(value, FrontConfig):
            raise ConfigError(f"front must be a FrontConfig, got {type(value).__name__}")
        if len(self.base_url) != 1:
            raise ConfigError(
                f"with a front, base_url is the router's one URL, got {len(self.base_url)}: the replicas behind it "
                "are listed by the router"
            )
        if self.admin_base_url:
            raise ConfigError(
                "admin_base_url does not apply behind a front: admin operations go to every replica the front lists"
            )
        if self.fleet.discovery is not None:
            raise ConfigError(
                "fleet.discovery does not apply behind a front: the front lists the replicas (front.kind 'static' "
                "lists them in the config)"
            )

    @admin_base_url.validator
    def _check_admin(self, _attr: Any, value: tuple[str, ...]) -> None:
        if value and len(value) != len(self.base_url):
            raise _FieldError(
                "admin_base_url",
                f"admin_base_url has {len(value)} URL(s) but base_url has {len(self.base_url)}: give one per server",
            )

    @api_key_var.validator
    @admin_api_key_var.validator
    def _check_key_var(self, attr: Any, value: str | None) -> None:
        if value is not None and not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", value):
            raise _FieldError(
                attr.name, f"{attr.name} must be an environment variable NAME, got something else ({len(value)} chars)"
            )

    @property
    def servers(self) -> tuple[tuple[str, str], ...]:
        """``(base_url, admin_base_url)`` per server."""
        return tuple(zip(self.base_url, self.admin_base_url or self.base_url, strict=True))

    def api_key(self) -> str | None:
        """The API key read from ``api_key_var``; raises :class:`ConfigError` when the variable is unset."""
        return _key(self.api_key_var, "api_key_var")

    def admin_api_key(self) -> str | None:
        """The admin API key read from ``admin_api_key_var``; :class:`ConfigError` when the variable is unset."""
        return _key(self.admin_api_key_var, "admin_api_key_var")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, source: str | None = None) -> ClientConfig:
        """Build a config from plain data (parsed TOML/JSON); unknown keys are errors."""
        if not isinstance(data, Mapping):
            raise ConfigError([f"expected a table/object at $, got {type(data).__name__}"], source=source)
        try:
            return _converter.structure(dict(data), cls)
        except Exception as exc:  # cattrs raises exception groups; attrs validators raise ValueError/TypeError
            raise ConfigError(_messages(exc), source=source) from exc

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], *, section: str | None = None) -> ClientConfig:
        """Load from a ``.toml`` or ``.json`` file; ``section`` picks a sub-table (e.g. ``"client"``).

        A file whose client config sits in a table while no ``section`` is given gets the hint to pass it
        (``the file has a [client] table: pass --section client``)."""
        data = _read_file(Path(path), section)
        try:
            return cls.from_mapping(data, source=str(path))
        except ConfigError as exc:
            raise ConfigError(_section_hint(exc.messages, data, section), source=str(path)) from exc

    @classmethod
    def load(
        cls,
        file: str | os.PathLike[str] | None = None,
        *,
        section: str | None = None,
        environ: Mapping[str, str] | None = None,
        flags: Mapping[str, Any] | None = None,
    ) -> ClientConfig:
        """Build a config from three layers, each replacing the top-level fields it sets in the ones before:

        1. a config file (:meth:`from_file`): ``file``, else ``$BACKENDS_CONFIG``; its table ``section``, else
           ``$BACKENDS_SECTION`` (a section without a file is an error);
        2. the environment (:data:`ENVIRONMENT`): ``BACKENDS_URL`` (one URL, or several separated by commas or
           whitespace), ``BACKENDS_BACKEND``, ``BACKENDS_MODEL``, ``BACKENDS_TOKENIZER``;
        3. ``flags``: field name → value, e.g. the ``backends`` CLI's ``--url`` as ``{"base_url": [...]}``;
           ``None`` values are not set.

        An empty (or blank) variable counts as unset. The whole config is validated once, after merging, so a
        file may leave ``base_url`` to ``$BACKENDS_URL``. Every error names where its value came from: the
        variable (``BACKENDS_URL: 'x' is not an http(s) URL with a host @ $.base_url``), the flag (``--url: ...``)
        or the file.

        :param file: config file (``.toml`` or ``.json``); ``None``: ``$BACKENDS_CONFIG``, if set.
        :param section: table of the file holding the client config; ``None``: ``$BACKENDS_SECTION``, if set.
        :param environ: the environment to read (default ``os.environ``).
        :param flags: the top layer, by field name.
        :raises ConfigError: a value (or the file) is invalid, or ``backend`` / ``base_url`` is set nowhere.
        """
        env = os.environ if environ is None else environ
        origin: dict[str, str] = {}  # top-level field -> the variable or flag that set it
        path: str | os.PathLike[str] | None = file if file is not None else _variable(env, "BACKENDS_CONFIG")
        if section is None and (section := _variable(env, "BACKENDS_SECTION")) is not None and path is None:
            raise ConfigError([f"BACKENDS_SECTION: names table [{section}], but no config file is given"])
        if section is not None and path is None:
            raise ConfigError([f"section={section!r} names a table, but no config file is given"])
        data: dict[str, Any] = {}
        if path is not None:
            try:
                raw = _read_file(Path(path), section)
            except ConfigError as exc:
                if file is not None:
                    raise
                raise ConfigError([f"BACKENDS_CONFIG: {m}" for m in exc.messages], source=exc.source) from exc
            if not isinstance(raw, Mapping):
                raise ConfigError([f"expected a table/object at $, got {type(raw).__name__}"], source=str(path))
            data.update(raw)
        for variable, field in ENVIRONMENT.items():
            value = _variable(env, variable)
            if value is not None:
                data[field] = [u for u in re.split(r"[,\s]+", value) if u] if field == "base_url" else value.strip()
                origin[field] = variable
        for field, value in (flags or {}).items():
            if value is not None:
                data[field] = value
                origin[field] = _FLAG_NAMES.get(field, "--" + field.replace("_", "-"))
        try:
            return cls.from_mapping(data)
        except ConfigError as exc:
            messages = _section_hint(exc.messages, data, section) if path is not None else exc.messages
            raise _located(messages, origin, None if path is None else str(path)) from exc

    def to_mapping(self) -> dict[str, Any]:
        """Plain data that :meth:`from_mapping` reads back to an equal config."""
        out: dict[str, Any] = _converter.unstructure(self)
        return out


def _read_file(path: Path, section: str | None) -> Any:
    """The parsed contents of a ``.toml`` or ``.json`` config file, or of its table ``section``."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError([f"cannot read config file: {exc}"], source=str(path)) from exc
    try:
        if path.suffix == ".toml":
            data: Any = tomllib.loads(raw.decode())
        elif path.suffix == ".json":
            data = json.loads(raw)
        else:
            raise ConfigError([f"config files must end in .toml or .json, got {path.suffix!r}"], source=str(path))
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError([f"cannot parse: {exc}"], source=str(path)) from exc
    if section is None:
        return data
    if not isinstance(data, dict) or section not in data:
        tables = _tables(data, among=None)
        has = f"the file's tables: {', '.join(f'[{t}]' for t in tables)}" if tables else "the file has no table"
        raise ConfigError([f"no [{section}] table ({has})"], source=str(path))
    return data[section]


def _tables(data: Any, *, among: frozenset[str] | None) -> list[str]:
    """The keys of ``data`` holding tables, except the names in ``among`` (the client config's own fields)."""
    if not isinstance(data, Mapping):
        return []
    return [k for k, v in data.items() if isinstance(v, Mapping) and (among is None or k not in among)]


def _section_hint(messages: Sequence[str], data: Any, section: str | None) -> list[str]:
    """``messages`` with the hint to pass ``--section`` on the unknown-field error of a file read without one
    whose client config sits in a table."""
    tables = [] if section is not None else _tables(data, among=_CLIENT_FIELDS)
    if not tables:
        return list(messages)
    clients = [t for t in tables if {"backend", "base_url"} & set(data[t])]
    if len(clients) == 1 or len(tables) == 1:
        table = clients[0] if len(clients) == 1 else tables[0]
        hint = f"the file has a [{table}] table: pass --section {table}"
    elif clients:
        choices = " or ".join(f"--section {t}" for t in clients)
        hint = f"the file has client tables {', '.join(f'[{t}]' for t in clients)}: pass {choices}"
    else:
        hint = f"the file has tables {', '.join(f'[{t}]' for t in tables)}: pass --section with the client's table"
    out = []
    for message in messages:
        head, at, path = message.rpartition(" @ ")
        out.append(f"{head}; {hint}{at}{path}" if path == "$" and head.startswith("unknown field") else message)
    return out


def _variable(env: Mapping[str, str], name: str) -> str | None:
    """The value of variable ``name``; ``None`` when it is unset or blank."""
    value = env.get(name)
    return value if value is not None and value.strip() else None


#: Where to set each required field, for :func:`_located`'s error when it is set nowhere.
_REQUIRED = {
    "backend": "give --backend (or $BACKENDS_BACKEND), or set backend in the config file",
    "base_url": "give --url (or $BACKENDS_URL), or set base_url in the config file",
}


def _located(messages: Sequence[str], origin: Mapping[str, str], file: str | None) -> ConfigError:
    """The error of a merged config: each message led by the variable or flag that set the field it names (a
    message about a file's field names the file)."""
    missing = [m for m in messages if m.startswith("required field missing")]
    if {m.rpartition(" @ ")[2] for m in missing} == {"$.backend", "$.base_url"}:
        both = "give --backend and --url (or $BACKENDS_BACKEND and $BACKENDS_URL), or a config file that sets them"
        messages = [f"no backend and no base_url: {both} @ $", *(m for m in messages if m not in missing)]
    located, from_file = [], []
    for message in messages:
        path = message.rpartition(" @ ")[2]
        field = re.split(r"[.\[]", path.removeprefix("$."), maxsplit=1)[0] if path.startswith("$.") else ""
        if message.startswith("required field missing") and field in _REQUIRED:
            located.append(f"no {field}: {_REQUIRED[field]} @ {path}")
        elif field in origin:
            located.append(f"{origin[field]}: {message}")
        else:
            from_file.append(len(located))
            located.append(message)
    if file is None or len(from_file) == len(located):
        return ConfigError(located, source=file)
    for i in from_file:  # mixed origins: the file's messages name it
        located[i] = f"{file}: {located[i]}"
    return ConfigError(located)


def _key(var: str | None, field: str) -> str | None:
    if var is None:
        return None
    key = os.environ.get(var)
    if not key:
        raise ConfigError([f"environment variable {var} ({field}) is not set or empty"])
    return key


#: Separates a validator's message from its field's name in :func:`_format_exception`'s output, until
#: :func:`_messages` moves the field into the path.
_FIELD = "\x1f"


def _messages(exc: BaseException) -> list[str]:
    if isinstance(exc, cattrs.BaseValidationError):
        lines = cattrs.transform_error(exc, path="$", format_exception=_format_exception)
    else:
        lines = [f"{_format_exception(exc, None)} @ $"]
    out = []
    for line in lines:
        message, _, rest = line.partition(_FIELD)
        if rest:  # "message<FIELD>name @ $.path" -> "message @ $.path.name"
            name, _, path = rest.partition(" @ ")
            line = f"{message} @ {path}.{name}"
        out.append(line)
    return out


def _format_exception(exc: BaseException, type_: Any) -> str:
    if isinstance(exc, _FieldError):
        return "; ".join(exc.messages) + _FIELD + exc.field
    if isinstance(exc, ConfigError):
        return "; ".join(exc.messages)
    return format_error(exc, type_)


def _structure_urls(value: Any, _type: Any) -> tuple[str, ...]:
    if value is None or not isinstance(value, str | list | tuple):
        raise ConfigError(f"expected a URL string or a list of URL strings, got {value!r}")
    return _urls(value)


def _structure_str_map(value: Any, _type: Any) -> dict[str, str]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ConfigError(f"expected a table of string -> string, got {value!r}")
    return dict(value)


def _structure_any_map(value: Any, _type: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"expected a table, got {type(value).__name__}")
    return dict(value)


def _structure_verify(value: Any, _type: Any) -> bool | str:
    if not isinstance(value, bool | str):
        raise ConfigError(f"expected true, false or a CA bundle path, got {value!r}")
    return value


def _structure_discovery(value: Any, _type: Any) -> str | None:
    if not isinstance(value, str):  # a file holds a source's name; callables are given in code
        raise ConfigError(f"discovery must be 'file:PATH' or 'dns:HOST:PORT', got {value!r}")
    return _discovery(value)  # type: ignore[return-value]  # a string stays a string


def _structure_interval(value: Any, _type: Any) -> float | None:
    if value is not None and not (
        isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    ):
        raise ConfigError(f"refresh_interval must be a positive number of seconds or null, got {value!r}")
    return None if value is None else float(value)


def _make_converter() -> cattrs.Converter:
    conv = make_converter(forbid_extra_keys=True)

    def timeouts_hook(value: Any, type_: Any) -> Timeouts:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return Timeouts(read=float(value))
        return timeouts_fn(value, type_)

    timeouts_fn = make_dict_structure_fn(Timeouts, conv, _cattrs_forbid_extra_keys=True)
    conv.register_structure_hook(Timeouts, timeouts_hook)
    conv.register_structure_hook(
        FleetPolicy,
        make_dict_structure_fn(
            FleetPolicy,
            conv,
            _cattrs_forbid_extra_keys=True,
            discovery=override(struct_hook=_structure_discovery),
            refresh_interval=override(struct_hook=_structure_interval),
        ),
    )
    conv.register_structure_hook(
        ClientConfig,
        make_dict_structure_fn(
            ClientConfig,
            conv,
            _cattrs_forbid_extra_keys=True,
            base_url=override(struct_hook=_structure_urls),
            admin_base_url=override(struct_hook=_structure_urls),
            headers=override(struct_hook=_structure_str_map),
            admin_headers=override(struct_hook=_structure_str_map),
            backend_options=override(struct_hook=_structure_any_map),
            verify=override(struct_hook=_structure_verify),
        ),
    )
    return conv


_converter = _make_converter()
_CLIENT_FIELDS = frozenset(field.name for field in attrs.fields(ClientConfig))
