"""Multi-turn token-in/token-out: exact ids reused across turns, only new messages rendered.

* :mod:`~backends_core.multiturn.conversation`: :class:`Conversation`, a stateful exchange over a client.
* :mod:`~backends_core.multiturn.extension`: :func:`extend_prompt`, the pure function that extends turn N-1's
  ids with the rendered new messages and proves the result, and its counters (:class:`BridgeStats`).
* :mod:`~backends_core.multiturn.turn_cache`: :class:`TurnCache`, the per-session turns behind stateless calls
  (the caller sends the whole message list; the longest remembered prefix is reused).
* :mod:`~backends_core.multiturn.messages`: one plain normal form per message, for rendering and comparison.
* :mod:`~backends_core.multiturn.rendering`: the chat template through transformers.
* :mod:`~backends_core.multiturn.prefix_cache`: :class:`PrefixRenderCache`, the default render's cache of a
  batch's shared prefix ids (verified against the whole text), and its counters (:class:`RenderStats`).
"""

from backends_core.multiturn.conversation import Conversation
from backends_core.multiturn.extension import BridgeStats, clear_template_cache, extend_prompt
from backends_core.multiturn.messages import as_plain, normal_forms, normalize_message, normalize_messages
from backends_core.multiturn.prefix_cache import PrefixRenderCache, RenderStats
from backends_core.multiturn.rendering import encode, load_tokenizer, render_text
from backends_core.multiturn.turn_cache import Turn, TurnCache

__all__ = [
    "BridgeStats",
    "Conversation",
    "PrefixRenderCache",
    "RenderStats",
    "Turn",
    "TurnCache",
    "as_plain",
    "clear_template_cache",
    "encode",
    "extend_prompt",
    "load_tokenizer",
    "normal_forms",
    "normalize_message",
    "normalize_messages",
    "render_text",
]
