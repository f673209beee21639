"""Where lmspd keeps its state: ``open_store`` picks the backend from a URL.

``postgresql://...`` (or ``postgres://``, or SQLAlchemy's
``postgresql+psycopg://``) opens the shared PostgreSQL store
(``lmspd.store.postgres``), for several lmspd instances on one state; a
path is the embedded SQLite file (``lmspd.store.sqlite``). A URL of any
other scheme is refused: it became a SQLite file named after it, in the
working directory, its password in the file's path.
"""

from __future__ import annotations

import os
import re
from typing import Any

from lmspd.store.base import Store

POSTGRES_SCHEMES = ("postgresql://", "postgres://")
# SQLAlchemy's spelling (a driver after "+"): the same libpq URL without it.
_DRIVER_SCHEMES = {"postgresql+psycopg://": "postgresql://"}
ACCEPTED = ", ".join([*POSTGRES_SCHEMES, *_DRIVER_SCHEMES])
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")


def is_postgres_url(target: str | os.PathLike[str]) -> bool:
    return isinstance(target, str) and target.startswith((*POSTGRES_SCHEMES, *_DRIVER_SCHEMES))


def postgres_dsn(target: str | os.PathLike[str]) -> str | None:
    """The libpq URL ``target`` names, or None where it is a path (SQLite).
    ValueError for a URL of another scheme; the message names the scheme,
    never the rest (a password)."""
    if not isinstance(target, str) or "://" not in target:
        return None
    for scheme, libpq in _DRIVER_SCHEMES.items():
        if target.startswith(scheme):
            return libpq + target[len(scheme):]
    if target.startswith(POSTGRES_SCHEMES):
        return target
    scheme = target.split("://", 1)[0]
    named = f"{scheme}:// URLs" if _SCHEME.fullmatch(scheme) else "this URL"
    raise ValueError(f"the store cannot be opened from {named}: give a PostgreSQL URL ({ACCEPTED}) "
                     "or the path of a SQLite file")


def open_store(target: str | os.PathLike[str], **options: Any) -> Store:
    dsn = postgres_dsn(target)
    if dsn is not None:
        from lmspd.store.postgres import PostgresStore

        return PostgresStore(dsn, **options)
    from lmspd.store.sqlite import SQLiteStore

    return SQLiteStore(target, **options)
