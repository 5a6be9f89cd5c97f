"""``backends serve``: each installed backend's emulator served on a port, answering the CLI, until SIGTERM or
Ctrl-C (exit 0); a missing installation or a busy port exits 2 naming what to do."""

from __future__ import annotations

import json
import queue
import signal
import socket
import subprocess
import sys
import threading

import pytest

from backends_core import cli
from backends_core.cli import main

#: Seconds ``backends serve`` may take to print its URL (the tiny models are cached; an emulator starts in a second
#: or two, much longer on a loaded two-core machine): the guard that turns a hang into a failure.
START_DEADLINE_S = 120.0
#: Seconds it may take to exit once signalled.
STOP_DEADLINE_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def first_line(proc: subprocess.Popen[str], deadline_s: float) -> str:
    """The first line ``proc`` writes on stdout, waiting at most ``deadline_s`` (a reader thread feeds a queue)."""
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    stdout = proc.stdout
    threading.Thread(target=lambda: lines.put(stdout.readline()), daemon=True).start()
    try:
        return lines.get(timeout=deadline_s)
    except queue.Empty:
        command = " ".join(map(str, proc.args))
        raise AssertionError(f"{command[:200]!r} printed nothing within {deadline_s:.0f} s") from None


@pytest.mark.parametrize(
    ("backend", "moe", "stop"),
    [
        ("reference", False, signal.SIGTERM),
        ("vllm", False, signal.SIGTERM),
        ("sglang", False, signal.SIGTERM),
        ("dynamo", False, signal.SIGINT),  # Ctrl-C
        ("vllm", True, signal.SIGTERM),
    ],
)
def test_serve_answers_the_cli_until_signalled_then_exits_0(backend, moe, stop, tiny_models, capsys) -> None:
    port = free_port()
    argv = ["serve", "--backend", backend, "--port", str(port), "--models-dir", str(tiny_models.root), "--json"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "backends_core", *argv, *(["--moe"] if moe else [])],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ready = json.loads(first_line(proc, START_DEADLINE_S))
        model = "tiny-qwen3-moe" if moe else "tiny-qwen3"
        assert ready == {
            "url": f"http://127.0.0.1:{port}",
            "backend": backend,
            "model": model,
            "tokenizer": str(tiny_models.moe if moe else tiny_models.dense),
            "moe": moe,
        }
        generate = ["generate", "--backend", backend, "--url", ready["url"], "--model", model, "--json"]
        assert main([*generate, "--prompt-ids", "1,2,3", "--max-tokens", "4", "--temperature", "0"]) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["prompt_ids"] == [1, 2, 3] and len(result["completion_ids"]) == len(result["logprobs"]) == 4
        proc.send_signal(stop)
        assert proc.wait(timeout=STOP_DEADLINE_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=STOP_DEADLINE_S)
        proc.stdout.close()
        proc.stderr.close()


def test_serve_prints_the_url_and_a_command_to_try(tiny_models) -> None:
    argv = ["serve", "--backend", "reference", "--port", "0", "--models-dir", str(tiny_models.root)]
    proc = subprocess.Popen([sys.executable, "-m", "backends_core", *argv], stdout=subprocess.PIPE, text=True)
    try:
        line = first_line(proc, START_DEADLINE_S)
        assert line.startswith("serving the reference emulator of tiny-qwen3 at http://127.0.0.1:")
    finally:
        proc.terminate()
        assert proc.wait(timeout=STOP_DEADLINE_S) == 0
        proc.stdout.close()


def test_serve_without_the_test_kit_exits_2_naming_the_extra(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "backends_testkit.emulators", None)  # what an install without the kit sees
    assert main(["serve", "--backend", "vllm"]) == 2
    assert capsys.readouterr().err == (
        "error: no emulator of backend 'vllm' is installed: it comes with the backend's testing extra, "
        'pip install "backends-vllm[testing]"\n'
    )
    assert main(["serve", "--backend", "reference", "--json"]) == 2
    error = json.loads(capsys.readouterr().err)["error"]
    assert error["exit"] == 2 and 'pip install "backends-core[testing]"' in error["message"]


def test_serve_of_a_driver_without_its_emulator_exits_2_naming_the_extra(monkeypatch, capsys) -> None:
    monkeypatch.setattr(cli, "_installed_emulators", lambda: {"reference"})  # backends-sglang without [testing]
    assert main(["serve", "--backend", "sglang"]) == 2
    assert 'pip install "backends-sglang[testing]"' in capsys.readouterr().err


def test_serve_on_a_busy_port_exits_2(tiny_models, capsys) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        argv = ["serve", "--backend", "reference", "--port", str(port), "--models-dir", str(tiny_models.root)]
        assert main([*argv, "--json"]) == 2
    error = json.loads(capsys.readouterr().err)["error"]
    assert error["type"] == "OSError" and "address already in use" in error["message"]


def test_the_emulator_group_is_the_test_kits() -> None:
    from backends_testkit.emulators import EMULATOR_GROUP

    assert cli.EMULATOR_GROUP == EMULATOR_GROUP
