"""Open sampling (stop strings, logit bias, structured output, extra engine fields) and the chat template's
end-of-turn stop ids, through the client on the reference engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from backends_core import (
    Choice,
    Client,
    ClientConfig,
    GenerateRequest,
    Grammar,
    InvalidRequestError,
    JsonSchema,
    Regex,
    SamplingParams,
    UnsupportedOperationError,
    hookimpl,
)
from backends_core.errors import BackendValidationError
from backends_core.multiturn.extension import end_of_turn_stop_ids
from backends_core.multiturn.rendering import load_tokenizer
from backends_testkit.engine import EngineRequest, ReferenceEngine
from backends_testkit.reference.emulator import ReferenceEmulator
from backends_testkit.tinymodel import ENDOFTEXT_ID, IM_END_ID, write_eos_variant

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
MESSAGES = [{"role": "user", "content": "Name three colors."}]

# -- SamplingParams ------------------------------------------------------------------------------------


def test_new_fields_are_normalised() -> None:
    s = SamplingParams(
        max_tokens=16, stop="###", logit_bias={7: 2}, structured=Choice("yes"), extra={"skip_special_tokens": True}
    )
    assert s.stop == ("###",) and s.logit_bias == {7: 2.0} and s.structured == Choice(("yes",))
    assert s.features == {"stop", "logit_bias", "structured.choice", "extra"}
    assert SamplingParams(max_tokens=16).features == frozenset()
    assert SamplingParams(max_tokens=16, stop=["a", "\n"]).stop == ("a", "\n")  # whitespace is a legitimate stop string


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"stop": ["ok", ""]}, r"stop\[1\] must be a non-empty string, got ''"),
        ({"stop": [3]}, r"stop\[0\] must be a non-empty string, got 3"),
        ({"stop": 3}, "expected a string or a sequence of strings"),
        ({"logit_bias": {5: 101}}, r"logit_bias\[5\] = 101 is outside \[-100, 100\]"),
        ({"logit_bias": {5: float("nan")}}, r"logit_bias\[5\] must be a finite number"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias key '5' must be a token id"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias key -1 must be a token id"),
        ({"logit_bias": [(5, 1.0)]}, "logit_bias must be a mapping"),
        ({"structured": {"json": {}}}, "structured must be JsonSchema, Regex, Choice or Grammar, got dict"),
        ({"extra": {"top_k": 3}}, "extra key 'top_k' is a field of SamplingParams: set it there"),
        ({"extra": {"": 3}}, "extra keys must be non-empty strings"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be >= 0"),
    ],
)
def test_bad_values_are_refused_with_the_field_named(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**{"max_tokens": 16, **fields})


def test_structured_kinds_validate_their_content() -> None:
    with pytest.raises(InvalidRequestError, match="at least one choice"):
        Choice([])
    with pytest.raises(InvalidRequestError, match=r"choice \[1\] must be a non-empty string"):
        Choice(["a", ""])
    with pytest.raises(InvalidRequestError, match="regex pattern must be a non-empty string"):
        Regex("")
    with pytest.raises(InvalidRequestError, match="grammar must be a non-empty string"):
        Grammar("  ")
    with pytest.raises(InvalidRequestError, match="not JSON-serialisable"):
        JsonSchema({"type": object()})


def test_a_request_never_carries_unresolved_stop_ids() -> None:
    assert SamplingParams(max_tokens=16).stop_token_ids is None
    assert GenerateRequest(prompt_ids=[1], sampling=SamplingParams(max_tokens=16)).sampling.stop_token_ids == ()
    assert GenerateRequest(
        prompt_ids=[1], sampling=SamplingParams(max_tokens=16, stop_token_ids=[9])
    ).sampling.stop_token_ids == (9,)


# -- the reference engine: stop strings and logit bias ----------------------------------------------------


async def test_engine_stops_when_the_decoded_text_holds_a_stop_string(tiny_models: Any) -> None:
    engine = ReferenceEngine(tiny_models.dense, seed=0)
    tokenizer = load_tokenizer(str(tiny_models.dense))
    try:
        free = await engine.generate(EngineRequest(prompt_ids=PROMPT, max_tokens=12, temperature=0, ignore_eos=True))
        texts = [tokenizer.decode(list(free.completion_ids[:k]), skip_special_tokens=True) for k in range(13)]
        k = next(
            k
            for k in range(3, 13)
            if texts[k][len(texts[k - 1]) :].strip() and texts[k - 1] == texts[k][: len(texts[k - 1])]
        )
        stop = texts[k][len(texts[k - 1]) :]
        k = next(j for j in range(1, 13) if stop in texts[j])  # where it first appears
        out = await engine.generate(
            EngineRequest(prompt_ids=PROMPT, max_tokens=12, temperature=0, ignore_eos=True, stop=("\x00", stop))
        )
        assert out.completion_ids == free.completion_ids[:k]  # the completing token is kept
        assert (out.finish_reason, out.stop_reason) == ("stop", stop)
        # not before min_tokens: the text of the first min_tokens tokens is never searched
        late = await engine.generate(
            EngineRequest(prompt_ids=PROMPT, max_tokens=12, temperature=0, ignore_eos=True, stop=(stop,), min_tokens=k)
        )
        assert len(late.completion_ids) > k
    finally:
        await engine.aclose()


async def test_engine_logit_bias_steers_sampling_not_logprobs(tiny_models: Any) -> None:
    engine = ReferenceEngine(tiny_models.dense, seed=0)
    try:
        plain = await engine.generate(
            EngineRequest(prompt_ids=PROMPT, max_tokens=1, temperature=0, logprobs=0, prompt_logprobs=None)
        )
        favoured = (plain.completion_ids[0] + 1) % engine.vocab_size
        biased = await engine.generate(
            EngineRequest(prompt_ids=PROMPT, max_tokens=1, temperature=0, logprobs=5, logit_bias={favoured: 100.0})
        )
        assert biased.completion_ids == (favoured,)
        assert biased.top_logprobs is not None and biased.top_logprobs[0][0][0] == plain.completion_ids[0]
    finally:
        await engine.aclose()


# -- the client: features a backend does not declare ------------------------------------------------------


class Counting(httpx.AsyncBaseTransport):
    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner, self.sent = inner, 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.sent += 1
        return await self.inner.handle_async_request(request)


@pytest.fixture
async def reference(tiny_models: Any) -> Any:
    engine = ReferenceEngine(tiny_models.dense, seed=0)
    transport = Counting(ReferenceEmulator(engine).transport())
    config = ClientConfig(
        backend="reference", base_url="http://ref", model="tiny-qwen3", tokenizer=str(tiny_models.dense)
    )
    async with Client(config, transport=transport) as client:
        yield client, transport
    await engine.aclose()


@pytest.mark.parametrize(
    ("sampling", "operation"),
    [
        (SamplingParams(max_tokens=16, structured=JsonSchema({"type": "object"})), "sampling.structured.json_schema"),
        (SamplingParams(max_tokens=16, structured=Regex("a+")), "sampling.structured.regex"),
        (SamplingParams(max_tokens=16, extra={"skip_special_tokens": True}), "sampling.extra"),
    ],
)
async def test_undeclared_features_raise_before_anything_is_sent(
    reference: Any, sampling: SamplingParams, operation: str
) -> None:
    client, transport = reference
    with pytest.raises(UnsupportedOperationError, match="it honours \\['logit_bias', 'stop'\\]") as info:
        await client.generate(prompt_ids=PROMPT, sampling=sampling)
    assert info.value.operation == operation and info.value.backend == "reference"
    assert transport.sent == 0


async def test_a_backend_without_the_hook_honours_none_of_them() -> None:
    class Minimal:
        @hookimpl
        async def post_generate(self) -> Any:
            raise AssertionError("never sent")

        @hookimpl
        def parse_response(self) -> Any:
            raise AssertionError("never parsed")

    async with Client(ClientConfig(backend="minimal", base_url="http://x"), plugin=Minimal()) as client:
        assert client.driver.sampling_features == frozenset()
        with pytest.raises(UnsupportedOperationError, match="none of the optional sampling features"):
            await client.generate(prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=16, stop=["x"]))


def test_a_backend_declaring_an_unknown_feature_is_refused_at_load() -> None:
    class Odd:
        @hookimpl
        async def post_generate(self) -> Any: ...

        @hookimpl
        def parse_response(self) -> Any: ...

        @hookimpl
        def sampling_features(self) -> set[str]:
            return {"stop", "beam_search"}

    with pytest.raises(BackendValidationError, match="unknown features \\['beam_search'\\]"):
        Client(ClientConfig(backend="odd", base_url="http://x"), plugin=Odd())


async def test_stop_strings_and_logit_bias_round_trip(reference: Any) -> None:
    client, _ = reference
    result = await client.generate(
        prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logit_bias={100: 100})
    )
    assert result.completion_ids == (100,) * 4
    text = client.tokenizer.decode([100])
    stopped = await client.generate(
        prompt_ids=PROMPT,
        sampling=SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logit_bias={100: 100}, stop=[text]),
    )
    assert stopped.completion_ids == (100,) and (stopped.finish_reason, stopped.stop_reason) == ("stop", text)


# -- the chat template's end-of-turn stop ids -----------------------------------------------------------------


def test_end_of_turn_stop_ids_are_the_special_tokens_of_the_template_end_of_turn(tiny_models: Any) -> None:
    tokenizer = load_tokenizer(str(tiny_models.dense))
    assert end_of_turn_stop_ids(tokenizer) == (IM_END_ID,)  # "<|im_end|>\n": the newline is not a stop


@pytest.fixture
async def eos_differs(tiny_models: Any, tmp_path: Path) -> Any:
    """A model whose EOS is <|endoftext|> while its template ends turns with <|im_end|>."""
    model = write_eos_variant(Path(tiny_models.dense), tmp_path / "eos-endoftext", eos_token_ids=[ENDOFTEXT_ID])
    engine = ReferenceEngine(model, seed=0)
    assert engine.eos_token_ids == (ENDOFTEXT_ID,)
    config = ClientConfig(backend="reference", base_url="http://ref", model=engine.model_name, tokenizer=str(model))
    async with Client(config, transport=ReferenceEmulator(engine).transport()) as client:
        yield client
    await engine.aclose()


# <|im_end|> pushed to the top: only a stop on it can end the turn before max_tokens
TO_END_OF_TURN = SamplingParams(max_tokens=5, temperature=0, logit_bias={IM_END_ID: 100})


async def test_generation_from_messages_stops_at_the_template_end_of_turn(eos_differs: Client) -> None:
    result = await eos_differs.generate(messages=MESSAGES, sampling=TO_END_OF_TURN)
    assert result.completion_ids == (IM_END_ID,)
    assert (result.finish_reason, result.stop_reason) == ("stop", IM_END_ID)


async def test_explicit_stop_token_ids_replace_the_template_ones(eos_differs: Client) -> None:
    import attrs

    result = await eos_differs.generate(messages=MESSAGES, sampling=attrs.evolve(TO_END_OF_TURN, stop_token_ids=()))
    assert result.completion_ids == (IM_END_ID,) * 5 and result.finish_reason == "length"


async def test_prompt_ids_get_no_template_stop(eos_differs: Client) -> None:
    result = await eos_differs.generate(prompt_ids=eos_differs.render(MESSAGES), sampling=TO_END_OF_TURN)
    assert result.finish_reason == "length"


async def test_conversation_turns_stop_at_the_template_end_of_turn(eos_differs: Client) -> None:
    conv = eos_differs.conversation()
    first = await conv.send(MESSAGES, sampling=TO_END_OF_TURN)
    second = await conv.send([{"role": "user", "content": "More."}], sampling=TO_END_OF_TURN)
    assert first.completion_ids == second.completion_ids == (IM_END_ID,)
    assert second.prompt_ids[: len(first.token_ids)] == first.token_ids
