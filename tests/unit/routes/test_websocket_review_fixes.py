"""A Responses WebSocket connection against a fake socket (the route's
``Connection`` over the scripted engine), where a connection could hold
more than it should or a turn could end without the client hearing it: a
client that stops reading past the age limit, long ids in failed creates, a
RuntimeError inside a turn, a turn still unwinding when the connection
ends, and a turn that compacts."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import pytest
from starlette.websockets import WebSocketState

import lmspd.routes.websocket as websocket
from lmspd.core.compaction import is_compaction
from lmspd.core.conversation import Item
from lmspd.core.limits import MAX_RESPONSE_ID_CHARS
from lmspd.routes.websocket import Connection
from support.engine import MODEL, ScriptedEngine
from support.inprocess import make_app

TERMINAL = ("response.completed", "response.incomplete", "response.failed", "error")


def create(**body) -> dict:
    return {"type": "response.create", "model": MODEL, "input": "hi", "store": False, **body}


def continuing(**body) -> Callable[[dict], dict]:
    """A create continuing the response the previous turn ended with."""
    return lambda ended: create(previous_response_id=ended["response"]["id"], **body)


class Client:
    """The client side: its turns' frames, each sent the moment the previous
    turn's terminal (or error) frame arrives; a turn given as a function is
    the frame it makes of that terminal frame (a continuation). Done after
    the last turn ends. ``reading=False``: a client that reads nothing (its
    TCP window full, the server's send waits forever)."""

    def __init__(self, *turns: dict | Callable[[dict], dict], reading: bool = True) -> None:
        self.client_state = WebSocketState.CONNECTED
        self.headers: dict[str, str] = {}
        self.incoming: asyncio.Queue[dict] = asyncio.Queue()
        self.turns = list(turns)
        self.reading = reading
        self.sent: list[dict] = []
        self.closed_with: int | None = None
        self.done = asyncio.Event()
        self._next({})

    def send(self, frame: dict) -> None:
        self.incoming.put_nowait({"type": "websocket.receive", "text": json.dumps(frame)})

    def leave(self) -> None:
        self.incoming.put_nowait({"type": "websocket.disconnect"})

    def _next(self, ended: dict) -> None:
        if not self.turns:
            self.done.set()
            return
        turn = self.turns.pop(0)
        self.send(turn(ended) if callable(turn) else turn)

    async def receive(self) -> dict:
        return await self.incoming.get()

    async def send_text(self, text: str) -> None:
        if not self.reading:
            await asyncio.Event().wait()
        event = json.loads(text)
        self.sent.append(event)
        if event["type"] in TERMINAL:
            self._next(event)

    async def close(self, code: int = 1000) -> None:
        self.closed_with = code
        self.client_state = WebSocketState.DISCONNECTED

    def ends(self) -> list[tuple[str, str | None]]:
        return [(e["type"], (e.get("error") or {}).get("code")) for e in self.sent if e["type"] in TERMINAL]


def _converse(tmp_path, client: Client, engine: ScriptedEngine | None = None) -> Connection:
    """``client``'s turns on one connection, until it is done; then it leaves."""
    async def go() -> Connection:
        app, _ = make_app(tmp_path, engine=engine)
        connection = Connection(app.state.lmspd, "local", client)  # type: ignore[arg-type]
        served = asyncio.create_task(connection.serve())
        await asyncio.wait_for(client.done.wait(), 5)
        client.leave()
        await asyncio.wait_for(served, 5)
        return connection

    return asyncio.run(go())


# -- the age limit, for a client that stopped reading ------------------------

def _age_out(tmp_path, client: Client, engine: ScriptedEngine | None = None) -> float:
    """How long ``client``'s connection, 0.5 s from its age limit, took to end."""
    async def go() -> float:
        app, _ = make_app(tmp_path, engine=engine)
        connection = Connection(app.state.lmspd, "local", client)  # type: ignore[arg-type]
        connection._deadline = time.monotonic() + 0.5
        began = time.monotonic()
        await asyncio.wait_for(connection.serve(), 5)
        return time.monotonic() - began

    return asyncio.run(go())


def test_the_age_limit_ends_a_turn_whose_client_stopped_reading(tmp_path, monkeypatch):
    """The turn filled the outbox; at its age limit the connection queued
    its error frame behind it with no bound, and waited there forever: its
    slot, its session's sequence and its history were held for good."""
    monkeypatch.setattr(websocket, "_FLUSH_S", 0.1)
    engine = ScriptedEngine(tuple(f"w{i} " for i in range(2 * websocket._OUTBOX_FRAMES)))
    client = Client(create(), reading=False)
    assert _age_out(tmp_path, client, engine) < 2
    assert client.closed_with == 1000


def test_the_age_limit_ends_a_connection_waiting_to_answer_a_frame(tmp_path, monkeypatch):
    """Frames that each want an error frame, from a client that reads none:
    serve() waited for room in the outbox, where the age limit (checked
    only while it waited for a frame) never reached it."""
    monkeypatch.setattr(websocket, "_FLUSH_S", 0.1)
    client = Client(reading=False)
    for _ in range(websocket._OUTBOX_FRAMES + 2):
        client.send({"type": "bogus"})
    assert _age_out(tmp_path, client) < 2
    assert client.closed_with == 1000


# -- long ids in failed creates ---------------------------------------------

def test_a_previous_response_id_longer_than_an_id_is_refused_and_not_remembered(tmp_path):
    """Any length was accepted, and every failed create remembered the id it
    named (up to 1024 of them), validation errors included: 4 MiB ids made
    one connection hold gigabytes."""
    too_long = "resp_" + "x" * MAX_RESPONSE_ID_CHARS
    unknown = "resp_" + "y" * (MAX_RESPONSE_ID_CHARS - 5)
    client = Client(create(previous_response_id=too_long), create(previous_response_id=unknown))
    connection = _converse(tmp_path, client)
    refused, not_found = client.sent
    assert refused["error"]["code"] == "invalid_request" and refused["error"]["param"] == "previous_response_id"
    assert f"at most {MAX_RESPONSE_ID_CHARS} characters" in refused["error"]["message"]
    assert not_found["error"]["code"] == "previous_response_not_found"
    # An id that may name a response, once its create failed, is still not found here again.
    assert list(connection._evicted) == [unknown]


# -- a RuntimeError inside a turn -------------------------------------------

@pytest.mark.parametrize("error", [RuntimeError, NotImplementedError, RecursionError])
def test_a_runtime_error_in_a_turn_ends_it_with_an_error_frame(tmp_path, monkeypatch, error):
    """RuntimeError (and its subclasses) was taken for the socket going away
    under a send, which a turn's sends, through the outbox, never see: the
    turn ended with no terminal event and no error frame (the client waited
    forever), and the response it continued was not evicted."""
    remember = Connection._remember

    async def broken_once(self, turn, previous):
        if previous is not None and previous not in self._evicted:
            raise error("a bug")
        await remember(self, turn, previous)

    monkeypatch.setattr(Connection, "_remember", broken_once)
    completed: list[str] = []

    def continuing_it(ended: dict) -> dict:
        completed.append(ended["response"]["id"])
        return create(previous_response_id=completed[0])

    client = Client(create(), continuing_it, lambda _error: create(previous_response_id=completed[0]))
    _converse(tmp_path, client)
    assert client.ends() == [("response.completed", None), ("error", "server_error"),
                             ("error", "previous_response_not_found")]


# -- a turn still unwinding when the connection ends ----------------------------

def test_the_turn_still_unwinding_when_the_connection_ends_is_stopped(tmp_path):
    """A create that follows a terminal event at once waits for that turn's
    task to finish unwinding (a provider's stream close; here the scripted
    engine's pause after its last event). The connection ended by
    cancelling only the waiting turn: the one it waited for ran on, with
    nothing left to wait for it."""
    client = Client(create())

    async def go() -> None:
        app, _ = make_app(tmp_path, engine=ScriptedEngine((), delay_s=60))
        connection = Connection(app.state.lmspd, "local", client)  # type: ignore[arg-type]
        served = asyncio.create_task(connection.serve())
        await asyncio.wait_for(client.done.wait(), 5)
        unwinding = connection._turn
        assert unwinding is not None and not unwinding.done()
        client.send(create())
        client.leave()
        await asyncio.wait_for(served, 5)
        # Checked here: once go() returns, asyncio.run cancels every task left.
        assert unwinding.done()

    asyncio.run(go())


# -- a turn that compacts -----------------------------------------------------

def test_a_turn_that_compacts_remembers_its_compaction_item_once(tmp_path, monkeypatch):
    """The window the turn continued from already ended with the compaction
    item, and the turn's output starts with it: the connection remembered
    it twice, and counted it twice against websocket_max_history_chars."""
    engine = ScriptedEngine()
    threshold = [{"type": "compaction", "compact_threshold": 1}]
    client = Client(create(input="a long story", context_management=threshold), continuing(input="more"))
    remembered: list[list[Item]] = []
    remember = Connection._remember

    async def spied(self, turn, previous):
        await remember(self, turn, previous)
        remembered.append(list(self.latest.items))

    monkeypatch.setattr(Connection, "_remember", spied)
    _converse(tmp_path, client, engine)
    assert client.ends() == [("response.completed", None)] * 2
    assert sum(map(is_compaction, remembered[0])) == 1
    # The model saw the same: the reduced window, ending with the item, and
    # the continuation with it once.
    answered, continued = engine.conversations[-2:]
    assert is_compaction(answered.items[-1]) and sum(map(is_compaction, answered.items)) == 1
    assert sum(map(is_compaction, continued.items)) == 1
