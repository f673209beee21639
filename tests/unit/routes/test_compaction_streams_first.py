"""A turn that compacts (a ``compaction_trigger``, or ``context_management``'s
threshold crossed) starts its events before the summary is written:
response.created and in_progress at once, then keep-alives while the model
summarizes, over SSE and WebSocket alike. The summary was written before
anything was sent, the longest silence a turn can have, and clients give up
on silence (Codex after 300 s, proxies often after 60). What is refused
before the summary starts is still an HTTP error. In process, over a
scripted engine that is silent for a while before every run's first event."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest

from lmspd.core import compaction
from lmspd.core.conversation import Message
from lmspd.core.errors import ApiError
from lmspd.core.events import Failed, Finished, TextDelta, Usage
from lmspd.core.limits import DEFAULT_LIMITS
from lmspd.core.run import LOCAL
from support.follow import wait_for
from support.inprocess import MODEL, ScriptedEngine, serving

EVERY_S = 0.1
SILENCE_S = 1.0
LIMITS = replace(DEFAULT_LIMITS, sse_keepalive_s=EVERY_S)
TRIGGER = {"input": [{"role": "user", "content": "a long story"}, {"type": "compaction_trigger"}]}
THRESHOLD = {"input": "a long story", "context_management": [{"type": "compaction", "compact_threshold": 1}]}
END = ("response.completed", "response.incomplete", "response.failed", "error")


def sse_events(app, body: dict) -> list[tuple[float, dict]]:
    start = time.monotonic()
    with app.http.stream("POST", "/v1/responses", json={"model": MODEL, "store": False, "stream": True, **body}) as r:
        assert r.status_code == 200
        return [(time.monotonic() - start, json.loads(line[5:])) for line in r.iter_lines()
                if line.startswith("data:") and line != "data: [DONE]"]


def websocket_events(app, body: dict) -> list[tuple[float, dict]]:
    with app.http.websocket_connect("ws://localhost/v1/responses") as ws:
        start = time.monotonic()
        ws.send_text(json.dumps({"type": "response.create", "model": MODEL, "store": False, **body}))
        events = []
        while not events or events[-1][1]["type"] not in END:
            event = json.loads(ws.receive_text())
            events.append((time.monotonic() - start, event))
        return events


@pytest.mark.parametrize("events_of", [sse_events, websocket_events], ids=["sse", "websocket"])
@pytest.mark.parametrize("body", [TRIGGER, THRESHOLD], ids=["trigger", "threshold"])
def test_a_compacting_turn_is_heard_from_while_its_summary_is_written(tmp_path, events_of, body):
    with serving(tmp_path, engine=ScriptedEngine(first_delay_s=SILENCE_S), limits=LIMITS) as app:
        events = events_of(app, body)
    at = [t for t, _ in events]
    types = [e["type"] for _, e in events]
    assert types[:2] == ["response.created", "response.in_progress"], types
    assert at[0] < 2 * EVERY_S, f"the first event came after {at[0]:.2f} s"
    # Never silent for long: keep-alives (response.in_progress again) while
    # the summary is written, before the compaction item.
    gaps = [b - a for a, b in zip(at, at[1:])]
    assert max(gaps) < SILENCE_S / 2, f"silent for {max(gaps):.2f} s: {list(zip(at, types))}"
    done = [e["item"]["type"] for _, e in events if e["type"] == "response.output_item.done"]
    assert done[0] == "compaction" and types[-1] == "response.completed", types


def is_summary(conversation) -> bool:
    last = conversation.items[-1]
    return isinstance(last, Message) and last.text == compaction.COMPACTION_PROMPT


class RefusesSummaries(ScriptedEngine):
    """Refuses to prepare a summary request (as a model refuses a window it
    cannot fit)."""

    def prepare(self, conversation, run=LOCAL):
        if is_summary(conversation):
            raise ApiError("context_length_exceeded", "This window does not fit.")
        return super().prepare(conversation, run)


class ProviderRefusesSummaries(ScriptedEngine):
    """An engine that reaches its provider before any byte (the upstream
    engine), whose provider refuses the summary request."""

    opens_first = True

    async def open(self, prepared, cancel):
        if is_summary(prepared.conversation):
            raise ApiError("rate_limited", "The provider is busy.", headers={"Retry-After": "3"})


@pytest.mark.parametrize("engine, status", [(RefusesSummaries, 400), (ProviderRefusesSummaries, 429)],
                         ids=["preparing", "provider"])
@pytest.mark.parametrize("body", [TRIGGER, THRESHOLD], ids=["trigger", "threshold"])
def test_a_summary_refused_before_it_starts_is_still_an_http_error(tmp_path, body, engine, status):
    with serving(tmp_path, engine=engine(), limits=LIMITS) as app:
        r = app.http.post("/v1/responses", json={"model": MODEL, "store": False, "stream": True, **body})
        with app.http.websocket_connect("ws://localhost/v1/responses") as ws:
            ws.send_text(json.dumps({"type": "response.create", "model": MODEL, "store": False, **body}))
            frame = json.loads(ws.receive_text())
    assert r.status_code == status and r.json()["error"]["code"] in ("context_length_exceeded", "rate_limited"), r.text
    assert frame["type"] == "error" and frame["status"] == status, frame


def failing_summaries(conversation):
    if is_summary(conversation):
        return [Failed("server_error", "The model stopped.")]
    return [TextDelta("ok"), Finished("stop", Usage(3, 1))]


def test_a_summary_that_fails_once_the_stream_started_fails_the_response(tmp_path):
    with serving(tmp_path, engine=ScriptedEngine(script=failing_summaries), limits=LIMITS) as app:
        events = [e for _, e in sse_events(app, THRESHOLD)]
        # Not streamed: the error reply it always was.
        r = app.http.post("/v1/responses", json={"model": MODEL, "store": False, **THRESHOLD})
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.failed"]
    assert "Compaction failed" in events[-1]["response"]["error"]["message"]
    assert r.status_code == 500 and "Compaction failed" in r.json()["error"]["message"], r.text


def test_a_background_turn_compacts_in_its_task_and_can_be_cancelled_while_it_does(tmp_path):
    with serving(tmp_path, engine=ScriptedEngine(first_delay_s=0.3), limits=LIMITS) as app:
        created = app.http.post("/v1/responses", json={"model": MODEL, "background": True, **TRIGGER}).json()
        assert created["status"] == "queued"
        done = wait_for(lambda: (r := app.http.get(f"/v1/responses/{created['id']}").json())["status"]
                        not in ("queued", "in_progress") and r)
        assert done["status"] == "completed" and [i["type"] for i in done["output"]] == ["compaction"], done
        # Cancelled while its summary is written: nothing more runs.
        body = {"model": MODEL, "background": True, **THRESHOLD}
        created = app.http.post("/v1/responses", json=body).json()
        wait_for(lambda: app.engine.generations == 2)
        assert app.http.post(f"/v1/responses/{created['id']}/cancel").json()["status"] == "cancelled"
        assert app.engine.cancelled == 1 and app.engine.generations == 2
        events = app.http.get(f"/v1/responses/{created['id']}?stream=true").text
    assert "response.output_item.added" not in events and "response.failed" in events
