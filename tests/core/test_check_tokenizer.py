"""check_tokenizer proves the trainer's chat template and tokenizer agree with the server's."""

from __future__ import annotations

import json
import shutil

from backends_core import Client, ClientConfig
from backends_testkit.engine import ReferenceEngine
from backends_testkit.reference.emulator import ReferenceEmulator

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


async def check(tiny_models, tokenizer_dir: str):
    engine = ReferenceEngine(tiny_models.dense)
    config = ClientConfig(backend="reference", base_url="http://ref", model="tiny-qwen3", tokenizer=tokenizer_dir)
    try:
        async with Client(config, transport=ReferenceEmulator(engine).transport()) as client:
            return await client.check_tokenizer(MESSAGES, chat_template_kwargs={"enable_thinking": False})
    finally:
        await engine.aclose()


async def test_the_same_tokenizer_matches(tiny_models) -> None:
    result = await check(tiny_models, str(tiny_models.dense))
    assert result.match and result.first_difference is None and len(result.local_ids) > 10


async def test_a_different_chat_template_is_caught_at_the_first_differing_token(tiny_models, tmp_path) -> None:
    drifted = tmp_path / "drifted-tokenizer"
    shutil.copytree(tiny_models.dense, drifted, ignore=shutil.ignore_patterns("*.safetensors"))
    config_path = drifted / "tokenizer_config.json"
    cfg = json.loads(config_path.read_text())
    template = cfg["chat_template"]
    cfg["chat_template"] = template.replace("<|im_start|>system\\n", "<|im_start|>system\\n\\n")  # one extra newline
    assert cfg["chat_template"] != template
    config_path.write_text(json.dumps(cfg))
    result = await check(tiny_models, str(drifted))
    assert not result.match
    assert (
        result.first_difference is not None
        and result.local_ids[: result.first_difference] == result.server_ids[: result.first_difference]
    )
    assert result.local_token != result.server_token
