"""The Dynamo driver for backends: token-in/token-out generation through the frontend's chat or completions route
(``nvext.token_data``), teacher logprobs, and the workers' ``/engine/*`` control plane. Hooks in
:mod:`backends_dynamo.hooks`; the emulator for tests in :mod:`backends_dynamo_testing`."""

__version__ = "0.1.0"
