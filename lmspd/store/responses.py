"""Stored responses, written and read the same in both SQL backends
(closing the ones a crash left running differs: only the shared store asks
whose lease ran out)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from lmspd.store.base import (
    HISTORY_PAGE_BYTES,
    JSON,
    ChainError,
    ChainLink,
    ChainPages,
    Duplicate,
    ItemPage,
    Order,
    Page,
    ensure_item_ids,
    unstorable,
)
from lmspd.store.conversations import append_items
from lmspd.store.paging import check_page_args, item_pages, page
from lmspd.store.sql import Row, Sql, SqlBackend, dumps, in_list, size

__all__ = ["ResponseQueries"]

# The most responses whose items one statement of ``response_chain_pages`` reads.
_LINKS_PER_READ = 512


class ResponseQueries(SqlBackend):
    def put_response(
        self,
        owner: str,
        response_id: str,
        response: JSON,
        input_items: Sequence[JSON],
        *,
        previous_response_id: str | None = None,
        conversation_id: str | None = None,
        created_at: float | None = None,
    ) -> list[JSON]:
        with self.sql_write() as sql:
            return self._put_in(sql, owner, response_id, response, input_items,
                                previous_response_id=previous_response_id, conversation_id=conversation_id,
                                created_at=created_at)

    def _put_in(self, sql: Sql, owner: str, response_id: str, response: JSON, input_items: Sequence[JSON], *,
                previous_response_id: str | None, conversation_id: str | None,
                created_at: float | None) -> list[JSON]:
        items = ensure_item_ids(input_items)
        body = dumps(response)
        item_rows = [(response_id, pos, item["id"], dumps(item)) for pos, item in enumerate(items)]
        input_bytes = sum(size(row[3]) for row in item_rows)
        now = self._clock()
        created = self._now(created_at)
        inserted = sql.run(
            "INSERT INTO responses (id, owner, status, previous_response_id, conversation_id, created_at, "
            "updated_at, body, bytes, instance_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0, ?) "
            "ON CONFLICT (id) DO NOTHING",
            (response_id, owner, response.get("status"), previous_response_id, conversation_id, created, now,
             body, self.instance_id),
        )
        if not inserted:
            raise Duplicate(f"response {response_id!r} already exists")
        sql.many("INSERT INTO response_items (response_id, kind, position, item_id, body) "
                 "VALUES (?, 'input', ?, ?, ?)", item_rows)
        output_bytes = _insert_output_items(sql, response_id, response)
        sql.run("UPDATE responses SET bytes = ? WHERE id = ?",
                (size(body) + input_bytes + output_bytes, response_id))
        return items

    def update_response(self, owner: str, response_id: str, response: JSON) -> bool:
        with self.sql_write() as sql:
            return self._update_in(sql, owner, response_id, response)

    def _update_in(self, sql: Sql, owner: str, response_id: str, response: JSON) -> bool:
        body = dumps(response)
        if sql.first("SELECT 1 FROM responses WHERE id = ? AND owner = ?" + self.for_update,
                     (response_id, owner)) is None:
            return False
        input_bytes = sql.first(
            f"SELECT COALESCE(SUM({self.octets('body')}), 0) AS n FROM response_items "
            "WHERE response_id = ? AND kind = 'input'", (response_id,))
        assert input_bytes is not None  # an aggregate: always one row
        sql.run("DELETE FROM response_items WHERE response_id = ? AND kind = 'output'", (response_id,))
        output_bytes = _insert_output_items(sql, response_id, response)
        sql.run("UPDATE responses SET body = ?, status = ?, updated_at = ?, bytes = ? WHERE id = ?",
                (body, response.get("status"), self._clock(),
                 size(body) + int(input_bytes["n"]) + output_bytes, response_id))
        return True

    def end_turn(
        self,
        owner: str,
        response_id: str,
        response: JSON | None,
        input_items: Sequence[JSON],
        *,
        new: bool,
        previous_response_id: str | None = None,
        conversation_id: str | None = None,
        created_at: float | None = None,
        conversation_items: Sequence[JSON] | None = None,
    ) -> bool:
        # Safe to try again after a commit that landed but reported an error
        # (a connection lost during COMMIT): the response is then updated,
        # not inserted twice, and items already appended are not appended
        # again (the turn's items keep their ids across tries).
        with self.sql_write() as sql:
            if response is not None:
                if new and sql.first("SELECT 1 FROM responses WHERE id = ? AND owner = ?",
                                     (response_id, owner)) is None:
                    self._put_in(sql, owner, response_id, response, input_items,
                                 previous_response_id=previous_response_id, conversation_id=conversation_id,
                                 created_at=created_at)
                else:
                    self._update_in(sql, owner, response_id, response)
            if conversation_items is None or conversation_id is None:
                return True
            # Locked: a conversation deleted meanwhile is gone before this
            # append, or after it, never half-way.
            if sql.first("SELECT 1 FROM conversations WHERE id = ? AND owner = ?" + self.for_update,
                         (conversation_id, owner)) is None:
                return False  # deleted meanwhile: the response is stored all the same
            items = ensure_item_ids(conversation_items)
            if items and self._landed(sql, conversation_id, items[-1]):
                return True  # this turn's items are there already: an earlier try landed
            append_items(sql, conversation_id, items, self._clock(), renew_taken=True)
            return True

    @staticmethod
    def _landed(sql: Sql, conversation_id: str, last: JSON) -> bool:
        """Whether the turn whose last item is ``last`` was appended already
        (a commit that landed but reported an error): that item is there as
        it is. One of its id with another body is an item the turn
        referenced or sent again, which ``append_items`` renames."""
        row = sql.first("SELECT body FROM conversation_items WHERE conversation_id = ? AND item_id = ? "
                        "ORDER BY position DESC LIMIT 1", (conversation_id, last["id"]))
        return row is not None and json.loads(row["body"]) == last

    def get_response(self, owner: str, response_id: str) -> JSON | None:
        if unstorable(response_id):
            return None
        with self.sql_single() as sql:
            row = sql.first("SELECT body FROM responses WHERE id = ? AND owner = ?", (response_id, owner))
        return None if row is None else dict(json.loads(row["body"]))

    def delete_response(self, owner: str, response_id: str) -> bool:
        if unstorable(response_id):
            return False
        with self.sql_write() as sql:
            if sql.run("DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner)) != 1:
                return False
            # A background response's task has its id and keeps its request
            # and result; its event log goes with it (ON DELETE CASCADE).
            sql.run("DELETE FROM tasks WHERE id = ? AND owner = ?", (response_id, owner))
            return True

    def list_input_items(self, owner: str, response_id: str, *, after: str | None = None, limit: int = 20,
                         order: Order = "desc") -> Page | None:
        check_page_args(limit, order)
        if unstorable(response_id):
            return None
        with self.sql_read() as sql:
            if sql.first("SELECT 1 FROM responses WHERE id = ? AND owner = ?", (response_id, owner)) is None:
                return None
            return page(sql, "response_items WHERE response_id = ? AND kind = 'input'", (response_id,),
                        after=after, limit=limit, order=order)

    def response_chain(self, owner: str, response_id: str) -> list[ChainLink] | None:
        if unstorable(response_id):
            return None
        with self.sql_read() as sql:
            rows = self._chain(sql, owner, response_id)
            if rows is None:
                return None
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

    @contextmanager
    def response_chain_pages(self, owner: str, response_id: str, *,
                             page_bytes: int = HISTORY_PAGE_BYTES) -> Iterator[ChainPages | None]:
        if unstorable(response_id):
            yield None
            return
        with self.sql_snapshot() as sql:
            rows = self._chain(sql, owner, response_id)
            if rows is None:
                yield None
                return
            yield ChainPages(len(rows), rows[0]["status"],
                             self._chain_pages(sql, list(reversed(rows)), page_bytes))

    def _chain_pages(self, sql: Sql, links: list[Row], page_bytes: int) -> Iterator[ItemPage]:
        """The items of ``links`` (root first) in pages. Links whose stored
        bytes (their body, input and output: more than their items) fit in
        a page together are read by one statement; a larger one is paged
        on its own, item by item."""
        group: list[int] = []
        total = 0
        for index, link in enumerate(links):
            if group and (total + link["bytes"] > page_bytes or len(group) == _LINKS_PER_READ):
                yield from _links_items(sql, links, group)
                group, total = [], 0
            if link["bytes"] <= page_bytes:
                group.append(index)
                total += link["bytes"]
                continue
            # A link larger than a page, item by item. Response items keep no
            # size column: measuring one (SQLite's LENGTH of the blob) walks
            # the body once more, time but no Python memory.
            for kind in ("input", "output"):
                yield from item_pages(sql, "response_items WHERE response_id = ? AND kind = ?", (link["id"], kind),
                                      size=self.octets("body"), page_bytes=page_bytes, link=index, kind=kind)
        if group:
            yield from _links_items(sql, links, group)

    def _chain(self, sql: Sql, owner: str, response_id: str) -> list[Row] | None:
        """The chain ending at ``response_id``, newest first: each
        response's ``id``, ``status`` and stored ``bytes``; ``None`` or
        ``ChainError`` as ``response_chain``."""
        depth_bound = self.max_chain_depth
        # The depth bound also stops a (theoretical) cycle; it shows up as
        # a repeated id below.
        rows = sql.rows(
            """WITH RECURSIVE chain(id, prev, depth, status, bytes) AS (
                   SELECT id, previous_response_id, 1, status, bytes FROM responses
                    WHERE id = ? AND owner = ?
                   UNION ALL
                   SELECT r.id, r.previous_response_id, chain.depth + 1, r.status, r.bytes
                     FROM responses r JOIN chain ON r.id = chain.prev
                    WHERE r.owner = ? AND chain.depth < ?
               )
               SELECT id, prev, depth, status, bytes FROM chain ORDER BY depth""",
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
        return rows

    def find_item(self, owner: str, item_id: str) -> JSON | None:
        """The newest stored item with this id, from a response or a conversation."""
        if unstorable(item_id):
            return None
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


def _links_items(sql: Sql, links: list[Row], group: list[int]) -> Iterator[ItemPage]:
    """The items of the chain's ``links`` at ``group`` (small ones), read by one statement."""
    ids = [links[index]["id"] for index in group]
    by_id: dict[str, tuple[list[JSON], list[JSON]]] = {i: ([], []) for i in ids}
    for item in sql.rows(f"SELECT response_id, kind, body FROM response_items WHERE response_id IN {in_list(ids)} "
                         "ORDER BY response_id, kind, position", ids):
        inputs, outputs = by_id[item["response_id"]]
        (inputs if item["kind"] == "input" else outputs).append(json.loads(item["body"]))
    for index, rid in zip(group, ids, strict=True):
        inputs, outputs = by_id[rid]
        if inputs:
            yield ItemPage(index, "input", 0, inputs)
        if outputs:
            yield ItemPage(index, "output", 0, outputs)


def _insert_output_items(sql: Sql, response_id: str, response: JSON) -> int:
    """The response's output items as rows; their size in bytes."""
    output = response.get("output")
    if not isinstance(output, list):
        return 0
    rows = []
    total = 0
    for position, item in enumerate(output):
        body = dumps(item)
        total += size(body)
        item_id = item.get("id") if isinstance(item, dict) else None
        rows.append((response_id, position, item_id if isinstance(item_id, str) else None, body))
    sql.many("INSERT INTO response_items (response_id, kind, position, item_id, body) "
             "VALUES (?, 'output', ?, ?, ?)", rows)
    return total
