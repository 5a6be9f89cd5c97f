"""A web page in a browser on the gateway's machine cannot drive it: a page of another origin is refused whatever
it sends (a body a browser sends without asking first: ``text/plain``, a form), a ``Host`` the gateway does not
answer to (a DNS rebinding) is refused, and harnesses, SDKs and the gateway's own page go on working."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
from aiohttp import web
from selenium.webdriver.support.ui import WebDriverWait
from test_gateway_ui import browser  # noqa: F401  (the fixture: headless Chromium)

from backends_gateway import serve

TURN = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}

#: what a hostile page tries, each a request a browser sends cross-origin without a CORS preflight
ATTACK = """
const gw = "{gateway}";
const turn = JSON.stringify({turn});
const tries = [
  fetch(gw + "/v1/sessions/victim/close", {{method: "POST", mode: "no-cors"}}),
  fetch(gw + "/v1/sessions/victim/reward", {{method: "POST", mode: "no-cors",
    headers: {{"Content-Type": "text/plain"}}, body: JSON.stringify({{reward: -1}})}}),
  fetch(gw + "/s/victim/v1/chat/completions", {{method: "POST", mode: "no-cors",
    headers: {{"Content-Type": "text/plain"}}, body: turn}}),
  fetch(gw + "/s/planted/v1/chat/completions", {{method: "POST", mode: "no-cors",
    headers: {{"Content-Type": "application/x-www-form-urlencoded"}}, body: turn}}),
  fetch(gw + "/v1/sessions").then(r => r.text()).then(t => {{ window.leaked = t; }}),
];
Promise.allSettled(tries).then(() => {{ document.title = "tried"; }});
"""


@contextlib.asynccontextmanager
async def hostile_page(gateway: str) -> AsyncIterator[str]:
    """A page of another origin (``localhost`` where the gateway is ``127.0.0.1``) that attacks ``gateway``."""

    async def page(request: web.Request) -> web.Response:
        script = ATTACK.format(gateway=gateway, turn=json.dumps(TURN))
        return web.Response(text=f"<html><body><script>{script}</script></body></html>", content_type="text/html")

    app = web.Application()
    app.router.add_get("/", page)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        yield f"http://localhost:{port}/"
    finally:
        await runner.cleanup()


async def test_a_page_of_another_origin_changes_nothing_and_reads_nothing(scripted_gateway, browser) -> None:  # noqa: F811
    async with scripted_gateway(["mine<|im_end|>", "planted<|im_end|>"]) as served:
        async with httpx.AsyncClient(base_url=served.url, trust_env=False, timeout=60) as http:
            assert (await http.post("/s/victim/v1/chat/completions", json=TURN)).status_code == 200
        async with hostile_page(served.url) as url:

            def attack() -> Any:
                browser.get(url)
                WebDriverWait(browser, 60).until(lambda d: d.title == "tried")
                return browser.execute_script("return window.leaked === undefined ? null : window.leaked")

            leaked = await asyncio.to_thread(attack)
        assert leaked is None  # the read was refused (and a browser would not hand it over anyway)
        (victim,) = await served.gateway.sessions(group=None, status=None, limit=10, after=None)
        assert (victim["session"], victim["status"], victim["reward"], victim["turns"]) == ("victim", "open", None, 1)
        assert len(served.script.requests) == 1  # only the victim's own turn reached the engine


async def test_what_a_browser_may_send_anywhere_is_refused_before_anything_runs(scripted_gateway) -> None:
    async with scripted_gateway(["mine<|im_end|>"]) as served:
        async with httpx.AsyncClient(base_url=served.url, trust_env=False, timeout=60) as http:
            assert (await http.post("/s/victim/v1/chat/completions", json=TURN)).status_code == 200
            plain = await http.post(
                "/v1/chat/completions", content=json.dumps(TURN), headers={"content-type": "text/plain"}
            )
            assert plain.status_code == 415 and plain.json()["error"]["code"] == "unsupported_media_type"
            other = {"Origin": "http://evil.example"}
            closed = await http.post("/v1/sessions/victim/close", headers=other)
            assert closed.status_code == 403 and closed.json()["error"]["code"] == "cross_origin"
            rebound = await http.get("/v1/sessions", headers={"Host": "evil.example"})
            assert rebound.status_code == 403 and rebound.json()["error"]["code"] == "host_not_allowed"
            assert "victim" not in rebound.text
            # the gateway's own page (same origin) and programs (no Origin) are answered
            own = {"Origin": served.url}
            assert (await http.post("/v1/sessions/victim/reward", json={"reward": 1.0}, headers=own)).status_code == 200
            assert (await http.get("/v1/sessions", headers={"Host": "localhost"})).status_code == 200
        assert len(served.script.requests) == 1


async def test_allowed_hosts_add_names_a_gateway_answers_to(scripted_gateway) -> None:
    async with (
        scripted_gateway([]) as served,
        serve(served.gateway, allowed_hosts=["gateway.internal"]) as url,
        httpx.AsyncClient(base_url=url, trust_env=False, timeout=60) as http,
    ):
        assert (await http.get("/health", headers={"Host": "gateway.internal:8080"})).status_code == 200
        assert (await http.get("/health", headers={"Host": "evil.example"})).status_code == 403
