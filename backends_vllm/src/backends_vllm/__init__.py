"""The vLLM driver for backends: token-in/token-out generation on ``/inference/v1/generate`` or ``/v1/completions``,
teacher logprobs, routed experts, and vLLM's control plane (pause modes, weight reload and transfer, LoRA, sleep).
Hooks in :mod:`backends_vllm.hooks`; the emulator for tests in :mod:`backends_vllm_testing`."""

__version__ = "0.1.0"
