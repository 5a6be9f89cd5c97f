"""``backends rollout`` and ``backends teacher`` as file-to-file runs against a reference server in its own
process: results appended as each record finishes, resume, Ctrl-C, bad rows, seeds, top logprobs, progress,
summary and exit codes."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import numpy as np
import pytest

from backends_core.cli import main

DEAD_URL = "http://127.0.0.1:9"  # nothing listens on the discard port: every request fails to connect


@pytest.fixture(scope="module")
def server(tiny_models):
    proc = subprocess.Popen(
        [sys.executable, "-m", "backends_testkit.reference", "--model", str(tiny_models.dense)],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    assert line.startswith("listening on "), line
    yield line.split()[-1]
    proc.terminate()
    proc.wait(timeout=10)
    proc.stdout.close()


@pytest.fixture(scope="module")
def moe_server(tiny_models):
    proc = subprocess.Popen(
        [sys.executable, "-m", "backends_testkit.reference", "--model", str(tiny_models.moe)],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    assert line.startswith("listening on "), line
    yield line.split()[-1]
    proc.terminate()
    proc.wait(timeout=10)
    proc.stdout.close()


def flags(url: str, tiny_models=None) -> list[str]:
    """Client flags; without ``tiny_models`` no tokenizer (enough for runs refused before a client exists)."""
    tokenizer = [] if tiny_models is None else ["--tokenizer", str(tiny_models.dense)]
    return ["--backend", "reference", "--url", url, "--model", "tiny-qwen3", *tokenizer]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def conversations(count: int, start: int = 0) -> list[dict]:
    return [{"id": f"c{i}", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(start, start + count)]


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# -- bad input -------------------------------------------------------------------------------------------

BAD_ROWS = [
    {"id": "ok", "messages": [{"role": "user", "content": "hi"}]},
    "not json {",
    {"id": "hot", "messages": [{"role": "user", "content": "hi"}], "sampling": {"temperature": "hot"}},
    {"id": "typo", "messages": [{"role": "user", "content": "hi"}], "sampling": {"max_tokns": 3}},
    {"id": "no-prompt"},
    {"id": "zero", "messages": [{"role": "user", "content": "hi"}], "n": 0},
    {"id": "role", "messages": [{"content": "hi"}]},
]


def test_bad_rows_are_all_reported_with_line_and_field_path_and_nothing_is_sent(tmp_path, capsys) -> None:
    convs = write_jsonl(tmp_path / "in.jsonl", BAD_ROWS)
    out = tmp_path / "out.jsonl"
    assert main(["rollout", str(convs), str(out), *flags(DEAD_URL)]) == 2
    err = capsys.readouterr().err
    assert f"{convs}:2: not JSON" in err
    assert f"{convs}:3: must be a finite number, got 'hot' @ $.sampling.temperature" in err
    assert f"{convs}:4: unknown key 'max_tokns' (did you mean 'max_tokens'?) @ $.sampling.max_tokns" in err
    assert f"{convs}:5: missing: every row needs its conversation @ $.messages" in err
    assert f"{convs}:6: group size must be an int >= 1, got 0 @ $.n" in err
    assert f"{convs}:7: must be a non-empty string, got None @ $.messages[0].role" in err
    assert "6 bad row(s)" in err and "nothing was sent" in err
    assert not out.exists()  # refused before the output (or any server) was touched


def test_bad_rows_as_json_lines_on_stderr(tmp_path, capsys) -> None:
    convs = write_jsonl(tmp_path / "in.jsonl", BAD_ROWS)
    assert main(["rollout", str(convs), str(tmp_path / "o.jsonl"), "--json", *flags(DEAD_URL)]) == 2
    captured = capsys.readouterr()
    events = [json.loads(line) for line in captured.err.splitlines()]
    bad = [e for e in events if e["event"] == "bad_row"]
    assert [(e["line"], e["path"]) for e in bad] == [
        (2, "$"),
        (3, "$.sampling.temperature"),
        (4, "$.sampling.max_tokns"),
        (5, "$.messages"),
        (6, "$.n"),
        (7, "$.messages[0].role"),
    ]
    assert events[-1]["event"] == "refused" and events[-1]["error"] == "InvalidRequestError"
    assert captured.out == ""


def test_a_repeated_id_is_refused_up_front_with_its_line_numbers_even_when_skipping(tmp_path, capsys) -> None:
    rows = [*conversations(2), {"id": "c0", "messages": [{"role": "user", "content": "again"}]}]
    convs = write_jsonl(tmp_path / "in.jsonl", rows)
    argv = ["rollout", str(convs), str(tmp_path / "o.jsonl"), "--on-bad-row", "skip", *flags(DEAD_URL)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{convs}:3: id 'c0' repeats line 1 @ $.id" in err
    assert "nothing was sent" in err


def test_teacher_bad_rows_name_the_token(tmp_path, capsys) -> None:
    seqs = write_jsonl(
        tmp_path / "seqs.jsonl", [{"token_ids": [1, 2]}, {"token_ids": [1, "a"]}, {"ids": [1]}, {"token_ids": [5]}]
    )
    assert main(["teacher", str(seqs), str(tmp_path / "o.jsonl"), *flags(DEAD_URL)]) == 2
    err = capsys.readouterr().err
    assert f"{seqs}:2: must be a token id (an int >= 0), got 'a' @ $.token_ids[1]" in err
    assert f"{seqs}:3: unknown key 'ids'" in err
    assert f"{seqs}:4: teacher scoring needs at least two token ids (position 0 has no logprob) @ $.token_ids" in err
    assert main(["teacher", str(seqs), str(tmp_path / "o.jsonl"), "--top-logprobs", "21", *flags(DEAD_URL)]) == 2
    assert "top_logprobs must be in [0, 20], got 21" in capsys.readouterr().err
    assert main(["rollout", str(seqs), str(tmp_path / "o.jsonl"), "--max-tokens", "0", *flags(DEAD_URL)]) == 2
    assert "argument --max-tokens: must be an integer >= 1, got 0" in capsys.readouterr().err


def test_skip_runs_the_good_rows_reports_the_bad_ones_and_exits_2(server, tiny_models, tmp_path, capsys) -> None:
    convs = write_jsonl(tmp_path / "in.jsonl", BAD_ROWS)
    out = tmp_path / "out.jsonl"
    argv = ["rollout", str(convs), str(out), "--max-tokens", "2", "--on-bad-row", "skip"]
    assert main([*argv, *flags(server, tiny_models)]) == 2
    assert [r["id"] for r in read_rows(out)] == ["ok"]
    err = capsys.readouterr().err
    assert "@ $.sampling.temperature" in err
    assert "rollout: 1 ok, 0 failed, 6 skipped (bad rows)" in err


# -- results on disk -------------------------------------------------------------------------------------


def test_records_that_fail_on_a_server_get_an_error_line_and_exit_1(tiny_models, tmp_path, capsys) -> None:
    convs = write_jsonl(tmp_path / "in.jsonl", conversations(2))
    out = tmp_path / "out.jsonl"
    assert main(["rollout", str(convs), str(out), *flags(DEAD_URL, tiny_models)]) == 1
    rows = read_rows(out)
    assert sorted(r["id"] for r in rows) == ["c0", "c1"]
    assert all(r["error"].startswith("NetworkError") for r in rows)
    err = capsys.readouterr().err
    assert f"{convs}:1 (id 'c0') failed: NetworkError" in err
    assert "rollout: 0 ok, 2 failed" in err


def test_a_sampling_feature_the_backend_lacks_is_a_bad_row_found_before_sending(tiny_models, tmp_path, capsys) -> None:
    extra = {"id": "x", "messages": [{"role": "user", "content": "q"}], "sampling": {"extra": {"k": 1}}}
    convs = write_jsonl(tmp_path / "in.jsonl", [*conversations(1), extra])
    out = tmp_path / "out.jsonl"
    assert main(["rollout", str(convs), str(out), *flags(DEAD_URL, tiny_models)]) == 2
    err = capsys.readouterr().err
    assert f"{convs}:2: backend 'reference' does not support 'sampling.extra'" in err
    assert "@ $.sampling.extra" in err and "nothing was sent" in err
    assert not out.exists()


def test_a_record_the_client_refuses_at_run_time_gets_an_error_line_and_exits_2(
    server, tiny_models, tmp_path, capsys
) -> None:
    image = {"id": "img", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}
    convs = write_jsonl(tmp_path / "in.jsonl", [*conversations(1), image])
    out = tmp_path / "out.jsonl"
    assert main(["rollout", str(convs), str(out), "--max-tokens", "2", *flags(server, tiny_models)]) == 2
    by_id = {r["id"]: r for r in read_rows(out)}
    assert "completion_ids" in by_id["c0"]
    assert by_id["img"]["error"].startswith("InvalidRequestError: messages[0].content[0]")
    assert "rollout: 1 ok, 1 failed (1 refused before sending)" in capsys.readouterr().err


def test_teacher_records_that_fail_on_a_server_exit_1_with_json_events(tiny_models, tmp_path, capsys) -> None:
    seqs = write_jsonl(tmp_path / "seqs.jsonl", [{"id": "s0", "token_ids": [1, 2]}, {"id": "s1", "token_ids": [3, 4]}])
    out = tmp_path / "scored.jsonl"
    assert main(["teacher", str(seqs), str(out), "--json", *flags(DEAD_URL, tiny_models)]) == 1
    captured = capsys.readouterr()
    failed = [json.loads(line) for line in captured.err.splitlines() if '"record_failed"' in line]
    assert sorted((e["line"], e["id"], e["error"]) for e in failed) == [
        (1, "s0", "NetworkError"),
        (2, "s1", "NetworkError"),
    ]
    (summary,) = [json.loads(line) for line in captured.out.splitlines()]
    assert (summary["command"], summary["ok"], summary["failed"], summary["exit_code"]) == ("teacher", 0, 2, 1)
    assert sorted(r["id"] for r in read_rows(out)) == ["s0", "s1"]


def test_an_existing_output_is_kept_unless_resume_or_overwrite(server, tiny_models, tmp_path, capsys) -> None:
    convs = write_jsonl(tmp_path / "in.jsonl", conversations(1))
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "precious"}\n')
    assert main(["rollout", str(convs), str(out), *flags(server, tiny_models)]) == 2
    assert "exists: --resume to continue it, --overwrite to start over" in capsys.readouterr().err
    assert out.read_text() == '{"id": "precious"}\n'
    assert main(["rollout", str(convs), str(out), "--max-tokens", "2", "--overwrite", *flags(server, tiny_models)]) == 0
    assert [r["id"] for r in read_rows(out)] == ["c0"]


def test_resume_keeps_finished_records_drops_a_cut_off_line_and_runs_the_rest(
    server, tiny_models, tmp_path, capsys
) -> None:
    out = tmp_path / "out.jsonl"
    first = write_jsonl(tmp_path / "first.jsonl", conversations(3))
    assert main(["rollout", str(first), str(out), "--max-tokens", "3", *flags(server, tiny_models)]) == 0
    finished = out.read_text()
    with out.open("a") as f:
        f.write('{"id": "c3", "prompt_ids": [1, 2')  # a crash in the middle of a line
    convs = write_jsonl(tmp_path / "all.jsonl", conversations(5))
    capsys.readouterr()
    code = main(["rollout", str(convs), str(out), "--max-tokens", "3", "--resume", *flags(server, tiny_models)])
    assert code == 0
    assert out.read_text().startswith(finished)  # the finished lines are untouched, not re-run
    assert sorted(r["id"] for r in read_rows(out)) == ["c0", "c1", "c2", "c3", "c4"]
    err = capsys.readouterr().err
    assert f"{out}:4: dropped a cut-off last line" in err
    assert "rollout: 2 ok, 0 failed, 0 skipped (bad rows), 3 already done" in err


def test_resume_runs_failed_records_again(server, tiny_models, tmp_path, capsys) -> None:
    convs = write_jsonl(tmp_path / "in.jsonl", conversations(2))
    out = tmp_path / "out.jsonl"
    assert main(["rollout", str(convs), str(out), "--max-tokens", "2", *flags(DEAD_URL, tiny_models)]) == 1
    argv = ["rollout", str(convs), str(out), "--max-tokens", "2", "--resume"]
    assert main([*argv, *flags(server, tiny_models)]) == 0
    rows = read_rows(out)
    assert sorted(r["id"] for r in rows) == ["c0", "c1"] and not any("error" in r for r in rows)
    assert "2 record(s) that failed or were cut short run again" in capsys.readouterr().err


def test_resume_keeps_routed_experts_and_reruns_records_whose_routing_was_lost(
    moe_server, tiny_models, tmp_path, capsys
) -> None:
    moe = [
        "--backend",
        "reference",
        "--url",
        moe_server,
        "--model",
        "tiny-qwen3-moe",
        "--tokenizer",
        str(tiny_models.moe),
    ]
    out, npz = tmp_path / "out.jsonl", tmp_path / "out.routed_experts.npz"
    argv = ["rollout", "--max-tokens", "2", "--routed-experts", *moe]
    assert main([*argv, str(write_jsonl(tmp_path / "a.jsonl", conversations(2))), str(out)]) == 0
    with np.load(npz) as saved:
        c0 = saved["c0"]
    assert main([*argv, str(write_jsonl(tmp_path / "b.jsonl", conversations(3))), str(out), "--resume"]) == 0
    with np.load(npz) as saved:
        assert sorted(saved.files) == ["c0", "c1", "c2"]
        np.testing.assert_array_equal(saved["c0"], c0)  # kept from the first run, not generated again
    capsys.readouterr()

    npz.unlink()  # a crash: the result lines were flushed, the routing (written when a run ends) never was
    assert main([*argv, str(tmp_path / "b.jsonl"), str(out), "--resume"]) == 0
    assert "3 finished record(s) lack their routed experts: they run again" in capsys.readouterr().err
    assert sorted(r["id"] for r in read_rows(out)) == ["c0", "c1", "c2"]
    with np.load(npz) as saved:
        assert sorted(saved.files) == ["c0", "c1", "c2"]


def test_seed_is_the_runs_seed_plus_the_record_index_and_runs_repeat(server, tiny_models, tmp_path, capsys) -> None:
    same = {"role": "user", "content": "tell me"}
    convs = write_jsonl(
        tmp_path / "in.jsonl",
        [{"id": "a", "messages": [same]}, {"id": "b", "messages": [same]}, {"id": "g", "messages": [same], "n": 2}],
    )
    outputs = []
    for name in ("one.jsonl", "two.jsonl"):
        argv = ["rollout", str(convs), str(tmp_path / name), "--max-tokens", "6", "--seed", "7"]
        assert main([*argv, *flags(server, tiny_models)]) == 0
        rows = read_rows(tmp_path / name)
        outputs.append(sorted((r["id"], r.get("sample"), r["completion_ids"]) for r in rows))
    assert outputs[0] == outputs[1]
    by_key = {(i, s): ids for i, s, ids in outputs[0]}
    assert by_key[("a", None)] != by_key[("b", None)]  # same prompt, seeds 7 and 8
    capsys.readouterr()
    argv = ["generate", "--prompt", "tell me", "--max-tokens", "6", "--json", *flags(server, tiny_models)]
    for seed, key in ((8, ("b", None)), (9, ("g", 0)), (10, ("g", 1))):  # b is index 1; g index 2, sample j: +j
        assert main([*argv, "--seed", str(seed)]) == 0
        assert json.loads(capsys.readouterr().out)["completion_ids"] == by_key[key]


def test_top_logprobs_are_written_when_asked(server, tiny_models, tmp_path) -> None:
    convs = write_jsonl(tmp_path / "in.jsonl", conversations(2))
    out = tmp_path / "out.jsonl"
    argv = ["rollout", str(convs), str(out), "--max-tokens", "3", "--top-logprobs", "2"]
    assert main([*argv, *flags(server, tiny_models)]) == 0
    for row in read_rows(out):
        assert len(row["top_logprobs"]) == len(row["completion_ids"])
        assert all(len(position) == 2 for position in row["top_logprobs"])
        assert {"token_id", "logprob", "rank"} <= set(row["top_logprobs"][0][0])
    plain = tmp_path / "plain.jsonl"
    assert main(["rollout", str(convs), str(plain), "--max-tokens", "3", *flags(server, tiny_models)]) == 0
    assert not any("top_logprobs" in row for row in read_rows(plain))

    seqs = write_jsonl(tmp_path / "seqs.jsonl", [{"id": r["id"], "token_ids": r["prompt_ids"]} for r in read_rows(out)])
    scored = tmp_path / "scored.jsonl"
    assert main(["teacher", str(seqs), str(scored), "--top-logprobs", "2", *flags(server, tiny_models)]) == 0
    for row in read_rows(scored):
        assert row["logprobs"][0] is None and row["top_logprobs"][0] == []
        assert all(len(position) == 2 for position in row["top_logprobs"][1:])


def test_metadata_is_copied_to_each_result_line(server, tiny_models, tmp_path) -> None:
    row = {"id": "m", "messages": [{"role": "user", "content": "q"}], "n": 2, "metadata": {"answer": 4}}
    convs = write_jsonl(tmp_path / "in.jsonl", [row])
    out = tmp_path / "out.jsonl"
    assert main(["rollout", str(convs), str(out), "--max-tokens", "2", *flags(server, tiny_models)]) == 0
    assert [(r["sample"], r["metadata"]) for r in sorted(read_rows(out), key=lambda r: r["sample"])] == [
        (0, {"answer": 4}),
        (1, {"answer": 4}),
    ]


def test_teacher_appends_and_resumes(server, tiny_models, tmp_path, capsys) -> None:
    seqs = write_jsonl(tmp_path / "seqs.jsonl", [{"id": f"s{i}", "token_ids": [5, 6, 7 + i]} for i in range(3)])
    scored = tmp_path / "scored.jsonl"
    scored.write_text('{"id": "s0", "token_ids": [5, 6, 7], "logprobs": [null, -1.0, -2.0]}\n')
    code = main(["teacher", str(seqs), str(scored), "--resume", *flags(server, tiny_models)])
    assert code == 0
    rows = read_rows(scored)
    assert rows[0]["logprobs"] == [None, -1.0, -2.0]  # kept as it was: not scored again
    assert sorted(r["id"] for r in rows) == ["s0", "s1", "s2"]
    assert "teacher: 2 ok, 0 failed, 0 skipped (bad rows), 1 already done" in capsys.readouterr().err


# -- progress and summary --------------------------------------------------------------------------------


def test_progress_lines_and_summary_when_stderr_is_not_a_terminal(server, tiny_models, tmp_path, capsys) -> None:
    convs = write_jsonl(tmp_path / "in.jsonl", conversations(3))
    argv = ["rollout", str(convs), str(tmp_path / "o.jsonl"), "--max-tokens", "2", "--log-every", "0"]
    assert main([*argv, "--concurrency", "1", *flags(server, tiny_models)]) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    progress = [line for line in lines if line.startswith("rollout: ") and " records, " in line]
    assert [p.split(" records")[0] for p in progress] == ["rollout: 1/3", "rollout: 2/3", "rollout: 3/3"]
    assert all("0 failed" in p and "rec/s" in p and "tokens/s" in p and "ETA" in p for p in progress)
    assert lines[-1].startswith("rollout: 3 ok, 0 failed, 0 skipped (bad rows), 0 already done; 6 tokens in ")
    assert "tokens/s" in lines[-1] and captured.out == ""


def test_json_prints_the_summary_on_stdout_and_json_lines_on_stderr(server, tiny_models, tmp_path, capsys) -> None:
    convs = write_jsonl(tmp_path / "in.jsonl", conversations(2))
    argv = ["rollout", str(convs), str(tmp_path / "o.jsonl"), "--max-tokens", "2", "--log-every", "0", "--json"]
    assert main([*argv, *flags(server, tiny_models)]) == 0
    captured = capsys.readouterr()
    (summary,) = [json.loads(line) for line in captured.out.splitlines()]
    assert summary["event"] == "summary" and summary["command"] == "rollout"
    assert (summary["ok"], summary["failed"], summary["skipped"], summary["tokens"]) == (2, 0, 0, 4)
    assert summary["interrupted"] is False and summary["exit_code"] == 0 and summary["tokens_per_s"] > 0
    events = [json.loads(line) for line in captured.err.splitlines()]
    assert [e["event"] for e in events] == ["progress", "progress"]
    assert events[-1]["done"] == events[-1]["total"] == 2


def test_a_terminal_gets_a_progress_bar_with_rate_and_errors(tiny_models, tmp_path) -> None:
    convs = write_jsonl(tmp_path / "in.jsonl", conversations(2))
    primary, replica = pty.openpty()
    fcntl.ioctl(replica, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 160, 0, 0))  # a 160-column terminal
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "backends_core",
            "rollout",
            str(convs),
            str(tmp_path / "o.jsonl"),
            *flags(DEAD_URL, tiny_models),
        ],
        stderr=replica,
        stdout=subprocess.DEVNULL,
    )
    os.close(replica)
    screen = b""
    try:
        while True:
            ready, _, _ = select.select([primary], [], [], 60)
            assert ready, "no terminal output within 60 s"
            try:
                chunk = os.read(primary, 4096)
            except OSError:  # the process closed the terminal
                break
            if not chunk:
                break
            screen += chunk
    finally:
        assert proc.wait(timeout=60) == 1
        os.close(primary)
    text = screen.decode(errors="replace")
    assert "rollout: 100%" in text and "2/2" in text and "rec/s" in text and "errors=2" in text
    assert "rollout: 0 ok, 2 failed" in text


# -- Ctrl-C ----------------------------------------------------------------------------------------------


def test_ctrl_c_leaves_a_valid_file_and_prints_the_summary(server, tiny_models, tmp_path) -> None:
    convs = write_jsonl(tmp_path / "in.jsonl", conversations(5000))  # far more than can finish before the signal
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "backends_core",
            "rollout",
            str(convs),
            str(out),
            "--max-tokens",
            "4",
            "--concurrency",
            "4",
            *flags(server, tiny_models),
        ],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (out.exists() and out.read_text().count("\n") >= 1):
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "no result line within 120 s"
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    text = out.read_text()
    assert text.endswith("\n")
    rows = [json.loads(line) for line in text.splitlines()]
    assert 1 <= len(rows) < 5000 and not any("error" in r for r in rows)
    summary = err.strip().splitlines()[-1]
    assert summary.startswith(f"rollout interrupted: {len(rows)} ok, 0 failed, 0 skipped (bad rows), 0 already done")
    assert f"{5000 - len(rows)} not run" in summary and "Traceback" not in err
