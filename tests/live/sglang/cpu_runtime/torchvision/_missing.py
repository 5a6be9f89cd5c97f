"""Placeholders of the torchvision stand-in: any attribute resolves, any call raises."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn


class Missing:
    """A torchvision name the stand-in does not provide."""

    def __init__(self, qualname: str) -> None:
        self._qualname = qualname

    def __getattr__(self, name: str) -> Missing:
        if name.startswith("__"):
            raise AttributeError(name)
        return Missing(f"{self._qualname}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            f"{self._qualname} is not available: torchvision is an import-only stand-in in this SGLang "
            "server (text models only)"
        )

    def __repr__(self) -> str:
        return f"<missing {self._qualname}>"


def module_getattr(module_name: str) -> Callable[[str], Missing]:
    """A module-level ``__getattr__`` resolving every public name of ``module_name`` to a placeholder."""

    def __getattr__(name: str) -> Missing:
        if name.startswith("__"):
            raise AttributeError(name)
        return Missing(f"{module_name}.{name}")

    return __getattr__
