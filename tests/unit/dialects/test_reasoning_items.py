"""Reasoning items, in both Responses dialects: the model's own reasoning is
``reasoning_text`` content, never labelled a summary; ``reasoning.summary``
(auto, concise, detailed) on a /v1 request gets it as ``summary_text`` parts
instead, streamed as OpenAI's ``reasoning_summary_*`` events (pi keeps a
reasoning item, and replays it, only when its summary is non-empty)."""

from __future__ import annotations

import pytest

from lmspd.core.conversation import Reasoning
from lmspd.core.events import Finished, ReasoningDelta, ReasoningDone, TextDelta, Usage
from lmspd.dialects import lmsp, openai_responses
from lmspd.dialects.registry import LMSP, OPENAI
from lmspd.streaming.session import ResponseState, StreamSession
from support.validate import validate_openai_stream

THOUGHT = ["The user wants", " a greeting."]
RUN = [*(ReasoningDelta(t) for t in THOUGHT), ReasoningDone("sealed"), TextDelta("Hello."),
       Finished("stop", Usage(input_tokens=2, output_tokens=4))]


def stream(dialect, echo: dict | None = None):
    state = ResponseState(id="resp_1", model="m", created_at=1, echo=dict(echo or {}))
    session = StreamSession(state, dialect.encoder())
    wires = session.start()
    for event in RUN:
        wires += session.handle(event)
    return session.state, [data for _, _, data in wires]


@pytest.mark.parametrize("summary", ["auto", "concise", "detailed"])
def test_a_requested_summary_carries_the_reasoning_as_summary_text(summary):
    state, events = stream(OPENAI, {"reasoning": {"effort": "low", "summary": summary}})
    final = validate_openai_stream(events)  # every event as the openai SDK types it
    kinds = [e["type"] for e in events]
    assert [k for k in kinds if "reasoning" in k] == [
        "response.reasoning_summary_part.added", "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.delta", "response.reasoning_summary_text.done",
        "response.reasoning_summary_part.done"]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_summary_text.delta")
    reasoning = final["output"][0]
    assert reasoning["summary"] == [{"type": "summary_text", "text": "".join(THOUGHT)}] and deltas == "".join(THOUGHT)
    assert "content" not in reasoning and reasoning["encrypted_content"] == "sealed"
    added = next(e for e in events if e["type"] == "response.output_item.added")
    assert added["item"]["summary"] == []  # as OpenAI: the part is announced by its own event
    # A crash-cut log rebuilds to the same response.
    rebuilt, _ = openai_responses.state_from_log([(e["type"], e) for e in events])
    assert openai_responses.response_json(rebuilt)["output"] == final["output"]


def test_lmsp_writes_reasoning_as_the_responses_dialect_does():
    """Without a summary asked for: no summary, the reasoning as content."""
    state, _ = stream(LMSP)
    item = lmsp.response_json(state)["output"][0]
    openai_item = openai_responses.response_json(state)["output"][0]
    assert item["summary"] == openai_item["summary"] == []
    assert item["content"] == openai_item["content"] == [{"type": "reasoning_text", "text": "".join(THOUGHT)}]
    # A summary there is (a /v1 request asked for one) reads the same in both.
    summarized = Reasoning(summary=["In short: greet."], text=None, id="rs_1")
    assert lmsp.item_json(summarized)["summary"] == openai_responses.item_json(summarized)["summary"] \
        == [{"type": "summary_text", "text": "In short: greet."}]
    assert "content" not in lmsp.item_json(summarized)
