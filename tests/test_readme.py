"""The README runs as written.

Every fenced ``python`` block of README.md is run, unless the line before it is ``<!-- not run: REASON -->``
(``<!-- tutorial file -->`` blocks are files of the "Writing a backend" tutorial, run by installing them). A block
that fails names its README line. Blocks run against vLLM's emulator served on ports, with the README's
placeholders (server URLs, model name and directory, checkpoints) replaced as the README's quick start says.
Blocks without a top-level ``await`` are whole programs; the others run inside a coroutine whose namespace holds
what the README says they continue from (``client``, ``messages``, ``ids``, ``tools`` and the quick start's
imports).

The tutorial test writes the tutorial's files into a directory, installs them with the workspace's test kit into
a fresh virtual environment (third-party packages at the lock's versions from the package index through a uv cache
the test session made empty, ours as wheels built from this checkout) and runs the tutorial's commands block line
by line.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import inspect
import json
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest

from backends_core import Client, ClientConfig, SamplingParams, ServerStatusError
from backends_testkit.emulators import make_emulator
from backends_testkit.engine import ReferenceEngine
from backends_testkit.tinymodel import TinyModels
from clean_install import fresh_uv_env, install_locked_third_party, run_uv

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PLACEHOLDER_URLS = ("http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000")
KNOWN_MARKERS = ("tutorial file", "tutorial commands")


@attrs.frozen
class Block:
    """One fenced block: its language, the README line of its opening fence, its text and the HTML comment on the
    line before it (``None`` without one)."""

    lang: str
    line: int
    text: str
    marker: str | None

    @property
    def where(self) -> str:
        return f"README.md:{self.line}"


def blocks(text: str | None = None) -> list[Block]:
    lines = (README.read_text() if text is None else text).split("\n")
    found: list[Block] = []
    i = 0
    while i < len(lines):
        if not lines[i].startswith("```"):
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        assert end is not None, f"README.md:{i + 1}: a fence that is never closed"
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        comment = re.fullmatch(r"<!--(.*)-->", before)
        marker = comment[1].strip() if comment else None
        found.append(Block(lines[i][3:].strip(), i + 1, "\n".join(lines[i + 1 : end]) + "\n", marker))
        i = end + 1
    return found


def is_run(block: Block) -> bool:
    return block.lang == "python" and block.marker is None


def tutorial_path(block: Block) -> str:
    """A tutorial file's path: the first word after ``# `` on its first line."""
    first = block.text.split("\n", 1)[0]
    assert first.startswith("# "), f"{block.where}: a tutorial file starts with '# <path>'"
    return first[2:].split()[0]


def section(title: str) -> list[Block]:
    """The blocks under the level-2 heading ``title`` (up to the next level-2 heading)."""
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    offset = text[:start].count("\n")
    body = "\n" * offset + text[start : end if end != -1 else len(text)]
    return blocks(body)


# -- the markers ------------------------------------------------------------------------------------------


def test_every_block_is_run_or_says_why_it_is_not() -> None:
    problems = []
    for block in blocks():
        marker = block.marker
        if marker is None or marker in KNOWN_MARKERS:
            continue
        reason = marker.removeprefix("not run:").strip()
        if not marker.startswith("not run:") or len(reason) < 10:
            problems.append(f"{block.where}: <!-- {marker} --> is neither a tutorial marker nor 'not run: <why>'")
    assert problems == []
    assert [b for b in blocks() if is_run(b)], "no runnable python block found"


def test_the_block_parser_finds_markers_and_line_numbers() -> None:
    text = "intro\n\n<!-- not run: needs a GPU server -->\n```python\nx = 1\n```\n\n```python\ny = 2\n```\n"
    first, second = blocks(text)
    assert (first.line, first.marker, first.text) == (4, "not run: needs a GPU server", "x = 1\n")
    assert (second.line, second.marker, is_run(second)) == (8, None, True)


def test_a_failing_block_names_its_readme_line(servers: Served) -> None:
    block = Block("python", 41, "x = 1\nassert x == 2\n", None)
    with pytest.raises(AssertionError, match=r"README\.md:41") as info:
        run_block(block, servers)
    assert any(frame.lineno == 43 and frame.filename == "README.md" for frame in _frames(info.value.__cause__))


def _frames(exc: BaseException | None) -> list[Any]:
    import traceback

    return traceback.extract_tb(exc.__traceback__) if exc is not None else []


# -- running the python blocks ----------------------------------------------------------------------------


class Served:
    """vLLM's emulator on three ports (the README's three placeholder servers), served from a thread of their own
    so that the blocks may run event loops of theirs."""

    def __init__(self, models: TinyModels, checkpoints: Path) -> None:
        self.models = models
        self.checkpoints = checkpoints
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="readme-servers", daemon=True)
        self.thread.start()
        self.stack = contextlib.AsyncExitStack()
        self.urls: list[str] = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=300)
        self.model_name = Path(models.dense).name  # what the emulator serves: the model directory's name

    async def _start(self) -> list[str]:
        urls = []
        for _ in PLACEHOLDER_URLS:
            emulator = make_emulator("vllm", ReferenceEngine(self.models.dense, seed=0))
            self.stack.push_async_callback(emulator.aclose)
            urls.append(await self.stack.enter_async_context(emulator.serve()))
        return urls

    def close(self) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self.stack.aclose(), self.loop).result(timeout=120)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=60)
            self.loop.close()

    def substitute(self, source: str) -> str:
        for placeholder, url in zip(PLACEHOLDER_URLS, self.urls, strict=True):
            source = source.replace(placeholder, url)
        source = source.replace("/models/qwen3-8b", str(self.models.dense))
        source = source.replace("Qwen/Qwen3-8B", self.model_name)
        return source.replace("/ckpt/", f"{self.checkpoints}/")

    def config(self) -> ClientConfig:
        return ClientConfig(
            backend="vllm", base_url=self.urls[:2], model=self.model_name, tokenizer=str(self.models.dense)
        )


@pytest.fixture(scope="module")
def servers(tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    checkpoints = tmp_path_factory.mktemp("ckpt")
    for step in (*range(10, 1001, 10), 100):  # the steps the README's blocks load
        link = checkpoints / f"step-{step}"
        if not link.exists():
            link.symlink_to(Path(tiny_models.dense), target_is_directory=True)
    served = Served(tiny_models, checkpoints)
    try:
        yield served
    finally:
        served.close()


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "ls",
            "description": "List the files of a directory.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    }
]


async def _continue_quick_start(code: Any, served: Served) -> None:
    async with Client(served.config()) as client:
        messages = [{"role": "user", "content": "What is 2+2?"}]
        first = await client.generate(messages=messages, sampling=SamplingParams(max_tokens=1))
        namespace = {
            "asyncio": asyncio,
            "Client": Client,
            "ClientConfig": ClientConfig,
            "SamplingParams": SamplingParams,
            "client": client,
            "messages": messages,
            "ids": list(first.prompt_ids),
            "tools": TOOLS,
        }
        await eval(code, namespace)


def run_block(block: Block, served: Served) -> None:
    """Run one block; any failure is an AssertionError naming the block's README line (the traceback's frames
    carry README line numbers too)."""
    source = "\n" * block.line + served.substitute(block.text)
    try:
        code = compile(source, "README.md", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
        if code.co_flags & inspect.CO_COROUTINE:
            asyncio.run(_continue_quick_start(code, served))
        else:
            exec(code, {"__name__": "__readme__"})
    except BaseException as exc:
        raise AssertionError(f"{block.where}: the ```python block starting here failed: {exc!r}") from exc


@pytest.mark.parametrize("block", [b for b in blocks() if is_run(b)], ids=lambda b: b.where)
def test_readme_block_runs(block: Block, servers: Served) -> None:
    run_block(block, servers)


def test_the_snippets_that_must_run_are_run() -> None:
    run = [b.text for b in blocks() if is_run(b)]
    for start in (
        "import asyncio\nfrom backends_core import Client",  # quick start
        "from backends_core import ClientConfig, SamplingParams, SyncClient",  # synchronous use
        "seen = []\nasync with client.stream(",  # streaming
        "conv = client.conversation(",  # multi-turn
        "sampling = SamplingParams(max_tokens=256)\nmessages = [",  # stateless agent loops
        "from backends_core import loss_mask\n",  # token spans and loss masks
    ):
        assert any(text.startswith(start) for text in run), start


# -- try it in one minute ---------------------------------------------------------------------------------


def _backends_cli() -> str:
    found = shutil.which("backends", path=str(Path(sys.executable).parent))
    assert found is not None, "the backends console script is not installed next to this Python"
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _stop(process: subprocess.Popen[str]) -> None:
    process.terminate()
    process.wait(timeout=60)
    if process.stdout is not None:
        process.stdout.close()


def _read_until(process: subprocess.Popen[str], needle: str, deadline_s: float) -> str:
    """Lines of the process's output until one holds ``needle`` (the process ending or the deadline fails)."""
    seen: list[str] = []
    done = threading.Event()

    def reader() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            seen.append(line)
            if needle in line:
                done.set()
                return
        done.set()

    threading.Thread(target=reader, daemon=True).start()
    assert done.wait(deadline_s) and any(needle in line for line in seen), "".join(seen)
    return "".join(seen)


def _wait_until_serving(process: subprocess.Popen[str], url: str, log: Path, deadline_s: float) -> None:
    """Until ``url/health`` answers 200 (the process ending or the deadline fails, with what it printed)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=0.2)  # waits on the process: one that ended is reported below
        assert process.returncode is None, f"exited {process.returncode}: {log.read_text()}"
    pytest.fail(f"{url} did not come up in {deadline_s} s: {log.read_text()}")


def test_try_it_in_one_minute(tmp_path: Path) -> None:
    (block,) = section("Try it in one minute")
    commands = [line.split("  #")[0].strip() for line in block.text.splitlines() if line.strip()]
    assert commands[0].startswith("pip install")  # what this environment already holds
    serve, generate = commands[1:]
    port = str(_free_port())
    argv = [_backends_cli(), *shlex.split(serve.removesuffix("&"))[1:]]
    argv = [port if a == "8000" else a for a in argv]
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_until_serving(process, f"http://127.0.0.1:{port}", log, 300)
        call = [_backends_cli(), *(a.replace(":8000", f":{port}") for a in shlex.split(generate)[1:])]
        done = subprocess.run(call, capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, f"{block.where}: {generate}\n{done.stdout}\n{done.stderr}"
    finally:
        _stop(process)


# -- the backend tutorial, installed and run as the README says ----------------------------------------


def _run(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)


def test_the_tutorial_files_are_the_whole_distribution() -> None:
    files = {tutorial_path(b) for b in section("Writing a backend") if b.marker == "tutorial file"}
    assert files == {
        "pyproject.toml",
        "src/backends_acme/__init__.py",
        "testing/pyproject.toml",
        "testing/src/backends_acme_testing/__init__.py",
        "testing/src/backends_acme_testing/__main__.py",
        "tests/test_conformance.py",
    }
    text = "".join(b.text for b in section("Writing a backend"))
    assert "pytest_plugins" not in text  # a test file's pytest_plugins comes after the command line is read


@pytest.mark.slow
def test_the_backend_tutorial_installs_and_passes_conformance_as_the_readme_says(
    tmp_path: Path, fresh_uv_cache: Path
) -> None:
    tutorial = section("Writing a backend")
    project = tmp_path / "backends-acme"
    for block in (b for b in tutorial if b.marker == "tutorial file"):
        path = project / tutorial_path(block)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(block.text)
    (commands,) = [b for b in tutorial if b.marker == "tutorial commands"]
    lines = [
        (commands.line + 1 + n, line.split("  #")[0].strip())
        for n, line in enumerate(commands.text.splitlines())
        if line.strip()
    ]

    # `pip install "backends-core[testing]"` and `pip install -e . -e testing` as on a new machine: the third-party
    # packages at the lock's versions from the package index through a uv cache this session made empty, this
    # checkout's core and test kit and the tutorial's two distributions as wheels
    assert [line for _, line in lines if line.startswith("pip ")] == [
        'pip install "backends-core[testing]"',
        "pip install -e . -e ./testing",
    ]
    env = fresh_uv_env(fresh_uv_cache)
    wheels, venv = tmp_path / "wheels", tmp_path / "venv"
    python = str(venv / "bin" / "python")
    run_uv("build", "--all-packages", "--wheel", "--out-dir", str(wheels), cwd=ROOT, env=env)
    for directory in (project, project / "testing"):
        run_uv("build", "--wheel", str(directory), "--out-dir", str(wheels), cwd=tmp_path, env=env)
    run_uv("venv", "--quiet", str(venv), "--python", sys.executable, cwd=tmp_path, env=env)
    install_locked_third_party(Path(python), ROOT, "backends-testkit", cwd=tmp_path, env=env)
    run_uv(
        *("pip", "install", "--python", python, "--offline", "--no-index", "--find-links", str(wheels)),
        *("backends-core[testing]", "backends-acme", "backends-acme-testing"),
        cwd=tmp_path,
        env=env,
    )

    port = str(_free_port())
    url = f"http://127.0.0.1:{port}"
    server: subprocess.Popen[str] | None = None
    try:
        for line_number, line in lines:
            if line.startswith("pip "):
                continue
            argv = [a.replace("http://127.0.0.1:8000", url) for a in shlex.split(line.removesuffix("&"))]
            if line.startswith("pytest "):
                done = _run(python, "-m", "pytest", *argv[1:], "-p", "no:cacheprovider", cwd=project)
                assert done.returncode == 0 and " passed" in done.stdout, (
                    f"README.md:{line_number}: {line}\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}"
                )
                assert "failed" not in done.stdout.splitlines()[-1]
            elif line.startswith("python -m ") and line.endswith("&"):
                argv = [port if a == "8000" else a for a in argv]
                server = subprocess.Popen(
                    [python, *argv[1:]], cwd=project, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
                )
                _read_until(server, f"listening on {url}", 300)
            else:
                pytest.fail(f"README.md:{line_number}: a tutorial command this test does not know: {line}")
        assert server is not None, "the tutorial serves no emulator on a port"
    finally:
        if server is not None:
            _stop(server)

    # the live run did talk to that server: with it gone, the same command fails
    gone = _run(
        *(python, "-m", "pytest", "tests", "--backend-url", url, "--backend", "acme"),
        *("-k", "test_generate_round_trip_from_ids", "-p", "no:cacheprovider"),
        cwd=project,
    )
    assert gone.returncode != 0 and "NetworkError" in gone.stdout, gone.stdout[-3000:]


def _tutorial_module(name: str, path: str) -> types.ModuleType:
    (block,) = [b for b in section("Writing a backend") if b.marker == "tutorial file" and tutorial_path(b) == path]
    module = types.ModuleType(name)
    exec(compile("\n" * block.line + block.text, "README.md", "exec", dont_inherit=True), module.__dict__)
    return module


async def test_the_tutorial_backend_sends_every_sampling_field_and_its_emulator_refuses_what_it_cannot_honour(
    tiny_models: TinyModels,
) -> None:
    hooks = _tutorial_module("backends_acme", "src/backends_acme/__init__.py")
    testing = _tutorial_module("backends_acme_testing", "testing/src/backends_acme_testing/__init__.py")
    emulator = testing.AcmeEmulator(ReferenceEngine(tiny_models.dense, seed=0))
    bodies: list[dict[str, Any]] = []

    async def recording(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/generate":
            bodies.append(json.loads(request.content))
        response: httpx.Response = await emulator.handle(request)
        return response

    config = ClientConfig(backend="acme", base_url="http://acme.test", model="m", tokenizer=str(tiny_models.dense))
    try:
        async with Client(config, transport=httpx.MockTransport(recording), plugin=hooks) as client:
            sampling = SamplingParams(max_tokens=6, min_tokens=6, min_p=0.05, top_logprobs=2, seed=3)
            result = await client.generate(prompt_ids=[1, 2, 3], sampling=sampling)
            assert len(result.completion_ids) == 6 and result.top_logprobs is not None
            assert all(len(row) == 2 for row in result.top_logprobs)
            sent = bodies[-1]["sampling"]
            assert sent["min_p"] == 0.05 and sent["min_tokens"] == 6 and sent["top_logprobs"] == 2
            assert set(sent) == testing.SAMPLING  # nothing left to a server default
            with pytest.raises(ServerStatusError, match=r"sampling\.presence_penalty"):
                await client.generate(
                    prompt_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=16, presence_penalty=0.5)
                )
    finally:
        await emulator.aclose()
