"""Conversations and their items, written and read the same in both SQL
backends. Appending reserves the items' positions in one ``UPDATE ...
RETURNING`` (two PostgreSQL instances appending to one conversation get
disjoint ranges; SQLite's writer lock serializes anyway)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from lmspd.store.base import (
    HISTORY_PAGE_BYTES,
    JSON,
    ConversationRecord,
    Duplicate,
    DuplicateItem,
    ItemPage,
    Order,
    Page,
    ensure_item_ids,
    new_item_id,
    unstorable,
)
from lmspd.store.paging import check_page_args, item_pages, page
from lmspd.store.sql import Sql, SqlBackend, dumps, in_list, size

__all__ = ["ConversationQueries", "append_items", "conversation_record"]


def conversation_record(row: Mapping[str, Any]) -> ConversationRecord:
    return ConversationRecord(
        id=row["id"],
        owner=row["owner"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        metadata=json.loads(row["metadata"]),
    )


class ConversationQueries(SqlBackend):
    def create_conversation(self, owner: str, conversation_id: str, *, metadata: JSON | None = None,
                            items: Sequence[JSON] = (), created_at: float | None = None) -> ConversationRecord:
        meta = dumps(metadata or {})
        created = self._now(created_at)
        now = self._clock()
        with self.sql_write() as sql:
            if not sql.run("INSERT INTO conversations (id, owner, created_at, updated_at, metadata, bytes) "
                           "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO NOTHING",
                           (conversation_id, owner, created, now, meta, size(meta))):
                raise Duplicate(f"conversation {conversation_id!r} already exists")
            append_items(sql, conversation_id, items, now)
            row = sql.first("SELECT * FROM conversations WHERE id = ?", (conversation_id,))
        assert row is not None  # the row just written
        return conversation_record(row)

    def update_conversation(self, owner: str, conversation_id: str, metadata: JSON) -> ConversationRecord | None:
        if unstorable(conversation_id):
            return None
        meta = dumps(metadata)
        with self.sql_write() as sql:
            row = sql.first("SELECT metadata FROM conversations WHERE id = ? AND owner = ?" + self.for_update,
                            (conversation_id, owner))
            if row is None:
                return None
            row = sql.returning("UPDATE conversations SET metadata = ?, updated_at = ?, bytes = bytes - ? + ? "
                            "WHERE id = ? RETURNING *",
                            (meta, self._clock(), size(row["metadata"]), size(meta), conversation_id))
        assert row is not None  # the row just written
        return conversation_record(row)

    def append_conversation_items(self, owner: str, conversation_id: str,
                                  items: Sequence[JSON]) -> list[JSON] | None:
        if unstorable(conversation_id):
            return None
        with self.sql_write() as sql:
            if sql.first("SELECT 1 FROM conversations WHERE id = ? AND owner = ?", (conversation_id, owner)) is None:
                return None
            return append_items(sql, conversation_id, items, self._clock())

    def delete_conversation_item(self, owner: str, conversation_id: str, item_id: str) -> bool:
        if unstorable(conversation_id) or unstorable(item_id):
            return False
        with self.sql_write() as sql:
            if sql.first("SELECT 1 FROM conversations WHERE id = ? AND owner = ?" + self.for_update,
                         (conversation_id, owner)) is None:
                return False
            freed = sql.rows("DELETE FROM conversation_items WHERE conversation_id = ? AND item_id = ? "
                             "RETURNING bytes", (conversation_id, item_id))
            if not freed:
                return False
            sql.run("UPDATE conversations SET bytes = bytes - ?, updated_at = ? WHERE id = ?",
                    (sum(r["bytes"] for r in freed), self._clock(), conversation_id))
            return True

    def get_conversation(self, owner: str, conversation_id: str) -> ConversationRecord | None:
        if unstorable(conversation_id):
            return None
        with self.sql_single() as sql:
            row = sql.first("SELECT * FROM conversations WHERE id = ? AND owner = ?", (conversation_id, owner))
        return None if row is None else conversation_record(row)

    def delete_conversation(self, owner: str, conversation_id: str) -> bool:
        if unstorable(conversation_id):
            return False
        with self.sql_write() as sql:
            return sql.run("DELETE FROM conversations WHERE id = ? AND owner = ?", (conversation_id, owner)) == 1

    def list_conversation_items(self, owner: str, conversation_id: str, *, after: str | None = None,
                                limit: int = 20, order: Order = "desc") -> Page | None:
        check_page_args(limit, order)
        if unstorable(conversation_id):
            return None
        with self.sql_read() as sql:
            if sql.first("SELECT 1 FROM conversations WHERE id = ? AND owner = ?", (conversation_id, owner)) is None:
                return None
            return page(sql, "conversation_items WHERE conversation_id = ?", (conversation_id,),
                        after=after, limit=limit, order=order)

    def conversation_items(self, owner: str, conversation_id: str) -> list[JSON] | None:
        if unstorable(conversation_id):
            return None
        with self.sql_read() as sql:
            if sql.first("SELECT 1 FROM conversations WHERE id = ? AND owner = ?", (conversation_id, owner)) is None:
                return None
            rows = sql.rows("SELECT body FROM conversation_items WHERE conversation_id = ? ORDER BY position",
                            (conversation_id,))
        return [json.loads(r["body"]) for r in rows]

    @contextmanager
    def conversation_item_pages(self, owner: str, conversation_id: str, *,
                                page_bytes: int = HISTORY_PAGE_BYTES) -> Iterator[Iterator[ItemPage] | None]:
        if unstorable(conversation_id):
            yield None
            return
        with self.sql_snapshot() as sql:
            if sql.first("SELECT 1 FROM conversations WHERE id = ? AND owner = ?", (conversation_id, owner)) is None:
                yield None
                return
            # Each item's size as it was written (``bytes``), not its body's:
            # the sizes are read without the bodies.
            yield item_pages(sql, "conversation_items WHERE conversation_id = ?", (conversation_id,),
                             size="bytes", page_bytes=page_bytes)

    def get_conversation_item(self, owner: str, conversation_id: str, item_id: str) -> JSON | None:
        if unstorable(conversation_id) or unstorable(item_id):
            return None
        with self.sql_single() as sql:
            row = sql.first(
                "SELECT i.body FROM conversation_items i "
                "JOIN conversations c ON c.id = i.conversation_id "
                "WHERE i.conversation_id = ? AND c.owner = ? AND i.item_id = ? "
                "ORDER BY i.position DESC LIMIT 1",
                (conversation_id, owner, item_id),
            )
        return None if row is None else dict(json.loads(row["body"]))


# Item ids looked up per statement when appending (``_held``).
_IDS_PER_READ = 256


def append_items(sql: Sql, conversation_id: str, items: Sequence[JSON], now: float, *,
                 renew_taken: bool = False) -> list[JSON]:
    """Append ``items`` (ids assigned where missing). Ids stay unique within
    a conversation, as its paging resumes after an id: one it already holds,
    or one ``items`` repeats, is ``DuplicateItem`` (a client's choice), or
    with ``renew_taken`` is replaced by a new one (a turn's items: what the
    model saw is kept, at its place, under an id of its own)."""
    stored = ensure_item_ids(items)
    held = _held(sql, conversation_id, [item["id"] for item in stored])
    seen: set[str] = set()
    for index, item in enumerate(stored):
        if item["id"] in held or item["id"] in seen:
            if not renew_taken:
                raise DuplicateItem(index, item["id"], repeated=item["id"] in seen)
            item["id"] = new_item_id(item)
        seen.add(item["id"])
    bodies = [dumps(item) for item in stored]
    # Reserve the positions in one statement: concurrent appends to one
    # conversation get disjoint ranges.
    end = sql.returning("UPDATE conversations SET next_position = next_position + ?, bytes = bytes + ?, "
                    "updated_at = ? WHERE id = ? RETURNING next_position",
                    (len(stored), sum(size(b) for b in bodies), now, conversation_id))
    assert end is not None  # the caller checked the conversation exists
    start = end["next_position"] - len(stored)
    sql.many("INSERT INTO conversation_items (conversation_id, position, item_id, body, bytes) "
             "VALUES (?, ?, ?, ?, ?)",
             [(conversation_id, start + offset, item["id"], body, size(body))
              for offset, (item, body) in enumerate(zip(stored, bodies, strict=True))])
    return stored


def _held(sql: Sql, conversation_id: str, ids: list[str]) -> set[str]:
    """Which of ``ids`` the conversation already holds."""
    held: set[str] = set()
    unique = list(dict.fromkeys(ids))
    for start in range(0, len(unique), _IDS_PER_READ):
        chunk = unique[start:start + _IDS_PER_READ]
        held.update(row["item_id"] for row in sql.rows(
            f"SELECT item_id FROM conversation_items WHERE conversation_id = ? AND item_id IN {in_list(chunk)}",
            (conversation_id, *chunk)))
    return held
