"""Where the shape of SGLang's routed experts comes from, and their decoding.

SGLang sends ``meta_info.routed_experts`` as base64 of raw little-endian int32 of shape
``[prompt + completion - 1 - routed_experts_start_len, num_hidden_layers, num_experts_per_tok]``: raw bytes
carry no shape, so the number of layers and experts per token must be known beforehand. SGLang 0.5.23 exposes
neither on ``/model_info`` nor on ``/server_info`` (see the captures), so they come from, in this order:

1. ``backend_options.routed_experts_layers`` and ``routed_experts_top_k`` (both, or neither);
2. the model's ``config.json`` (``num_hidden_layers``, ``num_experts_per_tok``; also under ``text_config``) in
   the local tokenizer directory (``ClientConfig.tokenizer``, else ``ClientConfig.model`` when it is a directory),
   which for a HF checkpoint is the model directory the server loaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from backends_core.errors import ResponseParseError
from backends_core.routed_experts import align_routed_experts, decode_routed_experts
from backends_core.types import RoutedExperts

__all__ = ["RoutingGeometry", "decode", "geometry_from_model_dir"]


@attrs.frozen(kw_only=True)
class RoutingGeometry:
    """Layers and experts per token of a MoE model, and where they were read (for error messages)."""

    num_layers: int
    top_k: int
    source: str


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def geometry_from_model_dir(directory: str | None) -> RoutingGeometry | None:
    """Read ``num_hidden_layers`` and ``num_experts_per_tok`` from ``<directory>/config.json``.

    :returns: ``None`` when the directory, the file or either field is missing or unreadable (dense models
        have no ``num_experts_per_tok``): routed experts then need the backend options.
    """
    if not directory:
        return None
    path = Path(directory) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    for section in (config, config.get("text_config")):
        if isinstance(section, dict):
            layers = _positive_int(section.get("num_hidden_layers"))
            top_k = _positive_int(section.get("num_experts_per_tok"))
            if layers is not None and top_k is not None:
                return RoutingGeometry(num_layers=layers, top_k=top_k, source=str(path))
    return None


def decode(
    payload: Any,
    geometry: RoutingGeometry | None,
    *,
    total_tokens: int,
    server_start: int,
    wanted_start: int,
    field: str,
    url: str | None,
) -> RoutedExperts:
    """Decode one ``routed_experts`` payload and trim it to ``wanted_start``.

    :param payload: the base64 string of the response.
    :param geometry: layers and top-k of the served model; ``None`` is an error naming how to provide them.
    :param total_tokens: prompt + completion length of the sample.
    :param server_start: the ``routed_experts_start_len`` that was sent.
    :param wanted_start: the absolute position the caller wants row 0 to be.
    :param field: JSON path of the payload, for error messages.
    :param url: the server, for error messages.
    :raises ResponseParseError: unknown geometry, bad base64, element count not ``rows × layers × top_k``,
        negative expert ids, rows not matching the sequence.
    """
    if geometry is None:
        raise ResponseParseError(
            f"{field}: SGLang sends raw int32 routing without its shape, and the number of layers and experts per "
            "token is unknown: point ClientConfig.tokenizer at the model directory (its config.json has "
            "num_hidden_layers and num_experts_per_tok) or set backend_options.routed_experts_layers and "
            "backend_options.routed_experts_top_k",
            url=url,
        )
    try:
        experts = decode_routed_experts(
            payload, num_layers=geometry.num_layers, top_k=geometry.top_k, dtype="int32", field=field
        )
        return align_routed_experts(
            experts, total_tokens=total_tokens, server_start=server_start, wanted_start=wanted_start, field=field
        )
    except ResponseParseError as exc:
        raise ResponseParseError(
            f"{exc.detail} (layers {geometry.num_layers} and top_k {geometry.top_k} from {geometry.source})", url=url
        ) from exc
