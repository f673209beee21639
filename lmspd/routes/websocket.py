"""Responses over WebSocket: ``ws://host:port/v1/responses``.

A connection carries turns one after another. Each ``response.create``
frame is an ordinary create body (``stream: false`` and ``background:
true`` are refused by name: the socket is the stream); its events come back as JSON text frames from the same
stream session as SSE (``lmspd.routes.responses.turn_events``), and the
turn ends with its terminal event. Failures end the turn with an ``error``
frame, never the connection.

The connection remembers its latest response — the whole chain of input
and output items, ``store: false`` included — in its own memory:
``previous_response_id`` naming it continues from it with only the new
input, and the engine continues the KV it left in place
(``cache_source=connection``): while the connection is open its session
keeps its sequence (``lmspd.core.conversation.SessionPin``), and when
sequences run out the least recently used connection's is the first to go.
Another connection never sees that state: a ``store: false`` id from
elsewhere is ``previous_response_not_found`` (stored responses are found in
the store as over HTTP). A continuation that fails evicts the response it
named: on this connection it is not found again, stored or not.
``generate: false`` prefills the input and keeps it (an empty completed
response whose id the next turn continues; on an engine that cannot
prefill without generating, the upstream one, nothing is sent). An
upstream provider's refusal is an ``error`` frame with the status the HTTP
reply would have, as over HTTP. Codex's ``response.processed``
acknowledgements are accepted silently. A create's ``stream_id`` (its
lane) is echoed on every event of its turn, errors included. After
``websocket_max_age_s`` (60 minutes) the connection ends with
``websocket_connection_limit_reached``.

What a connection may hold is bounded (``lmspd.core.limits``): the history
it remembers (``websocket_max_history_chars``: under ``truncation: "auto"``
its oldest items are forgotten first, as truncation drops them: a call
with its outputs, never a call still waiting for one; otherwise a response
past it is not remembered), connections per credential and in all (a 429
at the upgrade, ``lmspd.connections``), and one message (the body limit; uvicorn's
``ws_max_size`` closes the socket on a larger one, ``lmspd.http11``, which
also turns permessage-deflate off).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import Response
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from lmspd.bodies import INLINE_BYTES, decode_off_loop, parse_json_object
from lmspd.core.conversation import Item, Message, SessionPin, ToolCall, ToolOutput, drop_groups
from lmspd.core.errors import ApiError, invalid
from lmspd.core.ids import new_id
from lmspd.core.lifecycle import TERMINAL_EVENT_NAMES
from lmspd.core.limits import MAX_RESPONSE_ID_CHARS, MAX_STREAM_ID_CHARS
from lmspd.core.run import RunContext
from lmspd.dialects.registry import OPENAI
from lmspd.dialects.responses_items import Expansion
from lmspd.dialects.session import agent_lineage, session_key
from lmspd.history import StoredContext
from lmspd.http import LmspdApp
from lmspd.routes.responses import Turn, begin_turn, turn_events
from lmspd.streaming.framing import Framer
from lmspd.streaming.sse import dumps
from lmspd.streaming.websocket import error_frame, event_frame

log = logging.getLogger("lmspd.websocket")

# Create-body fields the socket decides. The guide says not to send them,
# but Codex always sends ``"stream": true`` (its WS request type has a
# non-optional ``stream``), and so does OpenAI's server accept it: what
# agrees with the socket is accepted, what contradicts it is refused by name.
_AGREEING = {"stream": True, "background": False}
_DROPPED = ("stream_options",)
# Client frames accepted and ignored (Codex acknowledges every response).
_IGNORED = frozenset({"response.processed"})
# Frames a turn may have produced ahead of the socket: beyond it the turn
# waits for the client (back-pressure, as a paused HTTP write).
_OUTBOX_FRAMES = 256
# How long the last frames may take to leave before a connection closes.
_FLUSH_S = 5.0
# Remembered histories up to this many items are measured on the event
# loop (a thread hop costs more); longer ones in the decoding pool.
_INLINE_ITEMS = 512
# Evicted ids a connection remembers (beyond them the oldest may be found
# in the store again), each at most MAX_RESPONSE_ID_CHARS long.
_MAX_EVICTED = 1024


@dataclass
class Latest:
    """The connection's most recent response: everything the model saw
    (history + input) and said, so that a turn can send only new input."""

    response_id: str
    items: list[Item]
    stored: bool
    # Tools its ``additional_tools`` items declared (Codex's Responses Lite):
    # a turn that sends only new input keeps them.
    tools: list[tuple[str, Any]] = field(default_factory=list)


class ConnectionContext:
    """``StoredContext`` for one connection: its latest response first, the
    store (this credential's stored responses) otherwise; a response a
    failed continuation evicted is not found on this connection at all."""

    def __init__(self, stored: StoredContext, latest: Latest | None, evicted: Container[str] = ()) -> None:
        self._stored = stored
        self._latest = latest
        self._evicted = evicted
        self.continued: Latest | None = None

    def history(self, previous_response_id: str | None, conversation_id: str | None,
                expansion: Expansion) -> list[Item]:
        if previous_response_id is not None and previous_response_id in self._evicted:
            raise ApiError("previous_response_not_found", f"Previous response {previous_response_id!r} not "
                           "found on this connection: a continuation of it failed. Send the full context.",
                           param="previous_response_id")
        latest = self._latest
        if previous_response_id is not None and latest is not None and previous_response_id == latest.response_id:
            self.continued = latest
            return expansion.add_all(list(latest.items), "previous_response_id")
        return self._stored.history(previous_response_id, conversation_id, expansion)

    def declared_tools(self, previous_response_id: str | None,
                       conversation_id: str | None) -> list[tuple[str, Any]]:
        latest = self._latest
        if latest is not None and previous_response_id is not None and previous_response_id == latest.response_id:
            return list(latest.tools)
        return self._stored.declared_tools(previous_response_id, conversation_id)

    def resolve_reference(self, item_id: str, where: str) -> Item:
        return self._stored.resolve_reference(item_id, where)

    def open_compaction(self, blob: str, item_id: str | None, where: str) -> Item:
        return self._stored.open_compaction(blob, item_id, where)


async def openai_responses_websocket(ws: WebSocket) -> None:
    app: LmspdApp = ws.app.state.lmspd
    try:
        who = app.auth.authenticate(ws)  # type: ignore[arg-type]
        who.require("responses:write")
        app.websocket_slots.take(who.owner)
    except ApiError as exc:
        await _deny(ws, exc)
        return
    try:
        await ws.accept()
        await Connection(app, who.owner, ws).serve()
    finally:
        app.websocket_slots.give_back(who.owner)


async def _deny(ws: WebSocket, exc: ApiError) -> None:
    """Refuse the upgrade with the HTTP error itself where the server can
    send one (uvicorn can), else close before accepting (HTTP 403)."""
    if "websocket.http.response" in ws.scope.get("extensions", {}):
        await ws.send_denial_response(Response(
            dumps(exc.openai()), status_code=exc.status or 401, headers=exc.headers, media_type="application/json"))
    else:
        await ws.close(code=1008)


class Connection:
    def __init__(self, app: LmspdApp, owner: str, ws: WebSocket) -> None:
        self.app = app
        self.owner = owner
        self.ws = ws
        self.latest: Latest | None = None
        self.pin = SessionPin(new_id("ws"))
        self._turn: asyncio.Task[None] | None = None
        # The turn before it, where that one's task was still unwinding when
        # this one began (it waits for it): stopped with it.
        self._unwinding: asyncio.Task[None] | None = None
        # The running turn's terminal event is out: for the client nothing
        # runs (the task may still be unwinding: a provider's close).
        self._turn_ended = False
        # Frames leave through one writer task (``_write_frames``), so that a
        # turn never waits on the socket between its events: the engine gets
        # the request while response.created is still being written (over
        # HTTP the coalescing middleware does the same).
        self._frames: asyncio.Queue[str] = asyncio.Queue(maxsize=_OUTBOX_FRAMES)
        self._gone = False
        # Ids a failed continuation evicted (oldest first): not found here
        # even where the store still has them.
        self._evicted: dict[str, None] = {}
        self._deadline = time.monotonic() + app.settings.limits.websocket_max_age_s

    async def serve(self) -> None:
        writer = asyncio.create_task(self._write_frames())
        # The age limit bounds whatever the connection waits on: the next
        # frame, and room in the outbox for its answer too (a client that
        # stopped reading leaves it full: serve() waits there, not in receive()).
        age = asyncio.timeout(self._deadline - time.monotonic())
        try:
            async with age:
                await self._receive_frames()
        except TimeoutError:
            if not age.expired():
                raise
            await self._expire()
        except WebSocketDisconnect:
            return
        finally:
            self.pin.close()
            # The client left: a running turn stops generating.
            await self._stop_turns()
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await writer

    async def _receive_frames(self) -> None:
        """Frames, each answered, until the client leaves."""
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            text = message.get("text")
            if text is None:
                await self._error(invalid("Frames must be text frames holding one JSON object.", None))
                continue
            await self._on_frame(text)

    async def _stop_turns(self) -> None:
        """The running turn cancelled, and the one it waits for, should that
        one still be unwinding (nothing would wait for it any more)."""
        for task in (self._turn, self._unwinding):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def _expire(self) -> None:
        await self._stop_turns()
        limit = self.app.settings.limits.websocket_max_age_s
        reached = ApiError("websocket_connection_limit_reached",
                           f"This connection reached its {limit / 60:g}-minute limit; open a new one.")
        # Queuing the error waits as long as leaving does: a client that
        # stopped reading leaves the outbox full, and must not keep its
        # connection (its slot, its session's sequence, its history) for it.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._last_words(reached), _FLUSH_S)
        # Closed even where the last frames did not leave in time: a dropped
        # socket reads 1006 to the client, not the limit it reached.
        with contextlib.suppress(Exception):
            await self.ws.close(code=1000)

    async def _last_words(self, exc: ApiError) -> None:
        """``exc`` sent after every frame queued before it."""
        await self._error(exc)
        await self._frames.join()

    async def _on_frame(self, text: str) -> None:
        try:
            # As an HTTP body: a large frame is decoded off the event loop.
            if len(text) <= INLINE_BYTES:
                frame = parse_json_object(text, self.app.limits)
            else:
                frame = await decode_off_loop(parse_json_object, text, self.app.limits)
        except ApiError as exc:
            await self._error(exc)
            return
        kind = frame.get("type")
        if isinstance(kind, str) and kind in _IGNORED:  # any JSON value: a list is unhashable
            return
        if kind != "response.create":
            shown = kind if isinstance(kind, str) else type(kind).__name__
            await self._error(invalid(f"Unsupported client event type {shown[:64]!r}: send 'response.create'.",
                                      "type"))
            return
        unwinding = None
        if self._turn is not None and not self._turn.done():
            if not self._turn_ended:
                await self._error(ApiError("concurrent_request", "A response is already in progress on this "
                                           "connection; wait for its terminal event before the next "
                                           "response.create."), _lane(frame))
                return
            # Its terminal event is out (the client may go on at once; it was
            # refused while the turn closed its provider stream): this one
            # starts once that one is done.
            unwinding = self._turn
        self._turn_ended = False
        self._unwinding = unwinding
        self._turn = asyncio.create_task(self._run_turn(frame, small=len(text) <= INLINE_BYTES, after=unwinding))

    async def _run_turn(self, frame: dict[str, Any], *, small: bool, after: asyncio.Task[None] | None) -> None:
        try:
            if after is not None:
                await asyncio.wait({after})  # its outcome is its own; a cancel of this one still raises
            await self._turn_body(frame, small=small)
        except Exception:
            # Errors end the turn (the reference): the client would wait
            # forever. Each is the turn's own, a RuntimeError too: a turn's
            # frames go through the outbox, and only the writer hears the
            # socket go away.
            log.exception("websocket turn failed")
            self._evict(frame.get("previous_response_id"))
            if not self._turn_ended:
                with contextlib.suppress(Exception):
                    await self._error(ApiError("server_error", "Internal server error."), _lane(frame))

    async def _turn_body(self, frame: dict[str, Any], *, small: bool) -> None:
        body = {k: v for k, v in frame.items() if k not in ("type", "generate", "stream_id", *_AGREEING, *_DROPPED)}
        context = ConnectionContext(StoredContext(self.app.store, self.owner, self.app.sealer), self.latest,
                                    self._evicted)
        previous = body.get("previous_response_id")
        lane: str | None = None
        try:
            lane = _stream_id(frame)
            for name, agreeing in _AGREEING.items():
                value = frame.get(name)
                if value is not None and value is not agreeing:  # null: unset, as over HTTP
                    raise ApiError("unsupported_parameter",
                                   f"'{name}: {str(value).lower()}' is not possible over WebSocket: every "
                                   "response.create streams its events on this socket.", param=name)
            generate = frame.get("generate")
            generate = True if generate is None else generate
            if not isinstance(generate, bool):
                raise invalid("'generate' must be a boolean.", "generate")
            agent, parent = agent_lineage(self.ws.headers)
            run_context = RunContext(owner=self.owner, session_key=session_key(self.ws.headers), agent_id=agent,
                                     parent_agent_id=parent, prefill_only=not generate, pin=self.pin)
            turn = await begin_turn(self.app, run_context, OPENAI, body, context=context)
        except ApiError as exc:
            self._evict(previous)
            await self._error(exc, lane)
            return
        except Exception:
            log.exception("response.create failed")
            self._evict(previous)
            await self._error(ApiError("server_error", "Internal server error."), lane)
            return
        if turn.run.opens_first:
            # As over HTTP: an engine that must reach its provider first does
            # it before any event, so that a refusal is an error frame with
            # the status the HTTP reply would have (clients retry on it),
            # not a response.failed.
            try:
                await turn.run.open()
            except ApiError as exc:
                self._evict(previous)
                await self._error(turn.dialect.names(turn.req, turn.window).name(exc), lane)
                return
        state = turn.session.state
        ended = False
        # A large request's echo in the lifecycle events is encoded off the loop, once.
        frame_event = Framer(lambda _seq, _name, data: event_frame(data, lane), decode_off_loop, small=small)
        # Closed here, not whenever the collector gets to it: a turn cancelled
        # while the outbox is full (the connection's age limit, the client
        # gone) gives back its provider request and queue slot at once.
        async with contextlib.aclosing(turn_events(turn)) as events:
            async for seq, name, data in events:
                if name in TERMINAL_EVENT_NAMES:
                    # Before the client hears the end: its next create may
                    # follow at once, and must find this response.
                    await self._remember(turn, previous)
                    ended = True
                await self._send(await frame_event(seq, name, data))
                self._turn_ended = ended
        if not ended:
            self._evict(previous)
        log.info("websocket connection=%s response=%s status=%s continued=%s", self.pin.name, state.id,
                 state.status, context.continued is not None)

    async def _remember(self, turn: Turn, previous: Any) -> None:
        """The ended turn as the connection's latest response, or the
        response it continued evicted if it failed."""
        state = turn.session.state
        if state.status not in ("completed", "incomplete"):
            self._evict(previous)
            return
        budget = self.app.settings.limits.websocket_max_history_chars
        truncate = turn.req.conversation.truncate
        # The walk is as long as the chain: a long one is measured off the event loop.
        if len(turn.window) + len(state.output) <= _INLINE_ITEMS:
            items = _remembered(turn.window, state.output, budget, truncate)
        else:
            items = await decode_off_loop(_remembered, turn.window, state.output, budget, truncate)
        # Stored only if the write succeeded: a later turn must not
        # name a predecessor the store does not have.
        self.latest = None if items is None else Latest(state.id, items, turn.req.store and turn.stored,
                                                        getattr(turn.req, "declared_tools", []))

    def _evict(self, previous: Any) -> None:
        # No longer id can name a response (``CreateResponse`` refuses it):
        # remembering one would only hold the client's bytes.
        if not isinstance(previous, str) or len(previous) > MAX_RESPONSE_ID_CHARS:
            return
        if self.latest is not None and previous == self.latest.response_id:
            self.latest = None
        self._evicted[previous] = None
        while len(self._evicted) > _MAX_EVICTED:
            del self._evicted[next(iter(self._evicted))]

    async def _error(self, exc: ApiError, stream_id: str | None = None) -> None:
        await self._send(error_frame(exc, stream_id))

    async def _send(self, text: str) -> None:
        if not self._gone:
            await self._frames.put(text)

    async def _write_frames(self) -> None:
        """The connection's one writer: frames in the order they were queued."""
        while True:
            text = await self._frames.get()
            try:
                if not self._gone and self.ws.client_state == WebSocketState.CONNECTED:
                    await self.ws.send_text(text)
            except Exception:  # the socket went away: serve() hears the disconnect
                self._gone = True
            finally:
                self._frames.task_done()


def _lane(frame: dict[str, Any]) -> str | None:
    """The frame's lane for an error about it; None where the lane itself is invalid."""
    try:
        return _stream_id(frame)
    except ApiError:
        return None


def _stream_id(frame: dict[str, Any]) -> str | None:
    """The lane a ``response.create`` names, which every event of its turn
    echoes. Lanes are names only: a connection runs one turn at a time
    whatever its lane (a second one is ``concurrent_request``), which keeps
    the FIFO order the SDK promises within a lane. Not a create body field
    (HTTP has no lanes), so taken out before the body is decoded."""
    value = frame.get("stream_id")
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_STREAM_ID_CHARS:
        raise invalid(f"'stream_id' must be a string of 1 to {MAX_STREAM_ID_CHARS} characters.", "stream_id")
    return value


def _remembered(window: list[Item], output: Sequence[Item], budget: int, truncate: bool) -> list[Item] | None:
    return _within(window + list(output), budget, truncate=truncate)


def _within(items: list[Item], budget: int, *, truncate: bool) -> list[Item] | None:
    """``items`` as the connection may remember them: whole, if their text
    fits ``budget`` characters; under truncation, without the oldest groups
    that truncation would drop first (``drop_groups``: a call with its
    outputs) until they fit, keeping every call still without an output
    (the next turn may send it); otherwise not at all (None)."""
    sizes = [_chars(item) for item in items]
    total = sum(sizes)
    if total <= budget:
        return items
    if not truncate:
        return None
    kept = [True] * len(items)
    for group in drop_groups(items, kept_calls=_unanswered(items)):
        if total <= budget:
            break
        for i in group:
            kept[i] = False
            total -= sizes[i]
    if total > budget:
        return None
    return list(itertools.compress(items, kept))


def _unanswered(items: list[Item]) -> set[str]:
    answered = {item.call_id for item in items if isinstance(item, ToolOutput)}
    return {item.call_id for item in items if isinstance(item, ToolCall) and item.call_id not in answered}


def _chars(item: Item) -> int:
    if isinstance(item, Message):
        return len(item.text) + len(item.compaction or "")
    if isinstance(item, ToolCall):
        return len(item.payload) + len(item.name) + len(item.call_id)
    if isinstance(item, ToolOutput):
        return len(item.output) + len(item.call_id)
    return (len(item.text or "") + sum(map(len, item.summary)) + len(item.encrypted_content or "")
            + len(item.hidden or ""))

