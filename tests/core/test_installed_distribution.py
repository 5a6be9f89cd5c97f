"""A third-party backend built by a real build backend and installed by a real installer is found by name."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PYPROJECT = """
[project]
name = "backends-throwaway"
version = "9.8.7"
dependencies = []

[project.entry-points."backends_core.backends"]
throwaway = "backends_throwaway.hooks"

[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[tool.hatch.build.targets.wheel]
packages = ["src/backends_throwaway"]
"""

HOOKS = """
import numpy as np
from backends_core import GenerateResult, hookimpl

@hookimpl
async def post_generate(server, request):
    return await server.request("POST", "/gen", json_body={"ids": list(request.prompt_ids)})

@hookimpl
def parse_response(raw, request):
    return [GenerateResult(prompt_ids=request.prompt_ids, completion_ids=tuple(raw["out"]),
                           logprobs=np.asarray(raw["lp"], dtype=np.float32), finish_reason="stop")]

@hookimpl
async def admin_resume(server):
    return True
"""

SCRIPT = """
import asyncio, httpx
from backends_core import Client, ClientConfig, SamplingParams, available_backends

info = {b.name: b for b in available_backends()}["throwaway"]
print("listed", info.distribution, info.version)

async def main():
    transport = httpx.MockTransport(lambda r: httpx.Response(200, json={"out": [4, 2], "lp": [-1.0, -2.0]}))
    async with Client(ClientConfig(backend="throwaway", base_url="http://x"), transport=transport) as client:
        result = await client.generate(prompt_ids=[1], sampling=SamplingParams(max_tokens=2))
        print("generated", list(result.completion_ids), sorted(client.capabilities))

asyncio.run(main())
"""


@pytest.mark.slow
def test_a_built_and_installed_backend_is_selected_by_its_entry_point_name(tmp_path: Path) -> None:
    uv = os.environ.get("UV") or shutil.which("uv")
    if uv is None:
        pytest.skip("needs uv to build and install the throwaway distribution")
    project = tmp_path / "backends-throwaway"
    (project / "src" / "backends_throwaway").mkdir(parents=True)
    (project / "pyproject.toml").write_text(PYPROJECT)
    (project / "src" / "backends_throwaway" / "__init__.py").write_text("")
    (project / "src" / "backends_throwaway" / "hooks.py").write_text(textwrap.dedent(HOOKS))
    target = tmp_path / "site"
    subprocess.run(
        [uv, "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(project)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    assert (target / "backends_throwaway-9.8.7.dist-info" / "entry_points.txt").is_file()
    env = {**os.environ, "PYTHONPATH": str(target)}
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["listed backends-throwaway 9.8.7", "generated [4, 2] ['admin_resume']"]
