"""A request's stored history (``lmspd.history.StoredContext``): a
``conversation`` or a ``previous_response_id`` chain is read in pages and
decoded as it comes, so that one past the expansion bound
(``max_expanded_chars``, ``max_expanded_items``) is refused having read
about the bound, not all that is stored; and what is within the bound is
the stored items in their order, whatever the pages, with the same errors
and the same ``declared_tools``. On both store backends; the bound over
HTTP is tests/unit/routes/test_expansion_bound_inprocess.py."""

from __future__ import annotations

import tracemalloc
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from lmspd.core.errors import ApiError
from lmspd.core.limits import DEFAULT_LIMITS
from lmspd.dialects.responses_items import Expansion
from lmspd.history import StoredContext, stored_items
from lmspd.store import open_store
from lmspd.store.base import Store

MIB = 1024 * 1024
# The bound the requests here expand under, and what is stored: 32 times more.
BOUND = 2 * MIB
STORED = 64 * MIB
LIMITS = replace(DEFAULT_LIMITS.request, max_expanded_chars=BOUND)


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path):
    target = str(tmp_path / "lmspd.db") if request.param == "sqlite" else request.getfixturevalue("pg_database")
    store = open_store(target)
    yield store
    store.close()


def message(chars: int, tag: str = "", role: str = "user") -> dict:
    return {"type": "message", "role": role, "content": tag + "x" * chars}


def tools_item(*names: str) -> dict:
    return {"type": "additional_tools", "tools": [{"type": "function", "name": n, "parameters": {}} for n in names]}


def refusal(call: Any) -> tuple[ApiError, int]:
    """The error ``call()`` raises, and the most memory it held meanwhile."""
    tracemalloc.start()
    try:
        with pytest.raises(ApiError) as caught:
            call()
        return caught.value, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def whole_list_error(lists: list[list[dict]], where: str) -> ApiError:
    """What decoding each stored list whole, in order, refuses (the history
    as it was read before pages)."""
    expansion = Expansion(LIMITS)
    with pytest.raises(ApiError) as caught:
        for items in lists:
            stored_items(items, expansion=expansion, where=where)
    return caught.value


def same_error(got: ApiError, expected: ApiError) -> None:
    assert (got.status, got.code, got.param, got.message) == (expected.status, expected.code, expected.param,
                                                               expected.message)


def test_a_conversation_past_the_bound_is_refused_having_read_about_the_bound(store: Store) -> None:
    # 64 items of a MiB each: 32 times the bound.
    store.create_conversation("alice", "conv_1", items=[message(MIB - 100, f"m{i}") for i in range(STORED // MIB)])
    error, peak = refusal(lambda: StoredContext(store, "alice").history(None, "conv_1", Expansion(LIMITS)))
    assert error.status == 400 and error.param == "conversation" and "max_expanded_chars" in error.message
    same_error(error, whole_list_error([store.conversation_items("alice", "conv_1")], "conversation"))
    # The bound and a page or two, never the 64 MiB stored (read whole, they
    # held twice that: the JSON and what it parses to).
    assert peak < 3 * BOUND, peak


@pytest.mark.parametrize("link_chars", [MIB // 4, 2 * MIB], ids=["small links", "links larger than a page"])
def test_a_chain_past_the_bound_is_refused_having_read_about_the_bound(store: Store, link_chars: int) -> None:
    prev = None
    for i in range(STORED // link_chars):
        rid = f"resp_{i}"
        store.put_response("alice", rid, {"id": rid, "status": "completed", "output": []},
                           [message(link_chars - 100, f"t{i}")], previous_response_id=prev)
        prev = rid
    error, peak = refusal(lambda: StoredContext(store, "alice").history(prev, None, Expansion(LIMITS)))
    assert error.status == 400 and error.param == "previous_response_id" and "max_expanded_chars" in error.message
    chain = store.response_chain("alice", prev)
    same_error(error, whole_list_error([part for link in chain for part in link], "previous_response_id"))
    assert peak < 3 * BOUND + link_chars, peak


class SmallPages:
    """The store, its history read one item a page."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def conversation_item_pages(self, owner: str, conversation_id: str, **_: Any) -> Any:
        return self._store.conversation_item_pages(owner, conversation_id, page_bytes=1)

    def response_chain_pages(self, owner: str, response_id: str, **_: Any) -> Any:
        return self._store.response_chain_pages(owner, response_id, page_bytes=1)


def conversation_items() -> list[dict]:
    return [
        tools_item("old"), message(10, "a"), message(20, "b", "assistant"),
        {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "x" * 300},
        # The latest declaration: two items, in two pages of their own.
        tools_item("new1"), tools_item("new2", "new3"), message(5, "c"),
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "hm"}]}, message(40, "d"),
    ]


def test_a_conversation_is_its_items_in_order_whatever_the_pages(store: Store) -> None:
    store.create_conversation("alice", "conv_1", items=conversation_items())
    expected = stored_items(store.conversation_items("alice", "conv_1"), expansion=Expansion(LIMITS),
                            where="conversation")
    for paged in (store, SmallPages(store)):
        context = StoredContext(paged, "alice")  # type: ignore[arg-type]
        assert context.history(None, "conv_1", Expansion(LIMITS)) == expected
        assert [name for name, _ in context.declared_tools(None, "conv_1")] == [
            "conversation[0].tools[0]", "conversation[1].tools[0]", "conversation[1].tools[1]"]
        assert [tool["name"] for _, tool in context.declared_tools(None, "conv_1")] == ["new1", "new2", "new3"]
        # Asked without the history read first: the same.
        alone = StoredContext(paged, "alice")  # type: ignore[arg-type]
        assert alone.declared_tools(None, "conv_1") == context.declared_tools(None, "conv_1")
    assert len(expected) == 7


def test_a_chain_is_its_items_in_order_whatever_the_pages(store: Store) -> None:
    prev = None
    for i in range(4):
        rid = f"resp_{i}"
        inputs = [tools_item(f"t{i}")] if i in (0, 2) else []
        output = [{"id": f"msg_o{i}", "type": "message", "role": "assistant",
                   "content": [{"type": "output_text", "text": f"answer {i}"}]}]
        store.put_response("alice", rid, {"id": rid, "status": "completed", "output": output},
                           inputs + [message(100 * i, f"q{i}"), message(3, "r")], previous_response_id=prev)
        prev = rid
    chain = store.response_chain("alice", prev)
    expected = [item for link in chain for part in link
                for item in stored_items(part, expansion=Expansion(LIMITS), where="previous_response_id")]
    for paged in (store, SmallPages(store)):
        context = StoredContext(paged, "alice")  # type: ignore[arg-type]
        assert context.history(prev, None, Expansion(LIMITS)) == expected
        assert [tool["name"] for _, tool in context.declared_tools(prev, None)] == ["t2"]
        assert StoredContext(paged, "alice").declared_tools(prev, None) == context.declared_tools(prev, None)  # type: ignore[arg-type]
    assert len(expected) == 12


def test_what_a_paged_history_refuses_names_the_item_in_the_whole_list(store: Store) -> None:
    items = [message(10, f"m{i}") for i in range(6)]
    store.create_conversation("alice", "conv_bad", items=[*items[:4], {"type": "bogus"}, *items[4:]])
    store.create_conversation("alice", "conv_big", items=[*items, message(BOUND, "big"), *items])
    for conv in ("conv_bad", "conv_big"):
        expected = whole_list_error([store.conversation_items("alice", conv)], "conversation")
        for paged in (store, SmallPages(store)):
            with pytest.raises(ApiError) as caught:
                StoredContext(paged, "alice").history(None, conv, Expansion(LIMITS))  # type: ignore[arg-type]
            same_error(caught.value, expected)
    assert "at 'conversation[4]'" in whole_list_error([store.conversation_items("alice", "conv_bad")],
                                                        "conversation").message


class _AnswerLost:
    """``store`` whose first ``put_response`` commits and then fails, as a
    connection dropped during COMMIT does."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.lost = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def put_response(self, *args: Any, **kwargs: Any) -> None:
        self._store.put_response(*args, **kwargs)
        if not self.lost:
            self.lost = True
            raise ConnectionError("server closed the connection during COMMIT")


def test_a_final_write_retried_after_its_answer_was_lost_stores_it(store: Store) -> None:
    """The retry found the row its first try had stored: ``Duplicate``,
    not a transient error, so the client heard "generated but could not be
    stored" (a stream: ``store: false``) while it was, and the idempotency
    key was released for a retry to generate again."""
    from lmspd.history import ResponseRecord
    from lmspd.streaming.session import ResponseState

    wrapped = _AnswerLost(store)
    record = ResponseRecord(wrapped, "alice", [], keep=True)  # type: ignore[arg-type]
    state = ResponseState(id="resp_lost", model="m", status="completed")
    with pytest.raises(ConnectionError):
        record.ended(state)
    record.ended(state)  # the caller's retry
    assert store.get_response("alice", "resp_lost")["status"] == "completed"
