"""A minimal trainer for the live distributed weight-update test: rank 0 of a gloo group with one SGLang server.

Run as a script with the SGLang venv's python (it needs torch and safetensors, nothing of SGLang):

    python gloo_trainer.py --master-port 29555 --group-name weights --world-size 2 --hard-timeout 300

It hosts the rendezvous store (rank 0 is the TCP store's master), joins the group the server joins through
``POST /init_weights_update_group``, then obeys one JSON command per stdin line and answers one JSON event per
stdout line:

* ``{"op": "broadcast", "file": "<model.safetensors>", "names": [...]}`` broadcasts (``src`` 0) those tensors
  of the file, in that order, exactly as stored (dtype, shape): the order, names, dtypes and shapes the test
  sends in ``POST /update_weights_from_distributed``, whose receiving side posts one broadcast per tensor in
  the same order. Answers ``{"event": "sent", "count", "bytes", "seconds"}`` once the receiver has them.
* ``{"op": "exit"}`` leaves: ``{"event": "bye"}``.

How the group is built matters. SGLang 0.5.23 (``model_runner_components/weight_updater.py``,
``init_weights_update_group``) does not use ``torch.distributed.init_process_group``: it calls its
``init_custom_process_group`` (``srt/utils/common.py``), the OpenRLHF-style helper that makes a *second*
process group beside the server's own default group: rendezvous on ``tcp://<master>:<port>``, the store
wrapped in ``PrefixStore(group_name)``, then torch's ``_new_process_group_helper`` under ``group_name``
(which prefixes the store again with ``group_name/``). The trainer's store keys must match, so the trainer
builds its group the same way. With ``init_process_group`` both sides wait for each other until their timeouts
(seen with torch 2.13: ``DistStoreError: wait timeout ..., keys: /default_pg/0//cpu//0/1`` on one side and
``/g/g//cpu//0/0`` on the other, for a group ``g``; the server's wait is SGLang's 30-minute default, with its
scheduler blocked). The server's rank is ``rank_offset + tp_rank`` (1 here).

A hard deadline (``SIGALRM``, ``--hard-timeout``) ends the process whatever it is blocked on, so a hang
cannot wedge CI; the test also kills it in ``finally``. Killing it also unblocks the server: its pending
gloo receive fails with a closed connection instead of waiting out the group's 30-minute timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper
from torch.distributed.rendezvous import rendezvous


def _emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def join_group(
    address: str, port: int, *, world_size: int, rank: int, group_name: str, timeout: timedelta
) -> dist.ProcessGroup:
    """Join the weight-update group as SGLang's ``init_weights_update_group`` does on the server side."""
    store, rank, world_size = next(rendezvous(f"tcp://{address}:{port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend("gloo"),
        PrefixStore(group_name, store),
        group_name=group_name,
        backend_options=None,
        timeout=timeout,
    )
    return group


def broadcast_file(group: dist.ProcessGroup, path: str, names: list[str]) -> tuple[int, int]:
    tensors = load_file(path)
    missing = [name for name in names if name not in tensors]
    if missing:
        raise KeyError(f"{path} has no tensor(s) {missing}")
    sent = 0
    for name in names:
        tensor = tensors[name].contiguous()
        # group_src: a rank of this group (the process has no default group to translate a global rank with)
        dist.broadcast(tensor, group=group, group_src=0)
        sent += tensor.numel() * tensor.element_size()
    return len(names), sent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master-address", default="127.0.0.1")
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--group-name", required=True)
    parser.add_argument("--group-timeout", type=float, default=120.0, help="rendezvous and collective timeout, s")
    parser.add_argument("--hard-timeout", type=int, default=300, help="the process ends after this many seconds")
    args = parser.parse_args()

    signal.signal(signal.SIGALRM, signal.SIG_DFL)  # default action of SIGALRM: terminate
    signal.alarm(args.hard_timeout)
    torch.set_num_threads(1)

    started = time.perf_counter()
    group = join_group(
        args.master_address,
        args.master_port,
        world_size=args.world_size,
        rank=0,
        group_name=args.group_name,
        timeout=timedelta(seconds=args.group_timeout),
    )
    _emit("joined", rank=group.rank(), size=group.size(), seconds=round(time.perf_counter() - started, 3))

    for line in sys.stdin:
        if not line.strip():
            continue
        command = json.loads(line)
        if command["op"] == "exit":
            break
        if command["op"] != "broadcast":
            _emit("error", message=f"unknown op {command['op']!r}")
            return 2
        started = time.perf_counter()
        count, size = broadcast_file(group, command["file"], list(command["names"]))
        _emit("sent", count=count, bytes=size, seconds=round(time.perf_counter() - started, 3))
    _emit("bye", pid=os.getpid())
    return 0


if __name__ == "__main__":
    sys.exit(main())
