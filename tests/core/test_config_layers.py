"""``ClientConfig.load``: a config file, under ``BACKENDS_*`` variables, under flags; errors say where a bad value
came from; hints for the usual mistakes; the complete example ``examples/run.toml``."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import attrs
import pytest

from backends_core import ClientConfig, ConfigError
from backends_core.cli import main
from backends_core.config import AdminPolicy, FleetPolicy, FrontConfig, Limits, RetryPolicy, StatelessPolicy, Timeouts
from backends_vllm.options import parse_options

RUN_TOML = Path(__file__).resolve().parents[2] / "examples" / "run.toml"


@pytest.fixture
def run_toml(tmp_path: Path) -> Path:
    path = tmp_path / "run.toml"
    path.write_text('[client]\nbackend = "vllm"\nbase_url = "http://file:1"\nmodel = "from-file"\ntimeouts = 7\n')
    return path


def messages(info: pytest.ExceptionInfo[ConfigError]) -> list[str]:
    return info.value.messages


def test_the_environment_alone_makes_a_config() -> None:
    env = {
        "BACKENDS_URL": "http://a:1, http://b:2  http://c:3",
        "BACKENDS_BACKEND": "vllm",
        "BACKENDS_MODEL": "m",
        "BACKENDS_TOKENIZER": "/models/m",
    }
    config = ClientConfig.load(environ=env)
    assert config.base_url == ("http://a:1", "http://b:2", "http://c:3")
    assert (config.backend, config.model, config.tokenizer) == ("vllm", "m", "/models/m")


def test_flags_over_variables_over_the_file(run_toml: Path) -> None:
    env = {"BACKENDS_CONFIG": str(run_toml), "BACKENDS_SECTION": "client", "BACKENDS_MODEL": "from-env"}
    config = ClientConfig.load(environ=env)
    assert (config.base_url, config.model, config.timeouts.read) == (("http://file:1",), "from-env", 7.0)
    flagged = ClientConfig.load(
        environ=env, flags={"model": "from-flag", "base_url": ["http://flag:1"], "tokenizer": None}
    )
    assert (flagged.base_url, flagged.model, flagged.tokenizer) == (("http://flag:1",), "from-flag", None)
    # an explicit file and section win over $BACKENDS_CONFIG / $BACKENDS_SECTION
    other = run_toml.with_name("other.json")
    other.write_text('{"backend": "sglang", "base_url": "http://json:1"}')
    assert ClientConfig.load(other, environ={"BACKENDS_CONFIG": str(run_toml)}).backend == "sglang"


def test_a_file_may_leave_the_servers_to_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('backend = "vllm"\n[retry]\nattempts = 1\n')
    config = ClientConfig.load(path, environ={"BACKENDS_URL": "http://a:1"})
    assert (config.base_url, config.retry.attempts) == (("http://a:1",), 1)


def test_an_empty_variable_counts_as_unset(run_toml: Path) -> None:
    env = {"BACKENDS_URL": "", "BACKENDS_MODEL": "  ", "BACKENDS_SECTION": "client"}
    config = ClientConfig.load(run_toml, environ=env)
    assert (config.base_url, config.model) == (("http://file:1",), "from-file")


@pytest.mark.parametrize(
    ("env", "flags", "expected"),
    [
        ({"BACKENDS_URL": "x"}, {}, "BACKENDS_URL: 'x' is not an http(s) URL with a host @ $.base_url"),
        (
            {"BACKENDS_URL": "http://a:1,ftp://b"},
            {},
            "BACKENDS_URL: 'ftp://b' is not an http(s) URL with a host @ $.base_url",
        ),
        (
            {"BACKENDS_BACKEND": "vLLM"},
            {},
            "BACKENDS_BACKEND: backend must match [a-z][a-z0-9_]* (an entry-point name), got 'vLLM' @ $.backend",
        ),
        ({"BACKENDS_URL": "x"}, {"base_url": ["y"]}, "--url: 'y' is not an http(s) URL with a host @ $.base_url"),
        ({}, {"model": 3}, "--model: expected a string, got 3 @ $.model"),
    ],
)
def test_a_bad_value_names_the_variable_or_flag_it_came_from(
    env: dict[str, str], flags: dict[str, object], expected: str
) -> None:
    with pytest.raises(ConfigError) as info:
        ClientConfig.load(environ={"BACKENDS_URL": "http://a:1", "BACKENDS_BACKEND": "vllm", **env}, flags=flags)
    assert messages(info) == [expected]
    assert info.value.source is None


def test_errors_from_the_file_and_the_environment_each_name_their_origin(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('backend = "vllm"\nbase_url = "http://a:1"\n[timeouts]\nread = "10"\n')
    with pytest.raises(ConfigError) as info:
        ClientConfig.load(path, environ={"BACKENDS_URL": "x"})
    assert messages(info) == [
        "BACKENDS_URL: 'x' is not an http(s) URL with a host @ $.base_url",
        f"{path}: expected a number, got '10' @ $.timeouts.read",
    ]
    assert info.value.source is None
    with pytest.raises(ConfigError) as only_file:
        ClientConfig.load(path, environ={})
    assert only_file.value.source == str(path)
    assert messages(only_file) == ["expected a number, got '10' @ $.timeouts.read"]


def test_missing_servers_and_backend_say_where_to_set_them() -> None:
    with pytest.raises(ConfigError) as both:
        ClientConfig.load(environ={})
    assert messages(both) == [
        "no backend and no base_url: give --backend and --url (or $BACKENDS_BACKEND and $BACKENDS_URL), "
        "or a config file that sets them @ $"
    ]
    with pytest.raises(ConfigError) as url:
        ClientConfig.load(environ={"BACKENDS_BACKEND": "vllm"})
    assert messages(url) == [
        "no base_url: give --url (or $BACKENDS_URL), or set base_url in the config file @ $.base_url"
    ]


def test_a_config_file_that_cannot_be_read_names_the_variable_that_named_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        ClientConfig.load(environ={"BACKENDS_CONFIG": str(tmp_path / "missing.toml")})
    assert messages(info)[0].startswith("BACKENDS_CONFIG: cannot read config file:")
    assert info.value.source == str(tmp_path / "missing.toml")


def test_a_section_without_a_file_is_refused() -> None:
    with pytest.raises(ConfigError) as info:
        ClientConfig.load(environ={"BACKENDS_SECTION": "client", "BACKENDS_URL": "http://a:1"})
    assert messages(info) == ["BACKENDS_SECTION: names table [client], but no config file is given"]
    with pytest.raises(ConfigError) as arg:
        ClientConfig.load(section="client", environ={})
    assert messages(arg) == ["section='client' names a table, but no config file is given"]


def test_a_table_but_no_section_hints_to_pass_the_section(run_toml: Path) -> None:
    hint = "unknown field(s) ['client']; the file has a [client] table: pass --section client @ $"
    with pytest.raises(ConfigError) as from_file:
        ClientConfig.from_file(run_toml)
    assert hint in messages(from_file)
    with pytest.raises(ConfigError) as loaded:
        ClientConfig.load(run_toml, environ={})
    assert hint in messages(loaded)
    # among several tables, the one holding a client config is named
    with pytest.raises(ConfigError) as example:
        ClientConfig.from_file(RUN_TOML)
    hint = (
        "unknown field(s) ['behind_router', 'client', 'trainer']; the file has client tables [client], "
        "[behind_router]: pass --section client or --section behind_router @ $"
    )
    assert hint in messages(example)


def test_a_missing_section_lists_the_tables_the_file_has(run_toml: Path) -> None:
    with pytest.raises(ConfigError) as info:
        ClientConfig.from_file(run_toml, section="clinet")
    assert messages(info) == ["no [clinet] table (the file's tables: [client])"]


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"timeout": 30}, "unknown field(s) ['timeout']; did you mean 'timeouts'? @ $"),
        ({"timeouts": {"raed": 3}}, "unknown field(s) ['raed']; did you mean 'read'? @ $.timeouts"),
        (
            {"modle": "m", "retri": {}, "zzz": 1},
            "unknown field(s) ['modle', 'retri', 'zzz']; 'modle': did you mean 'model'?; "
            "'retri': did you mean 'retry'? @ $",
        ),
        ({"zzz": 1}, "unknown field(s) ['zzz'] @ $"),
    ],
)
def test_an_unknown_key_close_to_a_field_gets_did_you_mean(extra: dict[str, object], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        ClientConfig.from_mapping({"backend": "vllm", "base_url": "http://a:1", **extra})
    assert messages(info) == [expected]


def test_validator_errors_name_the_field_they_are_about() -> None:
    cases = {
        "backend": ({"backend": "Bad"}, "@ $.backend"),
        "admin_base_url": ({"admin_base_url": ["http://x:1", "http://y:1"]}, "@ $.admin_base_url"),
        "jitter": ({"retry": {"jitter": 2}}, "@ $.retry.jitter"),
        "deadlines": ({"admin": {"deadlines": {"pause": 0}}}, "@ $.admin.deadlines"),
        "discovery": ({"fleet": {"discovery": "ftp:x"}}, "@ $.fleet.discovery"),
    }
    for data, path in cases.values():
        with pytest.raises(ConfigError) as info:
            ClientConfig.from_mapping({"backend": "vllm", "base_url": "http://a:1", **data})
        assert messages(info)[0].endswith(path), messages(info)


def test_the_example_run_toml_is_complete_loads_and_round_trips() -> None:
    config = ClientConfig.from_file(RUN_TOML, section="client")
    assert ClientConfig.from_mapping(config.to_mapping()) == config
    assert config.base_url == ("http://10.0.0.1:8000", "http://10.0.0.2:8000")
    table = tomllib.loads(RUN_TOML.read_text())["client"]
    # every field of every section is written out, so the file documents them all (the front in its own table:
    # behind a router, base_url is the router's one URL)
    assert set(table) | {"front"} == {f.name for f in attrs.fields(ClientConfig)}
    routed = ClientConfig.from_file(RUN_TOML, section="behind_router")
    assert routed.front is not None and routed.front.kind == "vllm-router"
    front = tomllib.loads(RUN_TOML.read_text())["behind_router"]["front"]
    assert set(front) | {"workers_url", "replicas"} == {f.name for f in attrs.fields(FrontConfig)}
    for name, cls in (
        ("timeouts", Timeouts),
        ("limits", Limits),
        ("retry", RetryPolicy),
        ("fleet", FleetPolicy),
        ("admin", AdminPolicy),
        ("stateless", StatelessPolicy),
    ):
        assert set(table[name]) == {f.name for f in attrs.fields(cls)}, name
    assert parse_options(config.backend_options).transport == "generate"  # what vLLM's backend accepts
    # the environment layer goes over it
    env = {"BACKENDS_CONFIG": str(RUN_TOML), "BACKENDS_SECTION": "client", "BACKENDS_URL": "http://c:1 http://d:1"}
    with pytest.raises(ConfigError, match="admin_base_url has 2 URL"):  # its admin URLs pair with its own servers
        ClientConfig.load(environ={**env, "BACKENDS_URL": "http://c:1"})
    assert ClientConfig.load(environ=env).base_url == ("http://c:1", "http://d:1")


def test_the_cli_reads_the_environment_layer(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("BACKENDS_CONFIG", raising=False)
    monkeypatch.delenv("BACKENDS_SECTION", raising=False)
    monkeypatch.setenv("BACKENDS_BACKEND", "reference")
    monkeypatch.setenv("BACKENDS_URL", "x")
    assert main(["state"]) == 2
    assert "BACKENDS_URL: 'x' is not an http(s) URL with a host @ $.base_url" in capsys.readouterr().err
    assert main(["state", "--url", "http://127.0.0.1:9"]) == 1  # the flag wins; the backend came from the variable
    out = capsys.readouterr()
    assert "http://127.0.0.1:9" in out.out + out.err


def test_the_cli_hints_at_the_missing_section(
    run_toml: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("BACKENDS_CONFIG", "BACKENDS_SECTION", "BACKENDS_URL", "BACKENDS_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    assert main(["state", "--config", str(run_toml)]) == 2
    assert "the file has a [client] table: pass --section client" in capsys.readouterr().err


def test_the_readme_toml_excerpt_loads(tmp_path: Path) -> None:
    readme = (RUN_TOML.parents[1] / "README.md").read_text()
    configuration = readme[readme.index("### Configuration") :]
    block = re.findall(r"```toml\n(.*?)```", configuration, re.S)[0]
    path = tmp_path / "run.toml"
    path.write_text(block)
    config = ClientConfig.from_file(path, section="client")
    assert (config.backend, config.retry.attempts, config.timeouts.read) == ("vllm", 3, 600.0)
    assert "[`examples/run.toml`](examples/run.toml)" in readme
