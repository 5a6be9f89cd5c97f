"""Each backend maps the open sampling fields to its engine's own names, and refuses what its engine cannot
take by name, before sending."""

from __future__ import annotations

import json
from typing import Any

import pytest

from backends_core import (
    Choice,
    ClientConfig,
    GenerateRequest,
    Grammar,
    InvalidRequestError,
    JsonSchema,
    Regex,
    SamplingParams,
    UnsupportedOperationError,
)
from backends_core.driver import BackendDriver
from backends_dynamo import wire as dynamo_wire
from backends_sglang import wire as sglang_wire
from backends_vllm import wire as vllm_wire

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def request(**sampling: Any) -> GenerateRequest:
    return GenerateRequest(prompt_ids=[1, 2, 3], sampling=SamplingParams(**{"max_tokens": 16, **sampling}))


def features(backend: str, **options: Any) -> frozenset[str]:
    return BackendDriver(ClientConfig(backend=backend, base_url="http://x", backend_options=options)).sampling_features


# -- vLLM ---------------------------------------------------------------------------------------------------


def test_vllm_generate_route_detokenizes_only_for_stop_strings() -> None:
    plain = vllm_wire.generate_payload(request(), "m")["sampling_params"]
    assert plain["detokenize"] is False and "stop" not in plain and "logit_bias" not in plain
    stopped = vllm_wire.generate_payload(request(stop=["\n\n"], logit_bias={5: -100}), "m")["sampling_params"]
    assert stopped["detokenize"] is True  # vLLM refuses stop strings without it
    assert stopped["stop"] == ["\n\n"] and stopped["logit_bias"] == {"5": -100.0}


@pytest.mark.parametrize(
    ("structured", "wire"),
    [
        (JsonSchema(SCHEMA), {"json": SCHEMA}),
        (Regex("[0-9]+"), {"regex": "[0-9]+"}),
        (Choice(["yes", "no"]), {"choice": ["yes", "no"]}),
        (Grammar('root ::= "a"'), {"grammar": 'root ::= "a"'}),
    ],
)
def test_vllm_structured_outputs_on_both_routes(structured: Any, wire: dict[str, Any]) -> None:
    assert (
        vllm_wire.generate_payload(request(structured=structured), "m")["sampling_params"]["structured_outputs"] == wire
    )
    assert vllm_wire.completions_payload(request(structured=structured), "m")["structured_outputs"] == wire


def test_vllm_extra_passes_known_fields_and_refuses_the_rest() -> None:
    body = vllm_wire.generate_payload(request(extra={"bad_words": ["x"], "skip_special_tokens": False}), "m")
    assert body["sampling_params"]["bad_words"] == ["x"] and body["sampling_params"]["skip_special_tokens"] is False
    with pytest.raises(InvalidRequestError, match="extra key 'best_of_everything' is not a sampling field vllm takes"):
        vllm_wire.generate_payload(request(extra={"best_of_everything": 1}), "m")
    with pytest.raises(InvalidRequestError, match="extra key 'structured_outputs' collides"):
        vllm_wire.generate_payload(request(extra={"structured_outputs": {"regex": "a"}}), "m")
    with pytest.raises(InvalidRequestError, match="extra key 'detokenize' collides"):
        vllm_wire.generate_payload(request(extra={"detokenize": True}), "m")
    # the completions route sets skip_special_tokens itself
    with pytest.raises(InvalidRequestError, match="extra key 'skip_special_tokens' collides"):
        vllm_wire.completions_payload(request(extra={"skip_special_tokens": True}), "m")


def test_vllm_declares_every_feature() -> None:
    assert (
        features("vllm")
        == features("vllm", transport="completions")
        == {
            "stop",
            "logit_bias",
            "extra",
            "structured.json_schema",
            "structured.regex",
            "structured.choice",
            "structured.grammar",
        }
    )


# -- SGLang -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("structured", "wire"),
    [
        (JsonSchema(SCHEMA), {"json_schema": json.dumps(SCHEMA, separators=(",", ":"))}),  # a JSON string
        (Regex("[0-9]+"), {"regex": "[0-9]+"}),
        (Choice(["a.b", "c|d", "e"]), {"regex": r"(a\.b|c\|d|e)"}),  # literal alternatives
        (Grammar('root ::= "a"'), {"ebnf": 'root ::= "a"'}),
    ],
)
def test_sglang_structured_fields(structured: Any, wire: dict[str, Any]) -> None:
    params = sglang_wire.generate_payload(request(structured=structured))["sampling_params"]
    assert {k: params[k] for k in wire} == wire
    assert set(params) <= set(sglang_wire.SAMPLING_KEYS)  # SGLang refuses any other key with a 400


def test_sglang_stop_bias_and_extra() -> None:
    params = sglang_wire.generate_payload(
        request(stop="END", logit_bias={3: 1.5}, extra={"no_stop_trim": True, "stop_regex": "x+"})
    )["sampling_params"]
    assert (params["stop"], params["logit_bias"]) == (["END"], {"3": 1.5})
    assert (params["no_stop_trim"], params["stop_regex"]) == (True, "x+")
    with pytest.raises(InvalidRequestError, match="extra key 'max_tokens_total' is not a sampling_params field"):
        sglang_wire.generate_payload(request(extra={"max_tokens_total": 3}))
    with pytest.raises(InvalidRequestError, match="extra key 'json_schema' collides"):
        sglang_wire.generate_payload(request(extra={"json_schema": "{}"}))
    with pytest.raises(InvalidRequestError, match="extra key 'max_new_tokens' collides"):
        sglang_wire.generate_payload(request(extra={"max_new_tokens": 3}))


# -- Dynamo -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("structured", "wire"),
    [
        (JsonSchema(SCHEMA), {"guided_json": SCHEMA}),
        (Regex("[0-9]+"), {"guided_regex": "[0-9]+"}),
        (Choice(["yes", "no"]), {"guided_choice": ["yes", "no"]}),
        (Grammar('root ::= "a"'), {"guided_grammar": 'root ::= "a"'}),
    ],
)
@pytest.mark.parametrize("transport", ["chat", "completions"])
def test_dynamo_guided_fields(structured: Any, wire: dict[str, Any], transport: str) -> None:
    _, body = dynamo_wire.generation_payload(request(structured=structured), "m", transport=transport)
    assert {k: body[k] for k in wire} == wire


def test_dynamo_stop_and_extra() -> None:
    _, body = dynamo_wire.generation_payload(
        request(stop=["END"], extra={"include_stop_str_in_output": True}), "m", transport="chat"
    )
    assert body["stop"] == ["END"] and body["include_stop_str_in_output"] is True
    for key, match in (("guided_json", "collides"), ("best_of", "is not a sampling field")):
        with pytest.raises(InvalidRequestError, match=f"extra key '{key}' {match}"):
            dynamo_wire.check_generation(request(extra={key: 1}), fan_out=True)
    with pytest.raises(InvalidRequestError, match="extra key 'messages' collides"):
        dynamo_wire.generation_payload(request(extra={"messages": []}), "m", transport="chat")


def test_dynamo_refuses_stop_strings_with_ignore_eos_which_its_frontend_would_ignore() -> None:
    with pytest.raises(UnsupportedOperationError, match="ignores stop strings when ignore_eos is set") as info:
        dynamo_wire.check_generation(request(stop=["x"], ignore_eos=True), fan_out=True)
    assert info.value.operation == "sampling.stop"
    dynamo_wire.check_generation(request(stop=["x"]), fan_out=True)
    dynamo_wire.check_generation(request(ignore_eos=True), fan_out=True)


def test_dynamo_declares_structured_output_only_when_told_the_workers_honour_it() -> None:
    assert features("dynamo") == {"stop", "extra"}  # never logit_bias: 1.6.1 does not forward it
    assert features("dynamo", structured_output=True) == {
        "stop",
        "extra",
        "structured.json_schema",
        "structured.regex",
        "structured.choice",
        "structured.grammar",
    }
