"""backends_core.runs without a server: row checking, sampling rows, and how a resumed output is read."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest

from backends_core.client import Client
from backends_core.config import ClientConfig
from backends_core.driver import BackendDriver
from backends_core.errors import UnsupportedOperationError
from backends_core.runs import (
    _SAMPLING_KINDS,
    EXIT_USAGE,
    OutputError,
    RolloutJob,
    RowError,
    RunOptions,
    TeacherJob,
    execute,
    prepare_output,
    read_records,
    sampling_from_row,
)
from backends_core.types import Choice, JsonSchema, SamplingParams


def rollout_job(**kw) -> RolloutJob:
    return RolloutJob(**{"sampling": {"max_tokens": 8}, "seed": None, "n": 1, "routed_experts": False, **kw})


def write(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def test_every_sampling_field_but_n_is_accepted_in_a_row() -> None:
    fields = {f.name for f in attrs.fields(SamplingParams)}
    assert set(_SAMPLING_KINDS) == fields - {"n"}


def test_a_rows_sampling_overrides_the_command_line_and_reads_json_shapes() -> None:
    sampling = sampling_from_row(
        {
            "temperature": 0,
            "stop": "END",
            "logit_bias": {"7": -100},
            "structured": {"choice": ["yes", "no"]},
            "stop_token_ids": [3],
        },
        {"max_tokens": 8, "temperature": 1.0},
    )
    assert sampling.max_tokens == 8 and sampling.temperature == 0
    assert sampling.stop == ("END",) and sampling.logit_bias == {7: -100.0} and sampling.stop_token_ids == (3,)
    assert sampling.structured == Choice(["yes", "no"])
    schema = sampling_from_row({"structured": {"json_schema": {"type": "object"}}}, {"max_tokens": 8})
    assert schema.structured == JsonSchema({"type": "object"})


@pytest.mark.parametrize(
    ("sampling", "path", "message"),
    [
        ({"temperature": "hot"}, "$.sampling.temperature", "must be a finite number, got 'hot'"),
        ({"max_tokns": 3}, "$.sampling.max_tokns", "did you mean 'max_tokens'?"),
        ({"n": 2}, "$.sampling.n", "unknown key 'n'"),
        ({"ignore_eos": 1}, "$.sampling.ignore_eos", "must be true or false"),
        ({"seed": 1.5}, "$.sampling.seed", "must be an int or null"),
        ({"stop_token_ids": [1, -2]}, "$.sampling.stop_token_ids[1]", "must be a token id"),
        ({"logit_bias": {"x": 1}}, "$.sampling.logit_bias.x", "must be token ids"),
        ({"structured": {"yaml": "a"}}, "$.sampling.structured.yaml", "unknown structured kind 'yaml'"),
        ({"top_p": 2.0}, "$.sampling.top_p", "top_p must be in (0, 1]"),
        ({"max_tokens": 0}, "$.sampling.max_tokens", "max_tokens must be an int >= 1"),
        ([], "$.sampling", "must be an object of sampling fields"),
    ],
)
def test_bad_sampling_names_its_field_path(sampling, path, message) -> None:
    with pytest.raises(RowError) as info:
        sampling_from_row(sampling, {"max_tokens": 8})
    assert info.value.path == path and message in info.value.message


def test_records_get_their_line_index_key_and_seed(tmp_path) -> None:
    path = write(
        tmp_path / "in.jsonl",
        [
            {"messages": [{"role": "user", "content": "a"}]},
            "",
            {"id": 7, "messages": [{"role": "user", "content": "b"}], "sampling": {"seed": 1}},
            {"id": "x", "messages": [{"role": "user", "content": "c"}]},
        ],
    )
    records, bad = read_records(str(path), rollout_job(seed=100))
    assert bad == []
    assert [(r.line, r.index, r.key) for r in records] == [(1, 0, "1"), (3, 1, "7"), (4, 2, "x")]
    assert [r.item.sampling.seed for r in records] == [100, 1, 102]  # a row's own seed wins


def test_a_default_id_colliding_with_an_explicit_one_is_a_repeat(tmp_path) -> None:
    path = write(tmp_path / "in.jsonl", [{"id": "2", "token_ids": [1, 2]}, {"token_ids": [2, 3]}])
    _, bad = read_records(str(path), TeacherJob(top_logprobs=0))
    assert [(b.line, b.message) for b in bad] == [(2, "id '2' repeats line 1")]


def test_resume_reruns_a_group_cut_short_and_refuses_a_damaged_middle_line(tmp_path) -> None:
    path = write(
        tmp_path / "in.jsonl",
        [
            {"id": "g", "messages": [{"role": "user", "content": "a"}], "n": 2},
            {"id": "h", "messages": [{"role": "user", "content": "b"}]},
        ],
    )
    job = rollout_job()
    records, _ = read_records(str(path), job)
    out = tmp_path / "out.jsonl"
    write(out, [{"id": "g", "sample": 0}, {"id": "h"}, {"id": "other"}])
    resumed = prepare_output(out, records, job, resume=True, overwrite=False)
    assert resumed.done == {"h"}
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["h", "other"]
    assert any("1 record(s) that failed or were cut short run again" in n for n in resumed.notes)
    assert any("kept 1 result(s) whose id is not in the input" in n for n in resumed.notes)

    write(out, [{"id": "h"}, "garbage", {"id": "g", "sample": 0}])
    with pytest.raises(OutputError, match=r"out.jsonl:2: not a result line"):
        prepare_output(out, records, job, resume=True, overwrite=False)


def test_a_backend_that_cannot_score_refuses_the_teacher_run_before_anything_is_sent(
    tmp_path, monkeypatch, capsys
) -> None:
    def cannot(self, operation: str) -> None:
        raise UnsupportedOperationError(self.backend, operation)

    monkeypatch.setattr(BackendDriver, "require", cannot)
    seqs = write(tmp_path / "seqs.jsonl", [{"token_ids": [1, 2]}])
    out = tmp_path / "out.jsonl"
    options = RunOptions(input=str(seqs), output=str(out))

    def no_client(config: ClientConfig) -> Client:
        raise AssertionError("no client may be made")

    config = ClientConfig(backend="reference", base_url="http://127.0.0.1:9", model="m")
    assert execute(TeacherJob(top_logprobs=0), options, lambda: config, no_client) == EXIT_USAGE
    assert "backend 'reference' does not support 'teacher_logprobs'" in capsys.readouterr().err
    assert not out.exists()
