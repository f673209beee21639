"""What a Responses WebSocket connection may make the server hold: its
remembered history (websocket_max_history_chars), connections per
credential and in all, the size of one message (ws_max_size), and no
permessage-deflate (which would inflate on the event loop)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from starlette.testclient import WebSocketDenialResponse
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from lmspd.core.conversation import Message
from lmspd.core.limits import DEFAULT_LIMITS
from lmspd.http11 import WEBSOCKET_MESSAGE_SLACK
from support.inprocess import MODEL, ThreadedServer, make_app, serving

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
