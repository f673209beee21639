"""A Responses WebSocket client for tests, over the ``websockets`` package
(independent of lmspd's own code)."""

from __future__ import annotations

import json
from typing import Any

from websockets.sync.client import ClientConnection, connect

TERMINAL = {"response.completed", "response.incomplete", "response.failed", "error"}


def ws_url(server_url: str) -> str:
    return server_url.replace("http://", "ws://", 1) + "/v1/responses"


def open_ws(server_url: str, headers: dict[str, str] | None = None) -> ClientConnection:
    return connect(ws_url(server_url), additional_headers=headers or {}, open_timeout=30, max_size=2**24)


def read_turn(ws: ClientConnection, timeout: float = 120) -> list[dict[str, Any]]:
    """Every frame up to and including the turn's terminal event (or error)."""
    events: list[dict[str, Any]] = []
    while True:
        raw = ws.recv(timeout=timeout)
        assert isinstance(raw, str), f"binary frame: {raw!r}"
        assert raw != "[DONE]", "a [DONE] frame over WebSocket"
        event = json.loads(raw)
        events.append(event)
        if event["type"] in TERMINAL:
            return events


def create(ws: ClientConnection, body: dict[str, Any], timeout: float = 120) -> list[dict[str, Any]]:
    ws.send(json.dumps({"type": "response.create", **body}))
    return read_turn(ws, timeout)
