"""Every emulator stands on the test kit's one EmulatorBase: routing, auth levels, error answers, the request log,
and the three ways of serving it (in-process transport, ASGI, a real port)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from backends_testkit import emulators
from backends_testkit.emulator import GET, EmulatorBase, HttpError, Route, json_reply
from backends_testkit.emulators import make_emulator
from backends_testkit.engine import ReferenceEngine
from backends_testkit.tinymodel import TinyModels


class Boom(Exception):
    pass


class Mapped(Exception):
    pass


class AcmeEmulator(EmulatorBase):
    def routes(self) -> dict[str, Route]:
        return {
            "/health": Route(self._ok, methods=GET, level="open"),
            "/generate": Route(self._ok),
            "/pause": Route(self._ok, level="admin"),
            "/teapot": Route(self._teapot),
            "/boom": Route(self._boom),
            "/mapped": Route(self._mapped),
        }

    def error_response(self, exc: Exception) -> httpx.Response | None:
        return json_reply(400, {"mapped": str(exc)}) if isinstance(exc, Mapped) else None

    async def _ok(self, request: httpx.Request) -> httpx.Response:
        return json_reply(200, {"path": request.url.path})

    async def _teapot(self, request: httpx.Request) -> httpx.Response:
        raise HttpError(json_reply(418, {"short": "stout"}))

    async def _boom(self, request: httpx.Request) -> httpx.Response:
        raise Boom("unmapped")

    async def _mapped(self, request: httpx.Request) -> httpx.Response:
        raise Mapped("a refusal in the server's own form")


@pytest.fixture
async def engine(tiny_models: TinyModels) -> AsyncIterator[ReferenceEngine]:
    async with ReferenceEngine(tiny_models.dense, seed=0) as eng:
        yield eng


def call(emulator: EmulatorBase, method: str, path: str, key: str | None = None) -> httpx.Request:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.Request(method, f"http://emulator{path}", headers=headers, content=b"{}")


async def test_routes_methods_errors_and_the_request_log(engine: ReferenceEngine) -> None:
    emulator = AcmeEmulator(engine)
    assert (await emulator.handle(call(emulator, "GET", "/health"))).json() == {"path": "/health"}
    assert (await emulator.handle(call(emulator, "POST", "/nowhere"))).status_code == 404
    assert (await emulator.handle(call(emulator, "GET", "/generate"))).status_code == 405
    teapot = await emulator.handle(call(emulator, "POST", "/teapot"))
    assert (teapot.status_code, teapot.json()) == (418, {"short": "stout"})
    mapped = await emulator.handle(call(emulator, "POST", "/mapped"))
    assert (mapped.status_code, mapped.json()) == (400, {"mapped": "a refusal in the server's own form"})
    with pytest.raises(Boom):  # an exception the emulator does not map is a bug of the emulator, not an answer
        await emulator.handle(call(emulator, "POST", "/boom"))
    assert list(emulator.requests) == [
        ("GET", "/health"),
        ("POST", "/nowhere"),
        ("GET", "/generate"),
        ("POST", "/teapot"),
        ("POST", "/mapped"),
        ("POST", "/boom"),
    ]


async def test_the_request_log_keeps_the_newest(engine: ReferenceEngine) -> None:
    emulator = AcmeEmulator(engine, log_size=2)
    for path in ("/a", "/b", "/c"):
        await emulator.handle(call(emulator, "GET", path))
    assert list(emulator.requests) == [("GET", "/b"), ("GET", "/c")]


@pytest.mark.parametrize(
    ("path", "key", "status"),
    [
        ("/health", None, 200),  # open routes need no key
        ("/generate", None, 401),
        ("/generate", "user", 200),
        ("/generate", "admin", 401),  # the admin key is not the API key
        ("/pause", "user", 401),  # with an admin key set, the API key does not open admin routes
        ("/pause", "admin", 200),
        ("/nowhere", None, 401),  # an unknown route is checked like a normal one before its 404
        ("/nowhere", "user", 404),
    ],
)
async def test_bearer_keys_by_route_level(engine: ReferenceEngine, path: str, key: str | None, status: int) -> None:
    emulator = AcmeEmulator(engine, api_key="user", admin_api_key="admin")
    method = "GET" if path == "/health" else "POST"
    assert (await emulator.handle(call(emulator, method, path, key))).status_code == status


async def test_transport_asgi_and_a_real_port_serve_the_same_answers(engine: ReferenceEngine) -> None:
    emulator = AcmeEmulator(engine)
    transports: list[tuple[str, httpx.AsyncBaseTransport | None]] = [
        ("http://emulator", emulator.transport()),
        ("http://emulator", httpx.ASGITransport(app=emulator.asgi())),
    ]
    answers = []
    for base_url, transport in transports:
        async with httpx.AsyncClient(base_url=base_url, transport=transport) as client:
            answers.append([(r.status_code, r.content) for r in [await client.get("/health"), await client.get("/x")]])
    async with emulator.serve() as url, httpx.AsyncClient(base_url=url) as client:
        answers.append([(r.status_code, r.content) for r in [await client.get("/health"), await client.get("/x")]])
    assert answers[0] == answers[1] == answers[2]
    assert answers[0][0] == (200, b'{"path": "/health"}') and answers[0][1][0] == 404


def test_a_class_without_routes_says_so(engine_free_emulator: EmulatorBase) -> None:
    with pytest.raises(NotImplementedError, match="must define routes"):
        engine_free_emulator.find_route(httpx.Request("GET", "http://emulator/"))


@pytest.fixture
def engine_free_emulator() -> EmulatorBase:
    return EmulatorBase(engine=None)  # type: ignore[arg-type]  # routing never touches the engine


@pytest.mark.parametrize("backend", ["reference", "vllm", "sglang", "dynamo"])
async def test_every_registered_emulator_stands_on_the_base(engine: ReferenceEngine, backend: str) -> None:
    emulator = make_emulator(backend, engine)
    assert isinstance(emulator, EmulatorBase)
    unknown = await emulator.handle(httpx.Request("GET", "http://emulator/no/such/route"))
    assert unknown.status_code == 404
    assert len(emulator.requests) == 1 and emulator.requests[-1][0] == "GET"
    assert emulator.requests[-1][1].endswith("/no/such/route")


class LegacyEntryPoint:
    """An entry point whose factory returns a bare handler object, not an emulator on the base."""

    name, value = "acme", "backends_acme.testing:make_emulator"

    def load(self) -> object:
        return lambda engine, routed_experts: {"handle": None}


def test_a_factory_that_returns_something_else_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(emulators.md, "entry_points", lambda group: [LegacyEntryPoint()])
    with pytest.raises(TypeError, match=r"'backends_acme.testing:make_emulator' of backend 'acme' returned a dict"):
        make_emulator("acme", engine=None)  # type: ignore[arg-type]
