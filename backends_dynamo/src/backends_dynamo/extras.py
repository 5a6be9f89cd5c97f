"""Metadata Dynamo adds to an answer when asked (``nvext.extra_fields``): which worker served it, and timing.

Every result carries them in ``GenerateResult.metadata`` (``"worker_id"``: :class:`WorkerIds`, ``"timing"``:
:class:`Timing`) when they were asked for with ``backend_options.extra_fields``; they can also be read from a raw
answer here. Worker ids are u64 (above 2**53 in practice) and stay exact Python ints.
"""

from __future__ import annotations

from typing import Any

import attrs

from backends_core.converters import make_converter, structure_response
from backends_core.errors import ResponseParseError
from backends_dynamo._json import U64
from backends_dynamo.wire import Exchange

__all__ = ["Timing", "WorkerIds", "timing", "worker_ids"]

_converter = make_converter()


def _u64(_instance: Any, attribute: attrs.Attribute[Any], value: int | None) -> None:
    if value is not None and not 0 <= value < U64:
        raise ValueError(f"{attribute.name} must be a u64, got {value}")


@attrs.frozen(kw_only=True)
class WorkerIds:
    """``nvext.worker_id``: the prefill and decode workers (the same one when serving is aggregated)."""

    prefill_worker_id: int = attrs.field(validator=_u64)
    decode_worker_id: int = attrs.field(validator=_u64)
    prefill_dp_rank: int | None = None
    decode_dp_rank: int | None = None


@attrs.frozen(kw_only=True)
class Timing:
    """``nvext.timing`` (final chunk only); ``kv_hit_rate`` and ``router_queue_depth`` come with the KV router."""

    request_received_ms: float | None = None
    prefill_wait_time_ms: float | None = None
    prefill_time_ms: float | None = None
    ttft_ms: float | None = None
    total_time_ms: float | None = None
    kv_hit_rate: float | None = None
    router_queue_depth: int | None = None


def _nvext_field(raw: Any, key: str, url: str | None) -> Any:
    body = raw.samples[0].body if isinstance(raw, Exchange) and raw.samples else raw
    if not isinstance(body, dict):
        raise ResponseParseError(f"expected an answer object, got {type(body).__name__} @ $", url=url)
    nvext = body.get("nvext")
    return nvext.get(key) if isinstance(nvext, dict) else None


def worker_ids(raw: Any, url: str | None = None) -> WorkerIds | None:
    """``nvext.worker_id`` of an answer (of the first sample of an exchange); ``None`` when not asked for."""
    value = _nvext_field(raw, "worker_id", url)
    return None if value is None else structure_response(_converter, value, WorkerIds, url=url)


def timing(raw: Any, url: str | None = None) -> Timing | None:
    """``nvext.timing`` of an answer (of the first sample of an exchange); ``None`` when not asked for."""
    value = _nvext_field(raw, "timing", url)
    return None if value is None else structure_response(_converter, value, Timing, url=url)
