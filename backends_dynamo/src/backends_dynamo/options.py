"""``backend_options`` of the Dynamo backend."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal
from urllib.parse import urlsplit

import attrs

from backends_core.config import ClientConfig
from backends_core.errors import ConfigError

__all__ = ["METADATA_FIELDS", "TRANSPORTS", "DynamoOptions", "parse_options"]

Transport = Literal["chat", "completions"]
#: ``chat``: ``POST /v1/chat/completions`` with one placeholder message and the prompt ids in
#: ``nvext.token_data``. ``completions``: ``POST /v1/completions`` with a token-id ``prompt``.
TRANSPORTS: tuple[Transport, ...] = ("chat", "completions")
#: ``nvext.extra_fields`` values that only add metadata to the answer (read them with
#: :func:`backends_dynamo.extras.worker_ids` / :func:`backends_dynamo.extras.timing`).
METADATA_FIELDS = ("worker_id", "timing")


@attrs.frozen(kw_only=True)
class DynamoOptions:
    """Options of the ``dynamo`` backend.

    :param transport: ``"chat"`` (default; the frontend's main route, ``nvext.token_data`` skips its
        tokenizer) or ``"completions"`` (a token-id ``prompt``). Both return the same ids and logprobs.
    :param worker_urls: per frontend base URL, the system URL of every worker behind it (the worker's
        ``DYN_SYSTEM_PORT``, where Dynamo serves ``/engine/<route>``). Admin operations act on every worker of
        a frontend and fail if any fails. A frontend without an entry uses its ``admin_base_url`` (or its own
        URL: right for the in-process emulator, and answered by a real frontend with a 404 that names this
        option).
    :param fan_out_n: send ``n > 1`` as ``n`` requests of one sample each (seeds ``seed``, ``seed + 1``, ...)
        because Dynamo 1.6.1 refuses ``n > 1`` together with completion ids; ``False`` refuses ``n > 1``.
    :param stream: send ``stream: true`` and fold the server-sent events into one answer (same result; the
        engine data comes on the final chunk).
    :param extra_fields: metadata ``nvext.extra_fields`` to request as well (``worker_id``, ``timing``).
    """

    transport: Transport = "chat"
    worker_urls: Mapping[str, tuple[str, ...]] = attrs.field(factory=dict)
    fan_out_n: bool = True
    stream: bool = False
    extra_fields: tuple[str, ...] = ()

    def workers(self, base_url: str, admin_url: str) -> tuple[str, ...]:
        """System URLs of the workers behind the frontend at ``base_url``."""
        return self.worker_urls.get(base_url) or (admin_url,)


_SIMPLE = {"transport": str, "fan_out_n": bool, "stream": bool}
_KNOWN = (*_SIMPLE, "worker_urls", "extra_fields")


def _url(value: Any, where: str, problems: list[str]) -> str | None:
    parts = urlsplit(value) if isinstance(value, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
        problems.append(f"expected an http(s) URL, got {value!r} @ {where}")
        return None
    return str(value).rstrip("/")


def _url_list(value: Any, where: str, problems: list[str]) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence) or not value:
        problems.append(f"expected a non-empty list of worker system URLs, got {value!r} @ {where}")
        return ()
    urls = [_url(v, f"{where}[{i}]", problems) for i, v in enumerate(value)]
    return tuple(u for u in urls if u is not None)


def _workers(value: Any, config: ClientConfig | None, problems: list[str]) -> dict[str, tuple[str, ...]]:
    where = "$.backend_options.worker_urls"
    frontends = [u.rstrip("/") for u in config.base_url] if config is not None else []
    if isinstance(value, Mapping):
        out: dict[str, tuple[str, ...]] = {}
        for key, urls in value.items():
            frontend = _url(key, f"{where} key", problems)
            if frontend is None:
                continue
            if config is not None and frontend not in frontends:
                problems.append(f"{frontend!r} is not one of base_url {frontends} @ {where}")
            out[frontend] = _url_list(urls, f"{where}[{key!r}]", problems)
        return out
    urls = _url_list(value, where, problems)
    if config is None or len(frontends) != 1:
        problems.append(
            f"a list of worker URLs needs exactly one frontend in base_url (got {len(frontends)}): "
            f"give a mapping {{frontend base URL: [worker system URLs]}} @ {where}"
        )
        return {}
    return {frontends[0]: urls}


def parse_options(options: Mapping[str, Any], config: ClientConfig | None = None) -> DynamoOptions:
    """Validate ``backend_options``; every problem is reported with its path.

    :raises ConfigError: unknown keys, wrong types, unknown transport, bad worker URLs.
    """
    problems = [
        f"unknown option @ $.backend_options.{key} (known: {', '.join(_KNOWN)})" for key in options if key not in _KNOWN
    ]
    for key, kind in _SIMPLE.items():
        if key in options and not isinstance(options[key], kind):
            problems.append(f"expected {kind.__name__}, got {options[key]!r} @ $.backend_options.{key}")
    if isinstance(options.get("transport"), str) and options["transport"] not in TRANSPORTS:
        problems.append(
            f"transport must be one of {list(TRANSPORTS)}, got {options['transport']!r} @ $.backend_options.transport"
        )
    extra = options.get("extra_fields", ())
    if isinstance(extra, str) or not isinstance(extra, Sequence) or any(f not in METADATA_FIELDS for f in extra):
        problems.append(
            f"extra_fields must be a list drawn from {list(METADATA_FIELDS)}, got {extra!r} "
            "@ $.backend_options.extra_fields"
        )
    workers = _workers(options["worker_urls"], config, problems) if "worker_urls" in options else {}
    if problems:
        raise ConfigError(problems)
    simple = {key: options[key] for key in _SIMPLE if key in options}
    return DynamoOptions(**simple, worker_urls=workers, extra_fields=tuple(dict.fromkeys(extra)))
