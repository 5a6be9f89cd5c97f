"""What the documented loggers report: retries (``backends_core.server``), failover and cooldown
(``backends_core.balancer``), admin operations and weight-sync phases (``backends_core.fleet``), members joining
and leaving (``backends_core.membership``); each line names the server and the request; never a key.
(Re-renders, ``backends_core.multiturn``: tests/core/test_stateless.py.)"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import httpx
import pytest

import backends_core
from backends_core import AdminError, AdminPolicy, Client, ClientConfig, NetworkError, RetryPolicy, SamplingParams
from backends_core.server import Server
from backends_testkit.engine import ReferenceEngine
from backends_testkit.reference.emulator import ReferenceEmulator

Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]
HOSTS = ["s0", "s1", "s2"]
SECRET = "sk-live-0123456789abcdef"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def fleet(tiny_models):
    engines = [ReferenceEngine(tiny_models.dense, seed=i) for i in range(len(HOSTS))]
    yield {host: ReferenceEmulator(e) for host, e in zip(HOSTS, engines, strict=True)}
    for e in engines:
        await e.aclose()


def routed(handlers: dict[str, Handler]) -> httpx.MockTransport:
    async def handle(request: httpx.Request) -> httpx.Response:
        return await handlers[request.url.host](request)

    return httpx.MockTransport(handle)


def config(tiny_models, hosts: list[str], **kw) -> ClientConfig:
    return ClientConfig(backend="reference", base_url=[f"http://{h}" for h in hosts], model="tiny-qwen3", **kw)


def lines(caplog: pytest.LogCaptureFixture, logger: str) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == logger]


async def test_a_retried_request_logs_the_retry_with_its_server_and_request_but_never_the_key(
    fleet, tiny_models, caplog, monkeypatch
) -> None:
    monkeypatch.setenv("INFER_API_KEY", SECRET)
    answers = iter(["refuse", "503"])

    async def flaky(request: httpx.Request) -> httpx.Response:
        assert request.headers["authorization"] == f"Bearer {SECRET}"
        step = next(answers, None)
        if step == "refuse":  # the transport's words may carry what was sent: they are redacted
            raise httpx.ConnectError(f"refused (sent authorization: Bearer {SECRET})", request=request)
        if step == "503":
            return httpx.Response(503, headers={"retry-after": "0"}, json={"echo": f"Bearer {SECRET}"})
        return await fleet["s0"].handle(request)

    cfg = config(tiny_models, ["s0"], api_key_var="INFER_API_KEY", retry=RetryPolicy(attempts=3, backoff=0))
    with caplog.at_level(logging.DEBUG, logger="backends_core"):
        async with Client(cfg, transport=routed({"s0": flaky})) as client:
            result = await client.generate(prompt_ids=[1, 2], sampling=SamplingParams(max_tokens=2), request_id="r-7")
    assert result.completion_ids
    assert lines(caplog, "backends_core.server") == [
        (
            logging.INFO,
            "POST http://s0/generate: ConnectError: refused (sent authorization: Bearer <redacted>) "
            "(attempt 1 of 3); retrying in 0.00 s [request r-7]",
        ),
        (logging.INFO, "POST http://s0/generate: status 503 (attempt 2 of 3); retrying in 0.00 s [request r-7]"),
    ]
    assert SECRET not in caplog.text


async def test_a_password_in_a_server_url_is_not_logged(caplog) -> None:
    calls = []

    def refuse_once(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) == 1:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json={})

    transport = httpx.MockTransport(refuse_once)
    server = Server(
        base_url="http://user:hunter2@data",
        admin_url="http://user:hunter2@data",
        data_client=httpx.AsyncClient(transport=transport),
        admin_client=httpx.AsyncClient(transport=transport),
        retry=RetryPolicy(attempts=2, backoff=0),
    )
    with caplog.at_level(logging.INFO, logger="backends_core.server"):
        assert await server.request("GET", "/health") == {}
    assert lines(caplog, "backends_core.server") == [
        (
            logging.INFO,
            "GET http://<redacted>@data/health: ConnectError: refused (attempt 1 of 2); retrying in 0.00 s "
            "[request None]",
        )
    ]


async def test_nothing_is_logged_below_the_level_asked_for(fleet, tiny_models, caplog) -> None:
    answers = iter(["503"])

    async def flaky(request: httpx.Request) -> httpx.Response:
        if next(answers, None) == "503":
            return httpx.Response(503)
        return await fleet["s0"].handle(request)

    cfg = config(tiny_models, ["s0"], retry=RetryPolicy(attempts=2, backoff=0))
    with caplog.at_level(logging.WARNING, logger="backends_core"):
        async with Client(cfg, transport=routed({"s0": flaky})) as client:
            await client.generate(prompt_ids=[1, 2], sampling=SamplingParams(max_tokens=2))
    assert lines(caplog, "backends_core.server") == []


async def test_failover_and_cooldown_are_logged_with_the_server_and_request(fleet, tiny_models, caplog) -> None:
    down = {"s0": True}

    async def s0(request: httpx.Request) -> httpx.Response:
        if down["s0"]:
            raise httpx.ConnectError("connection refused", request=request)
        return await fleet["s0"].handle(request)

    handlers = {h: e.handle for h, e in fleet.items()} | {"s0": s0}
    clock = Clock()
    with caplog.at_level(logging.INFO, logger="backends_core"):
        async with Client(config(tiny_models, HOSTS), transport=routed(handlers)) as client:
            client.balancer._clock = clock
            for i in range(3):  # the first pick is s0: it refuses, the request goes elsewhere
                await client.generate(prompt_ids=[1, 2], sampling=SamplingParams(max_tokens=2), request_id=f"r{i}")
            with pytest.raises(NetworkError):
                await client.generate(
                    prompt_ids=[1, 2], server=0, request_id="pinned", sampling=SamplingParams(max_tokens=16)
                )
            down["s0"] = False
            clock.now += 5.0
            await client.generate(
                prompt_ids=[1, 2], server=0, request_id="probe", sampling=SamplingParams(max_tokens=16)
            )
    assert lines(caplog, "backends_core.balancer") == [
        (
            logging.WARNING,
            "http://s0 unreachable (ConnectError): out of rotation for 5 s (cooldown); "
            "request r0 fails over to another server",
        ),
        (
            logging.WARNING,
            "http://s0 unreachable (ConnectError): out of rotation for 5 s (cooldown); "
            "request pinned was pinned to it: not sent elsewhere",
        ),
        (logging.INFO, "http://s0 answered again after 2 failure(s): back in rotation [request probe]"),
    ]


async def test_admin_operations_and_weight_sync_phases_are_logged(fleet, tiny_models, caplog) -> None:
    down = {"s1": False}

    async def s1(request: httpx.Request) -> httpx.Response:
        if down["s1"]:
            raise httpx.ConnectError("connection refused", request=request)
        return await fleet["s1"].handle(request)

    handlers = {h: e.handle for h, e in fleet.items()} | {"s1": s1}
    cfg = config(tiny_models, HOSTS, admin=AdminPolicy(retries=0))
    async with Client(cfg, transport=routed(handlers)) as client:
        with caplog.at_level(logging.INFO, logger="backends_core.fleet"):
            await client.admin.weight_sync(path=str(tiny_models.dense), version="v2")
        sync = lines(caplog, "backends_core.fleet")
        caplog.clear()
        down["s1"] = True
        with caplog.at_level(logging.INFO, logger="backends_core.fleet"), pytest.raises(AdminError):
            await client.admin.flush_cache()
        failed = lines(caplog, "backends_core.fleet")
    phases = [m for level, m in sync if m.startswith("weight_sync") and level == logging.INFO]
    assert phases == [
        "weight_sync to 'v2' on 3 server(s): pause (wait)",
        "weight_sync to 'v2': pause ok on 3 server(s)",
        "weight_sync to 'v2': update ok on 3 server(s)",
        "weight_sync to 'v2': flush ok on 3 server(s)",
        "weight_sync to 'v2': resume ok on 3 server(s)",
        "weight_sync to 'v2': verify ok on 3 server(s)",
        phases[-1],
    ]
    assert phases[-1].startswith("weight_sync to 'v2' done on 3 server(s) in ")
    per_server = sorted(m.split(": done in")[0] for level, m in sync if ": done in" in m)
    assert per_server == sorted(
        f"admin_{op} on http://{h}" for op in ("pause", "update_weights", "flush_cache", "resume") for h in HOSTS
    )  # state (verify) is a read: logged only when it fails
    assert [level for level, _ in sync] == [logging.INFO] * len(sync)
    (warning,) = [m for level, m in failed if level == logging.WARNING]
    assert warning.startswith("admin_flush_cache on http://s1 failed after ")
    assert warning.endswith(": NetworkError: ConnectError: connection refused (POST http://s1/flush_cache)")
    assert [m.split(": done")[0] for level, m in failed if level == logging.INFO] == [
        "admin_flush_cache on http://s0",
        "admin_flush_cache on http://s2",
    ]


async def test_a_failed_weight_sync_phase_is_a_warning_naming_the_server(fleet, tiny_models, caplog) -> None:
    async def s2(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/update_weights":
            return httpx.Response(500, json={"error": "disk full"})
        return await fleet["s2"].handle(request)

    handlers = {h: e.handle for h, e in fleet.items()} | {"s2": s2}
    async with Client(config(tiny_models, HOSTS, admin=AdminPolicy(retries=0)), transport=routed(handlers)) as client:
        with caplog.at_level(logging.INFO, logger="backends_core.fleet"), pytest.raises(AdminError):
            await client.admin.weight_sync(path=str(tiny_models.dense), version="v3")
    warnings = [m for level, m in lines(caplog, "backends_core.fleet") if level == logging.WARNING]
    assert warnings[0].startswith("admin_update_weights on http://s2 failed after ")
    assert warnings[1].startswith(
        "weight_sync to 'v3': update failed on 1 of 3 server(s): http://s2: ServerStatusError"
    )
    assert warnings[2].startswith("weight_sync to 'v3' failed in its update phase after ")


async def test_members_joining_and_leaving_are_logged(fleet, tiny_models, caplog) -> None:
    handlers = {h: e.handle for h, e in fleet.items()}
    async with Client(config(tiny_models, ["s0", "s1"]), transport=routed(handlers)) as client:
        with caplog.at_level(logging.INFO, logger="backends_core.membership"):
            await client.fleet.add("http://s2")
            await client.fleet.remove("http://s0")
    assert lines(caplog, "backends_core.membership") == [
        (logging.INFO, "http://s2 joined the fleet (caught up to weight version default)"),
        (logging.INFO, "http://s0 left the fleet (removed; 0 request(s) in flight)"),
    ]


def test_the_library_prints_nothing_until_the_application_configures_logging() -> None:
    handlers = logging.getLogger(backends_core.__name__).handlers
    assert [type(h) for h in handlers] == [logging.NullHandler]  # Python's last-resort stderr handler stays unused
