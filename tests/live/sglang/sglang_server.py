"""The SGLang recipe of the live tests: a trimmed, cached ``sglang==0.5.23`` venv and the server command lines.

Real SGLang runs here on the CPU, unmodified, with three small things from ``cpu_runtime/`` (this directory's
subfolder, put first on the server's ``PYTHONPATH``):

* ``sgl_kernel/``: a CPU stand-in for the kernel package. PyPI's ``sglang-kernel`` is a CUDA build that does
  not import without ``libcuda.so.1``; SGLang's CPU paths import a few names from it at module level. Only
  ``assign_req_to_token_pool_cpu`` is implemented (plain torch); every other name raises when called.
* ``torchvision/``: an import-only stand-in. SGLang imports ``torchvision.transforms`` at module level from
  vision-model config modules even for text models, and PyPI's torchvision (a CUDA build) does not import
  beside the local CPU torch wheel.
* ``sitecustomize.py``: two start-up patches applied after import in every server process: a plain CPU
  allocator for the routed-experts host buffer (``--enable-return-routed-experts`` otherwise dies in
  ``cudaHostRegister``) and pinned memory off for LoRA (``--enable-lora`` otherwise dies in ``pin_memory``).

The install is trimmed from ~11 GB (CUDA torch, flashinfer, cutlass, deep-gemm, ... none used on a CPU) to
about 2.5 GB: ``sglang`` with ``--no-deps``, the local CPU torch 2.13.0 wheel (SGLang pins torch 2.14.1; the
CPU paths used here run on 2.13), ``triton`` (imported at module level by KV-cache code; never launched on
the CPU) and the explicit dependency list :data:`RUNTIME_DEPENDENCIES`, with exact versions from
``sglang-0.5.23.constraints.txt`` so a new release of some dependency cannot break CI.

Environment: ``BACKENDS_SGLANG_PYTHON`` overrides the interpreter that creates the venv (default: the base
interpreter of this one; it must be CPython 3.11 for the local torch wheel to be used).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from backends_testkit.live import ServerProcess, ensure_venv, server_venvs_dir

SGLANG_VERSION = "0.5.23"
VENV_NAME = f"sglang-cpu-{SGLANG_VERSION}"
HERE = Path(__file__).resolve().parent
CPU_RUNTIME = HERE / "cpu_runtime"
"""Put first on the server's ``PYTHONPATH``: the ``sgl_kernel`` and ``torchvision`` stand-ins and the patches."""
VL_RUNTIME = HERE / "vl_runtime"
"""Put before ``cpu_runtime`` on the VL server's ``PYTHONPATH``: its ``sitecustomize.py`` loads ``cpu_runtime``'s and
adds what the Qwen-VL processor and model need (see that file)."""
CONSTRAINTS = HERE / f"sglang-{SGLANG_VERSION}.constraints.txt"
LOCAL_WHEELS = Path("/opt/wheels")
SERVED_MODEL_NAME = "tiny-qwen3"
VL_SERVED_MODEL_NAME = "tiny-qwen2_5-vl"
MAX_TOTAL_TOKENS = 16384
"""KV-cache slots. Without ``--max-total-tokens`` SGLang sizes the pool from free RAM (~13 GB RSS)."""
MAX_RUNNING_REQUESTS = 32
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
READY_PATH = "/health_generate"
"""Readiness route: 200 once a one-token generation went through the scheduler (503 before)."""
STOP_TIMEOUT_S = 15.0
"""Seconds between SIGTERM (SGLang drains and exits in ~10 s) and SIGKILL of the server's process group."""
START_TIMEOUT_S = 420.0
"""Seconds to wait for ``/health_generate``. Seen: 30-90 s, up to 130 s with the two cores loaded by other
work; nearly all of it is imports (torch alone ~14 s per process under load) in three processes."""

RUNTIME_DEPENDENCIES = (
    # torch's own requirements (torch itself comes from the local CPU wheel, installed with --no-deps)
    "filelock",
    "typing-extensions",
    "sympy",
    "networkx",
    "jinja2",
    "fsspec",
    "setuptools",
    # what SGLang's server imports on the CPU path for text models (found by starting it)
    "numpy",
    "aiohttp",
    "fastapi",
    "uvicorn",
    "uvloop",
    "orjson",
    "msgspec",
    "pybase64",
    "pydantic",
    "python-multipart",
    "pyzmq",
    "psutil",
    "setproctitle",
    "requests",
    "packaging",
    "tqdm",
    "transformers",
    "tokenizers",
    "safetensors",
    "prometheus-client",
    "einops",
    "pillow",
    "xxhash",
    "partial-json-parser",
    "regex",
    "python-dateutil",
    "ipython",
    "dill",
    "apache-tvm-ffi",
    "sentencepiece",
    "compressed-tensors",
    "gguf",
    "openai",
    "jsonschema",
    "xgrammar",
    "soundfile",
)
"""SGLang's requirements that its CPU server needs, instead of its full list (CUDA wheels included)."""

SERVER_ENV: dict[str, str | None] = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
    "PYTHONPATH": str(CPU_RUNTIME),
    # two cores: keep torch to one intra-op thread per process so the scheduler does not fight the tests
    "OMP_NUM_THREADS": "1",
}


def venv_python() -> str:
    """The interpreter that creates the venv: ``$BACKENDS_SGLANG_PYTHON`` or this Python's base interpreter."""
    override = os.environ.get("BACKENDS_SGLANG_PYTHON")
    if override:
        return override
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    return str(base) if base.exists() else sys.executable


def install_commands(constraints: Path) -> list[list[str]]:
    """The install recipe run inside the venv by :func:`~backends_testkit.live.ensure_venv`.

    :param constraints: a copy of ``sglang-0.5.23.constraints.txt`` (see :func:`stable_constraints`).
    """
    pins = ["-c", str(constraints)]
    if LOCAL_WHEELS.is_dir():  # where this machine kind keeps the CPU torch wheel (pip's config names it too)
        pins += ["--find-links", str(LOCAL_WHEELS)]
    return [
        # SGLang itself and the big pieces, without their dependency lists (torch: the local CPU wheel)
        ["pip", "install", "--no-deps", f"sglang=={SGLANG_VERSION}", "torch", "triton", *pins],
        ["pip", "install", "torch", "triton", *RUNTIME_DEPENDENCIES, *pins],
        ["python", "-c", _SMOKE],
    ]


_SMOKE = (
    "import importlib.metadata as md, sglang, torch, transformers, triton;"
    "assert torch.__version__.endswith('+cpu'), torch.__version__;"
    "print('sglang', md.version('sglang'), 'torch', torch.__version__, 'transformers', transformers.__version__,"
    " 'triton', triton.__version__)"
)


def stable_constraints() -> Path:
    """A copy of the constraints file beside the cached venvs, named by its content.

    The install recipe names this copy rather than the file in the work tree, so the recipe (hence the cached
    venv) does not depend on where the repository is checked out.
    """
    text = CONSTRAINTS.read_text(encoding="utf-8")
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    root = server_venvs_dir()
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{VENV_NAME}.constraints-{digest}.txt"
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    return path


def ensure_sglang_venv() -> Path:
    """Build (once per machine and recipe) and return the SGLang venv."""
    return ensure_venv(VENV_NAME, python=venv_python(), install=install_commands(stable_constraints()))


def server_command(
    venv: Path,
    model_dir: Path,
    *,
    lora: bool = False,
    routed_experts: bool = False,
    served_model_name: str = SERVED_MODEL_NAME,
    extra: Sequence[str] = (),
) -> list[str]:
    """The command line of an SGLang server on ``{host}:{port}`` (filled in by ``ServerProcess``), ``extra``
    flags last."""
    argv = [
        str(venv / "bin" / "python"),
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model_dir),
        "--served-model-name",
        served_model_name,
        "--host",
        "{host}",
        "--port",
        "{port}",
        "--device",
        "cpu",
        "--attention-backend",
        "torch_native",
        # float32 like the checkpoint: "auto" runs a float32 checkpoint in float16 on the CPU
        "--dtype",
        "float32",
        "--max-total-tokens",
        str(MAX_TOTAL_TOKENS),
        "--max-running-requests",
        str(MAX_RUNNING_REQUESTS),
        "--sleep-on-idle",
        "--random-seed",
        "0",
    ]
    if lora:
        argv += [
            "--enable-lora",
            "--lora-backend",
            "torch_native",
            "--max-lora-rank",
            "8",
            "--max-loras-per-batch",
            "2",
            "--lora-target-modules",
            *LORA_TARGET_MODULES,
        ]
    if routed_experts:
        argv += ["--enable-return-routed-experts"]
    return argv + list(extra)


def sglang_server(
    venv: Path,
    model_dir: Path,
    *,
    log_path: Path,
    name: str,
    lora: bool = False,
    routed_experts: bool = False,
    extra: Sequence[str] = (),
) -> ServerProcess:
    """A not-yet-started SGLang server process for ``model_dir`` (``extra``: more flags).

    It runs in the log's directory (``python -m`` puts the working directory first on ``sys.path``: not
    this repository, where ``tests/live/sglang`` would shadow the ``sglang`` package).
    """
    env = dict(SERVER_ENV)
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    return ServerProcess(
        server_command(venv, model_dir, lora=lora, routed_experts=routed_experts, extra=extra),
        name=name,
        log_path=log_path,
        env=env,
        cwd=log_path.parent,
    )


def sglang_vl_server(venv: Path, model_dir: Path, *, log_path: Path, name: str) -> ServerProcess:
    """A not-yet-started SGLang server for the tiny Qwen2.5-VL model in ``model_dir`` (no LoRA).

    Same command line as the text servers (served name :data:`VL_SERVED_MODEL_NAME`), with :data:`VL_RUNTIME`
    first on ``PYTHONPATH``.
    """
    env = dict(SERVER_ENV)
    env["PYTHONPATH"] = os.pathsep.join([str(VL_RUNTIME), str(CPU_RUNTIME)])
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    return ServerProcess(
        server_command(venv, model_dir, served_model_name=VL_SERVED_MODEL_NAME),
        name=name,
        log_path=log_path,
        env=env,
        cwd=log_path.parent,
    )


def main(argv: list[str] | None = None) -> int:
    """Start one server for a run outside pytest (e.g. the conformance suite with ``--backend-url``).

    ``python tests/live/sglang/sglang_server.py {dense,moe} [--url-file F] [--log F]`` builds the venv if
    needed, starts the server, prints its URL (and writes it to ``--url-file``) once ``/health_generate``
    answers, and stops it on SIGTERM / SIGINT. ``dense`` has LoRA enabled, ``moe`` routed experts.
    """
    from backends_testkit.tinymodel import build_tiny_models, default_models_dir

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("model", choices=["dense", "moe"])
    parser.add_argument("--url-file", type=Path, default=None)
    parser.add_argument("--log", type=Path, default=None)
    args = parser.parse_args(argv)
    models = build_tiny_models(default_models_dir())
    venv = ensure_sglang_venv()
    moe = args.model == "moe"
    log_path = args.log or Path(tempfile.mkdtemp(prefix="sglang-live-")) / f"sglang-{args.model}.log"
    server = sglang_server(
        venv,
        models.moe if moe else models.dense,
        log_path=log_path,
        name=f"sglang-{args.model}",
        lora=not moe,
        routed_experts=moe,
    )
    stop = False

    def request_stop(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    server.start()
    try:
        server.wait_ready(READY_PATH, timeout=START_TIMEOUT_S)
        if args.url_file is not None:
            args.url_file.write_text(server.url + "\n", encoding="utf-8")
        print(server.url, flush=True)
        sys.stderr.write(f"{server.name} ready after {server.ready_after:.1f}s, log {log_path}\n")
        while not stop and server.running():
            time.sleep(0.5)
        return 0 if stop else 1
    finally:
        server.stop(timeout=STOP_TIMEOUT_S)


if __name__ == "__main__":
    raise SystemExit(main())
