"""Startup patches for real SGLang 0.5.23 on a CPU-only machine (loaded by ``site`` in every server process).

This directory is put first on the server's ``PYTHONPATH`` (with the ``sgl_kernel`` stand-in beside this
file), so Python imports this module at start-up in the launcher and in every process SGLang spawns
(scheduler, detokenizer). Nothing SGLang is imported here: a post-import hook patches two SGLang modules
right after they are first imported.

1. ``sglang.srt.mem_cache.pool_host.common``: ``ALLOC_MEMORY_FUNCS`` has no ``"cpu"`` entry, so the
   routed-experts host buffer (``--enable-return-routed-experts``) falls back to ``cudaHostRegister`` and
   the server dies at start-up ("Found no NVIDIA driver"). The patch adds a plain CPU allocator.
2. ``sglang.srt.lora.*``: LoRA layers and backends build host tensors with ``pin_memory=True`` and call
   ``Tensor.pin_memory()``, which fails without an accelerator (``--enable-lora`` dies at start-up in
   ``lora/layers.py``, then at the first request in ``lora/backend/torch_backend.py``). When no CUDA device
   exists, the patch gives each of those modules a ``torch`` whose tensor factories ignore ``pin_memory``,
   and makes ``Tensor.pin_memory()`` return the tensor itself (pinning is meaningless without a device).

``SGLANG_CPU_PATCHES=0`` disables both (to reproduce the upstream crashes).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

Patch = Callable[[types.ModuleType], "str | None"]
"""Patches a freshly imported module; returns what it changed (logged to stderr), or ``None``."""

_PATCHES: dict[str, Patch] = {}
"""Module name → patch, or package prefix ending in ``.`` → patch applied to every module under it."""


def _patch_for(fullname: str) -> Patch | None:
    patch = _PATCHES.get(fullname)
    if patch is not None:
        return patch
    for prefix, prefix_patch in _PATCHES.items():
        if prefix.endswith(".") and fullname.startswith(prefix):
            return prefix_patch
    return None


def _patch_host_allocator(module: types.ModuleType) -> str | None:
    import torch

    def alloc_plain_cpu(
        dims: Sequence[int],
        dtype: torch.dtype,
        device: str,
        pin_memory: bool,
        allocator: Any,
        registration_granularity_bytes: int | None = None,
    ) -> torch.Tensor:
        del device, pin_memory, allocator, registration_granularity_bytes  # host memory, never pinned
        return torch.zeros(tuple(dims), dtype=dtype, device="cpu")

    module.ALLOC_MEMORY_FUNCS["cpu"] = alloc_plain_cpu
    return "ALLOC_MEMORY_FUNCS['cpu'] = plain CPU allocator (no cudaHostRegister)"


class _TorchWithoutPinning(types.ModuleType):
    """``torch`` as seen by one module, with ``pin_memory=`` dropped from tensor factories."""

    _FACTORIES = frozenset({"tensor", "empty", "zeros", "ones", "full", "arange", "as_tensor"})

    def __init__(self, torch_module: types.ModuleType) -> None:
        super().__init__(torch_module.__name__)
        self._torch = torch_module

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._torch, name)
        if name not in self._FACTORIES:
            return value

        def factory(*args: Any, **kwargs: Any) -> Any:
            kwargs.pop("pin_memory", None)
            return value(*args, **kwargs)

        return factory


def _patch_lora_pinning(module: types.ModuleType) -> str | None:
    import torch

    if torch.cuda.is_available() or getattr(module, "torch", None) is not torch:
        return None
    module.torch = _TorchWithoutPinning(torch)  # type: ignore[attr-defined]
    original = torch.Tensor.pin_memory
    if not getattr(original, "_cpu_patch", False):

        def pin_memory(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if torch.cuda.is_available():
                return original(self, *args, **kwargs)
            return self

        pin_memory._cpu_patch = True  # type: ignore[attr-defined]
        torch.Tensor.pin_memory = pin_memory  # type: ignore[method-assign]
    return "pin_memory ignored (no CUDA device)"


class _PatchingLoader(importlib.abc.Loader):
    """Wraps a module's real loader: executes the module, then patches it."""

    def __init__(self, inner: importlib.abc.Loader, patch: Patch) -> None:
        self._inner = inner
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._inner.exec_module(module)
        change = self._patch(module)
        if change:
            sys.stderr.write(f"[cpu-patches] {module.__name__}: {change}\n")

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ... of the real loader
        return getattr(self._inner, name)


class _PostImportPatcher(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        patch = _patch_for(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader, patch)
        return spec


if os.environ.get("SGLANG_CPU_PATCHES", "1") != "0":
    _PATCHES["sglang.srt.mem_cache.pool_host.common"] = _patch_host_allocator
    _PATCHES["sglang.srt.lora."] = _patch_lora_pinning
    sys.meta_path.insert(0, _PostImportPatcher())
