"""The SGLang driver for backends: token-in/token-out generation on ``/generate``, teacher logprobs, routed
experts, and SGLang's control plane (pause modes, weight updates, LoRA, memory release). Hooks in
:mod:`backends_sglang.hooks`; the emulator for tests in :mod:`backends_sglang_testing`."""

__version__ = "0.1.0"
