"""``backends gateway``: served over an engine in another process, killed with SIGKILL mid-turn and restarted on
the same store without losing an answered turn; ``backends gateway export``; the verb's hint where it is not
installed."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pyarrow.parquet as pq
import pytest

from backends_core import cli
from backends_gateway import Trajectories
from test_cli_serve import START_DEADLINE_S, STOP_DEADLINE_S, first_line


def start(argv: list[str]) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "backends_core", *argv, "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = first_line(proc, START_DEADLINE_S)
        return proc, json.loads(line)
    except BaseException:
        proc.kill()
        proc.wait(STOP_DEADLINE_S)
        raise AssertionError(f"{argv[0]} did not start: {proc.stderr.read() if proc.stderr else ''}") from None


def stop(proc: subprocess.Popen[str], signum: int = signal.SIGTERM) -> int:
    if proc.poll() is None:
        proc.send_signal(signum)
    try:
        return proc.wait(STOP_DEADLINE_S)
    finally:
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def turn(http: httpx.Client, messages: list[Any], **extra: Any) -> httpx.Response:
    body = {"model": "tiny-qwen3", "messages": messages, "max_tokens": 6, "seed": len(messages), **extra}
    return http.post("/s/run/v1/chat/completions", json=body)


def test_a_gateway_killed_mid_turn_keeps_every_answered_turn_and_goes_on_after_a_restart(tiny_models, tmp_path) -> None:
    engine, ready = start(["serve", "--backend", "vllm", "--port", "0", "--models-dir", str(tiny_models.root)])
    store = tmp_path / "rollouts.db"
    gateway_argv = [
        "gateway", "--backend", "vllm", "--url", ready["url"], "--model", ready["model"],
        "--tokenizer", ready["tokenizer"], "--port", "0", "--store", str(store),
    ]  # fmt: skip
    try:
        gateway, up = start(gateway_argv)
        try:
            with httpx.Client(base_url=up["url"], trust_env=False, timeout=120) as http:
                messages: list[Any] = [{"role": "user", "content": "hello"}]
                for i in range(2):
                    answer = turn(http, messages)
                    assert answer.status_code == 200, answer.text
                    messages += [answer.json()["choices"][0]["message"], {"role": "user", "content": f"next {i}"}]
                # a streamed turn in flight when the gateway is killed: never answered, so never expected
                with http.stream("POST", "/s/run/v1/chat/completions", json={
                    "model": "tiny-qwen3", "messages": messages, "max_tokens": 200, "stream": True
                }) as streaming:  # fmt: skip
                    assert streaming.status_code == 200
                    next(streaming.iter_lines())
                    assert stop(gateway, signal.SIGKILL) == -signal.SIGKILL
        finally:
            stop(gateway, signal.SIGKILL)
        gateway, up = start(gateway_argv)
        try:
            with httpx.Client(base_url=up["url"], trust_env=False, timeout=120) as http:
                kept = http.get("/v1/sessions/run/trajectory").json()
                assert [t["turn"] for t in kept["turns"]] == [0, 1]
                third = turn(http, messages)
                assert third.status_code == 200 and third.headers["X-Branch"] == "0"
                traj = http.get("/v1/sessions/run/trajectory").json()
            before = traj["turns"][1]
            ids = before["prompt_ids"] + before["completion_ids"]
            assert traj["turns"][2]["prompt_ids"][: len(ids)] == ids and traj["turns"][2]["parent"] == 1
            assert traj["bridged"] == 2 and traj["branched"] == 0
        finally:
            assert stop(gateway) == 0
    finally:
        stop(engine)


def test_export_writes_one_row_per_branch_of_closed_sessions_as_jsonl_and_parquet(
    tiny_models, tmp_path, capsys
) -> None:
    store = tmp_path / "export.db"
    _fill(store, tiny_models)
    reader = Trajectories(store)
    expected = [
        (t.session, s.branch, s.input_ids.tolist(), s.loss_mask.tolist()) for t in reader.closed() for s in t.samples
    ]
    assert [e[:2] for e in expected] == [("done", 0), ("done", 1)]
    out = tmp_path / "rows.jsonl"
    assert cli.main(["gateway", "export", "--store", str(store), "--format", "jsonl", "-o", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["session"], r["branch"], r["input_ids"], r["loss_mask"]) for r in rows] == expected
    assert rows[0]["reward"] == 0.5 and rows[1]["reason"] == "rewritten"
    parquet = tmp_path / "rows.parquet"
    assert cli.main(["gateway", "export", "--store", str(store), "--format", "parquet", "-o", str(parquet)]) == 0
    table = pq.read_table(parquet).to_pylist()
    assert [(r["session"], r["branch"], r["input_ids"], r["loss_mask"]) for r in table] == expected
    np.testing.assert_allclose(table[0]["logprobs"], rows[0]["logprobs"], rtol=1e-6)
    everything = tmp_path / "all.jsonl"
    assert cli.main(["gateway", "export", "--store", str(store), "--status", "all", "-o", str(everything)]) == 0
    assert {json.loads(line)["session"] for line in everything.read_text().splitlines()} == {"done", "open"}
    assert cli.main(["gateway", "export", "--store", str(tmp_path / "missing.db"), "-o", str(out)]) == 2
    assert "no gateway store" in capsys.readouterr().err


def _fill(store: Path, tiny_models: Any) -> None:
    """Two sessions through a gateway on the vLLM emulator: "done" (two branches, rewarded, closed), "open"."""
    import asyncio

    from backends_core import Client, ClientConfig, SamplingParams, StatelessPolicy
    from backends_gateway import Gateway, SQLiteStore, TurnRequest
    from backends_testkit.engine import ReferenceEngine
    from backends_vllm_testing.emulator import VllmEmulator

    async def fill() -> None:
        engine = ReferenceEngine(tiny_models.dense, seed=0)
        emulator = VllmEmulator(engine)
        config = ClientConfig(
            backend="vllm", base_url="http://emulated", tokenizer=str(tiny_models.dense),
            stateless=StatelessPolicy(enabled=False),
        )  # fmt: skip
        sampling = SamplingParams(max_tokens=4, seed=1)
        try:
            async with (
                Client(config, transport=emulator.transport()) as client,
                Gateway(client, SQLiteStore(store)) as gw,
            ):
                first = [{"role": "user", "content": "a"}]
                one = await gw.turn(TurnRequest(messages=first, sampling=sampling), session="done")
                more = [*first, dict(one.message), {"role": "user", "content": "b"}]
                await gw.turn(TurnRequest(messages=more, sampling=sampling), session="done")
                await gw.turn(
                    TurnRequest(messages=[{"role": "user", "content": "c"}], sampling=sampling), session="done"
                )
                await gw.set_reward("done", 0.5, None)
                await gw.close("done")
                await gw.turn(TurnRequest(messages=first, sampling=sampling), session="open")
        finally:
            await engine.aclose()

    asyncio.run(fill())


def test_the_gateway_verb_without_the_gateway_installed_says_what_to_install(monkeypatch, capsys) -> None:
    real = cli.md.entry_points
    monkeypatch.setattr(cli.md, "entry_points", lambda **kw: [] if kw.get("group") == cli.VERB_GROUP else real(**kw))
    assert cli.main(["gateway", "--port", "9"]) == 2
    assert 'pip install "backends[gateway]"' in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["gateway", "--port", "70000"], ["gateway", "--store", "mysql://x/y"]])
def test_bad_gateway_flags_exit_2_naming_the_flag(argv, capsys) -> None:
    assert cli.main([*argv, "--backend", "vllm", "--url", "http://127.0.0.1:9"]) == 2
    assert ("--port" if "--port" in argv else "--store") in capsys.readouterr().err


def test_a_gateway_with_keys_answers_only_its_keys_and_prints_none_of_them(tiny_models, tmp_path) -> None:
    trainer, harness = "tk-cli-0123456789abcdef", "hk-cli-0123456789abcdef"
    keys = tmp_path / "keys.toml"
    keys.write_text(f'[trainer]\ntrainer = "{trainer}"\n[harness]\nrunner = "{harness}"\n')
    engine, ready = start(["serve", "--backend", "vllm", "--port", "0", "--models-dir", str(tiny_models.root)])
    try:
        gateway, up = start([
            "gateway", "--backend", "vllm", "--url", ready["url"], "--model", ready["model"],
            "--tokenizer", ready["tokenizer"], "--port", "0", "--store", str(tmp_path / "k.db"), "--keys", str(keys),
        ])  # fmt: skip
        try:
            with httpx.Client(base_url=up["url"], trust_env=False, timeout=120) as http:
                messages = [{"role": "user", "content": "hello"}]
                assert turn(http, messages).status_code == 401
                ok = http.post(
                    "/s/run/v1/chat/completions",
                    json={"model": ready["model"], "messages": messages, "max_tokens": 4},
                    headers={"Authorization": f"Bearer {harness}"},
                )
                assert ok.status_code == 200, ok.text
                assert http.get("/v1/sessions/run/trajectory", headers={"x-api-key": harness}).status_code == 403
                # the trainer names the harness key's "run" in that key's names
                seen = http.get("/v1/sessions/runner~run/trajectory", headers={"Authorization": f"Bearer {trainer}"})
                assert seen.status_code == 200 and len(seen.json()["turns"]) == 1
        finally:
            gateway.send_signal(signal.SIGTERM)
            out, err = gateway.communicate(timeout=STOP_DEADLINE_S)
        assert gateway.returncode == 0, err
        assert trainer not in out + err and harness not in out + err
    finally:
        stop(engine)


def test_a_keys_file_that_cannot_be_used_exits_2_without_printing_a_key(tmp_path, capsys) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text('[harness]\nrunner = "hk-cli-0123456789abcdef"\n')
    argv = ["gateway", "--backend", "vllm", "--url", "http://127.0.0.1:9", "--keys", str(keys)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "--keys" in err and "at least one trainer key" in err and "0123456789abcdef" not in err
