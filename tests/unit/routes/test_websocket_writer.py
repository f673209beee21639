"""A WebSocket turn never waits on the socket between its events: frames
leave through the connection's one writer, in order, while the engine
already has the request (over HTTP the coalescing middleware does the
same). A fake socket whose writes are slow shows it, in process."""

from __future__ import annotations

import asyncio
import json

from starlette.websockets import WebSocketState

from lmspd.routes.websocket import Connection
from support.engine import MODEL, ScriptedEngine
from support.inprocess import make_app

WRITE_S = 0.05


class SlowSocket:
    """Each send takes WRITE_S; records whether the engine had the request
    when the first frame was written."""

    def __init__(self, engine: ScriptedEngine, frames: list[str]) -> None:
        self.engine = engine
        self.client_state = WebSocketState.CONNECTED
        self.headers: dict[str, str] = {}
        self._in: asyncio.Queue = asyncio.Queue()
        for frame in frames:
            self._in.put_nowait({"type": "websocket.receive", "text": frame})
        self.sent: list[dict] = []
        self.generations_at_first_write: int | None = None
        self.done = asyncio.Event()

    async def receive(self) -> dict:
        return await self._in.get()

    async def send_text(self, text: str) -> None:
        await asyncio.sleep(WRITE_S)
        if self.generations_at_first_write is None:
            self.generations_at_first_write = self.engine.generations
        event = json.loads(text)
        self.sent.append(event)
        if event["type"] in ("response.completed", "error"):
            self.done.set()

    async def close(self, code: int = 1000) -> None:
        self.client_state = WebSocketState.DISCONNECTED


def test_frames_leave_in_order_while_the_engine_runs(tmp_path):
    engine = ScriptedEngine(("Hello", " there"))
    app, _ = make_app(tmp_path, engine=engine)
    create = json.dumps({"type": "response.create", "model": MODEL, "input": "hi", "store": False})

    async def main() -> SlowSocket:
        ws = SlowSocket(engine, [create])
        conn = Connection(app.state.lmspd, "local", ws)  # type: ignore[arg-type]
        serving = asyncio.create_task(conn.serve())
        await asyncio.wait_for(ws.done.wait(), 10)
        ws._in.put_nowait({"type": "websocket.disconnect"})
        await asyncio.wait_for(serving, 10)
        return ws

    ws = asyncio.run(main())
    types = [e["type"] for e in ws.sent]
    assert types[0] == "response.created" and types[-1] == "response.completed", types
    assert [e["sequence_number"] for e in ws.sent] == list(range(len(ws.sent)))
    # The engine had the request by the time the first frame was out (the
    # old handler wrote response.created and response.in_progress first).
    assert ws.generations_at_first_write == 1
    assert engine.generations == 1
