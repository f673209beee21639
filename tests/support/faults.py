"""Store faults injected for one write: what a busy or failing store does to
the writes that keep a finished result."""

from __future__ import annotations

from typing import Any

from lmspd.store.sql import Sql


class FailingOnce:
    """``Sql.many`` raises ``error`` for the next ``times`` batch inserts
    whose statement holds ``needle`` (a write both the response's own
    methods and one-transaction turn writes go through)."""

    def __init__(self, monkeypatch: Any, needle: str, error: Exception, times: int = 1) -> None:
        self.left = times
        original = Sql.many

        def many(sql: Sql, statement: str, rows: Any) -> None:
            if self.left and needle in statement and rows:
                self.left -= 1
                raise error
            original(sql, statement, rows)

        monkeypatch.setattr(Sql, "many", many)
