"""One page of an item list (a response's input items, a conversation's
items), the same in both backends."""

from __future__ import annotations

import json
from typing import Any

from lmspd.store.base import InvalidCursor, Page
from lmspd.store.sql import Sql

__all__ = ["check_page_args", "page"]


def check_page_args(limit: int, order: str) -> None:
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    if order not in ("asc", "desc"):
        raise ValueError(f"order must be 'asc' or 'desc', got {order!r}")


def page(sql: Sql, source: str, args: tuple[Any, ...], *, after: str | None, limit: int, order: str) -> Page:
    """``source`` is ``<table> WHERE <list filter>`` over a table with
    ``position``, ``item_id`` and ``body`` columns."""
    desc = order == "desc"
    where = ""
    params: tuple[Any, ...] = args
    if after is not None:
        # Ids may repeat in a client-sent list; resuming after the occurrence
        # furthest along the chosen order keeps paging moving forward (it may
        # skip a twin, never loop).
        found = sql.first(
            f"SELECT position FROM {source} AND item_id = ? "
            f"ORDER BY position {'ASC' if desc else 'DESC'} LIMIT 1",
            (*args, after),
        )
        if found is None:
            raise InvalidCursor(after)
        where = f" AND position {'<' if desc else '>'} ?"
        params = (*args, found["position"])
    rows = sql.rows(
        f"SELECT body FROM {source}{where} ORDER BY position {'DESC' if desc else 'ASC'} LIMIT ?",
        (*params, limit + 1),
    )
    return Page([json.loads(r["body"]) for r in rows[:limit]], len(rows) > limit)
