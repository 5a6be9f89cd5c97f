"""The CLI's contract with scripts, verb by verb: exit codes (0 ok, 1 an operation failed on some server, 2 usage,
configuration or input), ``--json`` (one JSON object per line on stdout; an error as one JSON object on stderr),
bad input named with its field before anything is sent, ``--version``, and help text on every option."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from backends_core import cli
from backends_core.cli import build_parser, main

#: Nothing listens there: every request to it fails (connection refused).
DEAD = "http://127.0.0.1:9"

#: Every verb that talks to servers, in an order that leaves the server as it found it.
SERVER_VERBS = [
    "state",
    "health",
    "generate",
    "check-tokenizer",
    "update-weights",
    "load-lora",
    "unload-lora",
    "pause",
    "resume",
]
FILE_VERBS = ["rollout", "teacher"]
ALL_VERBS = ["list", *SERVER_VERBS, *FILE_VERBS, "demo", "serve", "gateway", "gateway export"]


@pytest.fixture(scope="module")
def server(tiny_models):
    proc = subprocess.Popen(
        [sys.executable, "-m", "backends_testkit.reference", "--model", str(tiny_models.dense)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening on "), line
        yield line.split()[-1]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        proc.stdout.close()


@pytest.fixture
def verb_args(tiny_models, tmp_path):
    """The arguments of each verb (without the client flags) asking for something that works."""
    convs = tmp_path / "convs.jsonl"
    convs.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    seqs = tmp_path / "seqs.jsonl"
    seqs.write_text(json.dumps({"id": "a", "token_ids": [1, 2, 3]}) + "\n")
    return {
        "state": ["state"],
        "health": ["health"],
        "generate": ["generate", "--prompt-ids", "1,2,3", "--max-tokens", "2"],
        "check-tokenizer": ["check-tokenizer", "--prompt", "hi"],
        "update-weights": ["update-weights", str(tiny_models.dense), "--version", "base"],
        "load-lora": ["load-lora", "tiny-lora", str(tiny_models.lora)],
        "unload-lora": ["unload-lora", "tiny-lora"],
        "pause": ["pause", "--mode", "wait"],
        "resume": ["resume"],
        "rollout": ["rollout", str(convs), str(tmp_path / "out.jsonl"), "--max-tokens", "2"],
        "teacher": ["teacher", str(seqs), str(tmp_path / "scored.jsonl")],
    }


def client_flags(url: str, tiny_models, backend: str = "reference") -> list[str]:
    return ["--backend", backend, "--url", url, "--model", "tiny-qwen3", "--tokenizer", str(tiny_models.dense)]


def json_error(err: str) -> dict:
    """The one JSON error object a ``--json`` command wrote on stderr."""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    error = json.loads(lines[0])["error"]
    assert set(error) >= {"type", "message", "exit"}
    return error


@pytest.mark.parametrize("verb", SERVER_VERBS)
def test_each_verb_exits_0_and_prints_json_lines(verb, server, tiny_models, verb_args, capsys) -> None:
    try:
        code = main([*verb_args[verb], "--json", *client_flags(server, tiny_models)])
        out, err = capsys.readouterr()
    finally:
        if verb == "pause":
            assert main(["resume", *client_flags(server, tiny_models)]) == 0
    assert code == 0, err
    lines = out.splitlines()
    assert lines and all(isinstance(json.loads(line), dict) for line in lines)


def test_list_prints_one_json_object_per_backend(capsys) -> None:
    assert main(["list", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {"reference", "vllm", "sglang", "dynamo"} <= {row["name"] for row in rows}
    assert all(set(row) == {"name", "distribution", "version", "capabilities", "parsers", "error"} for row in rows)
    assert all(row["parsers"] == {"tool": ["hermes"], "reasoning": ["qwen3"]} for row in rows)


def test_list_shows_the_parsers_auto_chooses_for_a_tokenizers_template(tiny_models, capsys) -> None:
    assert main(["list", "--json", "--tokenizer", str(tiny_models.dense)]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {(row["parsers"]["auto_tool"], row["parsers"]["auto_reasoning"]) for row in rows} == {("hermes", "qwen3")}
    assert main(["list", "--tokenizer", str(tiny_models.dense)]) == 0
    assert f"(auto for {tiny_models.dense}: tool hermes, reasoning qwen3)" in capsys.readouterr().out


def test_json_is_accepted_before_the_verb_too(server, tiny_models, capsys) -> None:
    assert main(["--json", "state", *client_flags(server, tiny_models)]) == 0
    assert json.loads(capsys.readouterr().out)["servers"][0]["reachable"] is True


@pytest.mark.parametrize("verb", [*SERVER_VERBS, *FILE_VERBS])
def test_each_verb_exits_1_when_the_operation_fails_on_the_server(verb, tiny_models, verb_args, capsys) -> None:
    code = main([*verb_args[verb], "--json", *client_flags(DEAD, tiny_models)])
    assert code == 1
    out, err = capsys.readouterr()
    if verb in ("state", "health"):  # the report is the output: the server is shown down
        assert [s["reachable"] for s in json.loads(out)["servers"]] == [False]
    elif verb not in FILE_VERBS:  # those report each record's failure in their output file
        error = json_error(err)
        assert error["exit"] == 1 and "127.0.0.1:9" in error["message"]


def test_demo_exits_1_when_its_server_fails(tiny_models, capsys) -> None:
    argv = ["demo", "--url", DEAD, "--models-dir", str(tiny_models.root), "--json"]
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert json.loads(out.splitlines()[-1])["demo"] == "failed"
    assert json_error(err)["exit"] == 1


@pytest.mark.parametrize("verb", [*SERVER_VERBS, *FILE_VERBS, "demo", "serve"])
def test_each_verb_exits_2_on_a_mistyped_backend(verb, tiny_models, verb_args, capsys) -> None:
    if verb in ("demo", "serve"):
        argv = [verb, "--backend", "vlm", "--json"]
    else:
        argv = [*verb_args[verb], "--json", *client_flags(DEAD, tiny_models, backend="vlm")]
    assert main(argv) == 2
    error = json_error(capsys.readouterr().err)
    assert error["type"] == "BackendNotFoundError" and error["exit"] == 2
    assert "did you mean 'vllm'?" in error["message"]


@pytest.mark.parametrize("verb", ALL_VERBS)
def test_each_verb_exits_2_on_an_unknown_option(verb, verb_args, capsys) -> None:
    required = {
        "list": ["list"],
        "demo": ["demo"],
        "serve": ["serve", "--backend", "vllm"],
        "gateway": ["gateway"],
        "gateway export": ["gateway", "export", "-o", "x.jsonl"],
    }
    argv = required.get(verb) or verb_args[verb]
    assert main([*argv, "--no-such-option", "--json"]) == 2
    error = json_error(capsys.readouterr().err)
    assert (
        error
        == {
            "type": "UsageError",
            "message": error["message"],
            "exit": 2,
        }
        and "unrecognized arguments: --no-such-option" in error["message"]
    )
    assert main([*argv, "--no-such-option"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: backends {verb}") and "error: unrecognized arguments: --no-such-option" in err


def test_no_command_or_an_unknown_one_exits_2(capsys) -> None:
    assert main([]) == 2
    assert "error: a command is required" in capsys.readouterr().err
    assert main(["generat", "--json"]) == 2
    assert "invalid choice: 'generat'" in json_error(capsys.readouterr().err)["message"]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("1,a", "argument --prompt-ids: item 2 of 2: 'a' is not an integer"),
        ("1,,3", "argument --prompt-ids: item 2 of 3 is empty"),
        ("", "argument --prompt-ids: item 1 of 1 is empty"),
    ],
)
def test_bad_prompt_ids_name_the_item_and_nothing_is_sent(value, message, tiny_models, capsys) -> None:
    # against a dead server: sending anything would end in exit 1, not 2
    argv = ["generate", "--prompt-ids", value, "--json", *client_flags(DEAD, tiny_models)]
    assert main(argv) == 2
    assert json_error(capsys.readouterr().err)["message"] == message


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-tokens", "0"], "argument --max-tokens: must be an integer >= 1, got 0"),
        (["--top-logprobs", "-1"], "argument --top-logprobs: must be an integer >= 0, got -1"),
        (["--temperature", "hot"], "argument --temperature: invalid float value: 'hot'"),
        (["--temperature", "-1"], "temperature must be finite and >= 0, got -1.0"),
        (["--tokenizer", "/no/such/tokenizer"], "@ $.tokenizer"),
        (["--url", "localhost:8000"], "'localhost:8000' is not an http(s) URL with a host @ $.base_url"),
    ],
)
def test_bad_generate_options_exit_2_before_anything_is_sent(argv, message, tiny_models, capsys) -> None:
    base = ["generate", "--prompt-ids", "1,2", "--json", "--backend", "reference", "--url", DEAD]
    assert main([*base, *argv]) == 2
    assert message in json_error(capsys.readouterr().err)["message"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("[{", ":1: not JSON:"),
        ('{"role": "user"}', "must hold a non-empty JSON list of messages"),
        ('[{"role": "user", "content": "hi"}, "hello"]', "$[1] must be an object, got str"),
        ('[{"content": "hi"}]', "$[0].role must be a string"),
    ],
)
def test_a_bad_messages_file_is_named_with_its_position(content, message, tiny_models, tmp_path, capsys) -> None:
    path = tmp_path / "messages.json"
    path.write_text(content)
    argv = ["check-tokenizer", "--messages", str(path), "--json", *client_flags(DEAD, tiny_models)]
    assert main(argv) == 2
    error = json_error(capsys.readouterr().err)["message"]
    assert error.startswith(f"--messages {path}") and message in error


def test_a_missing_messages_file_is_named(tiny_models, tmp_path, capsys) -> None:
    argv = ["check-tokenizer", "--messages", str(tmp_path / "none.json"), *client_flags(DEAD, tiny_models)]
    assert main(argv) == 2
    assert (
        f"error: --messages {tmp_path / 'none.json'}: cannot read: No such file or directory" in capsys.readouterr().err
    )


def test_an_admin_failure_lists_every_servers_outcome_in_json(server, tiny_models, capsys) -> None:
    argv = ["load-lora", "x", "/no/such/adapter", "--json", "--backend", "reference", "--url", server, "--url", DEAD]
    assert main(argv) == 1
    error = json_error(capsys.readouterr().err)
    assert error["type"] == "AdminError" and error["operation"] == "admin_load_lora"
    assert [s["server"] for s in error["servers"]] == [server, DEAD]
    assert all(s["ok"] is False and s["error"] for s in error["servers"])


def test_an_unexpected_error_is_one_json_object_with_exit_1(monkeypatch, capsys) -> None:
    def broken(args: argparse.Namespace) -> int:
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli, "_list", broken)
    assert main(["list", "--json"]) == 1
    assert json_error(capsys.readouterr().err) == {"type": "RuntimeError", "message": "a bug", "exit": 1}


def test_version_names_core_and_every_installed_backend_distribution(capsys) -> None:
    assert main(["--version"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "backends-core 0.1.0"
    assert "backends-vllm 0.1.0 (backends: vllm)" in lines
    assert "backends-testkit 0.1.0 (backends: reference; emulators: reference)" in lines
    assert "backends-sglang-testing 0.1.0 (emulators: sglang)" in lines
    assert main(["--version", "--json"]) == 0
    versions = json.loads(capsys.readouterr().out)
    assert versions["backends_core"] == "0.1.0"
    by_name = {d["distribution"]: d for d in versions["distributions"]}
    for engine in ("vllm", "sglang", "dynamo"):
        assert by_name[f"backends-{engine}"] == {
            "distribution": f"backends-{engine}",
            "version": "0.1.0",
            "backends": [engine],
            "emulators": [],
        }
        assert by_name[f"backends-{engine}-testing"]["emulators"] == [engine]


def _all_parsers(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(parser.prog, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _all_parsers(sub)
    return found


def test_every_option_and_argument_of_every_verb_has_help() -> None:
    parsers = _all_parsers(build_parser())
    assert {prog.removeprefix("backends ") for prog, _ in parsers[1:]} == set(ALL_VERBS)
    missing = [
        f"{prog}: {action.option_strings or action.dest}"
        for prog, parser in parsers
        for action in parser._actions
        if not isinstance(action, argparse._SubParsersAction) and not (action.help or "").strip()
    ]
    assert missing == []


def test_the_cli_module_does_not_import_the_test_kit() -> None:
    code = "import sys, backends_core.cli; print(sorted(m for m in sys.modules if m.startswith('backends_testkit')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_log_level_shows_the_librarys_retries_on_stderr_plain_or_as_json(tiny_models, capsys) -> None:
    assert main(["health", "--log-level", "info", *client_flags(DEAD, tiny_models)]) == 1
    err = capsys.readouterr().err
    assert "INFO backends_core.server: GET http://127.0.0.1:9/health: ConnectError" in err
    assert main(["--log-level", "INFO", "health", "--json", *client_flags(DEAD, tiny_models)]) == 1
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    logs = [x for x in lines if x.get("event") == "log"]
    assert logs and {x["logger"] for x in logs} <= {"backends_core.server", "backends_core.fleet"}
    assert all(set(x) == {"event", "logger", "level", "message"} for x in logs)
    assert main(["health", *client_flags(DEAD, tiny_models)]) == 1
    assert "backends_core.server" not in capsys.readouterr().err  # no --log-level: no log lines
