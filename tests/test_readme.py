"""The README's third-party backend example is real code that works."""

from __future__ import annotations

import re
import types
from pathlib import Path

from backends_core import Client, ClientConfig, SamplingParams
from backends_testkit.fakes import FakeServer

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def example(marker: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    (block,) = [b for b in blocks if b.startswith(marker)]
    return block


async def test_the_readme_backend_example_generates_and_reports_health() -> None:
    module = types.ModuleType("backends_acme_hooks")
    exec(compile(example("# src/backends_acme/hooks.py"), "README:hooks.py", "exec"), module.__dict__)
    fake = FakeServer()
    fake.add(
        "POST", "/v1/generate", json={"samples": [{"ids": [7, 8], "logprobs": [-0.5, -0.25], "finish_reason": "stop"}]}
    )
    fake.add("GET", "/health", json={})
    config = ClientConfig(backend="acme", base_url="http://acme", model="m")
    async with Client(config, transport=fake.transport(), plugin=module) as client:
        result = await client.generate(prompt_ids=[1, 2], sampling=SamplingParams(max_tokens=3, temperature=0.5))
        assert await client.admin.health() == [True]
    assert result.completion_ids == (7, 8) and result.finish_reason == "stop"
    assert fake.requests[0].json["input_ids"] == [1, 2] and fake.requests[0].json["temperature"] == 0.5
