"""The one store interface every handler uses, and the types it speaks.

Handlers depend on ``Store`` only, so the SQLite and PostgreSQL backends
(and any other) serve them alike. The store is a pure data layer: it
knows nothing of HTTP or dialects. Payloads (responses, items, requests,
events) are the dicts the dialect layer builds; the store keeps them as JSON
and gives back equal dicts.

Ownership: every row belongs to an ``owner`` (an opaque credential id). A
read, update or delete under another owner behaves exactly like "not found"
(``None`` / ``False``), so a handler maps both to the same 404 and never
reveals that the id exists.

Ids are any text but a NUL (PostgreSQL's text cannot hold one): a lookup
by an id that holds one is "not found" in every backend (``unstorable``),
and an item id that does is replaced when stored (``ensure_item_ids``).
"""

from __future__ import annotations

import enum
import logging
import secrets
import threading
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import (
    Any,
    Callable,
    Iterator,
    Literal,
    Mapping,
    NamedTuple,
    Protocol,
    Sequence,
    runtime_checkable,
)

from lmspd.core.lifecycle import STATUSES, TERMINAL_STATUSES
from lmspd.core.limits import Retention

JSON = dict[str, Any]
Order = Literal["asc", "desc"]

# The lifecycle's statuses (lmspd.core.lifecycle); a task has a response's.
TASK_STATUSES = STATUSES


def is_terminal(status: str | None) -> bool:
    return status in TERMINAL_STATUSES


# --- instances and notices ---------------------------------------------------

# What a notice is about: "events" (new events, or a terminal status, of the
# task), "cancel" (someone asked the task's instance to cancel it), or
# "resync" (notices may have been lost, e.g. after a reconnect: re-check all;
# the task id is then "").
NoticeKind = Literal["events", "cancel", "resync"]
# Called from a store thread, never the event loop's: hand over, do not block.
NoticeCallback = Callable[[NoticeKind, str], None]

_notice_log = logging.getLogger("lmspd.store")


def new_instance_id() -> str:
    return f"inst_{secrets.token_hex(8)}"


class Notices:
    """The callbacks ``Store.listen`` registered, called after a commit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callbacks: list[NoticeCallback] = []

    def add(self, callback: NoticeCallback) -> Callable[[], None]:
        with self._lock:
            self._callbacks.append(callback)

        def remove() -> None:
            with self._lock:
                if callback in self._callbacks:
                    self._callbacks.remove(callback)

        return remove

    def send(self, kind: NoticeKind, task_id: str) -> None:
        with self._lock:
            callbacks = list(self._callbacks)
        for callback in callbacks:
            try:
                callback(kind, task_id)
            except Exception:  # a listener's bug must not fail the write that committed
                _notice_log.exception("store notice callback failed")


# --- errors ---------------------------------------------------------------


class StoreError(Exception):
    """Base class; a handler that sees a bare ``StoreError`` has a bug or a broken disk."""


class NotFound(StoreError):
    """Raised only by owner-less internal calls (``append_event``); owner-scoped
    calls return ``None``/``False`` instead."""


class Duplicate(StoreError):
    """An id that must be new already exists (ids are server-generated, so: a bug)."""


class DuplicateItem(StoreError, ValueError):
    """A client-chosen item id that its conversation already holds, or that
    the list it came in repeats (maps to 400 naming ``items[index].id``):
    item ids are unique within a conversation, as its paging needs."""

    def __init__(self, index: int, item_id: str, repeated: bool) -> None:
        super().__init__(f"item {index} has id {item_id!r}, which "
                         + ("an earlier item in the list has too" if repeated else "the conversation already holds"))
        self.index = index
        self.item_id = item_id
        self.repeated = repeated


class InvalidCursor(StoreError, ValueError):
    """A pagination ``after`` id that is not in the list (maps to 400)."""

    def __init__(self, after: str) -> None:
        super().__init__(f"no item with id {after!r} in this list")
        self.after = after


class SequenceError(StoreError, ValueError):
    """An event whose ``seq`` does not strictly increase the task's log."""


class TaskFinished(StoreError):
    """An event appended to a task that already reached a terminal status.

    A runner that sees this should stop: someone (cancel, recovery) has
    already closed the log with a terminal event.
    """


class EventsExpired(StoreError):
    """Events the client asked for were pruned (maps to 410 ``event_history_expired``)."""

    def __init__(self, task_id: str, after_seq: int, first_retained_seq: int, last_seq: int) -> None:
        super().__init__(
            f"events of task {task_id!r} after {after_seq} are no longer retained; "
            + (f"the earliest retained event is {first_retained_seq}" if first_retained_seq <= last_seq
               else "none is")
        )
        self.task_id = task_id
        self.after_seq = after_seq
        self.first_retained_seq = first_retained_seq
        self.last_seq = last_seq

    @property
    def first_kept(self) -> int | None:
        """The earliest event still kept; ``None`` if the whole log went."""
        return self.first_retained_seq if self.first_retained_seq <= self.last_seq else None


ChainProblem = Literal["missing", "cycle", "too_deep"]


class ChainError(StoreError):
    """The ``previous_response_id`` chain cannot be rebuilt.

    ``problem``: ``missing`` (``response_id`` was deleted, expired or belongs to
    another owner), ``cycle`` or ``too_deep`` (longer than the store's bound).
    A handler maps all three to a 400 naming ``response_id``.
    """

    def __init__(self, response_id: str, problem: ChainProblem, message: str) -> None:
        super().__init__(message)
        self.response_id = response_id
        self.problem = problem


class SchemaTooNew(StoreError):
    """The database was written by a newer lmspd; refusing beats corrupting it."""


# --- configuration --------------------------------------------------------

# Retention (how long and how much is kept) and the instance lease are
# bounds like any other: lmspd.core.limits.

# --- records --------------------------------------------------------------


class Page(NamedTuple):
    items: list[JSON]
    has_more: bool


class ChainLink(NamedTuple):
    """One stored response of a ``previous_response_id`` chain."""

    input_items: list[JSON]
    output_items: list[JSON]


# About how much stored item JSON one page of ``conversation_item_pages`` /
# ``response_chain_pages`` holds (a larger item is a page of its own).
HISTORY_PAGE_BYTES = 1024 * 1024


class ItemPage(NamedTuple):
    """Consecutive stored items of one list: a conversation's items, or one
    chain link's input or output items."""

    # The list's response in the chain, root 0 (a conversation: 0).
    link: int
    # A conversation's items are "input".
    kind: Literal["input", "output"]
    # The index of ``items[0]`` in its list.
    start: int
    items: list[JSON]


class ChainPages(NamedTuple):
    """What ``response_chain_pages`` reads: the chain's length and the
    status of the response it ends at, then its items as pages."""

    links: int
    status: str | None
    pages: Iterator[ItemPage]


@dataclass(frozen=True)
class ConversationRecord:
    id: str
    owner: str
    created_at: float
    updated_at: float
    metadata: JSON


@dataclass(frozen=True)
class TaskRecord:
    id: str
    owner: str
    status: str
    # What a task's readers need of its request: its ``dialect`` and
    # ``model`` (``tasks.manager.task_request``; kept in columns of their
    # own), never its body, which may be megabytes of tools that a poll of
    # the task would parse each time (``Store.get_task_request`` reads it).
    request: JSON
    result: JSON | None
    error: JSON | None
    response_id: str | None
    created_at: float
    updated_at: float
    finished_at: float | None
    # Highest seq appended so far (0: none yet).
    last_seq: int
    # Events below this seq were pruned; resuming after N needs N + 1 >= this.
    first_retained_seq: int

    @property
    def terminal(self) -> bool:
        return is_terminal(self.status)


class TaskEvent(NamedTuple):
    seq: int
    event: str
    data: JSON


class BeginOutcome(str, enum.Enum):
    NEW = "new"  # the caller owns the key now: run, then finish or abandon
    REPLAY = "replay"  # finished before: send the stored reply
    IN_PROGRESS = "in_progress"  # another attempt is running: 409 + Retry-After
    CONFLICT = "conflict"  # same key, different request: 422 idempotency_conflict


@dataclass(frozen=True)
class IdempotencyBegin:
    outcome: BeginOutcome
    # Set only for REPLAY.
    status_code: int | None = None
    body: bytes | None = None
    headers: dict[str, str] | None = None


# (task after it was marked failed, the seq the event must use) -> (event name, data)
TerminalEventBuilder = Callable[[TaskRecord, int], tuple[str, JSON]]


class ClosedLog(NamedTuple):
    """What a ``LogCloser`` appends to an interrupted task: ``events`` (name,
    data) get consecutive seqs and the last one must be terminal; ``result``
    (optional) becomes the task's stored result."""

    events: list[tuple[str, JSON]]
    result: JSON | None = None


# (task after it was marked failed, the seq the first closing event must use,
# the task's whole log so far) -> the events that close it. Unlike a
# ``TerminalEventBuilder`` it sees the log, so it can close items the log left
# open (every ``output_item.added`` then has its ``done``).
# One task is not failed: one whose response row was stored with a final
# status (the response's end landed, the task's own terminal write did
# not). The closer then gets the task as it ends: that final ``status``,
# the row's ``error``, and as ``result`` the stored response (OpenAI
# Response JSON, as ``lmspd.history`` stores it); its events end the log
# the way the finished response did, and the task keeps that status.
LogCloser = Callable[[TaskRecord, int, list[TaskEvent]], ClosedLog]


def default_terminal_event(task: TaskRecord, seq: int) -> tuple[str, JSON]:
    """LMSP §6.3 ``response.failed`` closing the log of an interrupted task."""
    return "response.failed", {
        "response_id": task.response_id or task.id,
        "status": "failed",
        "error": task.error,
    }


_ITEM_ID_PREFIX = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "custom_tool_call": "ctc",
    "custom_tool_call_output": "ctco",
    "reasoning": "rs",
    "item_reference": "ref",
}


def ensure_item_ids(items: Sequence[Mapping[str, Any]]) -> list[JSON]:
    """Copies of ``items``, each with an ``id``: input items may arrive without
    one, but listing them pages by item id. A client's id that no store can
    keep (``unstorable``) is replaced too."""
    out: list[JSON] = []
    for item in items:
        copy = dict(item)
        if not isinstance(copy.get("id"), str) or not copy["id"] or unstorable(copy["id"]):
            copy["id"] = new_item_id(copy)
        out.append(copy)
    return out


def unstorable(key: str | None) -> bool:
    """Whether ``key`` (an id, a cursor) holds a NUL, which no stored id
    does: PostgreSQL's text cannot hold one, and ``ensure_item_ids``
    renames a client's item id that does. A lookup by such a key finds
    nothing without asking the database (which would refuse the
    statement), so both backends answer it as they answer an unknown id."""
    return key is not None and "\x00" in key


def new_item_id(item: Mapping[str, Any]) -> str:
    """A fresh id for ``item``, prefixed as its type's ids are."""
    return f"{_ITEM_ID_PREFIX.get(str(item.get('type')), 'item')}_{secrets.token_hex(16)}"


# --- the interface --------------------------------------------------------


@runtime_checkable
class Store(Protocol):
    """Synchronous and short per call; async handlers may call it directly or
    through a worker thread. Timestamps are epoch seconds; a ``None`` time
    means "the store's clock now".

    Instances: each store object is one lmspd instance (``instance_id``),
    which stamps the running rows it writes (tasks, responses, idempotency
    keys) and holds a lease it renews with ``heartbeat``. A ``shared`` store
    (PostgreSQL) serves several instances at once: "interrupted" then means
    "written by an instance whose lease ran out", and ``reap_interrupted``
    runs while serving. An unshared one (SQLite: one process per file)
    treats every running row as interrupted at start.
    """

    retention: Retention
    instance_id: str
    lease_s: float
    shared: bool

    # Instances and notices -------------------------------------------------------

    def heartbeat(self) -> list[str]:
        """Renew this instance's lease; returns the ids of this instance's
        running tasks whose cancel was requested (``request_cancel``), so a
        lost notice still cancels within one heartbeat."""
        ...

    def request_cancel(self, owner: str, task_id: str) -> bool:
        """Ask whichever instance runs the task to cancel it (a ``cancel``
        notice, and a flag ``heartbeat`` reports). ``False`` if not found or
        already terminal."""
        ...

    def release_task(self, task_id: str) -> bool:
        """Give up a running task this instance can no longer write (its
        store writes failed): it counts as interrupted from now on, so the
        next sweep of any instance (or the next start) closes its log."""
        ...

    def close_task(self, task_id: str, error: JSON, *, close_log: LogCloser | None = None) -> TaskRecord | None:
        """End a running task of this instance that its own writer could not
        end (the store refused its events): ``failed`` with ``error``, its
        log closed as a crash's would be (``fail_interrupted_tasks``; a task
        whose response's end was stored ends as that response did). None if
        it has ended already."""
        ...

    def listen(self, callback: NoticeCallback) -> Callable[[], None]:
        """Call ``callback(kind, task_id)`` after each commit that appends a
        task's events or ends it, and for cancel requests: from every
        instance of a shared store, from this one otherwise. Returns a
        function that removes the callback. Notices only say *that*
        something changed; readers read the events themselves, by seq."""
        ...

    # Responses ---------------------------------------------------------------

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
        """Store a new response with its input items; returns the input items
        as stored (ids assigned where missing). ``Duplicate`` if the id exists.
        Output items are read from ``response["output"]``."""
        ...

    def get_response(self, owner: str, response_id: str) -> JSON | None: ...

    def update_response(self, owner: str, response_id: str, response: JSON) -> bool:
        """Replace the stored response object (status changes of a background
        run, the final output). Input items are unchanged."""
        ...

    def delete_response(self, owner: str, response_id: str) -> bool:
        """Remove the response, its items and, for a background response,
        its task and event log, in one transaction. ``False`` if not found."""
        ...

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
        """What a finished turn leaves, in one transaction: the response
        (``put_response`` when ``new``, else ``update_response``; none when
        ``response`` is ``None``) and, when ``conversation_items`` is given,
        those items appended to ``conversation_id``. Both are stored or
        neither is, so a failure never leaves a stored response whose
        conversation lacks it. ``False`` if the conversation was not found
        (the response is stored all the same). An item whose id the
        conversation already holds (an ``item_reference`` to one of its
        items, a client id sent again) is appended under a new id."""
        ...

    def list_input_items(
        self,
        owner: str,
        response_id: str,
        *,
        after: str | None = None,
        limit: int = 20,
        order: Order = "desc",
    ) -> Page | None:
        """``None`` if the response is not found; ``InvalidCursor`` for an
        unknown ``after``."""
        ...

    def response_chain(self, owner: str, response_id: str) -> list[ChainLink] | None:
        """The chain ending at ``response_id``, root first. ``None`` if
        ``response_id`` itself is not found; ``ChainError`` if an ancestor is."""
        ...

    def response_chain_pages(self, owner: str, response_id: str, *,
                             page_bytes: int = HISTORY_PAGE_BYTES) -> AbstractContextManager[ChainPages | None]:
        """``response_chain``'s items as it would give them (root first, each
        response's input then output), in pages of about ``page_bytes`` of
        stored JSON, read from one snapshot as far as the caller iterates:
        what a request expands stops at its bound, whatever is stored.
        Entering it checks the chain (``None``, ``ChainError`` as
        ``response_chain``); the pages are read only inside the block,
        which calls nothing else on the store."""
        ...

    def find_item(self, owner: str, item_id: str) -> JSON | None:
        """A stored input/output/conversation item by id (``item_reference``);
        the most recent one if several share the id."""
        ...

    def fail_interrupted_responses(self, error: JSON) -> list[str]:
        """At start: responses left queued/in_progress become ``failed`` with
        ``error``. Returns their ids."""
        ...

    # Conversations -------------------------------------------------------------

    def create_conversation(
        self,
        owner: str,
        conversation_id: str,
        *,
        metadata: JSON | None = None,
        items: Sequence[JSON] = (),
        created_at: float | None = None,
    ) -> ConversationRecord: ...

    def get_conversation(self, owner: str, conversation_id: str) -> ConversationRecord | None: ...

    def update_conversation(
        self, owner: str, conversation_id: str, metadata: JSON
    ) -> ConversationRecord | None: ...

    def delete_conversation(self, owner: str, conversation_id: str) -> bool: ...

    def append_conversation_items(
        self, owner: str, conversation_id: str, items: Sequence[JSON]
    ) -> list[JSON] | None:
        """Returns the items as stored (ids assigned), ``None`` if not found;
        ``DuplicateItem`` for an id the conversation holds or ``items``
        repeats (``create_conversation`` too)."""
        ...

    def list_conversation_items(
        self,
        owner: str,
        conversation_id: str,
        *,
        after: str | None = None,
        limit: int = 20,
        order: Order = "desc",
    ) -> Page | None: ...

    def conversation_items(self, owner: str, conversation_id: str) -> list[JSON] | None:
        """All items, oldest first."""
        ...

    def conversation_item_pages(
        self, owner: str, conversation_id: str, *, page_bytes: int = HISTORY_PAGE_BYTES
    ) -> AbstractContextManager[Iterator[ItemPage] | None]:
        """``conversation_items`` for building a request's context: oldest
        first, in pages of about ``page_bytes`` of stored JSON, read from
        one snapshot (an append is in it whole or not at all) as far as the
        caller iterates. ``None`` if not found; the pages are read only
        inside the block, which calls nothing else on the store."""
        ...

    def get_conversation_item(
        self, owner: str, conversation_id: str, item_id: str
    ) -> JSON | None: ...

    def delete_conversation_item(self, owner: str, conversation_id: str, item_id: str) -> bool: ...

    # Tasks and their event logs --------------------------------------------------

    def create_task(
        self,
        owner: str,
        task_id: str,
        request: JSON,
        *,
        status: str = "queued",
        response_id: str | None = None,
        created_at: float | None = None,
    ) -> TaskRecord: ...

    def get_task(self, owner: str, task_id: str, *, result: bool = True) -> TaskRecord | None:
        """The task's state, without its request's body (``TaskRecord.request``);
        ``result`` False: without its result either (``None``), for a caller
        that needs its status, dialect or log position alone."""
        ...

    def get_task_request(self, owner: str, task_id: str) -> JSON | None:
        """The request the task was created with, body and all; ``None`` if not found."""
        ...

    def set_task_status(
        self,
        owner: str,
        task_id: str,
        status: str,
        *,
        result: JSON | None = None,
        error: JSON | None = None,
        final_event: tuple[int, str, JSON] | None = None,
    ) -> bool:
        """Move a task on. ``result``/``error`` replace the stored values when
        given. ``final_event`` (seq, name, data) is appended in the same
        transaction, so a log and its status never disagree. ``False`` if the
        task is not found or already terminal (first terminal write wins)."""
        ...

    def append_event(self, task_id: str, seq: int, event: str, data: JSON) -> None:
        """``NotFound``, ``SequenceError`` (seq not above the last one) or
        ``TaskFinished``."""
        ...

    def append_events(self, task_id: str, events: Sequence[tuple[int, str, JSON]]) -> None: ...

    def events_after(
        self, owner: str, task_id: str, after_seq: int = 0, limit: int = 1000
    ) -> list[TaskEvent] | None:
        """Events with seq > ``after_seq``, in order. ``None`` if the task is
        not found; ``EventsExpired`` if any of them were pruned."""
        ...

    def first_retained_seq(self, owner: str, task_id: str) -> int | None: ...

    def fail_interrupted_tasks(
        self,
        message: str,
        *,
        terminal_event: TerminalEventBuilder | None = None,
        close_log: LogCloser | None = None,
    ) -> list[TaskRecord]:
        """At start: every queued/in_progress task becomes ``failed`` with
        error ``{"code": "server_restarted", "message": message}`` and its log
        is closed by ``close_log(task, next_seq, log)`` when given, else by
        ``terminal_event(task, next_seq)`` (default:
        ``default_terminal_event``). Returns the failed tasks."""
        ...

    # Idempotency keys ----------------------------------------------------------------

    def idempotency_begin(self, owner: str, key: str, request_hash: str) -> IdempotencyBegin: ...

    def idempotency_finish(
        self, owner: str, key: str, status_code: int, body: bytes, headers: Mapping[str, str]
    ) -> bool: ...

    def idempotency_abandon(self, owner: str, key: str) -> bool: ...

    def abandon_interrupted_idempotency(self) -> int:
        """At start: drop keys whose attempt died with the previous process,
        so a retry runs instead of getting 409 for a day."""
        ...

    # Maintenance -------------------------------------------------------------------

    def prune(self, now: float | None = None) -> dict[str, int]: ...

    def stats(self) -> dict[str, int]: ...

    def close(self) -> None: ...
