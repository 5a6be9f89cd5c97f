"""A CPU stand-in for the ``sgl_kernel`` package, for running real SGLang 0.5.23 on a CPU-only machine.

PyPI's ``sglang-kernel`` is a CUDA build (it fails to import without ``libcuda.so.1``) and SGLang's CPU kernel
build is not published, yet SGLang's CPU code paths import a few names from ``sgl_kernel`` at module level.

* ``assign_req_to_token_pool_cpu`` is implemented in plain torch: SGLang calls it whenever it extends a
  request's row of the request-to-KV-slot table (``mem_cache/allocation.py``).
* Every other public name resolves (so module-level imports succeed) to a stub that raises
  ``NotImplementedError`` when called, naming itself. Nothing is registered under ``torch.ops.sgl_kernel``,
  so SGLang's capability probes (``cpu_has_amx_support()`` ...) report no CPU kernels and it stays on its
  ``forward_native`` torch paths.
* Submodules (``sgl_kernel.kvcacheio`` ...) do not exist: importing one raises ``ImportError``, which is
  what SGLang's optional-kernel probes expect when a kernel build lacks a feature.
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch

__version__ = "0.0.0+cpu-stand-in"

IMPLEMENTED = ("assign_req_to_token_pool_cpu",)
"""The only names with a real implementation."""


@torch.no_grad()
def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV slots into its row of the request-to-token table.

    Request ``i`` owns row ``req_pool_indices[i]`` of ``req_to_token`` (``[num_rows, pool_len]``); its new
    slots are the next ``end_offset[i] - start_offset[i]`` entries of ``out_cache_loc`` (the requests' slots
    concatenated in batch order) and go to columns ``start_offset[i] .. end_offset[i]``.
    """
    rows = req_pool_indices.tolist()
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    cursor = 0
    for row, start, end in zip(rows, starts, ends, strict=True):
        count = end - start
        if count <= 0:
            continue
        if end > pool_len:
            raise ValueError(f"assign_req_to_token_pool_cpu: end offset {end} > pool length {pool_len}")
        req_to_token[row, start:end] = out_cache_loc[cursor : cursor + count].to(req_to_token.dtype)
        cursor += count


class _Missing:
    """A kernel this stand-in does not provide: importable, but calling it raises."""

    def __init__(self, name: str) -> None:
        self.__name__ = self.__qualname__ = name

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            f"sgl_kernel.{self.__name__} is not implemented by the CPU stand-in for sgl_kernel "
            f"(only {', '.join(IMPLEMENTED)} is); SGLang reached a code path that needs the real kernel"
        )

    def __repr__(self) -> str:
        return f"<missing sgl_kernel.{self.__name__}>"


def __getattr__(name: str) -> _Missing:
    if name.startswith("__"):
        raise AttributeError(name)
    missing = _Missing(name)
    globals()[name] = missing
    return missing
