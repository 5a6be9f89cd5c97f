"""The CLI against two real reference servers (separate processes): output, files and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from backends_core.cli import main


@pytest.fixture(scope="module")
def servers(tiny_models):
    procs, urls = [], []
    for model in (tiny_models.dense, tiny_models.dense, tiny_models.moe):
        proc = subprocess.Popen(
            [sys.executable, "-m", "backends_testkit.reference", "--model", str(model)],
            stdout=subprocess.PIPE,
            text=True,
        )
        line = proc.stdout.readline()
        assert line.startswith("listening on "), line
        procs.append(proc)
        urls.append(line.split()[-1])
    yield urls
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=10)
        proc.stdout.close()


def flags(servers, tiny_models, *, moe: bool = False) -> list[str]:
    if moe:
        return [
            "--backend",
            "reference",
            "--url",
            servers[2],
            "--model",
            "tiny-qwen3-moe",
            "--tokenizer",
            str(tiny_models.moe),
        ]
    return [
        "--backend",
        "reference",
        "--url",
        servers[0],
        "--url",
        servers[1],
        "--model",
        "tiny-qwen3",
        "--tokenizer",
        str(tiny_models.dense),
    ]


def run(argv: list[str], capsys) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().out


def test_state_pause_resume_with_json_output(servers, tiny_models, capsys) -> None:
    code, out = run(["state", "--json", *flags(servers, tiny_models)], capsys)
    assert code == 0
    report = json.loads(out)
    assert [s["reachable"] for s in report["servers"]] == [True, True]
    assert "admin_pause" in report["capabilities"]
    assert run(["pause", "--mode", "wait", *flags(servers, tiny_models)], capsys)[0] == 0
    paused = json.loads(run(["state", "--json", *flags(servers, tiny_models)], capsys)[1])
    assert all(s["state"]["paused"] for s in paused["servers"])
    assert run(["resume", *flags(servers, tiny_models)], capsys)[0] == 0


def test_update_weights_with_sync_sets_the_version_everywhere(servers, tiny_models, capsys, tmp_path) -> None:
    from backends_testkit.tinymodel import write_perturbed_weights

    new = write_perturbed_weights(tiny_models.dense, tmp_path / "w", seed=2, scale=0.1)
    code, _ = run(["update-weights", str(new), "--version", "cli-1", "--sync", *flags(servers, tiny_models)], capsys)
    assert code == 0
    state = json.loads(run(["state", "--json", *flags(servers, tiny_models)], capsys)[1])
    assert {s["state"]["weight_version"] for s in state["servers"]} == {"cli-1"}
    assert (
        run(["update-weights", str(tiny_models.dense), "--version", "base", *flags(servers, tiny_models)], capsys)[0]
        == 0
    )


def test_generate_rollout_and_teacher_files(servers, tiny_models, capsys, tmp_path) -> None:
    code, out = run(
        ["generate", "--prompt", "hello", "--max-tokens", "5", "--seed", "1", "--json", *flags(servers, tiny_models)],
        capsys,
    )
    assert code == 0
    one = json.loads(out)
    assert len(one["completion_ids"]) == len(one["logprobs"]) >= 1
    assert "top_logprobs" not in one
    code, out = run(
        [
            "generate",
            "--prompt-ids",
            "1,2,3",
            "--max-tokens",
            "3",
            "--top-logprobs",
            "2",
            "--json",
            *flags(servers, tiny_models),
        ],
        capsys,
    )
    top = json.loads(out)["top_logprobs"]
    assert code == 0 and len(top) == 3 and all(len(position) >= 2 for position in top)
    convs = tmp_path / "in.jsonl"
    convs.write_text(
        "\n".join(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": f"q{i}"}]}) for i in range(5))
    )
    out_path = tmp_path / "out.jsonl"
    code, _ = run(
        [
            "rollout",
            str(convs),
            str(out_path),
            "--max-tokens",
            "4",
            "--routed-experts",
            *flags(servers, tiny_models, moe=True),
        ],
        capsys,
    )
    assert code == 0
    rows = sorted((json.loads(line) for line in out_path.read_text().splitlines()), key=lambda r: r["id"])
    assert [r["id"] for r in rows] == [f"c{i}" for i in range(5)]  # appended as they finish: any order
    routed = np.load(tmp_path / "out.routed_experts.npz")
    assert routed["c0"].shape == (len(rows[0]["prompt_ids"]) + len(rows[0]["completion_ids"]) - 1, 2, 2)
    seqs = tmp_path / "seqs.jsonl"
    seqs.write_text(
        "\n".join(json.dumps({"id": r["id"], "token_ids": r["prompt_ids"] + r["completion_ids"]}) for r in rows)
    )
    scored = tmp_path / "scored.jsonl"
    assert run(["teacher", str(seqs), str(scored), *flags(servers, tiny_models, moe=True)], capsys)[0] == 0
    (first,) = [row for row in map(json.loads, scored.read_text().splitlines()) if row["id"] == "c0"]
    assert first["logprobs"][0] is None
    np.testing.assert_allclose(first["logprobs"][len(rows[0]["prompt_ids"]) :], rows[0]["logprobs"], atol=1e-5)


def test_exit_codes_for_bad_usage_and_failed_operations(servers, tiny_models, capsys, tmp_path) -> None:
    assert main(["state"]) == 2  # no backend, no URL
    assert "give --backend and --url" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    assert main(["teacher", str(bad), str(tmp_path / "o.jsonl"), *flags(servers, tiny_models)]) == 2
    assert main(["load-lora", "x", "/no/such/adapter", *flags(servers, tiny_models)]) == 1
    assert "failed on 2 of 2 server(s)" in capsys.readouterr().err
    assert main(["state", "--backend", "reference", "--url", "http://127.0.0.1:9"]) == 1


def test_config_file_and_env(servers, tiny_models, capsys, tmp_path, monkeypatch) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'[client]\nbackend = "reference"\nbase_url = ["{servers[0]}"]\nmodel = "tiny-qwen3"\n')
    assert main(["health", "--config", str(cfg), "--section", "client"]) == 0
    monkeypatch.setenv("BACKENDS_CONFIG", str(tmp_path / "missing.toml"))
    assert main(["health", "--section", "client"]) == 2
    assert "missing.toml" in capsys.readouterr().err


def test_demo_without_the_test_kit_exits_2_with_the_install_hint(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "backends_testkit.demo", None)  # what an install without the kit sees
    assert main(["demo"]) == 2
    assert 'pip install "backends-core[testing]"' in capsys.readouterr().err


def test_rollout_runs_groups_one_line_per_sample(servers, tiny_models, capsys, tmp_path) -> None:
    convs = tmp_path / "in.jsonl"
    lines = [
        {"id": "a", "messages": [{"role": "user", "content": "qa"}]},
        {"id": "b", "messages": [{"role": "user", "content": "qb"}], "n": 2},
        {"id": "c", "messages": [{"role": "user", "content": "qc"}], "n": 0},
    ]
    convs.write_text("\n".join(json.dumps(line) for line in lines))
    out_path = tmp_path / "out.jsonl"
    argv = [
        "rollout",
        str(convs),
        str(out_path),
        "--max-tokens",
        "4",
        "--n",
        "3",
        "--seed",
        "7",
        "--on-bad-row",
        "skip",
    ]
    code = main([*argv, *flags(servers, tiny_models)])
    assert code == 2  # line c's group size is a bad row: reported and skipped; the others ran
    assert "group size must be an int >= 1, got 0 @ $.n" in capsys.readouterr().err
    rows = sorted(
        (json.loads(line) for line in out_path.read_text().splitlines()), key=lambda r: (r["id"], r.get("sample"))
    )
    assert [(r["id"], r.get("sample")) for r in rows] == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1)]
    group_a = rows[:3]
    assert len({tuple(r["prompt_ids"]) for r in group_a}) == 1 and len({r["server"] for r in group_a}) == 1
    code, out = run(
        ["generate", "--prompt", "qa", "--max-tokens", "4", "--seed", "8", "--json", *flags(servers, tiny_models)],
        capsys,
    )
    assert code == 0 and json.loads(out)["completion_ids"] == group_a[1]["completion_ids"]  # sample 1: seed 7 + 1


def test_rollout_groups_keep_each_samples_routed_experts(servers, tiny_models, capsys, tmp_path) -> None:
    convs = tmp_path / "in.jsonl"
    convs.write_text(json.dumps({"id": "m", "messages": [{"role": "user", "content": "q"}], "n": 2}))
    out_path = tmp_path / "out.jsonl"
    argv = ["rollout", str(convs), str(out_path), "--max-tokens", "3", "--routed-experts"]
    assert run([*argv, *flags(servers, tiny_models, moe=True)], capsys)[0] == 0
    rows = [json.loads(line) for line in out_path.read_text().splitlines()]
    routed = np.load(tmp_path / "out.routed_experts.npz")
    assert sorted(routed.files) == ["m/0", "m/1"]
    for row in rows:
        rows_expected = len(row["prompt_ids"]) + len(row["completion_ids"]) - 1
        assert routed[f"m/{row['sample']}"].shape == (rows_expected, 2, 2)
