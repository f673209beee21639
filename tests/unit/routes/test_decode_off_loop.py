"""Where a request is decoded. A small body (uncompressed, within
``lmspd.bodies.INLINE_BYTES``) that names nothing stored is decoded on the
event loop, as its JSON was parsed there (a thread hop costs more: it was
~0.3 ms of every short request's time to first token); the stored history
a body names is read off the loop, and so is everything a large body holds
— Chat Completions and Anthropic Messages bodies included (a 2 MB one took
6.5 ms to decode, every stream of the server waiting). Scripted engine."""

from __future__ import annotations

import asyncio
import json

import pytest

from lmspd.bodies import INLINE_BYTES
from lmspd.dialects import anthropic_messages, chat_completions
from lmspd.history import StoredContext
from lmspd.service import Service
from support.inprocess import MODEL, serving
from support.sse import parse_frames


def on_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@pytest.fixture
def hops(monkeypatch):
    """How many times a request went to the decoding threads, and on which
    side of the loop each store read ran."""
    seen = {"hops": 0, "history": [], "reference": []}
    decode = Service.decode

    async def counted(self, work):
        seen["hops"] += 1
        return await decode(self, work)

    history, reference = StoredContext.history, StoredContext.resolve_reference

    def spy_history(self, *a, **kw):
        seen["history"].append(on_loop())
        return history(self, *a, **kw)

    def spy_reference(self, *a, **kw):
        seen["reference"].append(on_loop())
        return reference(self, *a, **kw)

    monkeypatch.setattr(Service, "decode", counted)
    monkeypatch.setattr(StoredContext, "history", spy_history)
    monkeypatch.setattr(StoredContext, "resolve_reference", spy_reference)
    return seen


def test_a_small_body_that_names_nothing_stored_is_decoded_without_a_thread_hop(tmp_path, hops):
    with serving(tmp_path) as app:
        r = app.http.post("/v1/responses", json={"model": MODEL, "input": "hi"})
        assert r.status_code == 200, r.text
        assert hops["hops"] == 0
        first = r.json()

        # Its continuation reads the store: off the loop.
        r = app.http.post("/v1/responses", json={"model": MODEL, "input": "more",
                                                 "previous_response_id": first["id"]})
        assert r.status_code == 200, r.text
        assert hops["hops"] == 1 and hops["history"] == [False]

        # So does an item reference.
        item = first["output"][0]["id"]
        r = app.http.post("/v1/responses", json={"model": MODEL, "input": [{"type": "item_reference", "id": item}]})
        assert r.status_code == 200, r.text
        assert hops["hops"] == 2 and hops["reference"] == [False]

        # And a refusal found on the loop is the same refusal.
        r = app.http.post("/v1/responses", json={"model": MODEL, "input": "hi", "temperature": "hot"})
        assert r.status_code == 400 and hops["hops"] == 2


def test_a_large_body_is_decoded_in_a_thread(tmp_path, hops):
    with serving(tmp_path) as app:
        r = app.http.post("/v1/responses", json={"model": MODEL, "input": "x" * (INLINE_BYTES + 1)})
        assert r.status_code == 200, r.text
        assert hops["hops"] == 1


@pytest.mark.parametrize("path, module, extra", [
    ("/v1/chat/completions", chat_completions, {}),
    ("/v1/messages", anthropic_messages, {"max_tokens": 8}),
])
def test_a_large_compat_body_is_decoded_off_the_loop_and_a_small_one_on_it(tmp_path, monkeypatch, path, module,
                                                                            extra):
    where: list[bool] = []
    decode = module.decode_request

    def spy(raw, limits):
        where.append(on_loop())
        return decode(raw, limits)

    monkeypatch.setattr(module, "decode_request", spy)
    with serving(tmp_path) as app:
        for text in ("hi", "x" * (INLINE_BYTES + 1)):
            r = app.http.post(path, json={"model": MODEL, "messages": [{"role": "user", "content": text}], **extra})
            assert r.status_code == 200, r.text
    assert where == [True, False]


def test_replies_whose_size_follows_stored_data_are_serialized_off_the_loop(tmp_path, monkeypatch):
    """A page of a conversation's items, a stored response, its input items,
    a finished response: megabytes at worst, and serializing them on the
    event loop stalled every stream (a 34 MiB page of items: 114 ms)."""
    import lmspd.http

    replies: list[tuple[bool, int]] = []

    def spying(encode):
        def spy(body):
            out = encode(body)
            replies.append((on_loop(), len(out.encode() if isinstance(out, str) else out)))
            return out
        return spy

    monkeypatch.setattr(lmspd.http, "dumps", spying(lmspd.http.dumps))
    monkeypatch.setattr(lmspd.http, "dumps_in_pieces", spying(lmspd.http.dumps_in_pieces))
    big = "x" * 300_000

    def reply(r, large: bool = True) -> tuple[bool, int]:
        assert r.status_code == 200, r.text
        on, size = replies[-1]
        assert size == len(r.content) and (size > 300_000 or not large)
        return on, size

    with serving(tmp_path) as app:
        conversation = app.http.post("/v1/conversations", json={}).json()["id"]
        added = app.http.post(f"/v1/conversations/{conversation}/items",
                              json={"items": [{"type": "message", "role": "user", "content": big}]})
        assert reply(added)[0] is False
        item = added.json()["data"][0]["id"]
        assert reply(app.http.get(f"/v1/conversations/{conversation}/items"))[0] is False
        assert reply(app.http.get(f"/v1/conversations/{conversation}/items/{item}"))[0] is False

        # A finished response echoes its instructions; the stored one too.
        created = app.http.post("/v1/responses", json={"model": MODEL, "input": big, "instructions": big})
        assert reply(created)[0] is False
        response = created.json()["id"]
        assert reply(app.http.get(f"/v1/responses/{response}"))[0] is False
        assert reply(app.http.get(f"/v1/responses/{response}/input_items"))[0] is False
        # (LMSP's object does not echo the instructions: small here, yet its size follows the output.)
        lmsp = app.http.get(f"/lmsp/v1/responses/{response}", headers={"LMSP-Version": "1.0"})
        assert reply(lmsp, large=False)[0] is False
        # A small reply of the kind that never grows stays on the loop (no thread hop).
        assert app.http.get("/v1/models").status_code == 200
        assert replies[-1][0] is True


def test_a_background_create_reply_is_serialized_off_the_loop(tmp_path, monkeypatch):
    """The queued response a background create answers with echoes its
    instructions and tools (8 MB of them took 39 ms on the loop)."""
    import lmspd.http

    replies: list[tuple[bool, int]] = []
    encode = lmspd.http.dumps_in_pieces

    def spy(body):
        out = encode(body)
        replies.append((on_loop(), len(out)))
        return out

    monkeypatch.setattr(lmspd.http, "dumps_in_pieces", spy)
    big = "x" * 300_000
    with serving(tmp_path) as app:
        r = app.http.post("/v1/responses", json={"model": MODEL, "input": "hi", "instructions": big,
                                                 "background": True})
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "queued" and r.json()["output"] == []
    assert replies == [(False, len(r.content))]


def test_lifecycle_events_echo_a_large_request_without_encoding_it_on_the_loop(tmp_path, monkeypatch):
    """response.created, in_progress, completed (and each keep-alive) carry
    the whole Response object, which echoes the instructions: 8 MB of them
    took ~100 ms an event on the loop. They are encoded once, off the loop,
    and spliced into every frame: over SSE, over a WebSocket and for a
    background stream's follower (whose events are read back from the log)."""
    import lmspd.streaming.sse as sse

    on_loop_sizes: list[int] = []
    encode = sse._dumps

    def spy(value):
        out = encode(value)
        if on_loop():
            on_loop_sizes.append(len(out))
        return out

    monkeypatch.setattr(sse, "_dumps", spy)
    # Escaped in the frame (U+2028 ends a line for httpx), whole once read.
    big = "instructions\u2028" * 80_000
    body = {"model": MODEL, "input": "hi", "instructions": big}

    def echoed(events: list[dict]) -> list[str]:
        assert events[-1]["type"] == "response.completed", events[-1]
        return [e["type"] for e in events if e.get("response", {}).get("instructions") == big]

    with serving(tmp_path) as app:
        for extra in ({"stream": True}, {"stream": True, "background": True}):
            with app.http.stream("POST", "/v1/responses", json={**body, **extra}) as r:
                assert r.status_code == 200
                frames = [f for f in parse_frames(r.iter_lines()) if f.data != "[DONE]"]
            assert echoed([f.json() for f in frames])[0] == "response.created"
            assert {"response.in_progress", "response.completed"} <= set(echoed([f.json() for f in frames]))
        with app.http.websocket_connect("ws://localhost/v1/responses") as ws:
            ws.send_text(json.dumps({"type": "response.create", **body, "stream_id": "lane"}))
            events = [json.loads(ws.receive_text())]
            while events[-1]["type"] not in ("response.completed", "response.failed", "error"):
                events.append(json.loads(ws.receive_text()))
        assert echoed(events) == ["response.created", "response.in_progress", "response.completed"]
        assert {e["stream_id"] for e in events} == {"lane"}
    assert on_loop_sizes and max(on_loop_sizes) < 64 * 1024
