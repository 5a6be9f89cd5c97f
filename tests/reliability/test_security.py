"""Secrets stay secret; TLS is verified by default; admin calls never follow redirects."""

from __future__ import annotations

import logging
import ssl
import subprocess

import httpx
import pytest

from backends_core import (
    AdminError,
    Client,
    ClientConfig,
    ConfigError,
    NetworkError,
    RetryPolicy,
    SamplingParams,
    ServerStatusError,
)
from backends_core.cli import main
from backends_testkit.engine import ReferenceEngine
from backends_testkit.http_server import serve
from backends_testkit.reference.emulator import ReferenceEmulator

SECRET = "sk-live-THIS-MUST-NEVER-LEAK-42"


async def test_the_api_key_is_sent_but_never_logged_shown_or_put_in_errors(monkeypatch, caplog, tiny_models) -> None:
    monkeypatch.setenv("INFER_API_KEY", SECRET)
    engine = ReferenceEngine(tiny_models.dense)
    emulator = ReferenceEmulator(engine)
    seen = []

    async def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        if request.url.path == "/pause":
            return httpx.Response(500, json={"error": "boom", "echo": dict(request.headers)})
        return await emulator.handle(request)

    config = ClientConfig(backend="reference", base_url="http://ref", model="tiny-qwen3", api_key_var="INFER_API_KEY")
    errors: list[BaseException] = []
    with caplog.at_level(logging.DEBUG):
        async with Client(config, transport=httpx.MockTransport(handle)) as client:
            await client.generate(prompt_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=16))
            try:
                await client.admin.pause()
            except AdminError as exc:
                errors.append(exc)
    await engine.aclose()
    assert seen[0] == f"Bearer {SECRET}"
    assert SECRET not in repr(config) and SECRET not in str(config.to_mapping())
    assert SECRET not in caplog.text
    for exc in errors:
        # the server echoed our headers back in its error body: the body is kept, the key is not shown
        assert SECRET not in str(exc) and SECRET not in repr(exc)


def test_the_cli_never_echoes_secrets(monkeypatch, capsys) -> None:
    monkeypatch.setenv("INFER_API_KEY", SECRET)
    cfg = ["--backend", "reference", "--url", "http://127.0.0.1:9"]
    monkeypatch.setenv("BACKENDS_CONFIG", "")
    assert main(["state", "--json", *cfg]) == 1
    out = capsys.readouterr()
    assert SECRET not in out.out + out.err


def test_config_takes_a_variable_name_never_a_key() -> None:
    with pytest.raises(ConfigError) as info:
        ClientConfig(backend="vllm", base_url="http://h", api_key_var=SECRET)
    assert SECRET not in str(info.value)


@pytest.fixture
def self_signed(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    return key, cert


async def test_tls_is_verified_by_default(self_signed) -> None:
    key, cert = self_signed
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)

    async def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"status": "ok"})

    async with serve(handle, ssl=context) as url:
        async with Client(ClientConfig(backend="reference", base_url=url, retry=RetryPolicy(attempts=1))) as client:
            with pytest.raises(AdminError) as info:
                await client.admin.health()
        assert isinstance(info.value.results[0].error, NetworkError)
        assert "CERTIFICATE_VERIFY_FAILED" in str(info.value)
        trusting = ClientConfig(backend="reference", base_url=url, verify=str(cert))
        async with Client(trusting) as client:
            assert await client.admin.health() == [True]


async def test_admin_calls_do_not_follow_redirects() -> None:
    hits = []

    async def handle(request: httpx.Request) -> httpx.Response:
        hits.append(request.url.path)
        if request.url.path == "/pause":
            return httpx.Response(307, headers={"location": "http://evil.example/pause"})
        return httpx.Response(200, json={})

    config = ClientConfig(backend="reference", base_url="http://ref")
    async with Client(config, transport=httpx.MockTransport(handle)) as client:
        with pytest.raises(AdminError) as info:
            await client.admin.pause()
    assert hits == ["/pause"]
    assert isinstance(info.value.results[0].error, ServerStatusError) and info.value.results[0].error.status_code == 307
