"""vllm driver for backends (not implemented yet; see the project issues)."""

__version__ = "0.1.0"
