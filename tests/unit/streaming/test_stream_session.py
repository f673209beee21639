"""The stream session's invariants, for any engine event sequence, in every
dialect: numbering without gaps, every item that is added is done, exactly
one terminal event and nothing after it, the built state is what the wire
said — checked with the same stream validators the end-to-end tests use."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmspd.core.events import (
    Failed,
    Finished,
    ReasoningDelta,
    ReasoningDone,
    TextDelta,
    ToolCallDelta,
    ToolCallDone,
    ToolCallStarted,
    Usage,
)
from lmspd.core.lifecycle import TERMINAL_STATUSES
from lmspd.dialects.registry import DIALECTS, LMSP, OPENAI
from lmspd.streaming.session import ResponseState, StreamSession
from support.sse import Frame
from support.validate import validate_lmsp_stream, validate_openai_stream

TERMINALS = {"completed": "response.completed", "incomplete": "response.incomplete",
             "failed": "response.failed", "cancelled": "response.cancelled"}
words = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=6)


@st.composite
def engine_runs(draw):
    """Engine events in the order the contract allows (lmspd/core/events.py),
    then how the run ends: an engine terminal, or the core's fail/cancel."""
    events: list = []
    call = 0
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["text", "reasoning", "tool"]))
        if kind == "text":
            events += [TextDelta(w) for w in draw(st.lists(words, min_size=1, max_size=3))]
        elif kind == "reasoning":
            events += [ReasoningDelta(w) for w in draw(st.lists(words, min_size=1, max_size=3))]
            if draw(st.booleans()):
                events.append(ReasoningDone(draw(st.none() | st.just("sealed"))))
        else:
            args = draw(st.lists(st.sampled_from(['{"a"', ':', '1', '}']), max_size=4))
            events.append(ToolCallStarted(call, f"call_{call}", "lookup"))
            events += [ToolCallDelta(call, a) for a in args]
            if draw(st.booleans()):
                events.append(ToolCallDone(call, "".join(args)))
            call += 1
    end = draw(st.sampled_from(["stop", "length", "content_filter", "cancelled", "failed", "core_fail",
                                "core_cancel"]))
    return events, end


def run(dialect, events, end, queued=False):
    state = ResponseState(id="resp_1", model="m", status="queued" if queued else "in_progress", created_at=1)
    session = StreamSession(state, dialect.encoder())
    wires = session.start()
    if queued:
        wires += session.begin_progress()
    usage = Usage(input_tokens=2, output_tokens=len(events))
    for event in events:
        wires += session.handle(event)
    if end in ("stop", "length", "content_filter", "cancelled"):
        wires += session.handle(Finished(end, usage))
    elif end == "failed":
        wires += session.handle(Failed("upstream_error", "boom", usage))
    elif end == "core_fail":
        wires += session.fail("server_error", "bug")
    else:
        wires += session.cancel()
    # Once terminated, nothing more is ever sent.
    assert session.terminated
    assert session.handle(TextDelta("late")) == [] and session.fail("x", "y") == [] and session.cancel() == []
    return session, wires


@pytest.mark.parametrize("name", sorted(DIALECTS))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(run_=engine_runs(), queued=st.booleans())
def test_any_run_is_a_valid_stream_with_one_terminal(name, run_, queued):
    dialect = DIALECTS[name]
    events, end = run_
    if queued and dialect is LMSP:
        queued = False  # LMSP responses are never queued (tasks start in progress)
    session, wires = run(dialect, events, end, queued)
    seqs = [seq for seq, _, _ in wires]
    assert seqs == list(range(dialect.first_seq, dialect.first_seq + len(wires))), "numbered without gaps"
    names = [n for _, n, _ in wires]
    # Exactly one terminal event, the last (its name is the dialect's: the
    # OpenAI wire has no response.cancelled, a cancel ends as response.failed).
    assert sum(names.count(t) for t in TERMINALS.values()) == 1 and names[-1] in TERMINALS.values()
    terminal = names[-1]
    assert session.state.status in TERMINAL_STATUSES
    expected = {"stop": "completed", "length": "incomplete", "content_filter": "incomplete",
                "cancelled": "cancelled", "failed": "failed", "core_fail": "failed", "core_cancel": "cancelled"}
    assert session.state.status == expected[end]
    if dialect is OPENAI:
        final = validate_openai_stream([data for _, _, data in wires])
        assert final["status"] == session.state.status
        assert terminal == ("response.failed" if session.state.status == "cancelled"
                            else TERMINALS[session.state.status])
        assert [o["id"] for o in final["output"]] == [i.id for i in session.state.output]
    else:
        frames = [Frame(n, json.dumps(data), str(seq)) for seq, n, data in wires]
        summary = validate_lmsp_stream(frames)
        assert summary["terminal"] == terminal == TERMINALS[session.state.status]
    # No item is left open: every one that was added was closed.
    assert all(i.status != "in_progress" for i in session.state.output)
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert session.state.output_text == text


def test_a_tool_call_closes_the_open_message_and_text_after_it_is_a_new_item():
    session, _ = run(OPENAI, [TextDelta("a"), ToolCallStarted(0, "call_0", "f"), ToolCallDone(0, "{}"),
                              TextDelta("b")], "stop")
    kinds = [type(i).__name__ for i in session.state.output]
    assert kinds == ["Message", "ToolCall", "Message"]
    assert [getattr(i, "text", None) for i in session.state.output] == ["a", None, "b"]


def test_a_call_cut_off_mid_arguments_is_closed_incomplete():
    session, wires = run(OPENAI, [ToolCallStarted(0, "call_0", "f"), ToolCallDelta(0, '{"a"')], "length")
    (call,) = session.state.output
    assert call.status == "incomplete" and session.state.incomplete_reason == "max_output_tokens"
    done = [d for _, n, d in wires if n == "response.output_item.done"]
    assert done and done[-1]["item"]["status"] == "incomplete"


def test_resume_continues_the_numbering_and_closes_the_open_item():
    whole = StreamSession(ResponseState(id="resp_1", model="m", created_at=1), LMSP.encoder())
    wires = whole.start() + whole.handle(TextDelta("part"))
    state = ResponseState(id="resp_1", model="m", created_at=1, output=list(whole.state.output))
    resumed = StreamSession.resume(state, LMSP.encoder(), next_seq=wires[-1][0] + 1, open_index=0)
    rest = resumed.fail("server_restarted", "restarted")
    assert rest[0][0] == wires[-1][0] + 1
    frames = [Frame(n, json.dumps(d), str(s)) for s, n, d in wires + rest]
    assert validate_lmsp_stream(frames)["terminal"] == "response.failed"


@pytest.mark.parametrize("name", sorted(DIALECTS))
@pytest.mark.parametrize("bad", [TextDelta("\ud83d"), ReasoningDelta("ok \udfff"), ToolCallDelta(0, '{"a": "\ud800'),
                                 ToolCallDone(0, "\udc00"), ToolCallStarted(1, "call_\ud800", "f")])
def test_a_lone_surrogate_from_any_engine_fails_the_stream_once_and_every_event_is_utf8(name, bad):
    """Whatever engine let it through, a lone surrogate never reaches a
    writer: the response fails there, with its one terminal event, and
    every wire event before it encodes as UTF-8 (the SSE writer's and the
    WebSocket's encoding)."""
    from lmspd.streaming.sse import sse_event

    dialect = DIALECTS[name]
    session, wires = run(dialect, [TextDelta("smile "), ToolCallStarted(0, "call_0", "f"), bad, TextDelta("late")],
                         "stop")
    names = [n for _, n, _ in wires]
    assert sum(names.count(t) for t in TERMINALS.values()) == 1
    assert session.state.status == "failed" and session.state.error["code"] == "invalid_model_output"
    for seq, event, data in wires:
        sse_event(event, data, seq)  # raises UnicodeEncodeError on a surrogate
