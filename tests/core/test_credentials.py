"""Credentials go only to the hosts they were configured for: the servers' own token never reaches a host a
backend discovers for admin routes (Dynamo workers' system ports), which get the admin credentials only."""

from __future__ import annotations

import httpx
import pytest

from backends_core import Client, ClientConfig, SamplingParams

FRONTEND = "http://frontend.test:8000"
WORKERS = ["http://w1.test:8081", "http://w2.test:8081"]


def recorder() -> tuple[dict[str, set[str | None]], httpx.MockTransport]:
    """Every host's ``authorization`` and ``x-team`` headers, and a transport answering 500 to everything."""
    seen: dict[str, set[str | None]] = {}

    def handle(request: httpx.Request) -> httpx.Response:
        host = f"{request.url.host}:{request.url.port}"
        seen.setdefault(host, set()).add(f"{request.headers.get('authorization')} {request.headers.get('x-team')}")
        return httpx.Response(500, json={"error": "recorded"})

    return seen, httpx.MockTransport(handle)


async def exercise(config: ClientConfig) -> dict[str, set[str | None]]:
    seen, transport = recorder()
    async with Client(config, transport=transport) as client:
        await client.admin.outcomes().state()
        await client.admin.outcomes().flush_cache()
        with pytest.raises(Exception):  # noqa: B017,PT011 - only the headers matter here
            await client.generate(prompt_ids=[1, 2], sampling=SamplingParams(max_tokens=16))
    return seen


def dynamo(**more: object) -> ClientConfig:
    return ClientConfig.from_mapping(
        {
            "backend": "dynamo",
            "base_url": FRONTEND,
            "model": "m",
            "api_key_var": "FRONTEND_KEY",
            "headers": {"x-team": "rl"},
            "backend_options": {"worker_urls": WORKERS},
            **more,
        }
    )


async def test_the_frontend_token_and_headers_never_reach_the_workers(monkeypatch) -> None:
    monkeypatch.setenv("FRONTEND_KEY", "front-secret")
    seen = await exercise(dynamo())
    assert seen["frontend.test:8000"] == {"Bearer front-secret rl"}
    assert seen["w1.test:8081"] == seen["w2.test:8081"] == {"None None"}


async def test_admin_credentials_go_to_every_admin_host_and_replace_the_token_on_the_servers(monkeypatch) -> None:
    monkeypatch.setenv("FRONTEND_KEY", "front-secret")
    monkeypatch.setenv("ADMIN_KEY", "admin-secret")
    seen = await exercise(dynamo(admin_api_key_var="ADMIN_KEY", admin_headers={"x-team": "ops"}))
    # the frontend: the data token on generation, the admin token on admin calls
    assert seen["frontend.test:8000"] == {"Bearer front-secret rl", "Bearer admin-secret ops"}
    assert seen["w1.test:8081"] == seen["w2.test:8081"] == {"Bearer admin-secret ops"}


async def test_a_configured_admin_url_is_one_of_the_servers_own_hosts(monkeypatch) -> None:
    monkeypatch.setenv("KEY", "k")
    config = ClientConfig(
        backend="vllm", base_url="http://data.test:8000", admin_base_url="http://admin.test:9000", api_key_var="KEY"
    )
    seen = await exercise(config)
    assert seen["data.test:8000"] == seen["admin.test:9000"] == {"Bearer k None"}


def test_an_admin_key_variable_must_be_a_name() -> None:
    from backends_core import ConfigError

    with pytest.raises(ConfigError, match="admin_api_key_var must be an environment variable NAME"):
        ClientConfig(backend="vllm", base_url="http://x", admin_api_key_var="sk-live-123")
