"""Stores: ``sqlite:///PATH`` (embedded default) and ``redis://HOST:PORT/DB`` (several replicas)."""

from __future__ import annotations

from urllib.parse import urlsplit

from tether.capability.errors import BAD_REQUEST, TetherError

from .base import STORE_UNWRITABLE, Doc, Event, LinkConflict, Store, StoreUnavailable, StoreUnwritable, WriteStatus


def open_store_url(url: str) -> Store:
    """Build (not yet open) the store a ``--store`` URL names."""
    parts = urlsplit(url)
    if parts.scheme == "sqlite":
        # SQLAlchemy's convention: sqlite:///relative/path.db, sqlite:////absolute/path.db
        path = url[len("sqlite:///") :] if url.startswith("sqlite:///") else ""
        if not path:
            raise TetherError(f"--store {url}: give a file, e.g. sqlite:///tether.db", code=BAD_REQUEST)
        from .sqlite import SqliteStore

        return SqliteStore(path)
    if parts.scheme in ("redis", "rediss"):
        try:
            from .redis import RedisStore
        except ImportError as exc:  # the redis package is a dependency; this only guards broken installs
            raise TetherError(f"--store {url}: the Redis store is not available ({exc})", code=BAD_REQUEST) from None
        return RedisStore(url)
    raise TetherError(f"--store {url}: expected sqlite:///PATH or redis://HOST:PORT/DB", code=BAD_REQUEST)


__all__ = ["STORE_UNWRITABLE", "Doc", "Event", "LinkConflict", "Store", "StoreUnavailable", "StoreUnwritable",
           "WriteStatus", "open_store_url"]
