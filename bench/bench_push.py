"""Weight push over a gloo group: ``WeightPusher.push`` vs the raw ``torch.distributed.broadcast`` floor on the
same group, and vs the checkpoint path (write safetensors + ``weight_sync(path=)``).

    uv run python bench/bench_push.py [--rounds 5] [--sizes tiny,50m,200m] [--servers 1,4]
                                      [--buckets none,1,16,64,256] [--sglang N] [--parts sweep,checkpoint]
    uv run python bench/bench_push.py report bench/results/push.json     # the README's tables

Receivers (``--servers`` of them, each its own process, one rank each; the trainer is rank 0 in this process):

* **stand-ins** (the size sweep, 1 and 4 servers): this file run as ``standin``, an ``aiohttp.web`` server whose
  every route but the weight routes is answered by the SGLang 0.5.23 emulator (``backends_sglang_testing``:
  ``/pause_generation``, ``/continue_generation``, ``/flush_cache``, ``/begin_weight_update``,
  ``/end_weight_update``, ``/model_info``, ... with SGLang's answers). The weight routes are real:
  ``/init_weights_update_group`` joins the gloo group as SGLang's ``init_custom_process_group`` does (rendezvous
  on ``tcp://``, ``PrefixStore(group_name)``, ``_new_process_group_helper``); ``/update_weights_from_distributed``
  receives as SGLang 0.5.23's ``WeightUpdater.receive_weights_from_distributed`` does (per tensor: ``torch.empty``
  of each announced tensor + one ``async_op`` broadcast each, then wait all; ``load_format: flattened_bucket``:
  SGLang's own ``FlattenedTensorBucket.empty`` (the class is loaded from the cached SGLang venv) + one ``uint8``
  broadcast + ``reconstruct_tensors``), then "loads" by copying each tensor into the stand-in's parameter of that
  name (what ``default_weight_loader`` does; SGLang's Qwen3 loader also fuses q/k/v and gate/up by slice copies);
  ``/update_weights_from_disk`` reads every ``*.safetensors`` of the directory (``safetensors.torch.load_file``)
  and copies the same way. No scheduler process, no ZMQ hop, no model forward.
* **real SGLang 0.5.23** (``--sglang N``: N servers, the tiny model of ``backends_testkit.tinymodel``, started as
  the live tests start them, ~1.84 GB RSS each): ``WeightPusher.push`` over a gloo group (per tensor, 1 MiB, 64 MiB)
  and over a checkpoint directory, beside the same pushes to N stand-ins and the floor on the stand-ins' group.

Per point and round (floor, ours, before and warm receivers, in an order rotated by round; ratios are per round;
each stand-in's parameters are checked byte for byte against the pushed tensors after the first and last push):

* **floor**: on the pusher's own process group, every receiver first preallocates and touches its buffers (per
  tensor, or one ``uint8`` buffer per bucket) and the trainer pre-packs its buckets (untimed); then one
  ``all_reduce`` of one element (all ranks ready), the timer starts, the same bytes go out as raw
  ``dist.broadcast`` calls (per tensor, or one per packed bucket), one more ``all_reduce`` (every receiver has
  everything), the timer stops. No HTTP, no pause/resume, no allocation, no packing.
* **ours**: the wall time of ``await pusher.push(state_dict, version=...)``: checks, pause, the trainer's
  broadcasts (packing included) concurrently with each server's ``/begin_weight_update`` →
  ``/update_weights_from_distributed`` (one per bucket) → ``/end_weight_update``, flush, resume, version check.
  Split: ``send_s`` (the trainer's broadcasts) and ``duration_s - send_s`` (the admin part); the stand-ins report
  their own allocation, receive and load times.
* **before**: the same push with the packing before the staging buffers (every packed bucket a new ``torch.cat``
  result, sent synchronously): ``pusher._staging = None``.
* **warm receivers**: the same push with the stand-ins receiving into buffers kept from the previous push instead
  of SGLang's fresh ``torch.empty`` (``/bench/mode``): what the engine's allocation costs on a CPU.
* **checkpoint** (``--parts checkpoint``): ``WeightPusher(checkpoint=...)``: ``write_checkpoint`` (safetensors in
  a fresh directory under ``--ckpt-dir``) + ``weight_sync(path=)``.

Models: ``tiny`` = the tiny Qwen3 of the live tests (its own tensors); ``50m`` / ``200m`` = synthetic float32 state
dicts shaped like Qwen3-0.6B layers (hidden 1024, 16 query / 8 KV heads of 128, MLP 3072: 11 tensors, 15.7 M
parameters per layer), 3 layers + a 2,048-row embedding (49.3 M parameters) and 12 layers + a 12,288-row
embedding (201.4 M). Raw numbers: ``bench/results/push.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import gc
import importlib.util
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import _common as c
import torch
import torch.distributed as dist

GROUP_TIMEOUT_S = 600.0
#: the group name of every push to vLLM stand-ins (vLLM's ``init_info`` carries none; each push has its own store)
VLLM_GROUP = "bench-push-vllm"
MIB = 1 << 20


# -- the synthetic models ---------------------------------------------------------------------------------

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP = 1024, 16, 8, 128, 3072
SIZES = {"50m": (3, 2048), "200m": (12, 12288)}
"""name -> (layers, embedding rows)."""


def synthetic(size: str) -> dict[str, torch.Tensor]:
    """A float32 state dict shaped like a Qwen3-0.6B layer stack (random values, fixed seed)."""
    layers, vocab = SIZES[size]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, HIDDEN)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
            p + "self_attn.q_norm.weight": (HEAD_DIM,),
            p + "self_attn.k_norm.weight": (HEAD_DIM,),
            p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "mlp.gate_proj.weight": (MLP, HIDDEN),
            p + "mlp.up_proj.weight": (MLP, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, MLP),
        }
    shapes["model.norm.weight"] = (HIDDEN,)
    generator = torch.Generator().manual_seed(7)
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def tiny_model_dir() -> Path:
    from backends_testkit.tinymodel import build_tiny_models, default_models_dir

    return build_tiny_models(default_models_dir()).dense


def tiny() -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return dict(load_file(str(tiny_model_dir() / "model.safetensors")))


def state_dict(size: str) -> dict[str, torch.Tensor]:
    return tiny() if size == "tiny" else synthetic(size)


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


# -- the stand-in server (a subprocess) -------------------------------------------------------------------


def sglang_site() -> Path:
    from backends_testkit.live import server_venvs_dir

    lib = server_venvs_dir() / "sglang-cpu-0.5.23" / "lib"
    found = sorted(lib.glob("python3*/site-packages/sglang"))
    if not found:
        raise SystemExit(f"no cached SGLang venv under {lib}: run the SGLang live tests once (it builds it)")
    return found[0]


def load_flattened_bucket() -> Any:
    """SGLang 0.5.23's own ``FlattenedTensorBucket`` (its module imports only torch)."""
    path = sglang_site() / "srt" / "weight_sync" / "tensor_bucket.py"
    spec = importlib.util.spec_from_file_location("sglang_tensor_bucket", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FlattenedTensorBucket


def join_group(body: dict[str, Any]) -> dist.ProcessGroup:
    """SGLang's ``init_custom_process_group`` (``sglang/srt/utils/common.py``) for rank ``rank_offset``."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world
    from torch.distributed.rendezvous import rendezvous

    timeout = timedelta(seconds=GROUP_TIMEOUT_S)
    url = f"tcp://{body['master_address']}:{body['master_port']}"
    store, rank, world_size = next(rendezvous(url, body["rank_offset"], body["world_size"], timeout=timeout))
    store.set_timeout(timeout)
    name = body["group_name"]
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(body.get("backend", "nccl")),
        PrefixStore(name, store),
        group_name=name,
        backend_options=None,
        timeout=timeout,
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    assert isinstance(group, dist.ProcessGroup)
    return group


def checksums(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """Exact and order-free: the sum of each tensor's bytes as integers (weighted by position mod 251)."""
    out = {}
    for name, t in tensors.items():
        raw = t.contiguous().reshape(-1).view(torch.uint8).to(torch.int64)
        out[name] = int((raw * (torch.arange(raw.numel()) % 251 + 1)).sum())
    return out


async def verify(http: Any, urls: list[str], tensors: dict[str, torch.Tensor]) -> None:
    """Every stand-in holds exactly the pushed tensors (sum and last element of each)."""
    expected = checksums(tensors)
    for url in urls:
        held = (await http.get(f"{url}/bench/checksum")).json()
        wrong = [name for name, value in expected.items() if held.get(name) != value]
        if wrong:
            raise SystemExit(f"{url} does not hold the pushed tensors: {wrong[:5]}")


def trim() -> None:
    """Give freed heap memory back to the kernel (between measurements: five processes holding 0.8 GB models
    and their freed receive buffers otherwise outgrow the machine)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def barrier(group: dist.ProcessGroup) -> None:
    dist.all_reduce(torch.zeros(1), group=group)


def group_broadcast(group: Any, tensor: torch.Tensor) -> Any:
    """A receiver's broadcast from rank 0 on ``group`` (torch's registered group or a bare ``ProcessGroupGloo``)."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    return group.broadcast([tensor], options)


def group_barrier(group: Any) -> None:
    """A receiver's side of :func:`barrier`."""
    group.allreduce([torch.zeros(1)]).wait()


def run_standin(url_file: Path, engine_kind: str) -> None:
    import httpx
    from aiohttp import web
    from safetensors.torch import load_file

    from backends_sglang_testing import SglangEmulator
    from backends_testkit.emulator import GET, POST, Route
    from backends_testkit.engine import ReferenceEngine
    from backends_vllm_testing import VllmEmulator
    from backends_vllm_testing._receiver import Announced, vllm_chunks

    torch.set_num_threads(1)
    bucket_class = load_flattened_bucket()

    def ok(message: str) -> httpx.Response:
        return httpx.Response(200, json={"success": True, "message": message})

    def fail(message: str) -> httpx.Response:
        return httpx.Response(400, json={"success": False, "message": message})

    class Bench:
        """What both stand-ins add to their emulator: the parameters pushed into, timers, the floors' receives,
        checksums and the warm-buffer switch."""

        def bench_init(self) -> None:
            self.params: dict[str, torch.Tensor] = {}
            self.stats: dict[str, float] = {}
            self.floor_error: str | None = None
            #: ``/bench/mode {"reuse": true}``: receive into buffers kept from the previous push of the same
            #: tensors (already touched) instead of the engine's fresh ``torch.empty``: isolates the engine's
            #: allocation cost from the rest.
            self.reuse = False
            self.kept: dict[Any, Any] = {}

        def bench_routes(self) -> dict[str, Route]:
            return {
                "/bench/floor": Route(self.floor, methods=POST, level="open"),
                "/bench/stats": Route(self.take_stats, methods=GET, level="open"),
                "/bench/mode": Route(self.set_mode, methods=POST, level="open"),
                "/bench/checksum": Route(self.checksum, methods=GET, level="open"),
            }

        def group(self, name: str) -> Any:
            raise NotImplementedError

        def engine_floor_receive(self, group: Any, body: dict[str, Any]) -> None:
            raise NotImplementedError

        def add(self, key: str, value: float) -> None:
            self.stats[key] = self.stats.get(key, 0.0) + value

        def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
            started = time.perf_counter()
            for name, tensor in tensors:
                param = self.params.get(name)
                if param is None or param.shape != tensor.shape or param.dtype != tensor.dtype:
                    param = self.params[name] = torch.empty_like(tensor)
                param.copy_(tensor)
            self.add("load_s", time.perf_counter() - started)

        def floor_receive(self, body: dict[str, Any]) -> None:
            group = self.group(body["group_name"])
            try:
                if body["engine"]:
                    group_barrier(group)
                    self.engine_floor_receive(group, body)
                    group_barrier(group)
                    return
                if body["packed"]:
                    buffers = [torch.zeros(size, dtype=torch.uint8) for size in body["sizes"]]
                else:
                    buffers = [torch.zeros(shape, dtype=getattr(torch, dtype)) for _, dtype, shape in body["tensors"]]
                group_barrier(group)
                for buffer in buffers:
                    group_broadcast(group, buffer).wait()
                group_barrier(group)
            except Exception as exc:
                self.floor_error = repr(exc)

        async def floor(self, request: httpx.Request) -> httpx.Response:
            body = json.loads(request.content)
            threading.Thread(target=self.floor_receive, args=(body,), daemon=True).start()
            return ok("floor receive started")

        async def checksum(self, request: httpx.Request) -> httpx.Response:
            return httpx.Response(200, json=checksums(self.params))

        async def set_mode(self, request: httpx.Request) -> httpx.Response:
            body = json.loads(request.content)
            self.reuse = bool(body["reuse"])
            if body.get("clear"):
                self.kept.clear()
                gc.collect()
            return ok(f"reuse={self.reuse}")

        async def take_stats(self, request: httpx.Request) -> httpx.Response:
            stats, self.stats = self.stats, {}
            trim()
            stats["rss_mb"] = c.proc_status_kb("VmRSS") / 1024
            stats["hwm_mb"] = c.proc_status_kb("VmHWM") / 1024
            if self.floor_error:
                stats["floor_error"] = self.floor_error  # type: ignore[assignment]
            return httpx.Response(200, json=stats)

    class StandIn(Bench, SglangEmulator):
        def __init__(self, engine: ReferenceEngine) -> None:
            super().__init__(engine, served_model_name=c.MODEL)
            self.bench_init()
            self.groups: dict[str, dist.ProcessGroup] = {}

        def routes(self) -> dict[str, Route]:
            routes = dict(super().routes())
            routes["/init_weights_update_group"] = Route(self.init_group, methods=POST, level="admin")
            routes["/destroy_weights_update_group"] = Route(self.destroy_group, methods=POST, level="admin")
            routes["/update_weights_from_distributed"] = Route(self.update_distributed, methods=POST, level="admin")
            routes["/update_weights_from_disk"] = Route(self.update_disk, methods=POST, level="admin")
            return routes | self.bench_routes()

        def group(self, name: str) -> Any:
            return self.groups[name]

        def finish(self, body: dict[str, Any]) -> None:
            if body.get("weight_version") is not None:
                self.engine.update_weight_version(body["weight_version"])
            if body.get("flush_cache", True):
                self.engine.flush_cache()

        async def init_group(self, request: httpx.Request) -> httpx.Response:
            body = json.loads(request.content)
            if body["group_name"] in self.groups:
                return fail(f"The group {body['group_name']} already exists.")
            try:
                self.groups[body["group_name"]] = await asyncio.to_thread(join_group, body)
            except Exception as exc:
                return fail(f"Failed to initialize custom process group: {exc}.")
            return ok("Succeeded to initialize custom process group.")

        async def destroy_group(self, request: httpx.Request) -> httpx.Response:
            group = self.groups.pop(json.loads(request.content)["group_name"], None)
            if group is None:
                return fail("The group to be destroyed does not exist.")
            dist.destroy_process_group(group)
            return ok("Succeeded to destroy custom process group.")

        def receive(self, body: dict[str, Any]) -> None:
            group = self.groups[body["group_name"]]
            names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
            started = time.perf_counter()
            if body.get("load_format") == "flattened_bucket":
                key = (tuple(names), tuple(tuple(shape) for shape in shapes))
                bucket = self.kept.get(key) if self.reuse else None
                if bucket is None:
                    bucket = bucket_class.empty(names, dtypes, shapes, "cpu")
                    if self.reuse:
                        self.kept[key] = bucket
                allocated = time.perf_counter()
                dist.broadcast(bucket.get_flattened_tensor(), src=0, group=group)
                tensors = bucket.reconstruct_tensors()
            else:
                tensors, handles = [], []
                for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
                    weight = self.kept.get(name) if self.reuse else None
                    if weight is None or list(weight.shape) != list(shape):
                        weight = torch.empty(shape, dtype=getattr(torch, dtype))
                        if self.reuse:
                            self.kept[name] = weight
                    handles.append(dist.broadcast(weight, src=0, group=group, async_op=True))
                    tensors.append((name, weight))
                allocated = time.perf_counter()  # the broadcasts are already running: allocation overlaps
                for handle in handles:
                    handle.wait()
            received = time.perf_counter()
            self.add("alloc_s", allocated - started)
            self.add("recv_s", received - allocated)
            self.add("calls", 1)
            self.load(tensors)

        def engine_floor_receive(self, group: Any, body: dict[str, Any]) -> None:
            """SGLang's receive of :meth:`receive` (fresh buffers, async per-tensor broadcasts or its flattened
            bucket and ``reconstruct_tensors``), bucket after bucket with nothing between them."""
            if body["packed"]:
                for bucket in body["buckets"]:
                    names, dtypes, shapes = zip(*bucket, strict=True)
                    flat = bucket_class.empty(list(names), list(dtypes), [list(s) for s in shapes], "cpu")
                    group_broadcast(group, flat.get_flattened_tensor()).wait()
                    flat.reconstruct_tensors()
            else:
                kept = [torch.empty(shape, dtype=getattr(torch, dtype)) for _, dtype, shape in body["tensors"]]
                for work in [group_broadcast(group, weight) for weight in kept]:
                    work.wait()

        async def update_distributed(self, request: httpx.Request) -> httpx.Response:
            body = json.loads(request.content)
            if not self.control.update_session:
                return fail("update_weights_from_distributed must run between begin and end_weight_update")
            started = time.perf_counter()
            try:
                await asyncio.to_thread(self.receive, body)
            except Exception as exc:
                return fail(f"Failed to update parameter online: {exc}")
            self.finish(body)
            self.add("handler_s", time.perf_counter() - started)
            return ok("Succeeded to update parameter online.")

        def read_disk(self, path: str) -> None:
            started = time.perf_counter()
            tensors: list[tuple[str, torch.Tensor]] = []
            for file in sorted(Path(path).glob("*.safetensors")):
                tensors += load_file(str(file)).items()
            self.add("read_s", time.perf_counter() - started)
            self.load(tensors)

        async def update_disk(self, request: httpx.Request) -> httpx.Response:
            body = json.loads(request.content)
            started = time.perf_counter()
            try:
                await asyncio.to_thread(self.read_disk, body["model_path"])
            except Exception as exc:
                return fail(f"Failed to update weights: {exc}.")
            self.finish(body)
            self.add("handler_s", time.perf_counter() - started)
            return ok("Succeeded to update model weights.")

    class VllmStandIn(Bench, VllmEmulator):
        """vLLM 0.32's weight-transfer routes (the emulator's protocol and its join of the trainer's group) with
        the receive of ``NCCLWeightTransferEngine.receive_weights`` into this stand-in's parameters: per tensor a
        fresh ``torch.empty`` and one broadcast, loaded as it arrives; packed, the chunks vLLM cuts itself from the
        announced list and ``packed_buffer_size_bytes``, each a fresh ``uint8`` buffer and one broadcast, its
        tensors viewed out of it and loaded. All of a push's buckets go under one ``/update_weights`` call."""

        def __init__(self, engine: ReferenceEngine) -> None:
            super().__init__(
                engine,
                served_model_name=c.MODEL,
                receive_weights=True,
                transfer_group_name=VLLM_GROUP,
                transfer_timeout_s=GROUP_TIMEOUT_S,
            )
            self.bench_init()

        def routes(self) -> dict[str, Route]:
            return dict(super().routes()) | self.bench_routes()

        def group(self, name: str) -> Any:
            assert self._joined is not None
            return self._joined.group

        def chunks(self, announced: list[Announced]) -> list[list[Announced]]:
            assert self._joined is not None
            if self._joined.packed:
                return vllm_chunks(announced, self._joined.buffer_size_bytes)
            return [[a] for a in announced]

        def receive_into(self, announced: list[Announced]) -> None:
            assert self._joined is not None
            group, packed = self._joined.group, self._joined.packed
            for chunk in self.chunks(announced):
                started = time.perf_counter()
                key = tuple(a.name for a in chunk)
                buffer = self.kept.get(key) if self.reuse else None
                sizes = [math.prod(a.shape) * getattr(torch, a.dtype).itemsize for a in chunk]
                if buffer is None:
                    if packed:
                        buffer = torch.empty(sum(sizes), dtype=torch.uint8)
                    else:
                        buffer = torch.empty(chunk[0].shape, dtype=getattr(torch, chunk[0].dtype))
                    if self.reuse:
                        self.kept[key] = buffer
                allocated = time.perf_counter()
                group_broadcast(group, buffer).wait()
                received = time.perf_counter()
                self.add("alloc_s", allocated - started)
                self.add("recv_s", received - allocated)
                if packed:
                    tensors, offset = [], 0
                    for a, size in zip(chunk, sizes, strict=True):
                        part = buffer[offset : offset + size]
                        offset += size
                        tensors.append((a.name, part.view(getattr(torch, a.dtype)).view(a.shape)))
                else:
                    tensors = [(chunk[0].name, buffer)]
                self.load(tensors)
            self.add("calls", 1)

        async def _receive(self, state: Any, info: dict[str, Any]) -> None:
            announced = [
                Announced(name, dtype, tuple(shape))
                for name, dtype, shape in zip(info["names"], info["dtype_names"], info["shapes"], strict=True)
            ]
            started = time.perf_counter()
            await asyncio.to_thread(self.receive_into, announced)
            self.add("handler_s", time.perf_counter() - started)

        def engine_floor_receive(self, group: Any, body: dict[str, Any]) -> None:
            """vLLM's receive of :meth:`receive_into` without the loads: a fresh buffer per broadcast."""
            if body["packed"]:
                for size in body["sizes"]:
                    group_broadcast(group, torch.empty(size, dtype=torch.uint8)).wait()
            else:
                for _, dtype, shape in body["tensors"]:
                    group_broadcast(group, torch.empty(shape, dtype=getattr(torch, dtype))).wait()

    async def main() -> None:
        async with ReferenceEngine(tiny_model_dir()) as engine:
            emulator = VllmStandIn(engine) if engine_kind == "vllm" else StandIn(engine)

            async def bridge(request: web.Request) -> web.Response:
                answer = await emulator.handle(
                    httpx.Request(
                        request.method,
                        str(request.url),
                        headers=list(request.headers.items()),
                        content=await request.read(),
                    )
                )
                await answer.aread()
                headers = {"Content-Type": answer.headers.get("content-type", "application/json")}
                return web.Response(status=answer.status_code, body=answer.content, headers=headers)

            app = web.Application(client_max_size=1 << 30)
            app.router.add_route("*", "/{tail:.*}", bridge)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = runner.addresses[0][1]
            await asyncio.to_thread(url_file.write_text, f"http://127.0.0.1:{port}\n")
            await asyncio.Event().wait()

    asyncio.run(main())


class StandIns:
    """``n`` stand-in processes."""

    def __init__(self, n: int, logs: Path, engine: str = "sglang") -> None:
        self.engine = engine
        self.processes: list[subprocess.Popen[bytes]] = []
        self.urls: list[str] = []
        env = dict(os.environ, OMP_NUM_THREADS="1")
        files = [logs / f"standin-{engine}-{i}.url" for i in range(n)]
        for i, file in enumerate(files):
            with (logs / f"standin-{engine}-{i}.log").open("wb") as log:
                self.processes.append(
                    subprocess.Popen(
                        [sys.executable, __file__, "standin", "--url-file", str(file), "--engine", engine],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                    )
                )
        deadline = time.monotonic() + 180
        for file, process in zip(files, self.processes, strict=True):
            while not file.exists() or not file.read_text().strip():
                if process.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"stand-in did not start: see {logs}")
                time.sleep(0.2)
            self.urls.append(file.read_text().strip())

    def close(self) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()


# -- the trainer's side -----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def make_client(urls: list[str], engine: str = "sglang") -> Any:
    from backends_core import Client, ClientConfig

    return Client(ClientConfig(backend=engine, base_url=urls, model=c.MODEL, tokenizer=str(tiny_model_dir())))


@contextlib.asynccontextmanager
async def group_pusher(client: Any, servers: int, bucket: int | None, reference: Any = None) -> AsyncIterator[Any]:
    from backends_core.types import DistributedGroup
    from backends_trainer import WeightPusher

    group = DistributedGroup(
        master_address="127.0.0.1",
        master_port=free_port(),
        world_size=1 + servers,
        rank_offset=1,
        backend="gloo",
        group_name=VLLM_GROUP if client.config.backend == "vllm" else f"bench-push-{servers}-{time.monotonic_ns()}",
        bucket_bytes=bucket,
    )
    pusher = WeightPusher(client, group=group, reference=reference, group_timeout_s=GROUP_TIMEOUT_S)
    await pusher.start()
    try:
        yield pusher
    finally:
        await pusher.close()


async def standin_stats(http: Any, urls: list[str]) -> list[dict[str, float]]:
    answers = await asyncio.gather(*(http.get(f"{url}/bench/stats") for url in urls))
    return [a.json() for a in answers]


async def floor_once(
    pusher: Any, http: Any, urls: list[str], tensors: dict[str, torch.Tensor], *, engine: bool = False
) -> float:
    """One raw broadcast of the push's bytes on the pusher's own group (see the module docstring); ``engine``: the
    receivers receive as the engine does, into fresh buffers (the engine floor)."""
    from backends_core.types import TensorSpec

    specs = [
        TensorSpec(name=n, dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape)) for n, t in tensors.items()
    ]
    plan = pusher._plan(specs)
    group = pusher._process_group
    if plan.packed:
        sent = [torch.cat([tensors[s.name].reshape(-1).view(torch.uint8) for s in bucket]) for bucket in plan.buckets]
        body: dict[str, Any] = {
            "packed": True,
            "sizes": [b.numel() for b in sent],
            "buckets": [[[s.name, s.dtype, list(s.shape)] for s in bucket] for bucket in plan.buckets],
        }
    else:
        sent = [tensors[s.name].contiguous() for bucket in plan.buckets for s in bucket]
        body = {"packed": False, "tensors": [[s.name, s.dtype, list(s.shape)] for b in plan.buckets for s in b]}
    body["group_name"] = pusher.group.group_name
    body["engine"] = engine
    for answer in await asyncio.gather(*(http.post(f"{url}/bench/floor", json=body) for url in urls)):
        answer.raise_for_status()

    def send() -> float:
        barrier(group)
        started = time.perf_counter()
        for buffer in sent:
            dist.broadcast(buffer, group=group, group_src=0)
        barrier(group)
        return time.perf_counter() - started

    seconds = await asyncio.to_thread(send)
    sent.clear()
    trim()
    return seconds


async def set_reuse(http: Any, urls: list[str], reuse: bool, *, clear: bool = False) -> None:
    """Switch the stand-ins between SGLang's fresh receive buffers and kept ones (``clear``: drop the kept)."""
    body = {"reuse": reuse, "clear": clear}
    for answer in await asyncio.gather(*(http.post(f"{url}/bench/mode", json=body) for url in urls)):
        answer.raise_for_status()


def pack_seconds(pusher: Any, tensors: dict[str, torch.Tensor], *, staging: bool, repeats: int = 3) -> float:
    """The trainer's packing alone (``group.py``'s ``_pack`` of every bucket, into a new tensor each or into a
    kept staging buffer; 0 per tensor), median of ``repeats``, no network."""
    from backends_core.types import TensorSpec
    from backends_trainer.group import Staging, _pack, _size, _wire

    buffer = Staging() if staging else None

    specs = [
        TensorSpec(name=n, dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape)) for n, t in tensors.items()
    ]
    plan = pusher._plan(specs)
    if not plan.packed:
        return 0.0
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for bucket in plan.buckets:
            parts = [_wire(tensors[s.name], "cpu") for s in bucket]
            if len(parts) == 1:
                continue
            flat = _pack(parts, None if buffer is None else buffer.take(_size(parts)))
            del flat
        times.append(time.perf_counter() - started)
    return statistics.median(times)


async def push_once(pusher: Any, tensors: dict[str, torch.Tensor], version: str) -> dict[str, float]:
    started = time.perf_counter()
    report = await pusher.push(tensors, version=version)
    wall = time.perf_counter() - started
    return {
        "wall_s": wall,
        "duration_s": report.duration_s,
        "send_s": report.send_s,
        "admin_s": report.duration_s - report.send_s,
        "buckets": report.buckets,
        "bytes": report.bytes,
    }


async def checkpoint_once(
    client: Any, ckpt_root: Path, tensors: dict[str, torch.Tensor], version: str, config_from: Path | None = None
) -> dict[str, float]:
    from backends_trainer import WeightPusher
    from backends_trainer.checkpoint import CheckpointDir

    directory = Path(tempfile.mkdtemp(prefix="push-ckpt-", dir=ckpt_root))
    try:
        pusher = WeightPusher(client, checkpoint=CheckpointDir(path=directory, config_from=config_from, keep=1))
        started = time.perf_counter()
        report = await pusher.push(tensors, version=version)
        wall = time.perf_counter() - started
        return {"wall_s": wall, "write_s": report.send_s, "sync_s": report.sync.duration_s}
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def bucket_label(bucket: int | None) -> str:
    return "per tensor" if bucket is None else f"{bucket // MIB} MiB"


async def measure_point(
    http: Any,
    client: Any,
    urls: list[str],
    tensors: dict[str, torch.Tensor],
    bucket: int | None,
    key: str,
    rounds: int,
    before: bool,
) -> dict[str, Any]:
    """One point of the sweep: ``rounds`` rounds of the floor, the engine floor, ours, ours with warm receive
    buffers (and ``before``: ours with the packing before the staging buffers), order rotated per round, on one
    group."""
    point: dict[str, Any] = {"floor_s": [], "engine_floor_s": [], "pressure": []}
    for kind in ("", "_reuse", "_fresh_pack"):
        point["ours" + kind], point["standins" + kind] = [], []
    async with group_pusher(client, len(urls), bucket) as pusher:
        point["pack_s"] = pack_seconds(pusher, tensors, staging=False)
        point["pack_staging_s"] = pack_seconds(pusher, tensors, staging=True)

        async def floor(r: int) -> None:
            point["floor_s"].append(await floor_once(pusher, http, urls, tensors))
            await standin_stats(http, urls)

        async def engine_floor(r: int) -> None:
            point["engine_floor_s"].append(await floor_once(pusher, http, urls, tensors, engine=True))
            await standin_stats(http, urls)

        async def ours(r: int) -> None:
            point["ours"].append(await push_once(pusher, tensors, f"{key}-{r}"))
            point["standins"].append(await standin_stats(http, urls))

        async def ours_reuse(r: int) -> None:
            await set_reuse(http, urls, True)
            point["ours_reuse"].append(await push_once(pusher, tensors, f"{key}-r{r}"))
            point["standins_reuse"].append(await standin_stats(http, urls))
            await set_reuse(http, urls, False)

        async def ours_fresh_pack(r: int) -> None:
            # the code before this benchmark: every packed bucket a new torch.cat result
            staging, pusher._staging = pusher._staging, None
            try:
                point["ours_fresh_pack"].append(await push_once(pusher, tensors, f"{key}-f{r}"))
            finally:
                pusher._staging = staging
            point["standins_fresh_pack"].append(await standin_stats(http, urls))

        await set_reuse(http, urls, True, clear=True)
        await push_once(pusher, tensors, f"{key}-warm")  # the stand-ins allocate their params and kept buffers
        await verify(http, urls, tensors)
        await set_reuse(http, urls, False)
        await floor_once(pusher, http, urls, tensors)
        await standin_stats(http, urls)
        kinds = [floor, engine_floor, ours, ours_reuse] + ([ours_fresh_pack] if before else [])
        for r in range(rounds):
            point["pressure"].append(c.cpu_pressure())
            for measure in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
                await measure(r)
            trim()
        await push_once(pusher, tensors, f"{key}-check")
        await verify(http, urls, tensors)
    await set_reuse(http, urls, False, clear=True)
    point["buckets"] = point["ours"][0]["buckets"]
    return point


async def sweep(args: argparse.Namespace, standins: StandIns, results: dict[str, Any]) -> None:
    import httpx

    buckets = [None if b == "none" else int(b) * MIB for b in args.buckets.split(",")]
    async with httpx.AsyncClient(timeout=600) as http:
        for size in args.sizes.split(","):
            tensors = state_dict(size)
            for servers in [int(s) for s in args.servers.split(",")]:
                urls = standins.urls[:servers]
                async with make_client(urls, standins.engine) as client:
                    for bucket in buckets:
                        key = f"{size}/{servers}/{bucket_label(bucket)}"
                        point = await measure_point(http, client, urls, tensors, bucket, key, args.rounds, args.before)
                        point |= {
                            "size": size,
                            "params": sum(t.numel() for t in tensors.values()),
                            "tensors": len(tensors),
                            "bytes": nbytes(tensors),
                            "servers": servers,
                            "bucket": bucket,
                            "engine": standins.engine,
                        }
                        results["sweep"][key] = point
                        print_point(key, point)
                        c.save(results["args"]["out"], results)
            tensors.clear()
            gc.collect()


def print_point(key: str, point: dict[str, Any]) -> None:
    floor = point["floor_s"]
    wall = [o["wall_s"] for o in point["ours"]]
    ratios = [w / f for w, f in zip(wall, floor, strict=True)]
    engine = point.get("engine_floor_s")
    if engine:
        print(
            f"{key:28s} engine floor {c.summary([f * 1e3 for f in engine])} ms  ours ÷ engine floor "
            f"{c.ratio_summary([w / f for w, f in zip(wall, engine, strict=True)])}",
            flush=True,
        )
    for kind, label in (("_fresh_pack", "before (torch.cat)"), ("_reuse", "warm receive buffers")):
        if not point["ours" + kind]:
            continue
        other = [o["wall_s"] for o in point["ours" + kind]]
        print(
            f"{key:28s} {label}: ours {c.summary([w * 1e3 for w in other])} ms  ratio "
            f"{c.ratio_summary([w / f for w, f in zip(other, floor, strict=True)])}  "
            f"send {c.summary([o['send_s'] * 1e3 for o in point['ours' + kind]])}",
            flush=True,
        )
    print(
        f"{key:28s} pack alone: new tensors {point['pack_s'] * 1e3:.0f} ms, staging "
        f"{point['pack_staging_s'] * 1e3:.0f} ms",
        flush=True,
    )
    send = [o["send_s"] for o in point["ours"]]
    admin = [o["admin_s"] for o in point["ours"]]
    first = [s[0] for s in point["standins"]]
    print(
        f"{key:28s} {point['buckets']:4d} buckets  floor {c.summary([f * 1e3 for f in floor])} ms  "
        f"ours {c.summary([w * 1e3 for w in wall])} ms  ratio {c.ratio_summary(ratios)}  "
        f"send {c.summary([s * 1e3 for s in send])}  admin {c.summary([a * 1e3 for a in admin])}  "
        f"standin alloc/recv/load {statistics.median(s.get('alloc_s', 0) for s in first) * 1e3:.0f}/"
        f"{statistics.median(s.get('recv_s', 0) for s in first) * 1e3:.0f}/"
        f"{statistics.median(s.get('load_s', 0) for s in first) * 1e3:.0f} ms",
        flush=True,
    )


async def checkpoint_part(args: argparse.Namespace, standins: StandIns, results: dict[str, Any]) -> None:
    import httpx

    ckpt_root = Path(args.ckpt_dir)
    async with httpx.AsyncClient(timeout=600) as http:
        for size in args.sizes.split(","):
            tensors = state_dict(size)
            for servers in [int(s) for s in args.servers.split(",")]:
                urls = standins.urls[:servers]
                key = f"{size}/{servers}"
                point: dict[str, Any] = {"size": size, "bytes": nbytes(tensors), "servers": servers, "runs": []}
                async with make_client(urls) as client:
                    await checkpoint_once(client, ckpt_root, tensors, f"{key}-ckpt-warm")
                    await standin_stats(http, urls)
                    for r in range(args.rounds):
                        run: dict[str, Any] = dict(await checkpoint_once(client, ckpt_root, tensors, f"{key}-ckpt-{r}"))
                        run["standins"] = await standin_stats(http, urls)
                        point["runs"].append(run)
                results["checkpoint"][key] = point
                walls = [r["wall_s"] * 1e3 for r in point["runs"]]
                writes = [r["write_s"] * 1e3 for r in point["runs"]]
                print(f"checkpoint {key:14s} wall {c.summary(walls)} ms  write {c.summary(writes)} ms", flush=True)
                c.save(results["args"]["out"], results)


# -- real SGLang ------------------------------------------------------------------------------------------


@contextlib.contextmanager
def real_sglang(logs: Path, n: int) -> Iterator[list[tuple[str, int]]]:
    """``n`` real SGLang 0.5.23 servers on the tiny model, as the live tests start them (started together)."""
    sys.path.insert(0, str(c.HERE.parent / "tests" / "live" / "sglang"))
    import sglang_server  # type: ignore[import-not-found]

    venv = sglang_server.ensure_sglang_venv()
    servers = [
        sglang_server.sglang_server(venv, tiny_model_dir(), log_path=logs / f"sglang-{i}.log", name=f"sglang-bench-{i}")
        for i in range(n)
    ]
    with contextlib.ExitStack() as stack:
        for server in servers:
            server.start()
            stack.callback(server.stop, timeout=sglang_server.STOP_TIMEOUT_S)
        for server in servers:
            server.wait_ready(sglang_server.READY_PATH, timeout=sglang_server.START_TIMEOUT_S)
            print(f"real SGLang ready at {server.url} after {server.ready_after:.0f} s", flush=True)
        yield [(server.url, server.pid) for server in servers]


def ms(runs: list[dict[str, float]], field: str = "wall_s") -> str:
    return c.summary([run[field] * 1e3 for run in runs], "{:.1f}")


def rss_tree_mb(pid: int) -> float:
    """RSS of a process and its descendants (MB)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError):
            total += c.proc_status_kb("VmRSS", p) / 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                children = (task / "children").read_text().split()
                todo += [int(x) for x in children]
    return total


async def sglang_part(args: argparse.Namespace, standins: StandIns, results: dict[str, Any], logs: Path) -> None:
    """The tiny model pushed to ``--sglang`` real SGLang 0.5.23 servers (group: per tensor and packed buckets;
    checkpoint); the same tensors pushed to as many stand-ins and broadcast raw to them, in the same run."""
    import httpx

    tensors = tiny()
    model_dir = tiny_model_dir()
    buckets = [None, MIB, 64 * MIB]  # the tiny model is 1.6 MB: per tensor, 2 buckets, 1 bucket
    ckpt_root = Path(args.ckpt_dir)
    out: dict[str, Any] = {"bytes": nbytes(tensors), "tensors": len(tensors), "points": {}}
    n = args.sglang
    urls = standins.urls[:n]
    with real_sglang(logs, n) as started:
        out["rss_mb_tree"] = [rss_tree_mb(pid) for _, pid in started]
        out["servers"] = n
        print(f"real SGLang RSS (each server's process tree): {out['rss_mb_tree']} MB", flush=True)
        async with (
            httpx.AsyncClient(timeout=600) as http,
            make_client([url for url, _ in started]) as real,
            make_client(urls) as standin,
        ):
            for bucket in buckets:
                point: dict[str, Any] = {"bucket": bucket, "real": [], "standin": [], "floor_s": []}
                async with (
                    group_pusher(real, n, bucket, reference=model_dir) as p_real,
                    group_pusher(standin, n, bucket, reference=model_dir) as p_standin,
                ):
                    await push_once(p_real, tensors, "warm")
                    await push_once(p_standin, tensors, "warm")
                    for r in range(args.rounds):
                        point["floor_s"].append(await floor_once(p_standin, http, urls, tensors))
                        point["real"].append(await push_once(p_real, tensors, f"sglang-{r}"))
                        point["standin"].append(await push_once(p_standin, tensors, f"standin-{r}"))
                        await standin_stats(http, urls)
                out["points"][bucket_label(bucket)] = point
                print(
                    f"real SGLang tiny {bucket_label(bucket):10s} ours {ms(point['real'])} ms"
                    f" (send {ms(point['real'], 'send_s')})  stand-in {ms(point['standin'])} ms"
                    f"  floor {c.summary([f * 1e3 for f in point['floor_s']], '{:.2f}')} ms",
                    flush=True,
                )
            runs: dict[str, list[dict[str, float]]] = {"real": [], "standin": []}
            await checkpoint_once(real, ckpt_root, tensors, "ckpt-warm", config_from=model_dir)
            for r in range(args.rounds):
                runs["real"].append(await checkpoint_once(real, ckpt_root, tensors, f"ckpt-{r}", config_from=model_dir))
                runs["standin"].append(await checkpoint_once(standin, ckpt_root, tensors, f"ckpt-s{r}"))
            out["checkpoint"] = runs
            print(f"real SGLang tiny checkpoint {ms(runs['real'])} ms  stand-in {ms(runs['standin'])} ms", flush=True)
            # leave the server as it started: the original tensors are what was pushed; the version is ours
    results[f"sglang{n}"] = out
    c.save(results["args"]["out"], results)


# -- main -------------------------------------------------------------------------------------------------


# -- the report (markdown tables from the saved results) -------------------------------------------------


def _ms(values: list[float]) -> str:
    return c.summary([v * 1e3 for v in values])


def _paired(ours: list[dict[str, Any]], floor: list[float]) -> str:
    return c.ratio_summary([o["wall_s"] / f for o, f in zip(ours, floor, strict=True)])


def _standin(point: dict[str, Any], field: str) -> float:
    """Median over rounds of the slowest stand-in's ``field`` (ms)."""
    return float(statistics.median(max(s.get(field, 0.0) for s in stands) for stands in point["standins"])) * 1e3


def _rest(point: dict[str, Any]) -> str:
    """Per round: ours minus the engine floor minus the slowest stand-in's load into its parameters (what is left
    for the HTTP calls, the admin part and the trainer's side), median [min-max] in ms."""
    rest = [
        (o["wall_s"] - f - max(s.get("load_s", 0.0) for s in stands)) * 1e3
        for o, f, stands in zip(point["ours"], point["engine_floor_s"], point["standins"], strict=True)
    ]
    return c.summary(rest)


def report(results: dict[str, Any]) -> str:
    out = []
    sweep = results.get("sweep", {})
    if sweep:
        best: dict[tuple[str, int], float] = {}
        for point in sweep.values():
            k = (point["size"], point["servers"])
            best[k] = min(best.get(k, float("inf")), statistics.median(point["floor_s"]))
        engine = all(point.get("engine_floor_s") for point in sweep.values())
        before = all(point["ours_fresh_pack"] for point in sweep.values())
        rows = []
        for point in sweep.values():
            ours = point["ours"]
            row = [
                f"{point['size']} ({point['bytes'] / 1e6:.0f} MB)",
                point["servers"],
                bucket_label(point["bucket"]),
                point["buckets"],
                _ms(point["floor_s"]),
            ]
            row += [_ms(point["engine_floor_s"])] if engine else []
            row += [
                _ms([o["wall_s"] for o in ours]),
                f"**{_paired(ours, point['floor_s'])}**",
            ]
            row += [f"**{_paired(ours, point['engine_floor_s'])}**", _rest(point)] if engine else []
            row += [f"{statistics.median(o['wall_s'] for o in ours) / best[(point['size'], point['servers'])]:.2f}"]
            row += [_paired(point["ours_fresh_pack"], point["floor_s"])] if before else []
            row += [
                _paired(point["ours_reuse"], point["floor_s"]),
                _ms([o["send_s"] for o in ours]),
                _ms([o["admin_s"] for o in ours]),
                " / ".join(f"{_standin(point, field):.0f}" for field in ("alloc_s", "recv_s", "load_s")),
                f"{point['pack_s'] * 1e3:.0f} / {point['pack_staging_s'] * 1e3:.0f}",
            ]
            rows.append(row)
        header = ["model", "servers", "bucket", "broadcasts", "floor ms"]
        header += ["engine floor ms"] if engine else []
        header += ["ours ms", "ours ÷ floor"]
        header += ["ours ÷ engine floor", "ours − engine floor − load ms"] if engine else []
        header += ["÷ best floor"]
        header += ["before ÷ floor"] if before else []
        header += [
            "warm receivers ÷ floor",
            "send ms",
            "admin ms",
            "stand-in alloc / recv / load ms",
            "pack alone ms (new / staging)",
        ]
        out.append(c.table(header, rows))
    checkpoint = results.get("checkpoint", {})
    if checkpoint:
        rows = []
        for key, point in checkpoint.items():
            size, servers = key.split("/")
            group = [p for p in sweep.values() if p["size"] == size and p["servers"] == int(servers)]
            push = min((statistics.median(o["wall_s"] for o in p["ours"]) for p in group), default=float("nan"))
            floor = min((statistics.median(p["floor_s"]) for p in group), default=float("nan"))
            walls = [r["wall_s"] for r in point["runs"]]
            rows.append(
                [
                    f"{size} ({point['bytes'] / 1e6:.0f} MB)",
                    servers,
                    _ms([r["write_s"] for r in point["runs"]]),
                    _ms([r["sync_s"] for r in point["runs"]]),
                    _ms(walls),
                    f"{statistics.median(walls) / push:.2f}",
                    f"{statistics.median(walls) / floor:.2f}",
                ]
            )
        out.append(
            c.table(
                ["model", "servers", "write ms", "weight_sync ms", "total ms", "÷ best group push", "÷ best floor"],
                rows,
            )
        )
    for key in sorted(k for k in results if k.startswith("sglang")):
        real = results[key]
        rows = []
        for label, point in real["points"].items():
            rows.append(
                [
                    real["servers"],
                    label,
                    _ms([o["wall_s"] for o in point["real"]]),
                    _ms([o["send_s"] for o in point["real"]]),
                    _ms([o["admin_s"] for o in point["real"]]),
                    _ms([o["wall_s"] for o in point["standin"]]),
                    c.summary([f * 1e3 for f in point["floor_s"]], "{:.1f}"),
                    _paired(point["real"], point["floor_s"]),
                ]
            )
        ckpt = real.get("checkpoint", {})
        if ckpt:
            rows.append(
                [
                    real["servers"],
                    "checkpoint (write + weight_sync(path=))",
                    _ms([o["wall_s"] for o in ckpt["real"]]),
                    _ms([o["write_s"] for o in ckpt["real"]]),
                    _ms([o["sync_s"] for o in ckpt["real"]]),
                    _ms([o["wall_s"] for o in ckpt["standin"]]),
                    "",
                    "",
                ]
            )
        out.append(
            c.table(
                [
                    "real SGLang servers",
                    "push",
                    "ours ms",
                    "send (write) ms",
                    "admin (sync) ms",
                    "same push to stand-ins ms",
                    "floor ms",
                    "ours ÷ floor",
                ],
                rows,
            )
        )
    return "\n\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", default="bench", choices=["bench", "standin", "report"])
    parser.add_argument("results", nargs="*", type=Path, help="report: results files (bench/results/push*.json)")
    parser.add_argument("--url-file", type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", default="tiny,50m,200m")
    parser.add_argument("--servers", default="1,4")
    parser.add_argument("--buckets", default="none,1,16,64,256", help="MiB, or none (one broadcast per tensor)")
    parser.add_argument("--parts", default="sweep,checkpoint")
    parser.add_argument("--sglang", type=int, default=0, help="also the tiny model on this many real SGLang 0.5.23")
    parser.add_argument("--ckpt-dir", default=str(Path(tempfile.gettempdir()) / "bench-push-ckpt"))
    parser.add_argument("--out", default="push")
    parser.add_argument(
        "--engine",
        default="sglang",
        choices=["sglang", "vllm"],
        help="whose receive the stand-ins run (vllm: --parts sweep only, no --sglang)",
    )
    parser.add_argument(
        "--before", action="store_true", help="also push with the packing before the staging buffers (torch.cat)"
    )
    args = parser.parse_args()
    if args.engine == "vllm" and args.mode == "bench" and (args.sglang or args.parts != "sweep"):
        parser.error("--engine vllm runs the size sweep only: give --parts sweep and no --sglang")
    if args.mode == "standin":
        run_standin(args.url_file, args.engine)
        return
    if args.mode == "report":
        for path in args.results:
            results = json.loads(path.read_text())
            engine = results["args"].get("engine", "sglang")
            print(f"## {path} (stand-ins receiving as {engine} does)\n\n{report(results)}\n")
        return
    results: dict[str, Any] = {
        "machine": c.machine() | {"torch": torch.__version__, "load_at_start": os.getloadavg()},
        "args": vars(args),
        "sweep": {},
        "checkpoint": {},
    }
    Path(args.ckpt_dir).mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="bench-push-"))
    n = max([int(s) for s in args.servers.split(",")] + [args.sglang])
    standins = StandIns(n, logs, args.engine)
    print(f"{n} stand-ins up ({logs}); machine {results['machine']}", flush=True)

    async def run() -> None:
        parts = args.parts.split(",")
        if args.sglang:
            await sglang_part(args, standins, results, logs)
        if "sweep" in parts:
            await sweep(args, standins, results)
        if "checkpoint" in parts:
            await checkpoint_part(args, standins, results)

    try:
        asyncio.run(run())
    finally:
        standins.close()
        results["machine"]["load_at_end"] = os.getloadavg()
        results["machine"]["cpu_pressure_at_end"] = c.cpu_pressure()
        c.save(args.out, results)


if __name__ == "__main__":
    main()
