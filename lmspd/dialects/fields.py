"""What a request calls the neutral fields the core and the engines name.

An engine refuses a conversation, not a request: it says "the call id of
item 3" (``(RequestField.ITEMS, 3, "call_id")``), and the dialect that decoded the
request says where that is on its wire — ``input[1].call_id`` in a
Responses request that continues two stored items, or
``messages[2].content[0].tool_use_id`` in a Messages request whose second
message held two blocks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lmspd.core.conversation import Item
from lmspd.core.errors import ApiError, FieldPath, RequestField, join_path

__all__ = ["FieldNames", "responses_items"]


@dataclass(frozen=True)
class FieldNames:
    """One request's names for the neutral fields."""

    # A field's name in this dialect (a field not listed keeps its neutral name).
    names: Mapping[RequestField, str]
    # The wire path of each of the conversation's items; ``None`` for an
    # item the request did not send (stored history).
    items: Sequence[str | None] = ()

    def param(self, path: FieldPath) -> str:
        head, rest = self.names.get(path[0], path[0].value), path[1:]
        if path[0] is RequestField.ITEMS and rest and isinstance(rest[0], int):
            index = rest[0]
            item = self.items[index] if 0 <= index < len(self.items) else None
            # An item the request did not send: the list is all it can name.
            head, rest = (item, rest[1:]) if item is not None else (head, ())
        return join_path(head, rest)

    def name(self, exc: ApiError) -> ApiError:
        """``exc`` with its neutral path (if it has one) in this request's words."""
        if exc.path is not None:
            exc.named(self.param(exc.path))
        return exc


def responses_items(items: Sequence[Item], input_items: Sequence[Item], field: str = "input") -> list[str | None]:
    """Item paths in a Responses request: the conversation is its stored
    history, then its own ``input`` one item an entry. Nothing is named if
    the conversation is not that (a compacted window)."""
    offset = len(items) - len(input_items)
    if offset < 0 or any(a is not b for a, b in zip(items[offset:], input_items, strict=True)):
        return []
    return [None] * offset + [f"{field}[{i}]" for i in range(len(input_items))]
