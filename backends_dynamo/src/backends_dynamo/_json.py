"""Typed JSON access (the core's :class:`~backends_core.jsonnode.Node`) and Dynamo's integer widths."""

from __future__ import annotations

from backends_core.jsonnode import PLACEHOLDER_LOGPROB, U32, Node

__all__ = ["PLACEHOLDER_LOGPROB", "U32", "U64", "Node"]

#: Dynamo's worker ids are u64.
U64 = 2**64
