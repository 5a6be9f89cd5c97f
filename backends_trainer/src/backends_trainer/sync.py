"""``SyncWeightPusher``: :class:`~backends_trainer.pusher.WeightPusher` for synchronous trainers, over a
:class:`~backends_core.SyncClient` (on that client's event loop)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any

import torch

from backends_core import Client, SyncClient
from backends_core.errors import InvalidRequestError
from backends_core.types import DistributedGroup
from backends_trainer.checkpoint import CheckpointDir
from backends_trainer.pusher import PushReport, WeightPusher
from backends_trainer.reference import Reference

__all__ = ["SyncWeightPusher"]


class SyncWeightPusher:
    """The same constructor as :class:`WeightPusher`, with a :class:`~backends_core.SyncClient`; every method
    blocks. Use it as ``with SyncWeightPusher(client, ...) as pusher: pusher.push(model.state_dict(), version=...)``.
    """

    def __init__(
        self,
        client: SyncClient,
        *,
        group: DistributedGroup | None = None,
        checkpoint: CheckpointDir | str | os.PathLike[str] | None = None,
        reference: Reference | None = None,
        **options: Any,
    ) -> None:
        if not isinstance(client, SyncClient):
            raise InvalidRequestError(f"client must be a backends_core.SyncClient, got {type(client).__name__}")
        self.client = client

        async def build(inner: Client) -> WeightPusher:
            return WeightPusher(inner, group=group, checkpoint=checkpoint, reference=reference, **options)

        self._pusher = client.run(build)

    def __enter__(self) -> SyncWeightPusher:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    @property
    def pusher(self) -> WeightPusher:
        """The async pusher behind this one."""
        return self._pusher

    def start(self) -> None:
        """Form the group (see :meth:`WeightPusher.start`)."""

        async def start(_client: Client) -> None:
            await self._pusher.start()

        self.client.run(start)

    def push(
        self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *, version: str
    ) -> PushReport:
        """Put ``named_tensors`` on every server as ``version`` (see :meth:`WeightPusher.push`)."""

        async def push(_client: Client) -> PushReport:
            return await self._pusher.push(named_tensors, version=version)

        return self.client.run(push)

    def close(self) -> None:
        """Leave the group (see :meth:`WeightPusher.close`)."""

        async def close(_client: Client) -> None:
            await self._pusher.close()

        self.client.run(close)
