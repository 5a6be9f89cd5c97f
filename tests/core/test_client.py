"""The client and driver around a minimal in-process backend: invariants, capabilities, plugins, fan-out."""

from __future__ import annotations

import json
from typing import Any

import attrs
import httpx
import numpy as np
import pytest

from backends_core import (
    AdminError,
    AdminPolicy,
    Client,
    ClientConfig,
    ConfigError,
    Event,
    GenerateRequest,
    GenerateResult,
    InvalidRequestError,
    ResponseParseError,
    SamplingParams,
    ServerStatusError,
    UnsupportedOperationError,
    hookimpl,
)
from backends_testkit.fakes import FakeServer


class Tiny:
    """A backend whose wire format is {"samples": [{"ids": [...], "lps": [...]}]}."""

    @hookimpl
    async def post_generate(self, server, request: GenerateRequest) -> Any:
        return await server.request(
            "POST",
            "/gen",
            json_body={"ids": list(request.prompt_ids), "n": request.sampling.n, "salt": request.cache_salt},
        )

    @hookimpl
    def parse_response(self, raw: Any, request: GenerateRequest, server_url: str) -> list[GenerateResult]:
        return [
            GenerateResult(
                prompt_ids=request.prompt_ids,
                completion_ids=tuple(s["ids"]),
                logprobs=np.asarray(s["lps"], dtype=np.float32),
                finish_reason="length",
                server=server_url,
            )
            for s in raw["samples"]
        ]

    @hookimpl
    async def admin_pause(self, server, mode: str) -> bool:  # a subset of the spec's arguments is fine
        await server.request("POST", "/pause", params={"mode": mode}, plane="admin", retry=False)
        return True


def config(**kw: Any) -> ClientConfig:
    kw.setdefault("base_url", "http://s1")
    return ClientConfig(backend="tiny", **kw)


def answering(samples: list[dict[str, Any]]) -> FakeServer:
    # json.dumps writes NaN / -Infinity as some servers do; httpx's json= would refuse them
    return FakeServer().add("POST", "/gen", content=json.dumps({"samples": samples}).encode())


async def test_generate_round_trip_and_request_recording() -> None:
    fake = answering([{"ids": [5, 6], "lps": [-0.1, -0.2]}])
    async with Client(config(), transport=fake.transport(), plugin=Tiny()) as client:
        result = await client.generate(prompt_ids=[1, 2, 3], cache_salt="v1", sampling=SamplingParams(max_tokens=16))
    assert result.token_ids == (1, 2, 3, 5, 6)
    assert result.logprobs.dtype == np.float32
    assert result.server == "http://s1"
    assert fake.requests[0].json == {"ids": [1, 2, 3], "n": 1, "salt": "v1"}


@pytest.mark.parametrize(
    ("samples", "message"),
    [
        ([{"ids": [5, 6], "lps": [-0.1]}], "1 logprobs for 2 completion ids"),
        ([{"ids": [5, 6], "lps": [-0.1, float("nan")]}], "position 1 is nan"),
        ([{"ids": [5], "lps": [float("-inf")]}], "position 0 is -inf"),
        ([{"ids": [5], "lps": [-1.0]}, {"ids": [5], "lps": [-1.0]}], "expected 1 sample(s), got 2"),
        ([{"ids": [5]}], "could not parse the body: KeyError"),
        ([{"ids": ["5"], "lps": [-1.0]}], "completion id '5' is not a token id"),
    ],
)
async def test_broken_results_never_reach_the_caller(samples: list[dict[str, Any]], message: str) -> None:
    async with Client(config(), transport=answering(samples).transport(), plugin=Tiny()) as client:
        with pytest.raises(ResponseParseError) as info:
            await client.generate(prompt_ids=[1], sampling=SamplingParams(max_tokens=16))
    assert message in str(info.value)


async def test_generate_samples_returns_n_results_and_generate_insists_on_one() -> None:
    fake = answering([{"ids": [5], "lps": [-1.0]}, {"ids": [6], "lps": [-2.0]}])
    async with Client(config(), transport=fake.transport(), plugin=Tiny()) as client:
        results = await client.generate_samples(prompt_ids=[1], sampling=SamplingParams(max_tokens=16, n=2))
        assert [r.completion_ids for r in results] == [(5,), (6,)]
        with pytest.raises(InvalidRequestError, match="generate_samples"):
            await client.generate(prompt_ids=[1], sampling=SamplingParams(max_tokens=16, n=2))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of messages= or prompt_ids="),
        ({"prompt_ids": []}, "prompt_ids is empty"),
        ({"prompt_ids": [1, -2]}, "negative token id"),
        ({"prompt_ids": "hello"}, "sequence of ints"),
        ({"prompt_ids": [1, 2.5]}, "sequence of ints"),
        ({"prompt_ids": [1], "server": 3}, "server index 3 out of range"),
        ({"prompt_ids": [1], "server": "http://other"}, "no server 'http://other'"),
    ],
)
async def test_bad_arguments_fail_before_sending(kwargs: dict[str, Any], message: str) -> None:
    fake = answering([{"ids": [5], "lps": [-1.0]}])
    async with Client(config(), transport=fake.transport(), plugin=Tiny()) as client:
        with pytest.raises(InvalidRequestError, match=message):
            await client.generate(**{"sampling": SamplingParams(max_tokens=4), **kwargs})
    assert fake.requests == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be an int >= 1"),
        ({"temperature": float("nan")}, "temperature must be finite"),
        ({"top_p": 0.0}, "top_p must be in"),
        ({"top_k": 0}, "top_k must be -1"),
        ({"top_logprobs": 21}, "top_logprobs must be in"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens must be in"),
    ],
)
def test_sampling_params_validate(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**{"max_tokens": 16, **kwargs})


async def test_missing_optional_operations_raise_unsupported_before_sending() -> None:
    fake = FakeServer()
    async with Client(config(), transport=fake.transport(), plugin=Tiny()) as client:
        assert client.capabilities == {"admin_pause"}
        with pytest.raises(UnsupportedOperationError, match="backend 'tiny' does not support 'teacher_logprobs'"):
            await client.teacher_logprobs([1, 2, 3])
        with pytest.raises(UnsupportedOperationError, match="admin_flush_cache"):
            await client.admin.flush_cache()
    assert fake.requests == []


async def test_backend_without_option_validation_refuses_options() -> None:
    with pytest.raises(ConfigError, match="takes no options"):
        Client(config(backend_options={"transport": "x"}), plugin=Tiny())


async def test_backend_options_are_validated_and_passed_to_hooks() -> None:
    @attrs.frozen
    class Options:
        path: str

    class WithOptions(Tiny):
        @hookimpl
        def validate_backend_options(self, options):
            unknown = set(options) - {"path"}
            if unknown:
                raise ConfigError([f"unknown option {sorted(unknown)} @ $.backend_options"])
            return Options(path=options.get("path", "/gen"))

        @hookimpl
        async def post_generate(self, server, request, options):
            return await server.request("POST", options.path, json_body={})

    fake = answering([{"ids": [5], "lps": [-1.0]}]).add("POST", "/alt", json={"samples": [{"ids": [9], "lps": [-3.0]}]})
    async with Client(
        config(backend_options={"path": "/alt"}), transport=fake.transport(), plugin=WithOptions()
    ) as client:
        assert (await client.generate(prompt_ids=[1], sampling=SamplingParams(max_tokens=16))).completion_ids == (9,)
    with pytest.raises(ConfigError, match="unknown option"):
        Client(config(backend_options={"nope": 1}), plugin=WithOptions())


async def test_cross_cutting_plugins_observe_and_rewrite_requests() -> None:
    events: list[Event] = []

    class Metrics:
        @hookimpl
        def observe(self, event: Event) -> None:
            events.append(event)

    class SaltByVersion:
        @hookimpl(wrapper=True)
        def prepare_request(self, request):
            inner = yield
            return attrs.evolve(inner, cache_salt="weights-v7")

    fake = answering([{"ids": [5], "lps": [-1.0]}])
    async with Client(
        config(), transport=fake.transport(), plugin=Tiny(), plugins=[Metrics(), SaltByVersion()]
    ) as client:
        await client.generate(prompt_ids=[1, 2], sampling=SamplingParams(max_tokens=16))
        with pytest.raises(UnsupportedOperationError):
            await client.admin.state()
    assert fake.requests[0].json["salt"] == "weights-v7"
    assert [(e.kind, e.ok, e.detail) for e in events] == [
        ("generate", True, {"prompt_tokens": 2, "completion_tokens": 1})
    ]


async def test_admin_fans_out_and_reports_every_server() -> None:
    seen = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.host, request.url.params["mode"]))
        if request.url.host == "bad-admin":
            return httpx.Response(500, json={"detail": "cannot pause"})
        return httpx.Response(200, json={})

    cfg = config(
        base_url=["http://s1", "http://s2"],
        admin_base_url=["http://good-admin", "http://bad-admin"],
        admin=AdminPolicy(retries=2, backoff=0),
    )
    async with Client(cfg, transport=httpx.MockTransport(handle), plugin=Tiny()) as client:
        with pytest.raises(AdminError) as info:
            await client.admin.pause("wait")
        with pytest.raises(InvalidRequestError, match="pause mode"):
            await client.admin.pause("later")  # type: ignore[arg-type]
    # pause is idempotent: the failing server was tried 1 + 2 times, the healthy one once
    assert sorted(seen) == [("bad-admin", "wait")] * 3 + [("good-admin", "wait")]
    outcomes = {o.server: o for o in info.value.results}
    assert outcomes["http://s1"].ok and outcomes["http://s1"].value is True
    assert isinstance(outcomes["http://s2"].error, ServerStatusError)
    assert "1 of 2 server(s)" in str(info.value) and "cannot pause" in str(info.value)


async def test_requests_spread_over_servers() -> None:
    hosts = []

    def handle(request: httpx.Request) -> httpx.Response:
        hosts.append(request.url.host)
        return httpx.Response(200, json={"samples": [{"ids": [1], "lps": [-1.0]}]})

    cfg = config(base_url=["http://s1", "http://s2", "http://s3"])
    async with Client(cfg, transport=httpx.MockTransport(handle), plugin=Tiny()) as client:
        for _ in range(6):
            await client.generate(prompt_ids=[1], sampling=SamplingParams(max_tokens=16))
        await client.generate(prompt_ids=[1], server="http://s2", sampling=SamplingParams(max_tokens=16))
    assert sorted(hosts[:6]) == ["s1", "s1", "s2", "s2", "s3", "s3"]
    assert hosts[6] == "s2"


async def test_api_key_and_headers_are_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFER_KEY", "sk-1")
    seen = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers)
        return httpx.Response(200, json={"samples": [{"ids": [1], "lps": [-1.0]}]})

    cfg = config(api_key_var="INFER_KEY", headers={"x-run": "42"})
    async with Client(cfg, transport=httpx.MockTransport(handle), plugin=Tiny()) as client:
        await client.generate(prompt_ids=[1], sampling=SamplingParams(max_tokens=16))
    assert seen[0]["authorization"] == "Bearer sk-1" and seen[0]["x-run"] == "42"


async def test_template_stop_resolves_the_same_parameters_once_and_new_ones_again(tiny_models: Any) -> None:
    from transformers import AutoTokenizer

    from backends_core import SamplingParams
    from backends_core.multiturn.extension import end_of_turn_stop_ids

    tok = AutoTokenizer.from_pretrained(str(tiny_models.dense), local_files_only=True)
    async with Client(ClientConfig(backend="vllm", base_url="http://127.0.0.1:9", model="m"), tokenizer=tok) as client:
        given = SamplingParams(max_tokens=5)
        first = client.template_stop(given)
        assert first.stop_token_ids == end_of_turn_stop_ids(tok) and given.stop_token_ids is None
        assert client.template_stop(given) is first
        other = SamplingParams(max_tokens=6)
        assert client.template_stop(other) is not first and client.template_stop(other).max_tokens == 6
        explicit = SamplingParams(max_tokens=5, stop_token_ids=[])
        assert client.template_stop(explicit) is explicit
