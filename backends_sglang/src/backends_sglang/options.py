"""``backend_options`` of the SGLang backend: what each option means, and their validation."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from backends_core.config import ClientConfig
from backends_core.errors import ConfigError
from backends_core.options import OPTIONS_PATH, require, structure_options
from backends_sglang.experts import RoutingGeometry, geometry_from_model_dir

__all__ = ["SglangOptions", "parse_options"]

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SECONDS = require(lambda v: math.isfinite(v) and v >= 0, "must be a finite number >= 0, got {value!r}")
_COUNT = require(lambda v: v >= 1, "must be >= 1, got {value!r}")


@attrs.frozen(kw_only=True)
class SglangOptions:
    """Options of the ``sglang`` backend.

    :param check_prompt_length: refuse, before sending, a prompt SGLang would cut short: longer than
        ``max_req_input_len`` (SGLang aborts it) or with ``prompt + max_tokens`` above ``max_req_len - 1``
        (SGLang silently lowers ``max_new_tokens``). Both limits are read once per server from ``/server_info``.
    :param admin_api_key_var: name of the environment variable holding SGLang's ``--admin-api-key``. It is sent
        as ``Authorization: Bearer`` on the control routes (pause, continue, flush, abort, weights, LoRA,
        memory); the data and read-only routes keep the client's own ``api_key_var``. The key is read from the
        environment on each call, never stored or logged.
    :param flush_cache_timeout: seconds to keep retrying ``/flush_cache`` while SGLang refuses it because
        requests are running, queued or paused in place; then the refusal is raised.
    :param pause_drain_timeout: ``pause("wait")``: seconds to wait for in-flight requests to finish before
        pausing anyway with SGLang's ``retract`` mode (nothing is lost; the rest finishes after resume).
    :param poll_interval: seconds between two ``/flush_cache`` attempts or two ``/v1/loads`` polls.
    :param routed_experts_layers: layers of the MoE model's routing (default: from the model's ``config.json``,
        see :mod:`backends_sglang.experts`); give it together with ``routed_experts_top_k``.
    :param routed_experts_top_k: experts per token of the MoE model.
    :ivar routing: the routing geometry in use (``None``: unknown, routed experts cannot be decoded).
    """

    check_prompt_length: bool = True
    admin_api_key_var: str | None = attrs.field(
        default=None,
        validator=[
            require(_ENV_NAME.match, "must be an environment variable NAME, not the key itself"),
            require(os.environ.get, "environment variable {value} is not set or empty"),
        ],
    )
    flush_cache_timeout: float = attrs.field(default=60.0, validator=_SECONDS)
    pause_drain_timeout: float = attrs.field(default=600.0, validator=_SECONDS)
    poll_interval: float = attrs.field(
        default=0.05,
        validator=require(lambda v: math.isfinite(v) and v > 0, "must be a finite number > 0, got {value!r}"),
    )
    routed_experts_layers: int | None = attrs.field(default=None, validator=_COUNT)
    routed_experts_top_k: int | None = attrs.field(default=None, validator=_COUNT)
    routing: RoutingGeometry | None = None

    def admin_headers(self) -> dict[str, str]:
        """Headers of a control-route request: the admin key when one is configured.

        :raises ConfigError: the variable named by ``admin_api_key_var`` is unset or empty.
        """
        if self.admin_api_key_var is None:
            return {}
        key = os.environ.get(self.admin_api_key_var)
        if not key:
            raise ConfigError(
                [f"environment variable {self.admin_api_key_var} (backend_options.admin_api_key_var) is not set"]
            )
        return {"authorization": f"Bearer {key}"}


def _local_model_dir(config: ClientConfig) -> str | None:
    for candidate in (config.tokenizer, config.model):
        if candidate and Path(candidate).is_dir():
            return candidate
    return None


def parse_options(options: Mapping[str, Any], config: ClientConfig) -> SglangOptions:
    """``backend_options`` structured into :class:`SglangOptions`, with the routing geometry resolved.

    :raises ConfigError: unknown keys, wrong types, out-of-range numbers, an invalid or unset admin key
        variable, only one of the two routing fields; each named with its path.
    """
    parsed = structure_options(options, SglangOptions, derived=("routing",))
    layers, top_k = parsed.routed_experts_layers, parsed.routed_experts_top_k
    if (layers is None) != (top_k is None):
        raise ConfigError([f"give routed_experts_layers and routed_experts_top_k together @ {OPTIONS_PATH}"])
    if layers is not None and top_k is not None:
        routing: RoutingGeometry | None = RoutingGeometry(num_layers=layers, top_k=top_k, source="backend_options")
    else:
        routing = geometry_from_model_dir(_local_model_dir(config))
    return attrs.evolve(parsed, routing=routing)
