"""Which preparations take a decode thread away (preparations.Preparations):
the count is read once per step and holds for the whole step, so a short
preparation that merely overlaps a step's start must not halve the threads
of a long prefill step; a long one (big input, or running for a while)
must, as before."""

from __future__ import annotations

import time

from lmspd.core.conversation import Conversation, Message, ToolOutput
from lmspd.engines.llama.preparations import Preparations, input_chars


def conv(chars: int) -> Conversation:
    return Conversation(model="m", items=[Message("user", "x" * chars)])


def test_a_short_preparation_counts_only_once_it_has_run_for_the_grace_period() -> None:
    # Windows of seconds, the clock moved explicitly: a descheduled test
    # thread must not outlive a window between two lines.
    preps = Preparations(grace_s=5, big_chars=1000)
    with preps.running(conv(10)):
        assert preps.long() == 0, "a just-started small preparation keeps the threads"
        assert preps.long(time.monotonic() + 6) == 1, "one still running after the grace period takes one"
    assert preps.long(time.monotonic() + 1) == 0, "a finished one counts no more"


def test_a_big_input_counts_at_once_and_each_counts_once() -> None:
    preps = Preparations(grace_s=10, big_chars=1000)
    with preps.running(conv(2000)), preps.running(conv(5)), preps.running(conv(3000)):
        assert preps.long() == 2
    assert preps.long() == 0


def test_input_chars_counts_instructions_messages_and_tool_outputs() -> None:
    c = Conversation(model="m", instructions="abc", items=[Message("user", "hello"), ToolOutput(call_id="c", output="12")])
    assert input_chars(c) == 3 + 5 + 2


def test_arriving_covers_a_short_running_preparation_and_a_prepared_request_until_it_is_submitted() -> None:
    preps = Preparations(grace_s=5, big_chars=1000, handoff_s=5)
    assert not preps.arriving()
    prepared = object()
    with preps.running(conv(10)) as landed:
        assert preps.arriving(), "a short preparation, just started: about to arrive"
        assert not preps.arriving(time.monotonic() + 6), "past its grace period it is a long one, not waited for"
        landed(prepared)
    assert preps.arriving(), "prepared, on its way to the scheduler"
    assert not preps.arriving(time.monotonic() + 6), "not submitted within the hand-off: not waited for"
    preps.submitted(prepared)
    assert not preps.arriving()
    with preps.running(conv(5000)):
        assert not preps.arriving(), "a big preparation is not waited for"


def test_an_announced_request_is_arriving_until_its_preparation_takes_it_over() -> None:
    # Sixteen requests released together wait for the preparing pool's two
    # threads: admitted but not yet preparing, they are on their way too
    # (Preparations.incoming, held by the service around prepare).
    preps = Preparations(grace_s=5, big_chars=1000, handoff_s=5)
    queued, other = conv(10), conv(10)
    with preps.incoming(queued):
        assert preps.arriving(), "admitted, waiting for a preparing thread: about to arrive"
        assert not preps.arriving(time.monotonic() + 6), "announced longer ago than the grace period: not waited for"
        with preps.running(queued) as landed:
            landed(prepared := object())
        preps.submitted(prepared)
        assert not preps.arriving(), "submitted: its announcement, still held, waits for nothing more"
    with preps.incoming(other):
        pass
    assert not preps.arriving(), "refused before its preparation: no longer on its way"
    with preps.incoming(conv(5000)):
        assert not preps.arriving(), "a big input is not waited for"
