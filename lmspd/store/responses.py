"""Stored responses, read the same in both SQL backends (writing one, with
its items and chain, stays in each backend: the reservation SQL differs)."""

from __future__ import annotations

import json

from lmspd.store.base import JSON, Order, Page
from lmspd.store.paging import check_page_args, page
from lmspd.store.sql import SqlBackend

__all__ = ["ResponseQueries"]


class ResponseQueries(SqlBackend):
    def get_response(self, owner: str, response_id: str) -> JSON | None:
        with self.sql_single() as sql:
            row = sql.first("SELECT body FROM responses WHERE id = ? AND owner = ?", (response_id, owner))
        return None if row is None else dict(json.loads(row["body"]))

    def delete_response(self, owner: str, response_id: str) -> bool:
        with self.sql_write() as sql:
            return sql.run("DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner)) == 1

    def list_input_items(self, owner: str, response_id: str, *, after: str | None = None, limit: int = 20,
                         order: Order = "desc") -> Page | None:
        check_page_args(limit, order)
        with self.sql_read() as sql:
            if sql.first("SELECT 1 FROM responses WHERE id = ? AND owner = ?", (response_id, owner)) is None:
                return None
            return page(sql, "response_items WHERE response_id = ? AND kind = 'input'", (response_id,),
                        after=after, limit=limit, order=order)

    def find_item(self, owner: str, item_id: str) -> JSON | None:
        """The newest stored item with this id, from a response or a conversation."""
        with self.sql_read() as sql:
            row = sql.first(
                """SELECT body FROM (
                       SELECT i.body, r.updated_at AS t FROM response_items i
                         JOIN responses r ON r.id = i.response_id
                        WHERE i.item_id = ? AND r.owner = ?
                       UNION ALL
                       SELECT i.body, c.updated_at AS t FROM conversation_items i
                         JOIN conversations c ON c.id = i.conversation_id
                        WHERE i.item_id = ? AND c.owner = ?
                   ) AS found ORDER BY t DESC LIMIT 1""",
                (item_id, owner, item_id, owner),
            )
        return None if row is None else dict(json.loads(row["body"]))
