"""The short-reply copy of the tiny model (``write_short_reply_variant``) that the live harness runs serve
(``tests/live/test_harnesses_vllm.py``), checked on the numpy reference forward pass: a free reply is one visible
token and ``<|im_end|>`` at any temperature, a tool call's arguments close at once, and the call ends the reply."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from backends_testkit._numpy_qwen3 import Qwen3Model
from backends_testkit.tinymodel import IM_END_ID, TinyModels, write_long_context_variant, write_short_reply_variant

PROMPTS = (
    "<|im_start|>system\nYou are a coding agent.<|im_end|>\n<|im_start|>user\nRun `ls`, then say done.<|im_end|>\n"
    "<|im_start|>assistant\n",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
)


@pytest.fixture(scope="module")
def short_reply(tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("short-reply")
    long_context = write_long_context_variant(tiny_models.dense, root / "long", max_position_embeddings=131072)
    return write_short_reply_variant(long_context, root / "short")


def test_the_copy_keeps_config_and_tokenizer_and_is_reused(short_reply: Path) -> None:
    source = short_reply.parent / "long"
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (short_reply / name).read_bytes() == (source / name).read_bytes(), name
    assert json.loads((short_reply / "config.json").read_text())["max_position_embeddings"] == 131072
    written = (short_reply / "model.safetensors").stat().st_mtime_ns
    assert write_short_reply_variant(source, short_reply) == short_reply
    assert (short_reply / "model.safetensors").stat().st_mtime_ns == written, "an intact copy was rewritten"


@pytest.mark.parametrize("temperature", [0.0, 0.6, 1.0])
def test_a_free_reply_is_one_visible_token_and_the_end_of_turn(short_reply: Path, temperature: float) -> None:
    model = Qwen3Model.load(short_reply)
    tokenizer = Tokenizer.from_file(str(short_reply / "tokenizer.json"))
    rng = np.random.default_rng(7)
    for prompt in PROMPTS:
        for _ in range(1 if temperature == 0 else 20):
            cache = model.new_cache()
            logits = model.forward(tokenizer.encode(prompt).ids, cache).logits[-1]
            reply: list[int] = []
            while len(reply) < 8 and (not reply or reply[-1] != IM_END_ID):
                if temperature == 0:
                    reply.append(int(np.argmax(logits)))
                else:
                    p = np.exp((logits - logits.max()) / temperature)
                    reply.append(int(rng.choice(len(p), p=p / p.sum())))
                logits = model.forward([reply[-1]], cache).logits[-1]
            text = tokenizer.decode(reply[:-1], skip_special_tokens=False)
            assert reply[-1] == IM_END_ID and len(reply) <= 3 and text.strip(), (prompt, text)


def test_a_tool_calls_arguments_close_at_once_and_the_call_ends_the_reply(short_reply: Path) -> None:
    """What a tool-call grammar leaves the model to choose: after ``"arguments": {`` (JSON's next tokens: a
    key's quote, whitespace or ``}``) it closes the object; after ``</tool_call>`` (another call or the end) it ends."""
    model = Qwen3Model.load(short_reply)
    tokenizer = Tokenizer.from_file(str(short_reply / "tokenizer.json"))
    call = PROMPTS[0] + '<tool_call>\n{"name": "run_shell", "arguments": {'
    logits = model.forward(tokenizer.encode(call).ids, model.new_cache()).logits[-1]
    allowed = {tokenizer.token_to_id(t) for t in ("}", '"', "Ġ", "Ċ", 'Ġ"')} - {None}
    assert max(allowed, key=lambda i: logits[i]) == tokenizer.token_to_id("}")
    ended = call + "}}\n</tool_call>"
    logits = model.forward(tokenizer.encode(ended).ids, model.new_cache()).logits[-1]
    assert int(np.argmax(logits)) == IM_END_ID
