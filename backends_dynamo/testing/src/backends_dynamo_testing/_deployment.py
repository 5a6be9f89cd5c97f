"""What the emulated frontend and its worker share: the engine, the served names, and the worker's state."""

from __future__ import annotations

import time
import zlib
from typing import Any

import attrs

from backends_dynamo_testing._schema import HttpError
from backends_dynamo_testing._text import Text
from backends_testkit.engine import ReferenceEngine

__all__ = ["Deployment"]


@attrs.define(eq=False)
class Deployment:
    """One worker (``dynamo.vllm`` over the engine) behind one frontend.

    :ivar loras: loaded adapters: name -> (source URI, lora id).
    :ivar declared_version: the weight version set through the admin routes (``None`` until one is).
    :ivar wake_lag: seconds after ``control/wake_up`` during which the frontend already says the model is ready
        and lists the worker, but answers a routed request 503 (its request plane still holds the worker as
        removed from discovery, as Dynamo 1.6.1's does until a separate discovery consumer sees it back).
    :ivar unroutable_until: the ``time.monotonic()`` at which that lag ends.
    """

    engine: ReferenceEngine
    text: Text
    model_name: str
    worker_id: int
    routed_experts: bool
    enable_rl: bool
    enable_lora: bool
    lora_hot_swap: bool
    loras: dict[str, tuple[str, int]] = attrs.field(factory=dict)
    #: Engine request ids in flight (the bare request UUID; ``<uuid>-<i>`` for the samples of ``n > 1``).
    requests: set[str] = attrs.field(factory=set)
    sleeping: bool = False
    declared_version: str | None = None
    wake_lag: float = 0.0
    unroutable_until: float = 0.0
    started: float = attrs.field(factory=time.monotonic)

    def served_names(self) -> list[str]:
        """What ``/v1/models`` lists: nothing while asleep (the worker leaves discovery)."""
        return [] if self.sleeping else [self.model_name, *self.loras]

    def resolve(self, name: Any) -> str | None:
        """The adapter a model name selects (``None`` for the base model).

        :raises HttpError: 404 for an unknown name, 503 while the worker sleeps.
        """
        if name != self.model_name and name not in self.loras:
            raise HttpError(404, "Model not found")
        if self.sleeping:
            raise HttpError(
                503,
                f"Model `{name}` is not ready to serve requests yet. The deployment may still be starting up or is "
                "not fully provisioned. Please retry shortly.",
            )
        return None if name == self.model_name else str(name)

    def check_routable(self) -> None:
        """:raises HttpError: 503 while the woken worker is not routable yet (:attr:`wake_lag`)."""
        if time.monotonic() < self.unroutable_until:
            raise HttpError(503, "Service temporarily unavailable")

    def in_flight(self) -> int:
        state = self.engine.state()
        return state.in_flight + state.queued

    @staticmethod
    def lora_id(name: str) -> int:
        """A stable id per adapter name (Dynamo derives one from the name)."""
        return zlib.crc32(name.encode()) & 0x7FFFFFFF
