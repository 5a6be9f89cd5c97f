"""``backend_options`` of the vLLM backend."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import attrs

from backends_core.errors import ConfigError

__all__ = ["TRANSPORTS", "VllmOptions", "parse_options"]

Transport = Literal["generate", "completions"]
#: ``generate``: ``POST /inference/v1/generate`` (token ids in and out; needs ``--enable-scale-out``).
#: ``completions``: ``POST /v1/completions`` with a token-id prompt (any vLLM server).
TRANSPORTS: tuple[Transport, ...] = ("generate", "completions")


@attrs.frozen(kw_only=True)
class VllmOptions:
    """Options of the ``vllm`` backend.

    :param transport: ``"generate"`` (default; vLLM's native token-in/token-out route, which also reports
        weight-version spans and takes ``routed_experts_prompt_start``) or ``"completions"`` (``/v1/completions``
        with a token-id prompt, for servers started without ``--enable-scale-out``). A missing route is an
        error that names the fix; the backend never switches by itself.
    :param check_prompt_length: refuse prompts that cannot fit ``max_model_len`` (read once per server and
        model from ``/v1/models``) before sending them.
    """

    transport: Transport = "generate"
    check_prompt_length: bool = True


_FIELDS = {"transport": str, "check_prompt_length": bool}


def parse_options(options: Mapping[str, Any]) -> VllmOptions:
    """Validate ``backend_options``; every problem is reported with its path.

    :raises ConfigError: unknown keys, wrong types, unknown transport.
    """
    problems = [
        f"unknown option @ $.backend_options.{key} (known: {', '.join(_FIELDS)})"
        for key in options
        if key not in _FIELDS
    ]
    for key, kind in _FIELDS.items():
        if key in options and not isinstance(options[key], kind):
            problems.append(f"expected {kind.__name__}, got {options[key]!r} @ $.backend_options.{key}")
    if isinstance(options.get("transport"), str) and options["transport"] not in TRANSPORTS:
        problems.append(
            f"transport must be one of {list(TRANSPORTS)}, got {options['transport']!r} @ $.backend_options.transport"
        )
    if problems:
        raise ConfigError(problems)
    return VllmOptions(**dict(options))
