"""One page of an item list (a response's input items, a conversation's
items), the same in both backends; and a whole list read in pages of a
bounded size (``item_pages``: a request's stored history)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

from lmspd.store.base import InvalidCursor, ItemPage, Page, unstorable
from lmspd.store.sql import Sql

__all__ = ["check_page_args", "item_pages", "page"]

# Item sizes read per statement by ``item_pages`` (a few numbers each).
_SIZES_PER_READ = 1024


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
        found = None if unstorable(after) else sql.first(
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


def item_pages(sql: Sql, source: str, args: tuple[Any, ...], *, size: str, page_bytes: int, link: int = 0,
               kind: Literal["input", "output"] = "input") -> Iterator[ItemPage]:
    """The items of ``source`` (as ``page``'s) by position, in pages of at
    most ``page_bytes`` of stored JSON or one item: the items' sizes
    (``size``, the SQL of a row's byte size) first, then the bodies of as
    many as fit. What is read follows the caller, never the whole list; it
    reads a consistent list inside one snapshot (``SqlBackend.sql_snapshot``)."""
    after = -1
    start = 0
    while True:
        sizes = sql.rows(f"SELECT position, {size} AS n FROM {source} AND position > ? ORDER BY position LIMIT ?",
                         (*args, after, _SIZES_PER_READ))
        first = total = 0
        for k, row in enumerate(sizes):
            if k > first and total + row["n"] > page_bytes:
                items = _bodies(sql, source, args, sizes[first]["position"], sizes[k - 1]["position"])
                yield ItemPage(link, kind, start, items)
                start += len(items)
                first, total = k, 0
            total += row["n"]
        if sizes:
            items = _bodies(sql, source, args, sizes[first]["position"], sizes[-1]["position"])
            yield ItemPage(link, kind, start, items)
            start += len(items)
        if len(sizes) < _SIZES_PER_READ:
            return
        after = sizes[-1]["position"]


def _bodies(sql: Sql, source: str, args: tuple[Any, ...], first: int, last: int) -> list[Any]:
    rows = sql.rows(f"SELECT body FROM {source} AND position BETWEEN ? AND ? ORDER BY position", (*args, first, last))
    return [json.loads(r["body"]) for r in rows]
