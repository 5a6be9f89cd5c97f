from __future__ import annotations

import json

import pytest

from backends_core import ClientConfig, ConfigError, Limits, Timeouts


def test_single_url_and_list_both_become_a_tuple() -> None:
    one = ClientConfig(backend="vllm", base_url="http://a:8000/")
    many = ClientConfig(backend="vllm", base_url=["http://a:8000", "http://b:8000"])
    assert one.base_url == ("http://a:8000",)
    assert many.base_url == ("http://a:8000", "http://b:8000")
    assert many.servers == (("http://a:8000", "http://a:8000"), ("http://b:8000", "http://b:8000"))


def test_from_mapping_round_trips() -> None:
    config = ClientConfig.from_mapping(
        {
            "backend": "vllm",
            "base_url": ["http://a:1", "http://b:2"],
            "admin_base_url": ["http://a:9", "http://b:9"],
            "model": "m",
            "timeouts": {"read": 5, "admin": None},
            "retry": {"attempts": 1},
            "backend_options": {"transport": "generate"},
            "headers": {"x-team": "rl"},
        }
    )
    assert config.timeouts == Timeouts(read=5.0, admin=None)
    assert config.servers[1] == ("http://b:2", "http://b:9")
    assert ClientConfig.from_mapping(config.to_mapping()) == config


def test_a_number_for_timeouts_sets_the_read_timeout() -> None:
    assert ClientConfig.from_mapping({"backend": "x", "base_url": "http://h", "timeouts": 3}).timeouts.read == 3.0


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"base_url": "http://h"}, "required field missing (expected str) @ $.backend"),
        ({"backend": "vllm", "base_url": "http://h", "modle": "m"}, "unknown field(s) ['modle']"),
        ({"backend": "vllm", "base_url": "http://h", "timeouts": {"read": -1}}, "read must be a positive number"),
        (
            {"backend": "vllm", "base_url": "http://h", "timeouts": {"read": "10"}},
            "expected a number, got '10' @ $.timeouts.read",
        ),
        ({"backend": "vllm", "base_url": "ftp://h"}, "'ftp://h' is not an http(s) URL"),
        ({"backend": "vLLM", "base_url": "http://h"}, "backend must match"),
        ({"backend": "vllm", "base_url": []}, "base_url needs at least one server URL"),
        (
            {"backend": "vllm", "base_url": ["http://a", "http://b"], "admin_base_url": "http://c"},
            "admin_base_url has 1 URL(s)",
        ),
        (
            {"backend": "vllm", "base_url": "http://h", "retry": {"attempts": True}},
            "expected an integer, got True @ $.retry.attempts",
        ),
        ({"backend": "vllm", "base_url": "http://h", "headers": {"x": 1}}, "expected a table of string -> string"),
        (
            {"backend": "vllm", "base_url": "http://h", "api_key_var": "sk-abc def"},
            "api_key_var must be an environment variable NAME",
        ),
    ],
)
def test_bad_config_names_the_field(data: dict[str, object], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        ClientConfig.from_mapping(data)
    assert expected in str(info.value)


def test_api_key_comes_from_the_named_variable_and_is_never_in_repr(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_KEY", "sk-secret-123")
    config = ClientConfig(backend="vllm", base_url="http://h", api_key_var="MY_KEY")
    assert config.api_key() == "sk-secret-123"
    assert "sk-secret" not in repr(config)
    monkeypatch.delenv("MY_KEY")
    with pytest.raises(ConfigError, match="MY_KEY"):
        config.api_key()


def test_from_file_reads_toml_and_json_sections(tmp_path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text('[client]\nbackend = "sglang"\nbase_url = "http://h:30000"\n[client.limits]\nmax_connections = 8\n')
    config = ClientConfig.from_file(toml, section="client")
    assert config.backend == "sglang" and config.limits.max_connections == 8
    js = tmp_path / "c.json"
    js.write_text(json.dumps({"backend": "dynamo", "base_url": "http://h"}))
    assert ClientConfig.from_file(js).backend == "dynamo"


def test_from_file_errors_name_the_file(tmp_path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("backend = ")
    with pytest.raises(ConfigError, match=r"bad\.toml"):
        ClientConfig.from_file(bad)
    yaml = tmp_path / "c.yaml"
    yaml.write_text("backend: x")
    with pytest.raises(ConfigError, match=r"must end in \.toml or \.json"):
        ClientConfig.from_file(yaml)
    wrong = tmp_path / "w.toml"
    wrong.write_text('backend = "x"\nbase_url = "http://h"\n[limits]\nmax_connections = 0\n')
    with pytest.raises(ConfigError, match="max_connections"):
        ClientConfig.from_file(wrong)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"retry": {"attempts": 1}}, "retry must be a RetryPolicy, got dict"),
        ({"timeouts": 5}, "timeouts must be a Timeouts, got int"),
    ],
)
def test_direct_construction_errors_are_config_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ClientConfig(backend="vllm", base_url="http://h", **kwargs)
    with pytest.raises(ConfigError, match="max_connections must be a number >= 1, got 0"):
        Limits(max_connections=0)


def test_stateless_break_policy_is_validated() -> None:
    with pytest.raises(
        ConfigError, match=r"expected one of \['raise', 'rerender'\], got 'ignore' @ \$.stateless.on_break"
    ):
        ClientConfig.from_mapping({"backend": "x", "base_url": "http://h", "stateless": {"on_break": "ignore"}})
