"""An import-only stand-in for ``torchvision`` in the SGLang server of the live tests (text models only).

SGLang 0.5.23 imports ``torchvision.transforms`` at module level from config modules of vision models
(``sglang/srt/configs/nano_nemotron_vl.py`` → ``multimodal/internvl_utils.py``), which every server
imports, even for a text-only model. PyPI's torchvision is built for CUDA torch and does not import beside
the local CPU torch wheel (``operator torchvision::nms does not exist``), and the text models served here
never transform an image. So every name here (and in the submodules) resolves to a placeholder: attribute
access on it works (``InterpolationMode.BICUBIC`` as a default argument), calling it raises
``NotImplementedError``.
"""

from torchvision._missing import module_getattr

__version__ = "0.0.0+cpu-stand-in"
__getattr__ = module_getattr(__name__)
