"""Shared test setup. The test kit plugin (``backends_testkit``) is loaded through pytest's addopts.

Hypothesis runs derandomized (the same examples every run, no example database), so CI stays deterministic;
set ``HYPOTHESIS_PROFILE=explore`` to search new examples locally.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def fresh_uv_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A uv cache this test session created empty: what clean-venv installs read and fill (tests/clean_install.py)."""
    return tmp_path_factory.mktemp("uv-cache")
