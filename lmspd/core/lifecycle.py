"""A response's lifecycle named once (a task is a response run in the
background, so it shares it): its statuses, which of them are final, and
the names of the lifecycle steps that end a stream.

The engine-side counterpart, the events that end a generation (``Finished``,
``Failed``), is ``lmspd.core.events.TERMINAL_EVENTS``.
"""

from __future__ import annotations

__all__ = ["ACTIVE_STATUSES", "STATUSES", "TERMINAL_EVENT_NAMES", "TERMINAL_STATUSES"]

TERMINAL_STATUSES = frozenset({"completed", "incomplete", "failed", "cancelled"})
# Responses and tasks in these states are pinned: the store never prunes them.
ACTIVE_STATUSES = frozenset({"queued", "in_progress"})
STATUSES = ACTIVE_STATUSES | TERMINAL_STATUSES

# The stream session's terminal steps (also the event names a task's log
# stores, whatever the dialect writes on the wire).
TERMINAL_EVENT_NAMES = frozenset(f"response.{status}" for status in TERMINAL_STATUSES)
