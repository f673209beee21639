"""Where lmspd keeps its state: ``open_store`` picks the backend from a URL.

``postgresql://...`` (or ``postgres://``) opens the shared PostgreSQL store
(``lmspd.store.postgres``), for several lmspd instances on one state;
anything else is a path to the embedded SQLite file (``lmspd.store.sqlite``).
"""

from __future__ import annotations

import os
from typing import Any

from lmspd.store.base import Store

POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def is_postgres_url(target: str | os.PathLike[str]) -> bool:
    return isinstance(target, str) and target.startswith(POSTGRES_SCHEMES)


def open_store(target: str | os.PathLike[str], **options: Any) -> Store:
    if is_postgres_url(target):
        from lmspd.store.postgres import PostgresStore

        return PostgresStore(str(target), **options)
    from lmspd.store.sqlite import SQLiteStore

    return SQLiteStore(target, **options)
