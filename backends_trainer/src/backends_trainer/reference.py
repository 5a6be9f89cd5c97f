"""What the model's tensors are (name, dtype, shape), to refuse a push that does not fit it before anything is
sent."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeAlias

import attrs
import torch
from safetensors import safe_open

from backends_core.errors import InvalidRequestError
from backends_core.types import TensorSpec

__all__ = ["Reference", "TensorShapes", "reference_shapes"]

#: A model's tensors: a module, a state dict, a safetensors checkpoint directory or file, or name to
#: ``(dtype name, shape)``.
Reference: TypeAlias = (
    torch.nn.Module | Mapping[str, torch.Tensor] | Mapping[str, tuple[str, Sequence[int]]] | str | os.PathLike[str]
)

#: safetensors' dtype codes, by torch's name.
_SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


@attrs.frozen
class TensorShapes:
    """The model's tensors by name: ``(dtype name, shape)``."""

    tensors: Mapping[str, tuple[str, tuple[int, ...]]]
    source: str

    def check(self, specs: Sequence[TensorSpec]) -> None:
        """Refuse, naming every offender, tensors the model lacks or that disagree with it.

        :raises InvalidRequestError: the names, dtypes and shapes that do not fit.
        """
        problems: list[str] = []
        for spec in specs:
            known = self.tensors.get(spec.name)
            if known is None:
                problems.append(f"{spec.name!r}: the model has no such tensor")
            elif (spec.dtype, tuple(spec.shape)) != known:
                problems.append(
                    f"{spec.name!r}: {spec.dtype} {list(spec.shape)} given, the model's is {known[0]} {list(known[1])}"
                )
        if problems:
            shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
            raise InvalidRequestError(f"{len(problems)} tensor(s) do not fit {self.source}: {shown}")


def reference_shapes(reference: Reference) -> TensorShapes:
    """Read a :data:`Reference` (a checkpoint's safetensors headers only, never its data).

    :raises InvalidRequestError: something else, or a directory without safetensors.
    """
    if isinstance(reference, torch.nn.Module):
        return _from_tensors(reference.state_dict(), f"the model {type(reference).__name__}")
    if isinstance(reference, str | os.PathLike):
        return _from_checkpoint(Path(reference))
    if isinstance(reference, Mapping):
        tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
        for name, value in reference.items():
            if isinstance(value, torch.Tensor):
                tensors[name] = (_dtype(value), tuple(value.shape))
            elif isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str):
                tensors[name] = (value[0].removeprefix("torch."), tuple(int(d) for d in value[1]))
            else:
                raise InvalidRequestError(
                    f"reference[{name!r}] must be a tensor or (dtype name, shape), got {type(value).__name__}"
                )
        return TensorShapes(tensors, "the reference")
    raise InvalidRequestError(
        "reference must be a torch module, a state dict, a safetensors checkpoint path or name -> (dtype, shape), "
        f"got {type(reference).__name__}"
    )


def _from_tensors(tensors: Mapping[str, Any], source: str) -> TensorShapes:
    return TensorShapes({name: (_dtype(t), tuple(t.shape)) for name, t in tensors.items()}, source)


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _from_checkpoint(path: Path) -> TensorShapes:
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise InvalidRequestError(f"reference {str(path)!r} holds no safetensors file")
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118  (safe_open is not a mapping)
                piece = handle.get_slice(name)
                dtype = _SAFETENSORS_DTYPES.get(piece.get_dtype(), piece.get_dtype())
                tensors[name] = (dtype, tuple(piece.get_shape()))
    return TensorShapes(tensors, f"the checkpoint {str(path)!r}")
