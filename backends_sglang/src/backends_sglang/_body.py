"""Typed JSON access: the core's :class:`~backends_core.jsonnode.Node`, under the name this package uses."""

from __future__ import annotations

from backends_core.jsonnode import Node as Body

__all__ = ["Body"]
