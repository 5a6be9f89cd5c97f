"""The gateway's page (``GET /ui``) in a real headless Chromium over real sessions, and the token text it reads
(``/v1/sessions/{id}/trajectory?tokens=1``).

The browser test serves the gateway with keys (the sessions recorded with a harness key, the page opened with the
trainer's), so the page only works if it sends the key it took from the URL's fragment. Selenium blocks, so the
browser is driven from a thread while the gateway serves on the test's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import re
import struct
import zlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import numpy as np
import pytest
from aiohttp import web
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as ec
from selenium.webdriver.support.ui import WebDriverWait
from test_openai_sdk import TOOLS

from backends_core import Client, ClientConfig, GenerateRequest, GenerateResult, WeightVersionSpan
from backends_core.config import StatelessPolicy
from backends_core.multiturn.rendering import load_tokenizer
from backends_gateway import Gateway, Keys, SQLiteStore, create_app
from backends_gateway.ui import token_pieces
from scripted_stream import StreamingScript

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
KEY = "trainer-key-0123"
HARNESS = "harness-key-4567"
KEYS = Keys(trainer={"trainer": KEY}, harness={"runner": HARNESS})
#: the harness's sessions and group as the trainer (and so the page) names them
AGENT, CHAT, STEP_8 = "runner~agent-1", "runner~chat-1", "runner~step-8"
WIDTH, HEIGHT = 1200, 800
DEADLINE = 30.0  # seconds any one page state may take to appear

REPLIES = [
    '<think>\nadd 2 and 3 first\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
    "</tool_call><|im_end|>",
    '<think>\nthen add 5\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 5, "b": 5}}\n'
    "</tool_call><|im_end|>",
    "<think>\nall added\n</think>\n\nThe sum is 10 (2 + 3 + 5).<|im_end|>",
    "<think>\nthe tool said 6\n</think>\n\nThe tool says 2 + 3 = 6, which is wrong.<|im_end|>",
    "Bonjour ! Ça va très bien 🙂<|im_end|>",
]
#: the weights each reply finishes under; the second reply's sampling straddles an update
VERSIONS = [("step-6",), ("step-6", "step-7"), ("step-7",), ("step-7",), ("step-8",)]


class VersionedScript(StreamingScript):
    """The scripted engine with the weight versions of :data:`VERSIONS` and logprobs spread over (log 0.05, 0]."""

    def __init__(self, tokenizer: Any, replies: list[str]) -> None:
        super().__init__(tokenizer, replies)
        self.versions = list(VERSIONS)

    def _result(self, raw: str, request: GenerateRequest, server_url: str) -> GenerateResult:
        result = super()._result(raw, request, server_url)
        n = len(result.completion_ids)
        versions = self.versions.pop(0)
        cut = [round(n * i / len(versions)) for i in range(len(versions) + 1)]
        spans = tuple(WeightVersionSpan(version=v, start=cut[i], end=cut[i + 1]) for i, v in enumerate(versions))
        logprobs = np.log(np.random.default_rng(n).uniform(0.05, 1.0, n)).astype(np.float32)
        return attrs.evolve(result, logprobs=logprobs, weight_version=versions[-1], weight_versions=spans)


@attrs.frozen
class Site:
    url: str
    gateway: Gateway
    tokenizer: Any
    seen: list[tuple[str, str]]  # (path and query, Authorization) of every request


@contextlib.asynccontextmanager
async def site(tiny_models: Any, store: Path, replies: list[str]) -> AsyncIterator[Site]:
    """A gateway over :class:`VersionedScript`, its sessions routes behind the trainer key :data:`KEY`."""
    tokenizer = load_tokenizer(str(tiny_models.dense))
    config = ClientConfig(
        backend="scripted",
        base_url="http://scripted",
        model="tiny",
        tokenizer=str(tiny_models.dense),
        stateless=StatelessPolicy(enabled=False),  # the gateway keeps the turns itself
    )
    seen: list[tuple[str, str]] = []

    @web.middleware
    async def record(request: web.Request, handler: Any) -> web.StreamResponse:
        seen.append((request.path_qs, request.headers.get("Authorization", "")))
        return await handler(request)

    async with (
        Client(config, plugin=VersionedScript(tokenizer, replies)) as client,
        Gateway(client, SQLiteStore(store)) as gateway,
    ):
        app = create_app(gateway, keys=KEYS)
        app.middlewares.insert(0, record)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        try:
            tcp = web.TCPSite(runner, "127.0.0.1", 0)
            await tcp.start()
            port = tcp._server.sockets[0].getsockname()[1]
            yield Site(f"http://127.0.0.1:{port}", gateway, tokenizer, seen)
        finally:
            await runner.cleanup()


async def call(http: httpx.AsyncClient, method: str, path: str, **kwargs: Any) -> Any:
    response = await http.request(method, path, **kwargs)
    assert response.status_code == 200, response.text
    return response.json()


async def chat(http: httpx.AsyncClient, session: str, group: str, messages: list[Any]) -> dict[str, Any]:
    body = {"model": "tiny", "messages": messages, "tools": TOOLS, "max_tokens": 64}
    answer = await call(
        http, "POST", f"/s/{session}/v1/chat/completions", json=body, headers={"X-Session-Group": group}
    )
    message = answer["choices"][0]["message"]
    return {k: v for k, v in message.items() if v is not None}


def tool_result(call_message: dict[str, Any], content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_message["tool_calls"][0]["id"], "content": content}


async def record_sessions(url: str) -> None:
    """``agent-1`` (group ``step-7``): two tool calls and an answer, then the harness edits the first tool result
    (a branch from turn 0), a reward, closed. ``chat-1`` (group ``step-8``): one turn, left open."""
    harness = {"Authorization": f"Bearer {HARNESS}"}
    async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=60, headers=harness) as http:
        first = [
            {"role": "system", "content": "You add numbers with the add tool."},
            {"role": "user", "content": "What is 2 + 3 + 5?"},
        ]
        a1 = await chat(http, "agent-1", "step-7", first)
        second = [*first, a1, tool_result(a1, "5")]
        a2 = await chat(http, "agent-1", "step-7", second)
        await chat(http, "agent-1", "step-7", [*second, a2, tool_result(a2, "10")])
        await chat(http, "agent-1", "step-7", [*first, a1, tool_result(a1, "6")])
        auth = {"Authorization": f"Bearer {KEY}"}
        await call(http, "POST", f"/v1/sessions/{AGENT}/reward", json={"reward": 0.75}, headers=auth)
        await call(http, "POST", f"/v1/sessions/{AGENT}/close", headers=auth)
        await chat(http, "chat-1", "step-8", [{"role": "user", "content": "Bonjour, ça va ?"}])


def png_size(png: bytes) -> tuple[int, int]:
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR", "not a PNG"
    width, height = struct.unpack(">II", png[16:24])
    return width, height


def png_byte_variety(png: bytes) -> int:
    """Distinct byte values in the PNG's filtered pixel rows: a few for a blank page, many for a drawn one."""
    data, at = b"", 8
    while at < len(png):
        (length,) = struct.unpack(">I", png[at : at + 4])
        if png[at + 4 : at + 8] == b"IDAT":
            data += png[at + 8 : at + 8 + length]
        at += 12 + length
    return len(set(zlib.decompress(data)))


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    """Headless Chromium through Debian's chromedriver, never a downloaded one (``./dev test`` installs both)."""
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        missing = f"{CHROMIUM} and {CHROMEDRIVER} are not installed (./dev test installs them)"
        if os.environ.get("CI"):  # CI runs ./dev test, which installs them: missing there is a failure
            pytest.fail(missing)
        pytest.skip(missing)
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'chromium'}",
        f"--window-size={WIDTH},{HEIGHT}",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        # the viewport itself WIDTH x HEIGHT, whatever the window's frame takes
        driver.execute_cdp_cmd(
            "Emulation.setDeviceMetricsOverride",
            {"width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False},
        )
        yield driver
    finally:
        driver.quit()


#: every token of a branch as the page drew it: class, data-id, data-mask, data-logprob
TOKENS_JS = """
return [...document.querySelectorAll(`#detail details.branch[data-branch="${arguments[0]}"] .tok`)].map(
    (e) => [e.className, Number(e.dataset.id), Number(e.dataset.mask), e.dataset.logprob ?? null]);
"""
BLOCKS_JS = """
return [...document.querySelectorAll(`#detail details.branch[data-branch="${arguments[0]}"] .msg`)].map(
    (e) => [e.dataset.role, Number(e.dataset.start), Number(e.dataset.end)]);
"""


def check_page(
    driver: Any, url: str, listed: list[Any], trajectory: dict[str, Any], step8: list[Any], shots: Path
) -> None:
    wait = WebDriverWait(driver, DEADLINE)

    def ready(selector: str) -> Any:
        return wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, selector)))

    driver.get(f"{url}/ui#key={KEY}")
    ready('#sessions[data-state="ready"]')
    assert "key=" not in driver.current_url  # the key left the address bar
    assert driver.execute_script("return sessionStorage.getItem('backends-gateway-key')") == KEY

    # the list: one row per session of /v1/sessions, in its order, with its numbers
    rows = driver.find_elements(By.CSS_SELECTOR, "#sessions tbody tr[data-session]")
    assert [r.get_attribute("data-session") for r in rows] == [s["session"] for s in listed]
    for row, s in zip(rows, listed, strict=True):
        cell = {c.get_attribute("data-col"): c for c in row.find_elements(By.CSS_SELECTOR, "td")}
        assert cell["group"].text == s["group"] and cell["status"].text == s["status"]
        assert cell["owner"].text == s["owner"] == "runner"  # the harness key that recorded it
        assert cell["reward"].text == ("\u2014" if s["reward"] is None else f"{s['reward']:g}")
        for col in ("turns", "bridged", "branched", "rerendered"):
            assert int(cell[col].text) == s[col], col
    branches = {b["branch"]: b for b in trajectory["branches"]}
    agent = next(r for r in rows if r.get_attribute("data-session") == AGENT)
    assert int(agent.find_element(By.CSS_SELECTOR, 'td[data-col="branches"]').text) == len(branches) == 2

    # one trajectory: every branch, its tokens exactly as the training view has them
    agent.click()
    detail = ready(f'#detail[data-session="{AGENT}"][data-state="ready"]')
    assert "0.75" in detail.find_element(By.CSS_SELECTOR, "[data-reward]").text
    turns = {t["turn"]: t for t in trajectory["turns"]}
    drawn = detail.find_elements(By.CSS_SELECTOR, "details.branch")
    assert [int(d.get_attribute("data-branch")) for d in drawn] == sorted(branches)
    for number, branch in branches.items():
        tokens = driver.execute_script(TOKENS_JS, number)
        assert [t[1] for t in tokens] == branch["input_ids"]
        assert [t[2] for t in tokens] == branch["loss_mask"]
        for (classes, *_), expected in zip(tokens, branch["loss_mask"], strict=True):
            names = classes.split()
            assert "tok" in names and ("sampled" in names) == (expected == 1) and ("masked" in names) == (expected == 0)
        sampled = [t for t in tokens if "sampled" in t[0].split()]
        assert len(sampled) == sum(len(turns[t]["completion_ids"]) for t in branch["turns"])
        assert [float(t[3]) for t in sampled] == [
            lp for lp, m in zip(branch["logprobs"], branch["loss_mask"], strict=True) if m
        ]
        # the message blocks cover the sequence in order, each span under its message's role
        blocks = driver.execute_script(BLOCKS_JS, number)
        assert [b[1] for b in blocks] == [0, *[b[2] for b in blocks[:-1]]] and blocks[-1][2] == len(tokens)
        tip = turns[branch["turns"][-1]]
        roles = {s["role"] for s in tip["message_spans"] if s["message"] is not None}
        assert {b[0] for b in blocks} == roles | {"assistant"} and {"system", "user", "tool"} <= roles
        # each turn of the branch with its weight versions
        section = detail.find_element(By.CSS_SELECTOR, f'details.branch[data-branch="{number}"]')
        for t in branch["turns"]:
            versions = section.find_element(By.CSS_SELECTOR, f'tr[data-turn="{t}"] td.wv').text
            assert versions.split() == [
                part for w in turns[t]["weight_versions"] for part in (w["version"], f"[{w['start']},{w['end']})")
            ]
    fork = detail.find_element(By.CSS_SELECTOR, 'details.branch[data-branch="1"] .fork')
    assert (fork.get_attribute("data-parent-branch"), fork.get_attribute("data-parent-turn")) == ("0", "0")
    assert fork.get_attribute("data-reason") == branches[1]["reason"] == "edited"
    assert "branch 0 after turn 0" in fork.text
    assert detail.find_elements(By.CSS_SELECTOR, 'details.branch[data-branch="0"] .fork') == []

    shot = shots / "gateway-ui.png"
    assert driver.save_screenshot(str(shot))
    png = shot.read_bytes()
    assert png_size(png) == (WIDTH, HEIGHT) and png_byte_variety(png) > 64
    if target := os.environ.get("BACKENDS_UI_SCREENSHOT"):  # the README's (docs/gateway-ui.png)
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        Path(target).write_bytes(png)

    # the group filter asks the gateway for that group's sessions only
    group = driver.find_element(By.ID, "group")
    group.send_keys(STEP_8)
    driver.find_element(By.CSS_SELECTOR, '#filters button[type="submit"]').click()
    ready('#sessions[data-query="group=runner%7Estep-8"][data-state="ready"]')
    rows = driver.find_elements(By.CSS_SELECTOR, "#sessions tbody tr[data-session]")
    assert [r.get_attribute("data-session") for r in rows] == [s["session"] for s in step8] == [CHAT]

    # a key the gateway refuses (a new fragment on the open page): said on the page, and nothing left on show
    driver.get(f"{url}/ui#key=not-the-key")
    notice = ready('#notice[data-status="401"]')
    assert notice.is_displayed() and "refused this key" in notice.text and "not one of this gateway's" in notice.text
    assert "key=" not in driver.current_url
    assert driver.find_elements(By.CSS_SELECTOR, "#sessions tbody tr[data-session]") == []
    assert not driver.find_element(By.ID, "detail").is_displayed()


async def test_the_page_lists_the_sessions_and_draws_a_trajectory_token_by_token(
    tiny_models: Any, tmp_path: Path, browser: Any
) -> None:
    async with site(tiny_models, tmp_path / "ui.db", list(REPLIES)) as served:
        await record_sessions(served.url)
        auth = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=served.url, trust_env=False, headers=auth) as http:
            listed = (await call(http, "GET", "/v1/sessions"))["data"]
            step8 = (await call(http, "GET", "/v1/sessions", params={"group": STEP_8}))["data"]
            trajectory = await call(http, "GET", f"/v1/sessions/{AGENT}/trajectory")
        assert {s["session"]: s["group"] for s in listed} == {AGENT: "runner~step-7", CHAT: STEP_8}
        served.seen.clear()
        await asyncio.to_thread(check_page, browser, served.url, listed, trajectory, step8, tmp_path)
    page_loads = [path for path, _ in served.seen if path.startswith("/ui")]
    assert page_loads == ["/ui"]  # the fragment, and the key in it, never reached the server
    api = [(path, auth) for path, auth in served.seen if path.startswith("/v1/")]
    assert (f"/v1/sessions/{AGENT}/trajectory?tokens=1", f"Bearer {KEY}") in api
    assert {auth for _, auth in api} == {f"Bearer {KEY}", "Bearer not-the-key"}


async def test_the_trajectory_route_gives_each_ids_text_piece_on_request(tiny_models: Any, tmp_path: Path) -> None:
    async with site(tiny_models, tmp_path / "tokens.db", list(REPLIES)) as served:
        await record_sessions(served.url)
        auth = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=served.url, trust_env=False, headers=auth) as http:
            for session in (AGENT, CHAT):
                plain = await call(http, "GET", f"/v1/sessions/{session}/trajectory")
                assert all("tokens" not in b for b in plain["branches"])
                traj = await call(http, "GET", f"/v1/sessions/{session}/trajectory", params={"tokens": "1"})
                for branch in traj["branches"]:
                    ids, tokens = branch["input_ids"], branch["tokens"]
                    assert len(tokens) == len(ids)
                    text = served.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
                    assert "".join(tokens) == text
                    assert {k: v for k, v in traj.items() if k != "branches"} == {
                        k: v for k, v in plain.items() if k != "branches"
                    }
            # "ça", "très" and the emoji are several byte-level ids each: the id that ends a character carries it
            chat = (await call(http, "GET", f"/v1/sessions/{CHAT}/trajectory", params={"tokens": "1"}))["branches"][0]
            assert "" in chat["tokens"] and "\ufffd" not in "".join(chat["tokens"])
            assert any(piece.endswith("🙂") for piece in chat["tokens"])
            page = await http.get("/ui", headers={"Authorization": ""})  # the shell holds no data: no key
            assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
            assert "default-src 'none'" in page.headers["Content-Security-Policy"]
            assert re.search(r"\bsrc=|\bhref=|url\(|@import", page.text) is None  # nothing loaded from elsewhere
            bad = await http.get(f"/v1/sessions/{AGENT}/trajectory", params={"tokens": "yes"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
            missing = await http.get("/v1/sessions/nope/trajectory", params={"tokens": "1"})
            assert missing.status_code == 404 and missing.json()["error"]["param"] == "session"


def test_pieces_are_decoded_beside_the_piece_before_them() -> None:
    """A SentencePiece-style decode drops the word's leading space at the start of a decode: each id is decoded
    beside its context, so its piece keeps the space the full decode has."""
    vocab = {0: "\u2581Hello", 1: "\u2581world", 2: "!", 3: "\u2581again"}

    def decode(ids: list[int]) -> str:
        text = "".join(vocab[i] for i in ids).replace("\u2581", " ")
        return text.removeprefix(" ")

    ids = [0, 1, 2, 3]
    assert token_pieces(decode, ids) == ["Hello", " world", "!", " again"]
    assert "".join(token_pieces(decode, ids)) == decode(ids)
    assert token_pieces(decode, []) == []


def test_a_byte_level_character_split_over_ids_is_the_piece_of_the_id_that_ends_it() -> None:
    """Byte-level ids: the ids inside a UTF-8 character get ``""``; bytes that never form one come out as the
    full decode has them, without being held back for the rest of the sequence."""

    def decode(ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    text = "a é 🙂!"
    ids = list(text.encode())
    pieces = token_pieces(decode, ids)
    assert "".join(pieces) == text and len(pieces) == len(ids)
    assert pieces[2:5] == ["", "é", " "] and pieces[5:10] == ["", "", "", "🙂", "!"]
    garbage = [0x80] * 20 + list(b"ok")  # continuation bytes with no start: never a character
    pieces = token_pieces(decode, garbage)
    assert "".join(pieces) == decode(garbage) and pieces[-2][-1] == "o" and pieces[-1] == "k"
    assert max(len(list(run)) for blank, run in itertools.groupby(pieces, key=lambda p: p == "") if blank) < 8
