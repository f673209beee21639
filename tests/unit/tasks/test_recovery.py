"""Closing a task's log that a crash cut off: whatever the cut point, the
closed log is a valid stream of its dialect (every item done, one terminal
event) and ends the response as failed with the output it had."""

from __future__ import annotations

import json

import pytest

from lmspd.core.events import (
    Finished,
    ReasoningDelta,
    ReasoningDone,
    TextDelta,
    ToolCallDelta,
    ToolCallDone,
    ToolCallStarted,
    Usage,
)
from lmspd.dialects.registry import DIALECTS, LMSP, OPENAI, Dialect
from lmspd.store.base import TaskEvent, TaskRecord
from lmspd.streaming.session import ResponseState, StreamSession
from lmspd.tasks.recovery import RESTART_MESSAGE, close_interrupted
from support.sse import Frame
from support.validate import validate_lmsp_stream, validate_openai_stream

ENGINE_EVENTS = [
    TextDelta("Hello"), TextDelta(", world"),
    ToolCallStarted(0, "call_1", "lookup"), ToolCallDelta(0, '{"q":'), ToolCallDelta(0, '"x"}'),
    ToolCallDone(0, '{"q":"x"}'),
    TextDelta("Done."),
    Finished("stop", Usage(input_tokens=5, output_tokens=7)),
]


def whole_log(dialect: Dialect) -> list[TaskEvent]:
    """What a task running these engine events writes, as store events."""
    status = "queued" if dialect is OPENAI else "in_progress"
    session = StreamSession(ResponseState(id="resp_1", model="m", status=status, created_at=100), dialect.encoder())
    wires = session.start()
    if status == "queued":
        wires += session.begin_progress()
    for event in ENGINE_EVENTS:
        wires += session.handle(event)
    return [TaskEvent(dialect.store_seq(seq), name, data) for seq, name, data in wires]


def task(dialect: Dialect, last_seq: int) -> TaskRecord:
    return TaskRecord(id="task_1", owner="o", status="failed", request={"dialect": dialect.name, "model": "m"},
                      result=None, error={"code": "server_restarted", "message": RESTART_MESSAGE},
                      response_id="resp_1", created_at=100.0, updated_at=100.0, finished_at=101.0,
                      last_seq=last_seq, first_retained_seq=1)


@pytest.mark.parametrize("name", sorted(DIALECTS))
def test_every_cut_point_closes_into_a_valid_stream(name: str) -> None:
    dialect = DIALECTS[name]
    log = whole_log(dialect)
    for cut in range(1, len(log)):  # the terminal event itself never made it
        head = log[:cut]
        closed = close_interrupted(task(dialect, cut), cut + 1, head)
        events = [(e.event, e.data) for e in head] + closed.events
        assert closed.result is not None and closed.result["status"] == "failed"
        if dialect is LMSP:
            frames = [Frame(ev, json.dumps(data), str(i + 1)) for i, (ev, data) in enumerate(events)]
            summary = validate_lmsp_stream(frames)
            assert summary["terminal"] == "response.failed"
            assert summary["data"]["error"]["code"] == "server_restarted"
            assert closed.result["output"] == summary["output"]
        else:
            final = validate_openai_stream([data for _, data in events])
            assert final == closed.result and final["error"]["code"] == "server_restarted"


def test_a_summarised_reasoning_item_cut_off_is_closed_with_its_summary_part() -> None:
    """A /v1 request with ``reasoning.summary`` streams its reasoning as one
    summary part: cut off inside it, the log closes that part (its text
    done, the part done) before the item, as the session would have."""
    state = ResponseState(id="resp_1", model="m", status="queued", created_at=100,
                          echo={"reasoning": {"effort": "low", "summary": "auto"}})
    session = StreamSession(state, OPENAI.encoder())
    wires = session.start() + session.begin_progress()
    for event in (ReasoningDelta("Let me "), ReasoningDelta("think."), ReasoningDone(), TextDelta("Hi."),
                  Finished("stop", Usage(input_tokens=5, output_tokens=7))):
        wires += session.handle(event)
    log = [TaskEvent(OPENAI.store_seq(seq), name, data) for seq, name, data in wires]
    names = [e.event for e in log]
    for cut in range(1, len(log)):
        head = log[:cut]
        closed = close_interrupted(task(OPENAI, cut), cut + 1, head)
        final = validate_openai_stream([e.data for e in head] + [data for _, data in closed.events])
        assert final == closed.result and final["error"]["code"] == "server_restarted"
        if names[cut - 1] == "response.reasoning_summary_text.delta":
            assert [name for name, _ in closed.events] == [
                "response.reasoning_summary_text.done", "response.reasoning_summary_part.done",
                "response.output_item.done", "response.failed"]
            done = closed.events[0][1]
            assert done["text"] == "".join(e.data["delta"] for e in head if "delta" in e.data)
            assert final["output"][0]["status"] == "incomplete"


def test_a_log_without_events_gets_a_bare_failure_in_its_dialect() -> None:
    closed = close_interrupted(task(LMSP, 0), 1, [])
    ((name, data),) = closed.events
    assert name == "response.failed" and data["response_id"] == "resp_1" and data["status"] == "failed"
    # LMSP §6.3: the error is a problem object.
    problem = data["error"]
    assert problem["code"] == "server_restarted" and problem["detail"] == RESTART_MESSAGE
    assert {"type", "title", "status"} <= set(problem)
    # A log that cannot be replayed closes the same way.
    closed = close_interrupted(task(LMSP, 1), 2, [TaskEvent(1, "response.output_item.added", {"bad": 1})])
    ((name, data),) = closed.events
    assert name == "response.failed" and data["error"]["code"] == "server_restarted"
    assert {"type", "title", "status"} <= set(data["error"])
    closed = close_interrupted(task(OPENAI, 0), 1, [])
    ((name, data),) = closed.events
    assert name == "response.failed" and data["type"] == "response.failed"
    assert data["response"]["id"] == "resp_1" and data["response"]["error"]["code"] == "server_restarted"




def test_closing_an_lmsp_task_fails_its_response_row_too(tmp_path) -> None:
    """Its result is in LMSP's shape, not the row's: the row was left
    in_progress for good (a continuation from it refused as still running)
    where the task was closed while its instance lived (a shared store's
    sweep, or the store refusing its events)."""
    from lmspd.store.sqlite import SQLiteStore
    from lmspd.tasks.recovery import STORE_REFUSED, close_refused

    store = SQLiteStore(tmp_path / "s.db")
    store.put_response("alice", "resp_1", {"id": "resp_1", "object": "response", "status": "in_progress",
                                           "model": "m", "output": []}, [])
    store.create_task("alice", "task_1", {"dialect": "lmsp", "model": "m"}, status="in_progress",
                      response_id="resp_1")
    closed = close_refused(store, "task_1")
    assert closed is not None and closed.status == "failed"
    row = store.get_response("alice", "resp_1")
    assert row["status"] == "failed" and row["error"] == STORE_REFUSED
    store.close()
