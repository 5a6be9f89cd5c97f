"""Weight updates of the emulated server: from disk, and named tensors "received" through a transfer group.

A real ``/update_weights_from_distributed`` receives tensors by a collective broadcast from the trainer. The
emulator has no process group: a ``weight_source`` callable stands for the trainer and returns the tensors
(``{name: array}``) for the announced ``(name, dtype, shape)`` list. They replace the current weights' tensors of
the same names, the result is written as a new checkpoint directory, and the engine loads it.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from safetensors.numpy import load_file, save_file

__all__ = ["TensorAnnouncement", "WeightRejected", "WeightSource", "WeightStore"]

_WEIGHTS = "model.safetensors"
#: ``(name, dtype, shape)`` of one tensor, as announced to ``/update_weights_from_distributed``.
TensorAnnouncement = tuple[str, str, tuple[int, ...]]
#: Stands for the trainer's broadcast: ``(group_name, announcements) -> {name: array}``.
WeightSource = Callable[[str, Sequence[TensorAnnouncement]], Mapping[str, npt.NDArray[Any]]]


class WeightRejected(ValueError):
    """The announced or received tensors do not fit the model."""


class WeightStore:
    """The checkpoint directory the engine currently serves, and the directories written for updates."""

    def __init__(self, model_dir: Path) -> None:
        self.current = model_dir
        self._written: list[Path] = []

    def merge(self, announced: Sequence[TensorAnnouncement], received: Mapping[str, npt.NDArray[Any]]) -> Path:
        """Write a checkpoint: the current weights with ``received`` in place of same-named tensors.

        :raises WeightRejected: an unknown name, a missing tensor, or a shape that differs from the announcement
            or from the model's parameter.
        """
        tensors = load_file(str(self.current / _WEIGHTS))
        for name, _dtype, shape in announced:
            if name not in tensors:
                raise WeightRejected(f"Parameter {name} not found in the model")
            if name not in received:
                raise WeightRejected(f"the trainer sent no tensor for {name}")
            value = np.asarray(received[name])
            if tuple(value.shape) != tuple(shape) or tuple(shape) != tensors[name].shape:
                raise WeightRejected(
                    f"{name}: announced shape {list(shape)}, received {list(value.shape)}, "
                    f"parameter {list(tensors[name].shape)}"
                )
            tensors[name] = value.astype(tensors[name].dtype)
        target = Path(tempfile.mkdtemp(prefix="sglang-emulator-weights-"))
        self._written.append(target)
        for item in self.current.iterdir():
            if item.is_file() and item.name != _WEIGHTS:
                shutil.copyfile(item, target / item.name)
        save_file(tensors, str(target / _WEIGHTS))
        return target

    def close(self) -> None:
        """Delete every directory written for updates."""
        for path in self._written:
            shutil.rmtree(path, ignore_errors=True)
        self._written.clear()
