"""The main job runs end to end (every step of the demo checks what it shows)."""

from __future__ import annotations

import pytest

from backends_core.cli import main


@pytest.mark.parametrize("backend", [None, "reference"])
def test_the_demo_runs_and_every_check_holds(tiny_models, capsys, backend) -> None:
    argv = ["demo", "--models-dir", str(tiny_models.root)] + (["--backend", backend] if backend else [])
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "FAILED" not in out
    assert f"backend '{backend or 'vllm'}' over 2 embedded emulators" in out  # the default engine is vLLM's dialect
    assert out.count("  ok  ") == 13
    assert "demo finished" in out


def test_list_shows_the_reference_backend_and_its_capabilities(capsys) -> None:
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    blocks = {block.split()[0]: block for block in out.split("\n") if block and not block.startswith(" ")}
    assert blocks["reference"].split()[1:] == ["backends-core", "0.1.0"]
    assert blocks["vllm"].split()[1:] == ["backends-vllm", "0.1.0"]
    assert "admin_pause" in out and "teacher_logprobs" in out
