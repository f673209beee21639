"""A WebSocket connection's turns, against a fake socket (the route's
``Connection`` over the scripted engine): a create sent the moment the
previous terminal event arrives is served, an unexpected failure in a turn
ends it with an error frame, and the connection's age limit closes the
socket even where its last frames cannot leave."""

from __future__ import annotations

import asyncio
import json

from starlette.websockets import WebSocketState

import lmspd.routes.websocket as websocket
from lmspd.routes.websocket import Connection
from support.engine import MODEL, ScriptedEngine
from support.inprocess import make_app

TERMINAL = ("response.completed", "response.failed", "error")


class Socket:
    """The client side: ``turns`` creates, each sent the moment the previous
    turn's terminal frame (or error frame) arrives."""

    def __init__(self, turns: int, *, stall: bool = False) -> None:
        self.client_state = WebSocketState.CONNECTED
        self.headers: dict[str, str] = {}
        self.incoming: asyncio.Queue[dict] = asyncio.Queue()
        self.sent: list[dict] = []
        self.closed_with: int | None = None
        self.left = turns
        self.stall = stall
        self.done = asyncio.Event()
        self._create()

    def _create(self) -> None:
        self.left -= 1
        self.incoming.put_nowait({"type": "websocket.receive", "text": json.dumps(
            {"type": "response.create", "model": MODEL, "input": "hi", "store": False})})

    async def receive(self) -> dict:
        return await self.incoming.get()

    async def send_text(self, text: str) -> None:
        if self.stall:
            await asyncio.Event().wait()  # the client reads nothing more
        event = json.loads(text)
        self.sent.append(event)
        if event["type"] in TERMINAL:
            if self.left > 0:
                self._create()
            else:
                self.done.set()

    async def close(self, code: int = 1000) -> None:
        self.closed_with = code
        self.client_state = WebSocketState.DISCONNECTED


def _serve(tmp_path, engine: ScriptedEngine, socket: Socket, **settings) -> list[tuple[str, str | None]]:
    async def go() -> None:
        app, _ = make_app(tmp_path, engine=engine, **settings)
        connection = Connection(app.state.lmspd, "local", socket)
        served = asyncio.create_task(connection.serve())
        await asyncio.wait_for(socket.done.wait(), 10)
        socket.incoming.put_nowait({"type": "websocket.disconnect"})
        await asyncio.wait_for(served, 10)

    asyncio.run(go())
    return [(e["type"], (e.get("error") or {}).get("code")) for e in socket.sent if e["type"] in TERMINAL]


def test_a_create_sent_as_the_terminal_event_arrives_is_served(tmp_path):
    """The turn's task still unwinds after its terminal event (here the
    scripted engine's pause; an upstream provider's stream close): the next
    create was refused with concurrent_request, though nothing ran for the
    client."""
    engine = ScriptedEngine(("Hello", " there"), delay_s=0.02)
    ends = _serve(tmp_path, engine, Socket(3))
    assert ends == [("response.completed", None)] * 3


def test_an_unexpected_failure_ends_the_turn_with_an_error_frame(tmp_path, monkeypatch):
    async def broken(self, turn, previous):
        raise ValueError("a bug")

    monkeypatch.setattr(Connection, "_remember", broken)
    ends = _serve(tmp_path, ScriptedEngine(("Hello",)), Socket(1))
    assert ends == [("error", "server_error")]


def test_the_age_limit_closes_the_socket_where_its_last_frames_cannot_leave(tmp_path, monkeypatch):
    monkeypatch.setattr(websocket, "_FLUSH_S", 0.1)
    socket = Socket(0, stall=True)
    socket.incoming = asyncio.Queue()  # no create: the connection only ages

    async def go() -> None:
        app, _ = make_app(tmp_path)
        connection = Connection(app.state.lmspd, "local", socket)
        connection._deadline = 0  # past its age limit
        await asyncio.wait_for(connection.serve(), 10)

    asyncio.run(go())
    assert socket.closed_with == 1000
