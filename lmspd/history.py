"""The stored state around one response: what a request continues from
(``previous_response_id`` chains, conversations, ``item_reference``), and
what it leaves behind (the stored response, conversation items).

Items are kept as OpenAI Responses item JSON (``input_item_json`` /
``item_json``), the richest of the shapes lmspd speaks; both dialects decode
them back with the same lenient item reader they use for client input, and
response bodies are OpenAI Response objects that either dialect can render
(``openai_responses.state_from_json``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from lmspd.core import compaction
from lmspd.core.conversation import Item
from lmspd.core.errors import ApiError, invalid
from lmspd.core.limits import RequestLimits
from lmspd.core.sealing import Sealer
from lmspd.dialects import openai_responses
from lmspd.dialects.responses_items import (
    ADDITIONAL_TOOLS,
    Expansion,
    additional_tools,
    additional_tools_items,
    decode_items,
)
from lmspd.store.base import JSON, ChainError, Duplicate, ItemPage, Store, ensure_item_ids
from lmspd.streaming.session import ResponseState

log = logging.getLogger("lmspd.history")

# Stored items were bounded when they arrived; reading them back must not
# trip a request bound that has since been lowered.
_STORED = RequestLimits(max_input_items=2**31, max_content_parts=2**31, max_text_chars=2**62,
                        max_expanded_chars=2**62, max_expanded_items=2**31)

# Statuses whose output a conversation keeps (a failed or cancelled turn
# leaves the conversation as it was, as OpenAI does).
_CONVERSATION_STATUSES = frozenset({"completed", "incomplete"})


def stored_items(items: list[JSON], sealer: Sealer | None = None, owner: str = "local",
                 expansion: Expansion | None = None, where: str = "stored items", start: int = 0) -> list[Item]:
    """Stored item JSON back as neutral items; compaction items expand with
    ``sealer`` (without one, as the summary-less item they were stored as
    cannot be read: the caller lists, never renders). ``expansion``: a
    request's bound, which stops the reading once it is passed (``where``
    names what the request expanded). ``start``: the index of ``items[0]``
    in the stored list they are a page of (what an error names)."""

    def open_compaction(blob: str, item_id: str | None, where: str) -> Item:
        if sealer is None:
            return compaction.summary_message("", blob, item_id)
        return compaction.expand(sealer, blob, where, item_id, owner)

    try:
        # additional_tools items declare tools, no part of the window:
        # ``StoredContext.declared_tools`` reads them.
        return decode_items(items, _STORED, path=where, open_compaction=open_compaction, expansion=expansion,
                            additional_tools=True)
    except ApiError as exc:
        if start:
            _renumber(exc, where, start)
        if where != "stored items" and exc.param is not None and exc.param.startswith(where):
            # The message says which stored item; the param is the field the client sent.
            exc.param = where
        raise


def _renumber(exc: ApiError, where: str, start: int) -> None:
    """``exc``, raised about a page of a stored list, naming its items by
    their places in the whole list (``where[3]`` of a page that starts at 40
    is ``where[43]``)."""
    item = re.compile(re.escape(where) + r"\[(\d+)\]")

    def shift(found: re.Match[str]) -> str:
        return f"{where}[{int(found.group(1)) + start}]"

    exc.message = item.sub(shift, exc.message)
    exc.args = (exc.message,)
    if exc.param is not None:
        exc.param = item.sub(shift, exc.param)


def _latest_declaration(items: list[JSON]) -> list[JSON]:
    """The ``additional_tools`` items the latest request among ``items``
    declared: a request stores its own together, first
    (``ResponseRecord``), and a conversation holds many requests' input."""
    places = {i for i, _ in additional_tools_items(items)}
    if not places:
        return []
    end = start = max(places)
    while start - 1 in places:
        start -= 1
    return items[start:end + 1]


class _Declarations:
    """``_latest_declaration`` of each stored input list read in pages
    (``ItemPage``), without keeping the lists: the latest run of
    consecutive ``additional_tools`` items of each."""

    def __init__(self) -> None:
        # By link: (the run's items, the place after its last).
        self._runs: dict[int, tuple[list[JSON], int]] = {}

    def see(self, page: ItemPage) -> None:
        if page.kind != "input":
            return
        for i, item in additional_tools_items(page.items):
            place = page.start + i
            run, after = self._runs.get(page.link, ([], -1))
            if place != after:
                run = []
            run.append(item)
            self._runs[page.link] = (run, place + 1)

    def newest_first(self, links: int) -> list[list[JSON]]:
        """Each list's latest declaration (the whole of each list that
        ``declared_tools`` needs), newest list first."""
        return [self._runs[link][0] if link in self._runs else [] for link in reversed(range(links))]


@dataclass
class StoredContext:
    """``responses_items.StoredContext`` over the store, for one owner."""

    store: Store
    owner: str
    # The server key, to expand compaction items (``lmspd.core.compaction``).
    sealer: Sealer | None = None
    # Of each stored input list ``history`` read, newest first, what
    # ``declared_tools`` needs of it (its latest ``additional_tools``
    # items), by what named them: ``declared_tools`` then reads the same
    # history without asking the store again.
    _inputs: dict[tuple[str | None, str | None], list[list[JSON]]] = field(default_factory=dict, init=False,
                                                                           repr=False)

    def open_compaction(self, blob: str, item_id: str | None, where: str) -> Item:
        return compaction.expand(self.sealer, blob, where, item_id, self.owner)

    def declared_tools(self, previous_response_id: str | None,
                       conversation_id: str | None) -> list[tuple[str, Any]]:
        inputs = self._inputs.get((previous_response_id, conversation_id))
        if inputs is None:
            inputs = self._read_inputs(previous_response_id, conversation_id)
        where = "previous_response_id" if previous_response_id is not None else "conversation"
        # The latest declaration holds, as a turn's own item replaces its
        # history's (``openai_responses.decode_request``).
        for items in inputs:
            declared = additional_tools(_latest_declaration(items), where)
            if declared:
                return declared
        return []

    def _read_inputs(self, previous_response_id: str | None, conversation_id: str | None) -> list[list[JSON]]:
        # What ``history`` would have kept; a history it cannot read is its
        # error to report, not this one's.
        declarations = _Declarations()
        if previous_response_id is not None:
            try:
                with self.store.response_chain_pages(self.owner, previous_response_id) as chain:
                    if chain is None:
                        return []
                    for page in chain.pages:
                        declarations.see(page)
                    return declarations.newest_first(chain.links)
            except ChainError:
                return []
        if conversation_id is not None:
            with self.store.conversation_item_pages(self.owner, conversation_id) as pages:
                if pages is None:
                    return []
                for page in pages:
                    declarations.see(page)
            return declarations.newest_first(1)
        return []

    def history(self, previous_response_id: str | None, conversation_id: str | None,
                expansion: Expansion) -> list[Item]:
        # The stored history is read in pages and decoded as it comes, so
        # that a history past the expansion bound is refused having read
        # about the bound, whatever is stored; what ``declared_tools`` reads
        # again is kept aside meanwhile.
        if previous_response_id is not None:
            return self._chain(previous_response_id, expansion)
        if conversation_id is not None:
            with self.store.conversation_item_pages(self.owner, conversation_id) as pages:
                if pages is None:
                    raise ApiError("conversation_not_found", f"Conversation {conversation_id!r} not found.",
                                   param="conversation")
                declarations = _Declarations()
                items = self._expand(pages, declarations, expansion, "conversation")
            self._inputs[(None, conversation_id)] = declarations.newest_first(1)
            return items
        return []

    def _expand(self, pages: Iterable[ItemPage], declarations: _Declarations, expansion: Expansion,
                where: str) -> list[Item]:
        items: list[Item] = []
        for page in pages:
            declarations.see(page)
            items += stored_items(page.items, self.sealer, self.owner, expansion, where, page.start)
        return items

    def _chain(self, response_id: str, expansion: Expansion) -> list[Item]:
        try:
            with self.store.response_chain_pages(self.owner, response_id) as chain:
                if chain is None:
                    raise ApiError("previous_response_not_found", f"Previous response {response_id!r} not found.",
                                   param="previous_response_id")
                if chain.status in ("queued", "in_progress"):
                    raise invalid(f"Previous response {response_id!r} is still {chain.status}; "
                                  "wait for it to finish.", "previous_response_id")
                declarations = _Declarations()
                # The model sees prev.input + prev.output + input, oldest link
                # first: the order of the pages.
                items = self._expand(chain.pages, declarations, expansion, "previous_response_id")
        except ChainError as exc:
            raise ApiError(
                "previous_response_not_found",
                f"Previous response {response_id!r} cannot be continued: response {exc.response_id!r} "
                f"in its chain is {'missing (deleted or expired)' if exc.problem == 'missing' else exc.problem}.",
                param="previous_response_id",
            ) from None
        self._inputs[(response_id, None)] = declarations.newest_first(chain.links)
        return items

    def resolve_reference(self, item_id: str, where: str) -> Item:
        found = self.store.find_item(self.owner, item_id)
        if found is None:
            raise invalid(f"'{where}' references item {item_id!r}, which is not stored (or was deleted); "
                          "send the item itself.", where)
        if found.get("type") == ADDITIONAL_TOOLS:
            # Its tools are a request's, not an item of the window a
            # reference stands in for.
            raise invalid(f"'{where}' references item {item_id!r}, an additional_tools item, which cannot be "
                          "referenced; send the item itself.", where)
        return stored_items([found], self.sealer, self.owner)[0]


class NeedsStore(Exception):
    """A decode on the event loop reached for the store (``OnLoop``)."""


@dataclass(frozen=True)
class OnLoop:
    """A request's stored context for decoding it on the event loop: what
    names stored data (``previous_response_id``, ``conversation``, an
    ``item_reference``) raises ``NeedsStore``, and the decode starts over in
    a worker thread (``routes.responses.begin_turn``). A small body that
    names nothing stored is decoded without a thread hop; the store is never
    read on the loop."""

    context: Any

    def history(self, previous_response_id: str | None, conversation_id: str | None,
                expansion: Expansion) -> list[Item]:
        raise NeedsStore

    def resolve_reference(self, item_id: str, where: str) -> Item:
        raise NeedsStore

    def declared_tools(self, previous_response_id: str | None,
                       conversation_id: str | None) -> list[tuple[str, Any]]:
        raise NeedsStore

    def open_compaction(self, blob: str, item_id: str | None, where: str) -> Item:
        # The server key's work on a blob the (small) body holds: no store.
        return self.context.open_compaction(blob, item_id, where)


@dataclass
class ResponseRecord:
    """What one response leaves in the store, written as it goes:
    ``created`` (a background response is readable while it waits),
    ``started``, then ``ended`` with the final state."""

    store: Store
    owner: str
    # This request's own input items (the chain before it is stored already).
    input_items: list[Item]
    keep: bool
    previous_response_id: str | None = None
    conversation_id: str | None = None
    # Its ``additional_tools`` items, stored as they came: a continuation
    # read from the store keeps their tools (``StoredContext.declared_tools``).
    tool_items: list[JSON] = field(default_factory=list)
    _stored_input: list[JSON] | None = field(default=None, init=False)
    _put: bool = field(default=False, init=False)

    def _input_json(self) -> list[JSON]:
        # Ids are assigned once, so the stored response and the conversation
        # name the same item by the same id.
        if self._stored_input is None:
            # First, as Codex sends them: they declare tools for the whole
            # request wherever they stand.
            self._stored_input = ensure_item_ids(
                self.tool_items + [openai_responses.input_item_json(i) for i in self.input_items])
        return self._stored_input

    def created(self, state: ResponseState) -> None:
        if self.keep:
            self._save(state)

    def started(self, state: ResponseState) -> None:
        if self._put:
            self.store.update_response(self.owner, state.id, openai_responses.response_json(state))

    def writes_at_end(self, state: ResponseState) -> bool:
        """Whether ``ended(state)`` writes anything: a ``store: false``
        response outside a conversation does not, and its end need not wait
        for a store thread (which a row lock or an emptied pool may hold)."""
        return self.keep or (self.conversation_id is not None and state.status in _CONVERSATION_STATUSES)

    def ended(self, state: ResponseState) -> None:
        """The final state. A turn of a conversation is one transaction
        (``Store.end_turn``): the response and the conversation's new items
        are stored together or not at all, so a failed write is retried
        whole, and a client told that nothing was stored is told the truth."""
        if self.conversation_id is None or state.status not in _CONVERSATION_STATUSES:
            if self.keep:
                self._save(state)
            return
        body = openai_responses.response_json(state) if self.keep else None
        items = self._input_json() + [openai_responses.item_json(i) for i in state.output]
        found = self.store.end_turn(self.owner, state.id, body, self._input_json(), new=not self._put,
                                    previous_response_id=self.previous_response_id,
                                    conversation_id=self.conversation_id, created_at=state.created_at,
                                    conversation_items=items)
        if body is not None:
            self._put = True
        if not found:
            log.warning("conversation %s vanished before response %s ended", self.conversation_id, state.id)

    def _save(self, state: ResponseState) -> None:
        body: dict[str, Any] = openai_responses.response_json(state)
        if self._put:
            self.store.update_response(self.owner, state.id, body)
            return
        try:
            self.store.put_response(self.owner, state.id, body, self._input_json(),
                                    previous_response_id=self.previous_response_id,
                                    conversation_id=self.conversation_id, created_at=state.created_at)
        except Duplicate:
            # A try before this one landed and only its answer was lost (a
            # connection dropped in COMMIT): the row is this response's own.
            # The client was told "not stored" while it was, and its retry
            # generated again.
            self.store.update_response(self.owner, state.id, body)
        self._put = True
