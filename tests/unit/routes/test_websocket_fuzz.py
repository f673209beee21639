"""The HTTP fuzz (test_http_fuzz.py), extended to the Responses WebSocket:

- messages, through the whole app in process: ``response.create`` bodies
  with any field mutated, other event types, non-JSON and binary frames.
  Every message but an acknowledgement gets exactly one ending (an
  ``error`` frame or a turn's one terminal event, nothing after it), never
  a 5xx, and a refused one changes nothing in the store;
- frames, on a real uvicorn socket: every field of the frame header (FIN,
  RSV1 -- the "compressed" bit -- RSV2, RSV3, opcode, mask, each length
  form) and its payload. The server answers or closes with a protocol code,
  never an internal error (1011), and keeps serving.
"""

from __future__ import annotations

import json
import os
import socket
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_http_fuzz import json_value, snapshot

from support.inprocess import MODEL, ThreadedServer, make_app, serving

URL = "ws://localhost/v1/responses"
TERMINAL = {"response.completed", "response.incomplete", "response.failed"}
_CREATE = {"type": "response.create", "model": MODEL, "input": "hi", "store": False}
_FIELDS = ["model", "input", "previous_response_id", "generate", "stream", "background", "store", "tools",
           "truncation", "tool_choice", "text", "instructions", "metadata", "max_output_tokens", "type",
           "stream_options", "reasoning", "conversation", "temperature", "extensions"]


@st.composite
def messages(draw) -> tuple[str, str | bytes]:
    """(kind, message): kind is "ack" for an acknowledgement (no reply)."""
    kind = draw(st.sampled_from(["create", "create", "other", "text", "binary", "ack"]))
    if kind == "create":
        body = dict(_CREATE)
        for _ in range(draw(st.integers(1, 3))):
            body[draw(st.sampled_from(_FIELDS))] = draw(json_value | st.sampled_from(
                [True, False, "auto", "disabled", "resp_x", [{"role": "user", "content": "x"}]]))
        return kind, json.dumps(body)
    if kind == "other":
        return kind, json.dumps({"type": draw(st.sampled_from(["response.cancel", "session.update", "", 7, [], {},
                                                               None])),
                                 "x": draw(json_value)})
    if kind == "text":
        return kind, draw(st.sampled_from(['{"type": "response.create", "input": "\\ud800"}', "[]", "{",
                                           '{"type": "response.create", "a": 1, "a": 2}', "NaN", ""])
                          | st.text(max_size=40))
    if kind == "binary":
        return kind, draw(st.binary(max_size=40))
    return kind, json.dumps({"type": "response.processed", "response_id": "resp_x"})


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    data = tmp_path_factory.mktemp("wsfuzz")
    with serving(data) as app:
        yield app, data / "lmspd.sqlite3"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(st.lists(messages(), min_size=1, max_size=4))
def test_no_message_is_a_5xx_or_loses_its_ending(rig, sent) -> None:
    app, db = rig
    with app.http.websocket_connect(URL) as ws:
        for kind, message in sent:
            before = snapshot(db)
            if isinstance(message, bytes):
                ws.send_bytes(message)
            else:
                ws.send_text(message)
            if kind == "ack":
                continue
            events = []
            while True:
                event = json.loads(ws.receive_text())
                events.append(event)
                if event["type"] == "error" or event["type"] in TERMINAL:
                    break
                assert event["type"] not in ("error",), events
            if events[-1]["type"] == "error":
                assert len(events) == 1, events  # an error frame is the whole answer
                assert events[0]["status"] < 500, (message, events[0])
                assert snapshot(db) == before, (message, events[0])
            else:
                assert events[0]["type"] == "response.created", events
                assert sum(e["type"] in TERMINAL for e in events) == 1
        # Nothing was left over: the next turn's first frame is its own.
        ws.send_text(json.dumps(_CREATE))
        first = json.loads(ws.receive_text())
        assert first["type"] == "response.created", first


# -- frames on a real socket -----------------------------------------------------------


def _handshake(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(f"GET /v1/responses HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                 "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                 "Sec-WebSocket-Version: 13\r\nSec-WebSocket-Extensions: permessage-deflate\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        piece = sock.recv(4096)
        assert piece, head
        head += piece
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock


def _frame(fin: bool, rsv: int, opcode: int, masked: bool, length_form: int, payload: bytes) -> bytes:
    first = (0x80 if fin else 0) | (rsv << 4) | opcode
    n = len(payload)
    if length_form == 0 and n < 126:
        head = struct.pack("!BB", first, (0x80 if masked else 0) | n)
    elif length_form <= 1 and n < 65536:
        head = struct.pack("!BBH", first, (0x80 if masked else 0) | 126, n)
    else:
        head = struct.pack("!BBQ", first, (0x80 if masked else 0) | 127, n)
    if not masked:
        return head + payload
    key = os.urandom(4)
    return head + key + bytes(b ^ key[i % 4] for i, b in enumerate(payload))


def _close_code(sock: socket.socket) -> int | None:
    """Read what the server sends for a moment; the close code if it closed."""
    data = b""
    try:
        while piece := sock.recv(65536):
            data += piece
    except (TimeoutError, socket.timeout, ConnectionResetError):
        pass
    pos = 0
    while pos + 2 <= len(data):
        opcode, n = data[pos] & 0x0F, data[pos + 1] & 0x7F
        pos += 2
        if n == 126:
            n, pos = struct.unpack("!H", data[pos:pos + 2])[0], pos + 2
        elif n == 127:
            n, pos = struct.unpack("!Q", data[pos:pos + 8])[0], pos + 8
        if opcode == 8:
            return struct.unpack("!H", data[pos:pos + 2])[0] if n >= 2 else 1005
        pos += n
    return None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    app, store = make_app(tmp_path_factory.mktemp("wsframes"))
    with ThreadedServer(app) as url:
        yield int(url.rsplit(":", 1)[1])
    store.close()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(fin=st.booleans(), rsv=st.integers(0, 7), opcode=st.integers(0, 15), masked=st.booleans(),
       length_form=st.integers(0, 2),
       payload=st.one_of(st.binary(max_size=64), st.just(json.dumps(_CREATE).encode()),
                         st.builds(lambda v: json.dumps(v).encode(), json_value)))
def test_no_frame_is_an_internal_error_and_the_server_goes_on(server, fin, rsv, opcode, masked, length_form,
                                                              payload) -> None:
    sock = _handshake(server)
    try:
        sock.sendall(_frame(fin, rsv, opcode, masked, length_form, payload))
        sock.settimeout(0.3)
        code = _close_code(sock)
    finally:
        sock.close()
    assert code != 1011, "the server failed on a frame"
    # And it still serves.
    sock = _handshake(server)
    try:
        sock.sendall(_frame(True, 0, 1, True, 0, json.dumps(_CREATE).encode()))
        sock.settimeout(5)
        got = b""
        while b"response.completed" not in got:
            piece = sock.recv(65536)
            assert piece, got
            got += piece
    finally:
        sock.close()
