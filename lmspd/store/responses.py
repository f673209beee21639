"""Stored responses, read the same in both SQL backends (writing one, with
its items and chain, stays in each backend: the reservation SQL differs)."""

from __future__ import annotations

import json

from lmspd.store.base import JSON, ChainError, ChainLink, Order, Page
from lmspd.store.paging import check_page_args, page
from lmspd.store.sql import SqlBackend, in_list

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

    def response_chain(self, owner: str, response_id: str) -> list[ChainLink] | None:
        depth_bound = self.max_chain_depth
        with self.sql_read() as sql:
            # The depth bound also stops a (theoretical) cycle; it shows up as
            # a repeated id below.
            rows = sql.rows(
                """WITH RECURSIVE chain(id, prev, depth) AS (
                       SELECT id, previous_response_id, 1 FROM responses
                        WHERE id = ? AND owner = ?
                       UNION ALL
                       SELECT r.id, r.previous_response_id, chain.depth + 1
                         FROM responses r JOIN chain ON r.id = chain.prev
                        WHERE r.owner = ? AND chain.depth < ?
                   )
                   SELECT id, prev, depth FROM chain ORDER BY depth""",
                (response_id, owner, owner, depth_bound),
            )
            if not rows:
                return None
            seen: set[str] = set()
            for row in rows:
                if row["id"] in seen:
                    raise ChainError(
                        row["id"], "cycle",
                        f"previous_response_id chain of {response_id!r} loops at {row['id']!r}",
                    )
                seen.add(row["id"])
            last = rows[-1]
            if last["prev"] is not None:
                if last["depth"] >= depth_bound:
                    raise ChainError(
                        last["id"], "too_deep",
                        f"previous_response_id chain of {response_id!r} is longer than "
                        f"{depth_bound} responses",
                    )
                raise ChainError(
                    last["prev"], "missing",
                    f"previous response {last['prev']!r} in the chain of {response_id!r} "
                    "was not found (deleted or expired)",
                )
            ids = [row["id"] for row in rows]
            by_id: dict[str, tuple[list[JSON], list[JSON]]] = {i: ([], []) for i in ids}
            # One query for the whole chain's items, not one per link (the
            # depth bound keeps the id list within both engines' limits).
            for item in sql.rows(
                f"SELECT response_id, kind, body FROM response_items WHERE response_id IN {in_list(ids)} "
                "ORDER BY response_id, kind, position",
                ids,
            ):
                inputs, outputs = by_id[item["response_id"]]
                (inputs if item["kind"] == "input" else outputs).append(json.loads(item["body"]))
        return [ChainLink(*by_id[i]) for i in reversed(ids)]

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
