"""Admin operations over every server of a client, concurrently, with per-server outcomes.

An operation succeeds only if it succeeded on every server; otherwise :class:`~backends_core.errors.AdminError`
carries every server's outcome, successes included, so the caller knows exactly where it stands.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import attrs

from backends_core.errors import AdminError, InvalidRequestError
from backends_core.types import PAUSE_MODES, DistributedGroup, LoraAdapter, PauseMode, ServerState, TensorSpec

if TYPE_CHECKING:
    from backends_core._http import Server
    from backends_core.driver import BackendDriver

__all__ = ["Admin", "ServerOutcome"]

T = TypeVar("T")


@attrs.frozen(kw_only=True)
class ServerOutcome(Generic[T]):
    """What one server answered: ``value`` on success, ``error`` on failure (never both)."""

    server: str
    value: T | None = None
    error: BaseException | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class Admin:
    """``client.admin``: every admin hook, fanned out over the client's servers.

    Each method returns the per-server values (in server order) and raises
    :class:`~backends_core.errors.AdminError` if any server failed, or
    :class:`~backends_core.errors.UnsupportedOperationError` (before sending anything) if the backend lacks
    the operation.
    """

    def __init__(self, driver: BackendDriver, servers: Sequence[Server]) -> None:
        self._driver = driver
        self._servers = list(servers)

    async def run(self, operation: str, **kwargs: Any) -> list[ServerOutcome[Any]]:
        """Run ``admin_<operation>`` on every server concurrently and collect every outcome (never raises
        for a server's failure; see the typed methods for that)."""
        self._driver.require(f"admin_{operation}")

        async def one(server: Server) -> ServerOutcome[Any]:
            try:
                value = await self._driver.admin(operation, server, **kwargs)
            except Exception as exc:
                return ServerOutcome(server=server.base_url, error=exc)
            return ServerOutcome(server=server.base_url, value=value)

        return list(await asyncio.gather(*(one(s) for s in self._servers)))

    async def _all(self, operation: str, **kwargs: Any) -> list[Any]:
        outcomes = await self.run(operation, **kwargs)
        if any(o.error is not None for o in outcomes):
            raise AdminError(f"admin_{operation}", outcomes)
        return [o.value for o in outcomes]

    async def health(self) -> list[bool]:
        return await self._all("health")

    async def ready(self) -> list[bool]:
        return await self._all("ready")

    async def pause(self, mode: PauseMode = "abort", *, clear_cache: bool = False) -> list[bool]:
        if mode not in PAUSE_MODES:
            raise InvalidRequestError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        return await self._all("pause", mode=mode, clear_cache=clear_cache)

    async def resume(self) -> list[bool]:
        return await self._all("resume")

    async def flush_cache(self) -> list[bool]:
        return await self._all("flush_cache")

    async def update_weights(self, path: str, *, version: str | None = None) -> list[bool]:
        return await self._all("update_weights", path=path, version=version)

    async def init_weight_transfer(self, group: DistributedGroup) -> list[bool]:
        return await self._all("init_weight_transfer", group=group)

    async def update_weights_distributed(
        self, group_name: str, tensors: Sequence[TensorSpec], *, version: str | None = None
    ) -> list[bool]:
        return await self._all(
            "update_weights_distributed", group_name=group_name, tensors=list(tensors), version=version
        )

    async def load_lora(self, adapter: LoraAdapter) -> list[bool]:
        return await self._all("load_lora", adapter=adapter)

    async def unload_lora(self, name: str) -> list[bool]:
        return await self._all("unload_lora", name=name)

    async def state(self) -> list[ServerState]:
        return await self._all("state")

    async def sleep(self, level: int = 1) -> list[bool]:
        if level not in (1, 2):
            raise InvalidRequestError(f"sleep level must be 1 or 2, got {level!r}")
        return await self._all("sleep", level=level)

    async def wake(self) -> list[bool]:
        return await self._all("wake")

    async def abort(self, request_ids: Sequence[str] | None = None) -> list[int]:
        return await self._all("abort", request_ids=None if request_ids is None else list(request_ids))
