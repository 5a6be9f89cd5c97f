"""check_tokenizer against real SGLang's /v1/tokenize (messages form)."""

from __future__ import annotations

import pytest

from backends_core import Client, ClientConfig
from backends_testkit.tinymodel import TinyModels

pytestmark = pytest.mark.live

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object", "properties": {}}}}]


async def test_sglang_renders_plain_chats_exactly_like_us_and_the_check_catches_its_tool_rewrite(
    sglang_dense_url: str, tiny_models: TinyModels
) -> None:
    config = ClientConfig(
        backend="sglang", base_url=sglang_dense_url, model="tiny-qwen3", tokenizer=str(tiny_models.dense)
    )
    async with Client(config) as client:
        plain = await client.check_tokenizer(MESSAGES, chat_template_kwargs={"enable_thinking": False})
        assert plain.match, plain
        # SGLang passes tools through its own schema model, which adds "description": null (and more) before
        # rendering: a real trainer/server difference, and exactly what the check exists to catch
        with_tools = await client.check_tokenizer(
            MESSAGES, tools=TOOLS, chat_template_kwargs={"enable_thinking": False}
        )
    assert not with_tools.match and with_tools.first_difference is not None


async def test_a_deliberately_different_chat_template_is_caught(
    sglang_dense_url: str, tiny_models: TinyModels, tmp_path
) -> None:
    import json
    import shutil

    drifted = tmp_path / "drifted"
    shutil.copytree(tiny_models.dense, drifted, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((drifted / "tokenizer_config.json").read_text())
    cfg["chat_template"] = cfg["chat_template"].replace("<|im_start|>system\\n", "<|im_start|>system\\n\\n")
    (drifted / "tokenizer_config.json").write_text(json.dumps(cfg))
    config = ClientConfig(backend="sglang", base_url=sglang_dense_url, model="tiny-qwen3", tokenizer=str(drifted))
    async with Client(config) as client:
        check = await client.check_tokenizer(MESSAGES)
    assert not check.match and check.first_difference is not None
    assert check.local_ids[: check.first_difference] == check.server_ids[: check.first_difference]


async def test_content_parts_one_part_matches_and_several_show_sglangs_space_join(
    sglang_dense_url: str, tiny_models: TinyModels
) -> None:
    """SGLang's chat route joins the text parts of a message with " " where the client (and vLLM, and Dynamo)
    joins them with "\\n": a one-part message renders alike, a two-part one differs exactly at the separator."""
    config = ClientConfig(
        backend="sglang", base_url=sglang_dense_url, model="tiny-qwen3", tokenizer=str(tiny_models.dense)
    )
    one = [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}]
    two = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]}]
    async with Client(config) as client:
        single = await client.check_tokenizer(one)
        double = await client.check_tokenizer(two)
        spaced = client.render([{"role": "user", "content": "hello there"}])
    assert single.match, single
    assert not double.match and (double.local_token or "").startswith("\n")
    assert list(double.server_ids) == spaced  # SGLang rendered "hello there"
