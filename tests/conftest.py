"""Shared test setup. The test kit plugin (``backends_core.testing``) is loaded through pytest's addopts."""
