"""A conversation a CLI resumes (Claude Code's ``--continue``, Codex's ``exec resume --last``) goes on in its
session, on the same branch, every turn extending the previous turn's exact ids: the harness's own id names it."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from agent_engine import ShellLoop
from npm_clis import CLAUDE_CODE, CODEX, ensure_cli, run_cli
from test_claude_code import claude_argv, claude_env
from test_codex import codex_argv, codex_env

pytestmark = pytest.mark.slow


def one_exact_branch(gw: Any) -> list[dict[str, Any]]:
    (session,) = gw.sessions()
    trajectory = gw.trajectory(session["session"])
    (branch,) = trajectory["branches"]
    turns = sorted(trajectory["turns"], key=lambda t: t["turn"])
    assert branch["turns"] == [t["turn"] for t in turns]
    for before, after in itertools.pairwise(turns):
        assert after["prompt_ids"][: len(before["prompt_ids"]) + len(before["completion_ids"])] == (
            before["prompt_ids"] + before["completion_ids"]
        )
    return turns


def test_claude_codes_continue_goes_on_in_its_session(agent_gateway: Callable[..., Any], tmp_path: Path) -> None:
    prefix = ensure_cli(CLAUDE_CODE)
    work = tmp_path / "work"
    work.mkdir()
    with agent_gateway(ShellLoop()) as gw:
        env = claude_env(prefix, tmp_path / "home", gw.url)
        first = run_cli(claude_argv(prefix), env=env, cwd=work)
        again = [claude_argv(prefix)[0], "-p", "Now say bye.", "--output-format", "json", "--continue"]
        resumed = run_cli(again, env=env, cwd=work)
        assert (first.returncode, resumed.returncode) == (0, 0), resumed.stderr[-2000:]
        turns = one_exact_branch(gw)
    # the shell loop's three turns, then three more for the resumed conversation's new request
    assert len(turns) == 6 and "Now say bye." in str(turns[3]["messages"])


def test_codexs_resume_goes_on_in_its_session(agent_gateway: Callable[..., Any], tmp_path: Path) -> None:
    prefix = ensure_cli(CODEX)
    work = tmp_path / "work"
    work.mkdir()
    with agent_gateway(ShellLoop()) as gw:
        env = codex_env(prefix, tmp_path / "home", gw.url)
        first = run_cli(codex_argv(prefix), env=env, cwd=work)
        again = [codex_argv(prefix)[0], "exec", "--skip-git-repo-check", "resume", "--last", "Now say bye."]
        resumed = run_cli(again, env=env, cwd=work)
        assert (first.returncode, resumed.returncode) == (0, 0), resumed.stderr[-2000:]
        turns = one_exact_branch(gw)
    assert len(turns) == 6 and "Now say bye." in str(turns[3]["messages"])
