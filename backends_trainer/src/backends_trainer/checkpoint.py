"""The checkpoint path: the trainer writes safetensors into a directory the servers read, then every server
loads it (``weight_sync(path=...)``). For engines or machines where no collective group can be formed."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors.torch import save_file

from backends_core.errors import InvalidRequestError

__all__ = ["CheckpointDir", "write_checkpoint"]

#: A version becomes a directory name: these characters only.
_SAFE = re.compile(r"[^A-Za-z0-9._-]")
#: What the servers may need beside the weights, copied from ``config_from`` into every version's directory.
_SIDE_FILES = ("config.json", "generation_config.json")


def _directory(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str | os.PathLike) or not str(value).strip():
        raise InvalidRequestError(f"CheckpointDir.{attribute.name} must be a non-empty path, got {value!r}")


def _keep(_inst: object, _attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidRequestError(f"CheckpointDir.keep must be an int of at least 1, got {value!r}")


def _optional_directory(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        _directory(inst, attribute, value)


@attrs.frozen(kw_only=True)
class CheckpointDir:
    """Where the checkpoint path writes.

    :param path: the directory the trainer writes into; each version gets a subdirectory of its own.
    :param server_path: the same directory as the servers see it (another mount point), or ``None``: ``path``.
    :param config_from: a model directory whose ``config.json`` (and ``generation_config.json``) go beside the
        weights (an engine that loads a checkpoint as a model needs them), or ``None``.
    :param keep: how many versions stay on disk; older ones are removed once a newer one was loaded.
    """

    path: str | os.PathLike[str] = attrs.field(validator=_directory)
    server_path: str | os.PathLike[str] | None = attrs.field(default=None, validator=_optional_directory)
    config_from: str | os.PathLike[str] | None = attrs.field(default=None, validator=_optional_directory)
    keep: int = attrs.field(default=2, validator=_keep)

    def local(self, version: str) -> Path:
        """The version's directory as the trainer writes it."""
        return Path(self.path) / _name(version)

    def remote(self, version: str) -> str:
        """The version's directory as the servers read it."""
        return str(Path(self.server_path if self.server_path is not None else self.path) / _name(version))

    def prune(self, newest: str) -> list[Path]:
        """Remove all but the ``keep`` newest version directories this writer made (``newest`` stays);
        returns what was removed."""
        root = Path(self.path)
        made = sorted(
            (p for p in root.iterdir() if p.is_dir() and (p / _MARK).exists()),
            key=lambda p: (p / _MARK).stat().st_mtime_ns,
        )
        removable = [p for p in made if p.name != _name(newest)][: max(0, len(made) - self.keep)]
        for directory in removable:
            shutil.rmtree(directory)
        return removable


#: Written last in a version directory: it is complete, and it is this writer's (``prune`` removes only those).
_MARK = ".backends-trainer.json"


def _name(version: str) -> str:
    return _SAFE.sub("_", version)


def write_checkpoint(target: CheckpointDir, version: str, tensors: Mapping[str, torch.Tensor]) -> Path:
    """Write ``tensors`` as ``model.safetensors`` (plus the side files) into the version's directory, atomically:
    a reader never sees a half-written directory. Returns it."""
    final = target.local(version)
    staging = final.with_name(f".{final.name}.partial")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    try:
        save_file(
            {name: tensor.detach().to("cpu").contiguous() for name, tensor in tensors.items()},
            str(staging / "model.safetensors"),
            metadata={"format": "pt"},
        )
        if target.config_from is not None:
            for side in _SIDE_FILES:
                source = Path(target.config_from) / side
                if source.exists():
                    shutil.copyfile(source, staging / side)
        (staging / _MARK).write_text(json.dumps({"version": version, "tensors": len(tensors)}))
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final
