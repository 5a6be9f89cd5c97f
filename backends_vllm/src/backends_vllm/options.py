"""``backend_options`` of the vLLM backend."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import attrs

from backends_core.options import structure_options

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


def parse_options(options: Mapping[str, Any]) -> VllmOptions:
    """``backend_options`` structured into :class:`VllmOptions`.

    :raises ConfigError: unknown keys, wrong types, unknown transport; each named with its path.
    """
    return structure_options(options, VllmOptions)
