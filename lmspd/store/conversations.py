"""Conversations and their items, read the same in both SQL backends
(appending items stays in each backend: reserving positions differs)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from lmspd.store.base import JSON, ConversationRecord, Order, Page
from lmspd.store.paging import check_page_args, page
from lmspd.store.sql import SqlBackend

__all__ = ["ConversationQueries", "conversation_record"]


def conversation_record(row: Mapping[str, Any]) -> ConversationRecord:
    return ConversationRecord(
        id=row["id"],
        owner=row["owner"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        metadata=json.loads(row["metadata"]),
    )


class ConversationQueries(SqlBackend):
    def get_conversation(self, owner: str, conversation_id: str) -> ConversationRecord | None:
        with self.sql_single() as sql:
            row = sql.first("SELECT * FROM conversations WHERE id = ? AND owner = ?", (conversation_id, owner))
        return None if row is None else conversation_record(row)

    def delete_conversation(self, owner: str, conversation_id: str) -> bool:
        with self.sql_write() as sql:
            return sql.run("DELETE FROM conversations WHERE id = ? AND owner = ?", (conversation_id, owner)) == 1

    def list_conversation_items(self, owner: str, conversation_id: str, *, after: str | None = None,
                                limit: int = 20, order: Order = "desc") -> Page | None:
        check_page_args(limit, order)
        with self.sql_read() as sql:
            if sql.first("SELECT 1 FROM conversations WHERE id = ? AND owner = ?", (conversation_id, owner)) is None:
                return None
            return page(sql, "conversation_items WHERE conversation_id = ?", (conversation_id,),
                        after=after, limit=limit, order=order)

    def conversation_items(self, owner: str, conversation_id: str) -> list[JSON] | None:
        with self.sql_read() as sql:
            if sql.first("SELECT 1 FROM conversations WHERE id = ? AND owner = ?", (conversation_id, owner)) is None:
                return None
            rows = sql.rows("SELECT body FROM conversation_items WHERE conversation_id = ? ORDER BY position",
                            (conversation_id,))
        return [json.loads(r["body"]) for r in rows]

    def get_conversation_item(self, owner: str, conversation_id: str, item_id: str) -> JSON | None:
        with self.sql_single() as sql:
            row = sql.first(
                "SELECT i.body FROM conversation_items i "
                "JOIN conversations c ON c.id = i.conversation_id "
                "WHERE i.conversation_id = ? AND c.owner = ? AND i.item_id = ? "
                "ORDER BY i.position DESC LIMIT 1",
                (conversation_id, owner, item_id),
            )
        return None if row is None else dict(json.loads(row["body"]))
