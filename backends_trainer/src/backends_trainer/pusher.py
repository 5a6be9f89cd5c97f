"""``WeightPusher``: the trainer's half of a weight update, on every backend.

A push is one ``client.admin.weight_sync``: every server paused, the new weights in, the version set, caches
flushed, every server resumed (in ``finally``), the versions checked; any failure an
:class:`~backends_core.errors.AdminError` with every server's outcome and the state it left. What the pusher adds
is the trainer's side of the update phase:

* over a **group** (:class:`~backends_core.types.DistributedGroup`): the trainer hosts the rendezvous as rank 0,
  each server joins at its own ranks, and each push broadcasts the tensors in the order and buckets the
  backend's :meth:`~backends_core.fleet.Admin.transfer_plan` gives, while the servers receive;
* through a **checkpoint directory** (:class:`~backends_core.checkpoint.CheckpointDir`): the trainer writes
  safetensors, then every server loads them.

Everything a push is given is checked before anything is sent: names, dtypes and shapes against the model's
(``reference``), one push at a time, a group sized for the fleet.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import attrs
import torch
import torch.distributed as dist

from backends_core import Client
from backends_core.errors import AdminError, InvalidRequestError, TransferError, UnsupportedOperationError
from backends_core.fleet import ServerOutcome, SyncReport
from backends_core.server import Server
from backends_core.types import PAUSE_MODES, DistributedGroup, PauseMode, TensorSpec, TransferPlan
from backends_trainer.checkpoint import CheckpointDir, write_checkpoint
from backends_trainer.group import Staging, broadcast_plan, join_as_trainer, leave
from backends_trainer.reference import Reference, TensorShapes, reference_shapes

__all__ = ["PushReport", "WeightPusher"]

log = logging.getLogger("backends_trainer")

#: How long the rendezvous and every broadcast may wait on the servers before the group gives up.
DEFAULT_GROUP_TIMEOUT_S = 600.0
#: How long a broadcast thread abandoned by its push gets to end before the group counts as blocked: one whose
#: servers received everything (and refused it afterwards) ends within milliseconds; one waiting on a server that
#: never posted its receive waits for the group's timeout.
_ABANDONED_GRACE_S = 5.0


@attrs.frozen(kw_only=True)
class PushReport:
    """What one push did.

    :ivar version: the version every server now serves.
    :ivar sync: the weight sync's report (every phase, every server).
    :ivar tensors: how many tensors went out.
    :ivar bytes: their bytes.
    :ivar buckets: how many buckets (broadcasts of a packed plan; 1 on the checkpoint path).
    :ivar send_s: the trainer's part: the broadcasts, or writing the checkpoint.
    :ivar duration_s: the whole push, checks to resume.
    :ivar path: the checkpoint directory written, on the checkpoint path.
    """

    version: str
    sync: SyncReport
    tensors: int
    bytes: int
    buckets: int
    send_s: float
    duration_s: float
    path: Path | None = None


class WeightPusher:
    """Push a torch model's weights to every server of ``client``.

    Exactly one of ``group`` and ``checkpoint``::

        async with WeightPusher(client, group=DistributedGroup(master_address="10.0.0.5", master_port=29500,
                                                               world_size=1 + n_servers, rank_offset=1,
                                                               backend="nccl", bucket_bytes=256 << 20),
                                reference=model) as pusher:
            await pusher.push(model.state_dict(), version="step-12")

    :param client: the fleet to update.
    :param group: the transfer group: ``world_size`` counts the trainer (rank 0) and every server's ranks;
        ``rank_offset`` is the first server's first rank (the others follow, ``ranks_per_server`` each);
        ``bucket_bytes`` packs the broadcasts (``None``: one per tensor).
    :param checkpoint: a :class:`CheckpointDir`, or a path for one.
    :param reference: the model's tensors: a ``torch.nn.Module``, a state dict, a safetensors checkpoint
        directory or a mapping of name to ``(dtype, shape)``. A push naming a tensor it lacks, or with another
        dtype or shape, is refused before anything is sent. ``None``: nothing to check against.
    :param ranks_per_server: the ranks each server joins with (its tensor-parallel size).
    :param group_timeout_s: how long the rendezvous and each broadcast wait on the servers.
    :param mode: how in-flight requests are paused (``weight_sync``'s ``mode``).
    :param flush_cache: flush the prefix cache while paused.
    """

    def __init__(
        self,
        client: Client,
        *,
        group: DistributedGroup | None = None,
        checkpoint: CheckpointDir | str | os.PathLike[str] | None = None,
        reference: Reference | None = None,
        ranks_per_server: int = 1,
        group_timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
        mode: PauseMode = "wait",
        flush_cache: bool = True,
    ) -> None:
        if not isinstance(client, Client):
            raise InvalidRequestError(f"client must be a backends_core.Client, got {type(client).__name__}")
        if (group is None) == (checkpoint is None):
            raise InvalidRequestError("WeightPusher needs exactly one of group= and checkpoint=")
        if group is not None and not isinstance(group, DistributedGroup):
            raise InvalidRequestError(f"group must be a DistributedGroup, got {type(group).__name__}")
        if isinstance(checkpoint, str | os.PathLike):
            checkpoint = CheckpointDir(path=checkpoint)
        if checkpoint is not None and not isinstance(checkpoint, CheckpointDir):
            raise InvalidRequestError(f"checkpoint must be a CheckpointDir or a path, got {type(checkpoint).__name__}")
        if not isinstance(ranks_per_server, int) or isinstance(ranks_per_server, bool) or ranks_per_server < 1:
            raise InvalidRequestError(f"ranks_per_server must be a positive int, got {ranks_per_server!r}")
        if not isinstance(group_timeout_s, int | float) or group_timeout_s <= 0:
            raise InvalidRequestError(f"group_timeout_s must be a positive number, got {group_timeout_s!r}")
        if mode not in PAUSE_MODES:
            raise InvalidRequestError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        if group is not None:
            _check_group(group)
            _require(client, "admin_init_weight_transfer", "admin_update_weights_distributed")
        else:
            _require(client, "admin_update_weights")
        self.client = client
        self.group = group
        self.checkpoint = checkpoint
        self.reference: TensorShapes | None = None if reference is None else reference_shapes(reference)
        self.ranks_per_server = ranks_per_server
        self.group_timeout_s = float(group_timeout_s)
        self.mode = mode
        self.flush_cache = flush_cache
        self._process_group: dist.ProcessGroup | None = None
        self._joined: list[Server] = []
        self._pushing: str | None = None
        self._stuck: threading.Thread | None = None
        self._plans: dict[tuple[TensorSpec, ...], TransferPlan] = {}
        #: the host buffer gloo pushes pack their buckets into (CUDA's caching allocator already reuses memory)
        self._staging: Staging | None = Staging() if group is not None and group.backend == "gloo" else None

    # -- lifecycle ----------------------------------------------------------------------------------

    async def __aenter__(self) -> WeightPusher:
        await self.start()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        await self.close()

    @property
    def started(self) -> bool:
        """The group is formed (always ``True`` on the checkpoint path)."""
        return self.group is None or self._process_group is not None

    async def start(self) -> None:
        """Form the group: the trainer hosts the rendezvous while every server joins at its ranks. Nothing to do
        on the checkpoint path.

        :raises InvalidRequestError: the group's world size does not fit the fleet (nothing is sent).
        :raises AdminError: a server did not join (every server's outcome; those that joined are told to leave).
        :raises TransferError: the trainer's side did not form (the servers that joined are told to leave).
        """
        if self.group is None or self._process_group is not None:
            return
        group = self.group
        servers = self._serving()
        needed = group.rank_offset + len(servers) * self.ranks_per_server
        if group.world_size != needed:
            raise InvalidRequestError(
                f"group.world_size is {group.world_size} but the fleet needs {needed}: rank_offset "
                f"{group.rank_offset} + {len(servers)} server(s) x {self.ranks_per_server} rank(s) each "
                f"({', '.join(s.base_url for s in servers)})"
            )
        joining = asyncio.ensure_future(asyncio.to_thread(join_as_trainer, group, timeout_s=self.group_timeout_s))
        outcomes = await asyncio.gather(
            *(self._join(server, index) for index, server in enumerate(servers)), return_exceptions=False
        )
        joined = [server for server, outcome in zip(servers, outcomes, strict=True) if outcome.ok]
        if len(joined) < len(servers):
            # the trainer's rendezvous waits for ranks that will not come: it ends with its timeout
            joining.add_done_callback(_discard)
            await self._leave_servers(joined)
            raise AdminError(
                "init_weight_transfer",
                outcomes,
                state="the servers that joined were told to leave; the trainer's rendezvous ends with its timeout",
            )
        try:
            self._process_group = await joining
        except Exception as exc:
            await self._leave_servers(joined)
            raise TransferError(f"the trainer could not join group {group.group_name!r}: {exc}") from exc
        self._joined = joined
        log.info("joined weight-transfer group %r with %d server(s)", group.group_name, len(joined))

    async def close(self) -> None:
        """Leave the group: every server, then the trainer. Safe to call twice."""
        if self._process_group is None:
            return
        process_group, self._process_group = self._process_group, None
        try:
            await self._leave_servers(self._joined)
        finally:
            self._joined = []
            if self._staging is not None:
                self._staging.release()  # a broadcast still blocked keeps its own view alive
            if not await self._blocked():
                leave(process_group)

    # -- pushing ------------------------------------------------------------------------------------

    async def push(
        self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *, version: str
    ) -> PushReport:
        """Put ``named_tensors`` on every server as ``version``.

        :param named_tensors: HF parameter name to tensor (``model.state_dict()``, ``model.named_parameters()``,
            or any subset of the model's tensors).
        :param version: the weight version every server reports afterwards.
        :raises InvalidRequestError: bad arguments, a tensor the reference lacks or that disagrees with it, a
            push while another runs, a group not started (nothing is sent).
        :raises AdminError: a server failed; the message and ``results``/``phases`` say which, and the state left.
        """
        if not isinstance(version, str) or not version.strip():
            raise InvalidRequestError(f"version must be a non-empty string, got {version!r}")
        if self._pushing is not None:
            raise InvalidRequestError(f"a push is running (version {self._pushing!r}): one push at a time")
        if not self.started:
            raise InvalidRequestError("the group is not formed: call start() (or use the pusher as a context manager)")
        self._pushing = version
        try:
            if await self._blocked():
                raise TransferError(
                    "a broadcast of an earlier push is still blocked on the group: close() this pusher and start "
                    "a new group"
                )
            tensors = _named(named_tensors)
            specs = [_spec(name, tensor) for name, tensor in tensors.items()]
            if self.reference is not None:
                self.reference.check(specs)
            if self.group is None:
                return await self._push_checkpoint(tensors, version)
            return await self._push_group(tensors, specs, version)
        finally:
            self._pushing = None

    async def _push_checkpoint(self, tensors: dict[str, torch.Tensor], version: str) -> PushReport:
        assert self.checkpoint is not None
        started = time.perf_counter()
        path = await asyncio.to_thread(write_checkpoint, self.checkpoint, version, tensors)
        written = time.perf_counter() - started
        report = await self.client.admin.weight_sync(
            version=version, path=self.checkpoint.remote(version), mode=self.mode, flush_cache=self.flush_cache
        )
        await asyncio.to_thread(self.checkpoint.prune, version)
        return PushReport(
            version=version,
            sync=report,
            tensors=len(tensors),
            bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
            buckets=1,
            send_s=written,
            duration_s=time.perf_counter() - started,
            path=path,
        )

    async def _push_group(self, tensors: dict[str, torch.Tensor], specs: list[TensorSpec], version: str) -> PushReport:
        assert self.group is not None and self._process_group is not None
        process_group = self._process_group
        plan = self._plan(specs)
        device = "cpu" if self.group.backend == "gloo" else _device(tensors)
        started = time.perf_counter()
        sent: dict[str, float] = {}

        def send() -> None:
            began = time.perf_counter()
            staging = self._staging if device == "cpu" else None
            sent["bytes"] = broadcast_plan(process_group, plan, tensors, device=device, staging=staging)
            sent["seconds"] = time.perf_counter() - began

        async def sender() -> None:
            thread = _Sender(send)
            thread.start()
            try:
                await thread.finished
            except asyncio.CancelledError:
                self._stuck = thread if thread.is_alive() else None
                raise

        report = await self.client.admin.weight_sync(
            version=version,
            group_name=self.group.group_name,
            tensors=plan.tensors,
            plan=plan,
            sender=sender,
            mode=self.mode,
            flush_cache=self.flush_cache,
        )
        return PushReport(
            version=version,
            sync=report,
            tensors=len(specs),
            bytes=int(sent["bytes"]),
            buckets=len(plan.buckets),
            send_s=sent["seconds"],
            duration_s=time.perf_counter() - started,
        )

    async def _blocked(self) -> bool:
        """A broadcast thread of an earlier push, abandoned when that push failed, is still blocked on the group
        (given :data:`_ABANDONED_GRACE_S` to end)."""
        thread = self._stuck
        if thread is None:
            return False
        if thread.is_alive():
            await asyncio.to_thread(thread.join, _ABANDONED_GRACE_S)
        if thread.is_alive():
            return True
        self._stuck = None
        return False

    def _plan(self, specs: list[TensorSpec]) -> TransferPlan:
        """The backend's plan for these tensors (the same tensors plan the same way: kept)."""
        assert self.group is not None
        key = tuple(specs)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self.client.admin.transfer_plan(specs, bucket_bytes=self.group.bucket_bytes)
        return plan

    # -- servers ------------------------------------------------------------------------------------

    def _serving(self) -> list[Server]:
        serving = set(self.client.base_urls)
        return [server for server in self.client.servers if server.base_url in serving]

    async def _join(self, server: Server, index: int) -> ServerOutcome[bool]:
        assert self.group is not None
        group = attrs.evolve(self.group, rank_offset=self.group.rank_offset + index * self.ranks_per_server)
        (outcome,) = await self.client.admin.outcomes([server]).init_weight_transfer(group)
        return outcome

    async def _leave_servers(self, servers: list[Server]) -> None:
        if not servers or self.group is None:
            return
        outcomes = await self.client.admin.outcomes(servers).destroy_weight_transfer(self.group.group_name)
        for outcome in outcomes:
            if not outcome.ok:
                log.warning("%s did not leave group %r: %s", outcome.server, self.group.group_name, outcome.error)


class _Sender(threading.Thread):
    """The broadcasts, on a thread of their own (a collective blocks until every rank took part); ``finished``
    resolves on the event loop that started it."""

    def __init__(self, send: Any) -> None:
        super().__init__(name="backends-trainer-broadcast", daemon=True)
        self._send = send
        loop = asyncio.get_running_loop()
        self.finished: asyncio.Future[None] = loop.create_future()
        self._loop = loop

    def run(self) -> None:
        try:
            self._send()
        except BaseException as exc:  # reported on the loop: the push's error
            self._loop.call_soon_threadsafe(_settle, self.finished, exc)
        else:
            self._loop.call_soon_threadsafe(_settle, self.finished, None)


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _discard(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.info("the trainer's abandoned rendezvous ended: %s", task.exception())


def _require(client: Client, *operations: str) -> None:
    for operation in operations:
        if operation not in client.capabilities:
            raise UnsupportedOperationError(client.backend, operation)


def _check_group(group: DistributedGroup) -> None:
    for name in ("master_port", "world_size", "rank_offset"):
        value = getattr(group, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < (1 if name != "master_port" else 0):
            raise InvalidRequestError(f"group.{name} must be a positive int, got {value!r}")
    if not 0 < group.master_port < 65536:
        raise InvalidRequestError(f"group.master_port must be a TCP port, got {group.master_port}")
    if group.bucket_bytes is not None and (
        not isinstance(group.bucket_bytes, int) or isinstance(group.bucket_bytes, bool) or group.bucket_bytes < 1
    ):
        raise InvalidRequestError(f"group.bucket_bytes must be a positive int or None, got {group.bucket_bytes!r}")
    if group.backend not in ("gloo", "nccl"):
        raise InvalidRequestError(f"group.backend must be 'gloo' or 'nccl', got {group.backend!r}")


def _named(named_tensors: Any) -> dict[str, torch.Tensor]:
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    try:
        pairs = list(items)
    except TypeError:
        raise InvalidRequestError(
            f"named_tensors must be a mapping or pairs of name and tensor, got {type(named_tensors).__name__}"
        ) from None
    tensors: dict[str, torch.Tensor] = {}
    for index, pair in enumerate(pairs):
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise InvalidRequestError(f"named_tensors[{index}] must be a (name, tensor) pair, got {pair!r:.80}")
        name, tensor = pair
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"named_tensors[{index}]: the name must be a non-empty string, got {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise InvalidRequestError(f"tensor {name!r} must be a torch.Tensor, got {type(tensor).__name__}")
        if name in tensors:
            raise InvalidRequestError(f"tensor {name!r} is given twice")
        tensors[name] = tensor
    if not tensors:
        raise InvalidRequestError("named_tensors is empty: nothing to push")
    return tensors


def _spec(name: str, tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(name=name, dtype=str(tensor.dtype).removeprefix("torch."), shape=tuple(tensor.shape))


def _device(tensors: Mapping[str, torch.Tensor]) -> str:
    return str(next(iter(tensors.values())).device)
