"""backends-gateway: a capture gateway over backends.

Unmodified agent harnesses (the OpenAI and Anthropic SDKs, OpenAI Agents, LangChain, Claude Code-style CLIs) talk
to it as to OpenAI's chat completions or Responses API or Anthropic's Messages API; every turn is rendered with the
chat template, sent token-in to the engines through a :class:`backends_core.Client` (any backend, fleet or router
front), extended from the previous turn's exact ids, kept durably, and read back by the trainer as exact token
trajectories.

* :class:`Gateway` (the core, independent of any wire), :func:`create_app` / :func:`serve` (its HTTP routes),
  :class:`GatewayLimits`, :class:`Keys` (who may call it).
* :class:`Store`, :class:`SQLiteStore` (the embedded default, write-ahead log) and, with the ``postgres`` extra,
  ``backends_gateway.store_postgres.PostgresStore`` (several replicas, one database); :func:`open_store`.
* :class:`Trajectories`: a trainer's reader of a store, closed sessions as numpy arrays.
"""

from __future__ import annotations

from backends_gateway.app import create_app, serve
from backends_gateway.errors import GatewayError, Overloaded
from backends_gateway.gateway import Gateway, GatewayLimits, Served, Started, TextDelta
from backends_gateway.keys import Keys, KeysError, Principal
from backends_gateway.sessions import Branch, SessionRecord, TurnRecord, TurnRequest
from backends_gateway.store import SQLiteStore, Store
from backends_gateway.stores import open_store
from backends_gateway.trajectory import Sample, Trajectories, Trajectory, TrajectoryError, build

__version__ = "0.1.0"

__all__ = [
    "Branch",
    "Gateway",
    "GatewayError",
    "GatewayLimits",
    "Keys",
    "KeysError",
    "Overloaded",
    "Principal",
    "SQLiteStore",
    "Sample",
    "Served",
    "SessionRecord",
    "Started",
    "Store",
    "TextDelta",
    "Trajectories",
    "Trajectory",
    "TrajectoryError",
    "TurnRecord",
    "TurnRequest",
    "build",
    "create_app",
    "open_store",
    "serve",
]
