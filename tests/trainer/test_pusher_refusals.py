"""``WeightPusher`` refuses what cannot work before anything is sent: a typed error naming what was wrong, and
not one request reaches the server (a vLLM emulator in-process, every request it receives recorded)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file

from backends_core import Client, ClientConfig, DistributedGroup
from backends_core.errors import InvalidRequestError
from backends_testkit.engine import ReferenceEngine
from backends_trainer import CheckpointDir, WeightPusher
from backends_vllm_testing import VllmEmulator

HOSTS = ("s0", "s1")
DEADLINE_S = 30.0


class Server:
    """Emulators behind one transport, with every request they were sent; ``gate`` holds ``/pause`` while set."""

    def __init__(self, emulators: dict[str, VllmEmulator]) -> None:
        self.emulators = emulators
        self.sent: list[httpx.Request] = []
        self.gate: asyncio.Event | None = None
        self.pausing = asyncio.Event()

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(request)
        if request.url.path == "/pause" and self.gate is not None:
            self.pausing.set()
            await self.gate.wait()
        return await self.emulators[request.url.host].handle(request)


@pytest.fixture
async def server(tiny_models) -> AsyncIterator[Server]:
    engines = [ReferenceEngine(tiny_models.dense, seed=i) for i in range(len(HOSTS))]
    try:
        yield Server({h: VllmEmulator(e) for h, e in zip(HOSTS, engines, strict=True)})
    finally:
        for e in engines:
            await e.aclose()


@pytest.fixture
async def client(server: Server) -> AsyncIterator[Client]:
    config = ClientConfig(backend="vllm", base_url=[f"http://{h}" for h in HOSTS], model="tiny-qwen3")
    async with Client(config, transport=httpx.MockTransport(server.handle)) as c:
        yield c


@pytest.fixture
def weights(tiny_models) -> dict[str, torch.Tensor]:
    return load_file(str(Path(tiny_models.dense) / "model.safetensors"))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def group(**changes: Any) -> DistributedGroup:
    fields: dict[str, Any] = {
        "master_address": "127.0.0.1",
        "master_port": free_port(),
        "world_size": 1 + len(HOSTS),
        "rank_offset": 1,
        "backend": "gloo",
        "group_name": "refusals",
    }
    return DistributedGroup(**(fields | changes))


def pusher(client: Client, tmp_path: Path, reference: Any, config_from: Path | None = None) -> WeightPusher:
    target = CheckpointDir(path=tmp_path / "ckpt", config_from=config_from)
    return WeightPusher(client, checkpoint=target, reference=reference)


# -- what a push carries ---------------------------------------------------------------------------------------


async def test_a_tensor_the_model_does_not_have_is_named(client, server, tiny_models, tmp_path, weights) -> None:
    p = pusher(client, tmp_path, tiny_models.dense)
    with pytest.raises(InvalidRequestError) as caught:
        await p.push({**weights, "model.layers.9.mlp.up_proj.weight": torch.zeros(128, 64)}, version="v1")
    assert "'model.layers.9.mlp.up_proj.weight': the model has no such tensor" in str(caught.value)
    assert server.sent == []
    assert not (tmp_path / "ckpt").exists()  # not even the checkpoint was written


@pytest.mark.parametrize(
    ("tensor", "said"),
    [
        (torch.zeros(64, dtype=torch.bfloat16), "bfloat16 [64] given, the model's is float32 [64]"),
        (torch.zeros(32), "float32 [32] given, the model's is float32 [64]"),
    ],
    ids=["dtype", "shape"],
)
async def test_a_dtype_or_shape_that_disagrees_with_the_reference_is_named(
    client, server, tiny_models, tmp_path, weights, tensor, said
) -> None:
    p = pusher(client, tmp_path, tiny_models.dense)
    with pytest.raises(InvalidRequestError) as caught:
        await p.push({**weights, "model.norm.weight": tensor}, version="v1")
    assert f"'model.norm.weight': {said}" in str(caught.value)
    assert "1 tensor(s) do not fit the checkpoint" in str(caught.value)
    assert server.sent == []


@pytest.mark.parametrize(
    "reference",
    ["module", "state_dict", "shapes"],
)
async def test_every_kind_of_reference_checks_alike(client, server, tmp_path, weights, reference) -> None:
    module = torch.nn.Linear(64, 32, bias=False)
    ref: Any = {
        "module": module,
        "state_dict": module.state_dict(),
        "shapes": {"weight": ("torch.float32", [32, 64])},
    }[reference]
    p = pusher(client, tmp_path, ref)
    with pytest.raises(
        InvalidRequestError, match=r"'weight': float32 \[64, 32\] given, the model's is float32 \[32, 64\]"
    ):
        await p.push({"weight": torch.zeros(64, 32)}, version="v1")
    assert server.sent == []


@pytest.mark.parametrize(
    ("tensors", "said"),
    [
        ({}, "named_tensors is empty"),
        ([("a", torch.zeros(1)), ("a", torch.zeros(1))], "tensor 'a' is given twice"),
        ({"a": [1.0]}, "tensor 'a' must be a torch.Tensor, got list"),
        ([("a",)], r"named_tensors\[0\] must be a \(name, tensor\) pair"),
        (42, "named_tensors must be a mapping or pairs of name and tensor, got int"),
    ],
    ids=["empty", "twice", "not-a-tensor", "not-a-pair", "not-iterable"],
)
async def test_malformed_tensors_are_refused(client, server, tmp_path, tensors, said) -> None:
    with pytest.raises(InvalidRequestError, match=said):
        await pusher(client, tmp_path, None).push(tensors, version="v1")
    assert server.sent == []


@pytest.mark.parametrize("version", ["", "  ", None, 3])
async def test_a_blank_version_is_refused(client, server, tmp_path, weights, version) -> None:
    with pytest.raises(InvalidRequestError, match="version must be a non-empty string"):
        await pusher(client, tmp_path, None).push(weights, version=version)
    assert server.sent == []


async def test_a_push_while_another_runs_is_refused_and_sends_nothing(
    client, server, tiny_models, tmp_path, weights
) -> None:
    p = pusher(client, tmp_path, None, config_from=tiny_models.dense)
    server.gate = asyncio.Event()
    first = asyncio.ensure_future(p.push(weights, version="v1"))
    try:
        async with asyncio.timeout(DEADLINE_S):
            await server.pausing.wait()
        before = len(server.sent)
        with pytest.raises(InvalidRequestError, match=r"a push is running \(version 'v1'\): one push at a time"):
            await p.push(weights, version="v2")
        assert len(server.sent) == before
    finally:
        server.gate.set()
    async with asyncio.timeout(DEADLINE_S):
        report = await first
    assert report.version == "v1"
    assert [e.engine.weight_version for e in server.emulators.values()] == ["v1", "v1"]
    assert [str(r.url.path) for r in server.sent].count("/pause") == 2  # the first push's only


# -- how the pusher is built -----------------------------------------------------------------------------------


async def test_exactly_one_of_group_and_checkpoint(client, server, tmp_path) -> None:
    with pytest.raises(InvalidRequestError, match="exactly one of group= and checkpoint="):
        WeightPusher(client)
    with pytest.raises(InvalidRequestError, match="exactly one of group= and checkpoint="):
        WeightPusher(client, group=group(), checkpoint=tmp_path)
    assert server.sent == []


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"bucket_bytes": 0}, "group.bucket_bytes must be a positive int or None, got 0"),
        ({"bucket_bytes": -5}, "group.bucket_bytes must be a positive int or None, got -5"),
        ({"bucket_bytes": True}, "group.bucket_bytes must be a positive int or None, got True"),
        ({"bucket_bytes": 1.5}, "group.bucket_bytes must be a positive int or None, got 1.5"),
        ({"backend": "mpi"}, "group.backend must be 'gloo' or 'nccl', got 'mpi'"),
        ({"master_port": 70000}, "group.master_port must be a TCP port, got 70000"),
        ({"world_size": 0}, "group.world_size must be a positive int, got 0"),
    ],
)
async def test_a_group_that_cannot_work_is_refused_when_built(client, server, changes, said) -> None:
    with pytest.raises(InvalidRequestError, match=said.replace("(", r"\(").replace(")", r"\)")):
        WeightPusher(client, group=group(**changes))
    assert server.sent == []


@pytest.mark.parametrize("world_size", [2, 4])
async def test_a_group_whose_world_size_does_not_fit_the_fleet_is_refused_at_start(client, server, world_size) -> None:
    p = WeightPusher(client, group=group(world_size=world_size))
    with pytest.raises(InvalidRequestError) as caught:
        await p.start()
    assert f"group.world_size is {world_size} but the fleet needs 3" in str(caught.value)
    assert "rank_offset 1 + 2 server(s) x 1 rank(s) each (http://s0, http://s1)" in str(caught.value)
    assert server.sent == []
    assert not p.started


async def test_a_group_push_before_start_is_refused(client, server, weights) -> None:
    with pytest.raises(InvalidRequestError, match=r"the group is not formed: call start\(\)"):
        await WeightPusher(client, group=group()).push(weights, version="v1")
    assert server.sent == []


async def test_other_bad_arguments_are_refused_when_built(client, server, tmp_path) -> None:
    for kwargs, said in [
        ({"ranks_per_server": 0}, "ranks_per_server must be a positive int, got 0"),
        ({"group_timeout_s": 0}, "group_timeout_s must be a positive number, got 0"),
        ({"mode": "later"}, "mode must be one of"),
        ({"reference": 3}, "reference must be a torch module"),
        ({"reference": tmp_path}, "holds no safetensors file"),
    ]:
        with pytest.raises(InvalidRequestError, match=said):
            WeightPusher(client, checkpoint=tmp_path, **kwargs)
    assert server.sent == []
