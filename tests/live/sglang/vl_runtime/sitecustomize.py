"""Start-up shim of the SGLang 0.5.23 *vision-language* server of the live tests (tiny Qwen2.5-VL, CPU only).

This directory goes first on the VL server's ``PYTHONPATH``, before ``../cpu_runtime`` (whose
``sitecustomize.py`` it shadows, so it loads that file itself). No installed file is edited. On top of the
text server's runtime it does three things, all needed for the Qwen-VL processor and model to load:

1. Loads ``../cpu_runtime/sitecustomize.py`` (the text server's start-up patches) and registers one more
   post-import patch with it: ``transformers.utils.import_utils`` reports torchvision as **absent**. The
   ``torchvision`` stand-in of ``cpu_runtime`` makes ``find_spec("torchvision")`` succeed, so transformers
   would pick torchvision-backed image / video processors whose calls then hit the stand-in's placeholders
   (the first failure: ``unsupported operand type(s) for |: 'EnumType' and 'Missing'`` in a video
   processor module imported by ``AutoProcessor``). SGLang's own ``import torchvision`` lines keep working.
2. Installs the vLLM VL shim (``../../vllm_vl_shim/sitecustomize.py``): ``image_processing_qwen2_vl`` served
   by its PIL sibling, and a stand-in video processor (``AutoVideoProcessor`` otherwise raises "requires the
   Torchvision library" and the Qwen2.5-VL ``ProcessorMixin`` needs one). Its "torchvision is missing" test
   is forced to true (the ``cpu_runtime`` stand-in is importable).
3. Registers three ops under ``torch.ops.sgl_kernel`` that raise when called:
   ``fused_sigmoid_mul_cpu``, ``fused_qk_gemma_rmsnorm_cpu``, ``fused_qk_gemma_rmsnorm_with_gate_cpu``.
   ``sglang/srt/models/qwen3_5.py`` (imported by the Qwen-VL processor module
   ``sglang/srt/multimodal/processors/qwen_vl.py``) and ``models/muse_glimmer.py`` read them at module level on
   the CPU; without them the import fails (``'_OpNamespace' 'sgl_kernel' object has no attribute
   'fused_sigmoid_mul_cpu'``), SGLang skips the processor, and the server has no processor for the model.
   Qwen2.5-VL never calls them; capability probes look at other names (``convert_weight_packed``, ...), which
   stay absent, so SGLang stays on its ``forward_native`` torch paths. Registered right before one of those
   two modules is first executed.

``SGLANG_VL_PATCHES=0`` disables 1-3 (``cpu_runtime`` still loads).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CPU_RUNTIME_SITECUSTOMIZE = HERE.parent / "cpu_runtime" / "sitecustomize.py"
VLLM_VL_SHIM = HERE.parent.parent / "vllm_vl_shim" / "sitecustomize.py"

SGL_KERNEL_IMPORT_ONLY_OPS = (
    "fused_sigmoid_mul_cpu",
    "fused_qk_gemma_rmsnorm_cpu",
    "fused_qk_gemma_rmsnorm_with_gate_cpu",
    "fused_qkvzba_split_reshape_cat_contiguous_cpu",
)
"""Names SGLang reads from ``torch.ops.sgl_kernel`` at module level in modules the VL server imports."""
_NEEDS_SGL_KERNEL_OPS = frozenset({"sglang.srt.models.qwen3_5", "sglang.srt.models.muse_glimmer"})

_libraries: list[Any] = []
"""Keeps the ``torch.library.Library`` fragment alive (the ops vanish with it)."""


def _load_by_path(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _hide_torchvision_from_transformers(module: types.ModuleType) -> str | None:
    original: Callable[..., tuple[bool, Any]] = module._is_package_available

    def _is_package_available(pkg_name: str, return_version: bool = False) -> tuple[bool, Any]:
        if pkg_name == "torchvision":
            return (False, "N/A") if return_version else (False, None)
        return original(pkg_name, return_version)

    module._is_package_available = _is_package_available
    return "torchvision reported absent (the cpu_runtime stand-in is import-only)"


CHECKPOINT_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))
"""transformers >= 4.52 checkpoint names → the names ``Qwen2_5_VLForConditionalGeneration.load_weights`` knows."""


def _rename_checkpoint_weights(module: types.ModuleType) -> str | None:
    model_class = module.Qwen2_5_VLForConditionalGeneration
    original = model_class.load_weights

    def load_weights(self: Any, weights: Any) -> Any:
        def renamed() -> Any:
            for name, tensor in weights:
                for old, new in CHECKPOINT_PREFIXES:
                    if name.startswith(old):
                        name = new + name[len(old) :]
                        break
                yield name, tensor

        return original(self, renamed())

    model_class.load_weights = load_weights
    return "Qwen2_5_VLForConditionalGeneration.load_weights takes model.language_model.* / model.visual.* names"


def _register_sgl_kernel_ops() -> None:
    if _libraries:
        return
    import torch

    library = torch.library.Library("sgl_kernel", "FRAGMENT")
    for name in SGL_KERNEL_IMPORT_ONLY_OPS:
        if hasattr(torch.ops.sgl_kernel, name):
            continue
        library.define(f"{name}(Tensor[] args) -> ()")

        def missing(args: Any, _name: str = name) -> None:
            raise NotImplementedError(f"torch.ops.sgl_kernel.{_name} is an import-only stand-in (SGLang VL live shim)")

        library.impl(name, missing, "CompositeExplicitAutograd")
    _libraries.append(library)
    sys.stderr.write(f"[vl-patches] torch.ops.sgl_kernel: import-only {', '.join(SGL_KERNEL_IMPORT_ONLY_OPS)}\n")


class _BeforeExecLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, before: Callable[[], None]) -> None:
        self._inner = inner
        self._before = before

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._before()
        self._inner.exec_module(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _SglKernelOpsFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _NEEDS_SGL_KERNEL_OPS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _BeforeExecLoader(spec.loader, _register_sgl_kernel_ops)
        return spec


_cpu_runtime = _load_by_path("backends_sglang_cpu_runtime", CPU_RUNTIME_SITECUSTOMIZE)

if os.environ.get("SGLANG_VL_PATCHES", "1") != "0":
    _cpu_runtime._PATCHES["transformers.utils.import_utils"] = _hide_torchvision_from_transformers
    _cpu_runtime._PATCHES["sglang.srt.models.qwen2_5_vl"] = _rename_checkpoint_weights
    if not any(isinstance(finder, _cpu_runtime._PostImportPatcher) for finder in sys.meta_path):
        sys.meta_path.insert(0, _cpu_runtime._PostImportPatcher())  # SGLANG_CPU_PATCHES=0 left it out
    _vllm_vl_shim = _load_by_path("backends_vllm_vl_shim", VLLM_VL_SHIM)
    _vllm_vl_shim._torchvision_missing = lambda: True  # type: ignore[attr-defined]
    sys.meta_path.insert(0, _SglKernelOpsFinder())
