"""The stores' schemas as numbered SQL files, one folder per database (``sqlite/``, ``postgres/``): a store applies,
in order and each in its own transaction, the files past the version it records."""

from __future__ import annotations

import re
from importlib import resources

import attrs

__all__ = ["Migration", "migrations"]

_NAME = re.compile(r"(\d{4})_[a-z0-9_]+\.sql")


@attrs.frozen
class Migration:
    version: int
    name: str
    sql: str


def migrations(dialect: str) -> list[Migration]:
    """The migrations of ``dialect`` in order; numbered 1, 2, ... with no gap (a gap is a packaging mistake)."""
    folder = resources.files(__package__).joinpath(dialect)
    found: list[Migration] = []
    for entry in folder.iterdir():
        match = _NAME.fullmatch(entry.name)
        if match is not None:
            found.append(Migration(int(match.group(1)), entry.name, entry.read_text(encoding="utf-8")))
    found.sort(key=lambda m: m.version)
    if [m.version for m in found] != list(range(1, len(found) + 1)):
        raise RuntimeError(f"{dialect} migrations are not numbered 1..{len(found)}: {[m.name for m in found]}")
    return found
