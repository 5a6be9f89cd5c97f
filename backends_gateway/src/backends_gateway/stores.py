"""Which store a ``--store`` value names: :mod:`backends_gateway.store` for SQLite,
:mod:`backends_gateway.store_postgres` for PostgreSQL (which builds on the first)."""

from __future__ import annotations

import os

from backends_gateway.store import SQLiteStore, Store

__all__ = ["open_store"]


def open_store(spec: str | os.PathLike[str]) -> Store:
    """The store a ``--store`` value names: a path (or ``sqlite:///path``) is a SQLite file; a
    ``postgresql://`` (or ``postgres://``) URL a PostgreSQL database (:class:`PostgresStore`, the ``postgres``
    extra), which several gateways can write at once."""
    text = os.fspath(spec)
    if text.startswith(("postgresql://", "postgres://")):
        try:
            from backends_gateway.store_postgres import PostgresStore
        except ModuleNotFoundError as exc:
            raise ValueError(
                f"a PostgreSQL store needs {exc.name}: pip install 'backends-gateway[postgres]' "
                "(or 'backends[gateway-postgres]')"
            ) from None
        return PostgresStore(text)
    if text.startswith("sqlite://"):
        text = text.removeprefix("sqlite://")
    elif "://" in text:
        scheme = text.split("://", 1)[0]
        raise ValueError(f"unknown store scheme {scheme!r}: give a SQLite file path or a postgresql:// URL")
    return SQLiteStore(text)
