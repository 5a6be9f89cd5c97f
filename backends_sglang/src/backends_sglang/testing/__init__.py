"""Test support for the SGLang backend: :class:`SglangEmulator`, an SGLang-dialect server over the numpy
reference engine (needs ``backends-sglang[testing]``)."""

from __future__ import annotations

from backends_sglang.testing.emulator import SglangEmulator

__all__ = ["SglangEmulator"]
