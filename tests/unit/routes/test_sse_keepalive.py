"""A stream with nothing to say (a long prefill, a wait in the queue) sends
an SSE comment every ``limits.sse_keepalive_s``, so that clients and proxies
do not give up on it; SDK parsing is unaffected. A dialect with an event for
it also sends that event (``response.in_progress``, Anthropic's ``ping``):
Codex times out on silence between events, comments or not. Served by uvicorn as
``lmspd serve`` serves it (coalescing middleware included), over a scripted
engine that stays silent before its first event."""

from __future__ import annotations

import dataclasses
import json
import time

import httpx
import openai

from lmspd.core.limits import DEFAULT_LIMITS
from lmspd.streaming.coalesce import CoalescingMiddleware
from lmspd.streaming.sse import SSE_KEEPALIVE
from support.engine import MODEL, ScriptedEngine
from support.follow import wait_for
from support.inprocess import ThreadedServer, make_app

EVERY_S = 0.05
SILENCE_S = 0.4


def serve(tmp_path, every_s: float = EVERY_S, engine: ScriptedEngine | None = None):
    limits = dataclasses.replace(DEFAULT_LIMITS, sse_keepalive_s=every_s)
    engine = engine or ScriptedEngine(("Hello", " there"), first_delay_s=SILENCE_S)
    app, _ = make_app(tmp_path, engine=engine, limits=limits)
    return ThreadedServer(CoalescingMiddleware(app), limits)


def lines_of(url: str, path: str, body: dict) -> list[tuple[float, str]]:
    out = []
    with httpx.Client(timeout=30) as client, client.stream("POST", url + path, json=body) as r:
        assert r.status_code == 200
        t0 = time.perf_counter()
        for line in r.iter_lines():
            if line:
                out.append((time.perf_counter() - t0, line))
    return out


def test_a_silent_stream_gets_comments_until_its_first_event(tmp_path):
    # LMSP: a dialect with no keep-alive event of its own, so that its
    # silence is only ever filled by comments (a Responses stream repeats
    # response.in_progress at the same interval, and then has no silence).
    with serve(tmp_path) as url:
        lines = lines_of(url, "/lmsp/v1/responses", {"model": MODEL, "input": "hi", "stream": True})
    texts = [text for _, text in lines]
    comment = SSE_KEEPALIVE.decode().strip()
    created = texts.index("event: response.created")
    first_delta = texts.index("event: response.output_text.delta")
    during = [i for i, text in enumerate(texts) if text == comment]
    # 0.4 s of silence at one comment per 0.05 s: several, each between
    # response.created and the first delta, none once events flow again.
    assert len(during) >= 3, texts
    assert all(created < i < first_delta for i in during), texts
    gaps = [b[0] - a[0] for a, b in zip(lines[created:first_delta], lines[created + 1:first_delta + 1], strict=False)]
    # Without comments one gap would be the whole silence.
    assert max(gaps) < SILENCE_S * 0.75, f"the stream was silent for {max(gaps):.2f} s: {lines}"


def test_no_comment_when_turned_off(tmp_path):
    with serve(tmp_path, every_s=0) as url:
        lines = lines_of(url, "/v1/responses", {"model": MODEL, "input": "hi", "stream": True})
    assert not any(text.startswith(":") for _, text in lines)
    assert events_of(lines)[-1]["type"] == "response.completed"  # the whole stream, silences included


def test_sdks_parse_a_stream_with_comments(tmp_path):
    with serve(tmp_path) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        events = list(client.responses.create(model=MODEL, input="hi", stream=True))
        assert [e.type for e in events][:1] == ["response.created"]
        assert events[-1].type == "response.completed"
        assert events[-1].response.output_text == "Hello there"
        assert [e.sequence_number for e in events] == list(range(len(events)))
        chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                     stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello there"


def events_of(lines: list[tuple[float, str]]) -> list[dict]:
    return [json.loads(text[len("data: "):]) for _, text in lines
            if text.startswith("data: ") and text != "data: [DONE]"]


def test_a_silent_responses_stream_repeats_in_progress_until_its_first_event(tmp_path):
    from support.validate import validate_openai_stream

    with serve(tmp_path) as url:
        events = events_of(lines_of(url, "/v1/responses", {"model": MODEL, "input": "hi", "stream": True}))
    final = validate_openai_stream(events)  # sequence numbers stay contiguous
    kinds = [e["type"] for e in events]
    first_delta = kinds.index("response.output_text.delta")
    # 0.4 s of silence at one per 0.05 s: several, all before the first delta.
    assert kinds[:first_delta].count("response.in_progress") >= 4, kinds
    assert "response.in_progress" not in kinds[first_delta:]
    assert final["output"][0]["content"][0]["text"] == "Hello there"


def test_a_queued_request_hears_in_progress_while_it_waits(tmp_path):
    """The model is busy with another request: the second one's stream is
    not silent while it waits for it."""
    import threading

    from support.validate import validate_openai_stream

    engine = ScriptedEngine(("Hello", " there"), first_delay_s=SILENCE_S)
    with serve(tmp_path, engine=engine) as url:
        first = threading.Thread(target=lines_of, args=(url, "/v1/responses", {"model": MODEL, "input": "a"}))
        first.start()
        wait_for(lambda: engine.generations == 1, timeout=10)  # the first one holds the model
        events = events_of(lines_of(url, "/v1/responses", {"model": MODEL, "input": "b", "stream": True}))
        first.join()
    validate_openai_stream(events)
    kinds = [e["type"] for e in events]
    # Its own 0.4 s of prefill silence (8 alone) and most of the first one's.
    assert kinds[:kinds.index("response.output_text.delta")].count("response.in_progress") >= 10, kinds


def test_other_dialects_hear_their_own_keep_alive(tmp_path):
    with serve(tmp_path) as url:
        messages = events_of(lines_of(url, "/v1/messages", {
            "model": MODEL, "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "hi"}]}))
        lmsp = lines_of(url, "/lmsp/v1/responses", {"model": MODEL, "input": "hi", "stream": True})
        chat_lines = lines_of(url, "/v1/chat/completions", {
            "model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    kinds = [e["type"] for e in messages]
    assert kinds[0] == "message_start" and kinds.count("ping") >= 4, kinds
    # LMSP and Chat Completions have no such event: comments only.
    assert not any(text.startswith("event: response.in_progress") for _, text in lmsp)
    assert [text for _, text in lmsp].count(SSE_KEEPALIVE.decode().strip()) >= 3
    chat = events_of(chat_lines)
    assert chat and all(c.get("object") == "chat.completion.chunk" for c in chat)
    assert [text for _, text in chat_lines].count(SSE_KEEPALIVE.decode().strip()) >= 3
    assert chat_lines[-1][1] == "data: [DONE]"


def test_keep_alive_events_continue_through_the_whole_generation(tmp_path):
    """A provider that stalls between its chunks (a long tool call whose
    arguments are not streamed, an overloaded upstream): Codex counts only
    events on its idle timer, so the stream repeats ``response.in_progress``
    whenever nothing else was sent for the interval, after the first event
    as before it. Through the real upstream engine, over a scripted provider."""
    from lmspd.engines.upstream.engine import UpstreamEngine, UpstreamSpec
    from support.provider import DONE, Reply, ScriptedProvider, finish_chunk, text_chunk, tool_chunk
    from support.validate import validate_openai_stream

    provider = ScriptedProvider().start()
    try:
        provider.push(Reply(parts=[
            text_chunk("Let me look."), SILENCE_S,
            tool_chunk(0, id="call_1", name="lookup", args=""), SILENCE_S,
            tool_chunk(0, args='{"q": "x"}'), SILENCE_S,
            finish_chunk("tool_calls"), DONE]))
        engine = UpstreamEngine(UpstreamSpec(served_model=MODEL, upstream_model="m", urls=[provider.url]))
        limits = dataclasses.replace(DEFAULT_LIMITS, sse_keepalive_s=EVERY_S)
        app, _ = make_app(tmp_path, engine=engine, limits=limits)
        tool = {"type": "function", "name": "lookup", "parameters": {"type": "object"}}
        with ThreadedServer(CoalescingMiddleware(app), limits) as url:
            lines = lines_of(url, "/v1/responses", {"model": MODEL, "input": "hi", "stream": True, "tools": [tool]})
        # The server's shutdown (the app's lifespan) closed the provider
        # client's aiohttp session: none is left for the garbage collector to
        # report in a later test ("Unclosed client session").
        assert engine.client._http is not None and engine.client._http.closed
    finally:
        provider.stop()
    events = events_of(lines)
    final = validate_openai_stream(events)
    assert [i["type"] for i in final["output"]] == ["message", "function_call"]
    kinds = [e["type"] for e in events]
    first_delta = kinds.index("response.output_text.delta")
    # The bridge holds a call back until its name is final, here until the
    # provider finishes: 1.2 s of silence after the first event, at one
    # keep-alive per 0.05 s (about 24; 6 is plenty on a loaded machine).
    assert kinds[first_delta:].count("response.in_progress") >= 6, kinds
    # Without the output so far: each would send it all again, and a long
    # stall after much text amplified it (96 MiB sent for 4 MiB of output).
    assert all(e["response"]["output"] == [] for e in events if e["type"] == "response.in_progress")
    timed = [t for t, text in lines if text.startswith("data: ")]
    gaps = [b - a for a, b in zip(timed, timed[1:])]
    assert max(gaps) < SILENCE_S * 0.75, f"the stream was silent for {max(gaps):.2f} s"
