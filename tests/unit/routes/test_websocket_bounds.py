"""What a Responses WebSocket connection may make the server hold: its
remembered history (websocket_max_history_chars), connections per
credential and in all, the size of one message (ws_max_size), and no
permessage-deflate (which would inflate on the event loop)."""

from __future__ import annotations

import json
import threading
from dataclasses import replace

import pytest
from starlette.testclient import WebSocketDenialResponse
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from lmspd.core.conversation import Message, ToolOutput, orphan_tool_outputs
from lmspd.core.events import Finished, TextDelta, ToolCallDone, ToolCallStarted, Usage
from lmspd.core.limits import DEFAULT_LIMITS
from lmspd.http11 import WEBSOCKET_MESSAGE_SLACK
from lmspd.routes import websocket
from support.inprocess import MODEL, ScriptedEngine, ThreadedServer, make_app, serving

URL = "ws://localhost/v1/responses"


def turn(ws, **body) -> dict:
    ws.send_text(json.dumps({"type": "response.create", "model": MODEL, "store": False, **body}))
    while True:
        event = json.loads(ws.receive_text())
        if event["type"] in ("response.completed", "response.incomplete", "response.failed", "error"):
            return event


def chain(ws, truncation: str) -> list[dict]:
    # generate: false adds input at no cost to the client: the bound holds all the same.
    first = turn(ws, input="a" * 900, generate=False, truncation=truncation)
    second = turn(ws, input="b" * 900, previous_response_id=first["response"]["id"], generate=False,
                  truncation=truncation)
    # 900 + 900 + 900 (+ the output) is over the 2000 the connection may remember.
    third = turn(ws, input="c" * 900, previous_response_id=second["response"]["id"], truncation=truncation)
    fourth = turn(ws, input="d", previous_response_id=third["response"]["id"], truncation=truncation)
    return [first, second, third, fourth]


def test_remembered_history_is_bounded(tmp_path) -> None:
    limits = replace(DEFAULT_LIMITS, websocket_max_history_chars=2000)
    with serving(tmp_path, limits=limits) as app, app.http.websocket_connect(URL) as ws:
        events = chain(ws, "disabled")
    assert [e["type"] for e in events[:3]] == ["response.completed"] * 3
    # Not remembered (store: false): continuing it needs the full context.
    assert events[3]["type"] == "error" and events[3]["error"]["code"] == "previous_response_not_found", events[3]


def test_under_truncation_the_newest_history_is_remembered(tmp_path) -> None:
    limits = replace(DEFAULT_LIMITS, websocket_max_history_chars=2000)
    with serving(tmp_path, limits=limits) as app, app.http.websocket_connect(URL) as ws:
        events = chain(ws, "auto")
    assert [e["type"] for e in events] == ["response.completed"] * 4, events[-1]
    # The oldest items went first, as truncation would drop them.
    texts = [i.text for i in app.engine.conversations[-1].items if isinstance(i, Message)]
    assert "a" * 900 not in texts and "c" * 900 in texts and texts[-1] == "d"
    assert sum(map(len, texts)) <= 2000 + 1


LOOKUP = [{"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}]


def lookups(*between: str):
    """A script: calls of lookup, each with large arguments, with the
    texts ``between`` them, until the conversation's last item is an output
    or a user message; then a short answer."""

    def script(conversation):
        last = conversation.items[-1]
        if isinstance(last, ToolOutput) or (isinstance(last, Message) and last.text.startswith("more")):
            return [TextDelta("ok"), Finished("stop", Usage(3, 1))]
        events = []
        for i, text in enumerate(("", *between)):
            events += [TextDelta(text)] if text else []
            events += [ToolCallStarted(i, f"call_{i}", "lookup", "function", None),
                       ToolCallDone(i, '{"q": "' + "x" * 900 + '"}')]
        return [*events, Finished("tool_calls", Usage(3, 1))]

    return script


def test_under_truncation_a_forgotten_call_takes_its_output_with_it(tmp_path) -> None:
    """The call is the oldest, largest item: forgetting it alone kept its
    output, and the next continuation was refused for an output with no
    call (400), then, evicted, not found: the chain was lost."""
    limits = replace(DEFAULT_LIMITS, websocket_max_history_chars=1200)
    with serving(tmp_path, limits=limits, engine=ScriptedEngine(script=lookups())) as app, \
            app.http.websocket_connect(URL) as ws:
        base = {"truncation": "auto", "tools": LOOKUP}
        first = turn(ws, input="call lookup", **base)
        assert [i["type"] for i in first["response"]["output"]] == ["function_call"]
        output = {"type": "function_call_output", "call_id": "call_0", "output": "y" * 300}
        second = turn(ws, input=[output], previous_response_id=first["response"]["id"], **base)
        assert second["type"] == "response.completed", second
        third = turn(ws, input="more please", previous_response_id=second["response"]["id"], **base)
        assert third["type"] == "response.completed", third
        items = list(app.engine.conversations[-1].items)
    assert orphan_tool_outputs(items) == []
    assert not [i for i in items if isinstance(i, ToolOutput)], "the call went, so did its output"


def test_under_truncation_calls_awaiting_their_outputs_are_remembered(tmp_path) -> None:
    """A turn ends with two calls and a message between them: the next turn
    answers both calls, so neither may be forgotten, though the older one
    is older than the message (forgotten instead)."""
    limits = replace(DEFAULT_LIMITS, websocket_max_history_chars=1900)
    with serving(tmp_path, limits=limits, engine=ScriptedEngine(script=lookups("m" * 600))) as app, \
            app.http.websocket_connect(URL) as ws:
        base = {"truncation": "auto", "tools": LOOKUP}
        first = turn(ws, input="call lookup twice", **base)
        assert [i["type"] for i in first["response"]["output"]] == ["function_call", "message", "function_call"]
        outputs = [{"type": "function_call_output", "call_id": f"call_{i}", "output": "y"} for i in range(2)]
        second = turn(ws, input=outputs, previous_response_id=first["response"]["id"], **base)
        assert second["type"] == "response.completed", second
        items = list(app.engine.conversations[-1].items)
    assert orphan_tool_outputs(items) == []
    assert [type(i).__name__ for i in items] == ["ToolCall", "ToolCall", "ToolOutput", "ToolOutput"]


def test_a_long_history_is_measured_off_the_event_loop(tmp_path, monkeypatch) -> None:
    """Remembering a turn walks its whole chain (tens of ms at 65,536 items):
    beyond a few items, in the decoding pool."""
    threads = []
    within = websocket._within

    def spied(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return within(*args, **kwargs)

    monkeypatch.setattr(websocket, "_within", spied)
    monkeypatch.setattr(websocket, "_INLINE_ITEMS", 2)
    with serving(tmp_path) as app, app.http.websocket_connect(URL) as ws:
        first = turn(ws, input="hi")  # its input and its answer: two items
        second = turn(ws, input="more", previous_response_id=first["response"]["id"])
        third = turn(ws, input="again", previous_response_id=second["response"]["id"])
    assert third["type"] == "response.completed", third
    assert [name.startswith("lmspd-decode") for name in threads] == [False, True, True], threads


def test_connections_are_bounded_per_credential_and_in_all(tmp_path) -> None:
    limits = replace(DEFAULT_LIMITS, websocket_max_connections=3, websocket_max_connections_per_owner=2)
    with serving(tmp_path, limits=limits, keys=["k1", "k2"]) as app:
        one, two = ({"Authorization": "Bearer k1"}, {"Authorization": "Bearer k2"})
        with app.http.websocket_connect(URL, headers=one) as a, app.http.websocket_connect(URL, headers=one):
            with pytest.raises(WebSocketDenialResponse) as info:
                with app.http.websocket_connect(URL, headers=one):
                    pass
            assert info.value.status_code == 429 and "credential" in json.loads(info.value.content)["error"]["message"]
            with app.http.websocket_connect(URL, headers=two) as b:
                with pytest.raises(WebSocketDenialResponse) as info:
                    with app.http.websocket_connect(URL, headers=two):
                        pass
                assert info.value.status_code == 429 and "server" in json.loads(info.value.content)["error"]["message"]
                assert turn(b, input="hi")["type"] == "response.completed"
            assert turn(a, input="hi")["type"] == "response.completed"
        # Closed connections give their slots back.
        with app.http.websocket_connect(URL, headers=two) as b, app.http.websocket_connect(URL, headers=two) as c:
            assert turn(b, input="hi")["type"] == turn(c, input="hi")["type"] == "response.completed"


def test_message_size_and_no_deflate_on_the_real_server(tmp_path) -> None:
    limit = 64 * 1024
    limits = replace(DEFAULT_LIMITS, request=replace(DEFAULT_LIMITS.request, max_body_bytes=limit))
    app, store = make_app(tmp_path, limits=limits)
    try:
        with ThreadedServer(app, limits) as url:
            ws_url = url.replace("http://", "ws://") + "/v1/responses"
            with connect(ws_url, max_size=None) as ws:  # the client offers permessage-deflate
                assert ws.response.headers.get("Sec-WebSocket-Extensions") is None
                # Over the body limit, within the slack: an error frame naming the limit.
                ws.send(json.dumps({"type": "response.create", "model": MODEL, "input": "x" * limit}))
                error = json.loads(ws.recv(timeout=10))
                assert error["type"] == "error" and error["error"]["code"] == "request_too_large", error
                # The socket goes on.
                ws.send(json.dumps({"type": "response.create", "model": MODEL, "input": "hi", "store": False}))
                while json.loads(ws.recv(timeout=10))["type"] != "response.completed":
                    pass
                # Past it: the server closes (1009) rather than read it.
                ws.send("x" * (limit + WEBSOCKET_MESSAGE_SLACK + 1))
                with pytest.raises(ConnectionClosed) as closed:
                    ws.recv(timeout=10)
                assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
    finally:
        store.close()
