"""The main job runs end to end (every step of the demo checks what it shows)."""

from __future__ import annotations

from backends_core.cli import main


def test_demo_on_the_reference_backend_runs_and_every_check_holds(tiny_models, capsys) -> None:
    assert main(["demo", "--backend", "reference", "--models-dir", str(tiny_models.root)]) == 0
    out = capsys.readouterr().out
    assert "FAILED" not in out
    assert out.count("  ok  ") == 13
    assert "demo finished" in out


def test_list_shows_the_reference_backend_and_its_capabilities(capsys) -> None:
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("reference    backends-core 0.1.0")
    assert "admin_pause" in out and "teacher_logprobs" in out
