"""Who may do what: bearer keys.

A gateway given keys answers only requests that carry one (``Authorization: Bearer <key>``, or ``x-api-key:
<key>`` as Anthropic's SDKs send it). A **harness** key sends turns and reads its own sessions' summaries; every
session it starts belongs to it, and it names its sessions and groups in names of its own (another key's
``run-1`` is another session; see :func:`backends_gateway.gateway.owned_name`). The **trainer** key does all that
and reads everything: any session, trajectories, rewards, closing, the page.

Keys are read from a file (never from the command line, where any user of the machine sees them) and held only as
SHA-256 digests; no error message, log line or answer contains one::

    # keys.toml
    [trainer]
    trainer = "tk-..."
    [harness]
    team-a = "hk-..."
    team-b = "hk-..."

A key's name (``team-a``) is what the store records as a session's ``owner``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

__all__ = ["KeysError", "Keys", "Principal"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
#: a shorter key is guessable
MIN_KEY_CHARS = 16


class KeysError(ValueError):
    """A keys file that cannot be used, naming the entry at fault (never its key)."""


@attrs.frozen
class Principal:
    """Who sent a request: the key's ``name`` and whether it is the trainer's."""

    name: str
    trainer: bool


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class Keys:
    """The keys a gateway accepts.

    :param trainer: name → key of the trainer's keys (at least one).
    :param harness: name → key of the harnesses' keys.
    """

    def __init__(self, *, trainer: Mapping[str, str], harness: Mapping[str, str] | None = None) -> None:
        harness = harness or {}
        if not trainer:
            raise KeysError("keys: at least one trainer key is needed (the trajectories and the page need one)")
        self._by_digest: dict[bytes, Principal] = {}
        for role, entries in (("trainer", trainer), ("harness", harness)):
            if not isinstance(entries, Mapping):
                raise KeysError(f"keys: [{role}] must map names to keys")
            for name, key in entries.items():
                where = f"keys: [{role}] {name!r}"
                if not isinstance(name, str) or not _NAME.fullmatch(name):
                    raise KeysError(f"{where}: a name is 1-64 letters, digits, '.', '_' or '-'")
                if not isinstance(key, str) or len(key) < MIN_KEY_CHARS or key != key.strip():
                    raise KeysError(f"{where}: a key is a string of at least {MIN_KEY_CHARS} characters, no spaces")
                if any(p.name == name for p in self._by_digest.values()):
                    raise KeysError(f"{where}: the name is given twice")
                digest = _digest(key)
                if digest in self._by_digest:
                    raise KeysError(f"{where}: the same key as {self._by_digest[digest].name!r}")
                self._by_digest[digest] = Principal(name=name, trainer=role == "trainer")

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Keys:
        """Keys from a TOML (or ``.json``) file with tables ``trainer`` and ``harness`` (name = key)."""
        file = Path(path)
        try:
            text = file.read_text(encoding="utf-8")
        except OSError as exc:
            raise KeysError(f"keys: cannot read {file}: {exc.strerror}") from None
        try:
            data: Any = json.loads(text) if file.suffix == ".json" else tomllib.loads(text)
        except ValueError as exc:  # both parsers say where, never what (no key is quoted)
            raise KeysError(
                f"keys: {file} is not valid {'JSON' if file.suffix == '.json' else 'TOML'}: {exc}"
            ) from None
        if not isinstance(data, dict) or set(data) - {"trainer", "harness"}:
            extra = sorted(set(data) - {"trainer", "harness"}) if isinstance(data, dict) else []
            raise KeysError(f"keys: {file} must have only the tables [trainer] and [harness], found {extra}")
        return cls(trainer=data.get("trainer") or {}, harness=data.get("harness") or {})

    def identify(self, key: str) -> Principal | None:
        """The principal ``key`` belongs to; ``None``: not a key of this gateway. (A dictionary lookup of the
        key's digest: the time it takes says nothing about the keys held.)"""
        return self._by_digest.get(_digest(key))

    @property
    def names(self) -> list[str]:
        return sorted(p.name for p in self._by_digest.values())
