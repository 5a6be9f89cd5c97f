"""``backend_options`` of the Dynamo backend."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, NewType
from urllib.parse import urlsplit

import attrs

from backends_core.config import ClientConfig
from backends_core.errors import ConfigError
from backends_core.options import OPTIONS_PATH, options_converter, require, structure_options

__all__ = ["METADATA_FIELDS", "TRANSPORTS", "DynamoOptions", "parse_options"]

Transport = Literal["chat", "completions"]
#: ``chat``: ``POST /v1/chat/completions`` with one placeholder message and the prompt ids in
#: ``nvext.token_data``. ``completions``: ``POST /v1/completions`` with a token-id ``prompt``.
TRANSPORTS: tuple[Transport, ...] = ("chat", "completions")
#: ``nvext.extra_fields`` values that only add metadata to the answer (read them with
#: :func:`backends_dynamo.wire.worker_ids` / :func:`backends_dynamo.wire.timing`).
MetadataField = Literal["worker_id", "timing"]
METADATA_FIELDS: tuple[MetadataField, ...] = ("worker_id", "timing")
#: An http(s) URL without query or fragment, trailing ``/`` removed.
HttpUrl = NewType("HttpUrl", str)
#: The key of the list form of ``worker_urls`` (the workers of the only frontend) until ``base_url`` is known.
_ONLY_FRONTEND = ""


def _unique(fields: tuple[MetadataField, ...]) -> tuple[MetadataField, ...]:
    return tuple(dict.fromkeys(fields))


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
    :param structured_output: the workers behind the frontend honour guided decoding (Dynamo's vLLM worker
        turns ``guided_*`` into vLLM structured outputs; the mocker ignores it). Off by default: the frontend
        accepts ``guided_*`` whatever the worker, so the backend cannot tell, and refuses ``structured``
        rather than let it be dropped.
    :param check_prompt_length: refuse, before sending, a generation whose prompt + ``max_tokens`` exceeds the
        model's ``context_window`` in the frontend's ``GET /v1/models`` (read once per frontend and model; a
        window of 0, as the mocker reports, is unknown and checks nothing).
    """

    transport: Transport = "chat"
    worker_urls: Mapping[str, tuple[str, ...]] = attrs.field(
        factory=dict,
        validator=require(lambda v: all(v.values()), "every frontend needs a non-empty list of worker system URLs"),
    )
    fan_out_n: bool = True
    stream: bool = False
    extra_fields: tuple[MetadataField, ...] = attrs.field(default=(), converter=_unique)
    structured_output: bool = False
    check_prompt_length: bool = True

    def workers(self, base_url: str, admin_url: str) -> tuple[str, ...]:
        """System URLs of the workers behind the frontend at ``base_url``."""
        return self.worker_urls.get(base_url) or (admin_url,)


def _http_url(value: Any, _type: Any) -> HttpUrl:
    parts = urlsplit(value) if isinstance(value, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
        raise ValueError(f"expected an http(s) URL, got {value!r}")
    return HttpUrl(value.rstrip("/"))


_converter = options_converter()
_converter.register_structure_hook(HttpUrl, _http_url)


def _worker_urls(value: Any, _type: Any) -> dict[str, tuple[str, ...]]:
    """``{frontend base URL: [worker system URLs]}``, or a list: the workers of the only frontend."""
    if isinstance(value, Mapping):
        workers = _converter.structure(value, dict[HttpUrl, tuple[HttpUrl, ...]])
        return {frontend: urls for frontend, urls in workers.items()}
    return {_ONLY_FRONTEND: _converter.structure(value, tuple[HttpUrl, ...])}


def _frontends(workers: Mapping[str, tuple[str, ...]], config: ClientConfig | None) -> dict[str, tuple[str, ...]]:
    """``worker_urls`` checked against ``base_url``: each key one of its frontends, the list form only with one."""
    where = f"{OPTIONS_PATH}.worker_urls"
    frontends = [u.rstrip("/") for u in config.base_url] if config is not None else []
    if _ONLY_FRONTEND in workers:
        if len(frontends) != 1:
            raise ConfigError(
                [
                    f"a list of worker URLs needs exactly one frontend in base_url (got {len(frontends)}): "
                    f"give a mapping {{frontend base URL: [worker system URLs]}} @ {where}"
                ]
            )
        return {frontends[0]: workers[_ONLY_FRONTEND]}
    if config is not None:
        problems = [f"{key!r} is not one of base_url {frontends} @ {where}" for key in workers if key not in frontends]
        if problems:
            raise ConfigError(problems)
    return dict(workers)


def parse_options(options: Mapping[str, Any], config: ClientConfig | None = None) -> DynamoOptions:
    """``backend_options`` structured into :class:`DynamoOptions`, worker URLs checked against ``base_url``.

    :raises ConfigError: unknown keys, wrong types, unknown transport or metadata field, bad worker URLs; each
        named with its path.
    """
    parsed = structure_options(options, DynamoOptions, hooks={"worker_urls": _worker_urls}, converter=_converter)
    return attrs.evolve(parsed, worker_urls=_frontends(parsed.worker_urls, config))
