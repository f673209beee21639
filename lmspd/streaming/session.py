"""The stream session: the one place that owns a response's lifecycle.

It turns an engine's neutral events into output items with stable ids and
indexes, numbers the wire events, and guarantees exactly one terminal event.
Dialect encoders (``lmspd.dialects``) only decide how each lifecycle step
looks on their wire, or that it is not sent at all.

It knows nothing of transports: its wire events are ``(sequence number,
event name, data object)``, which SSE frames as ``event:``/``data:`` lines
(``lmspd.streaming.sse``) and a WebSocket sends as one JSON text frame each
(``lmspd.streaming.websocket``) — the same objects, the same numbers.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from lmspd.core.conversation import Message, Reasoning, ToolCall
from lmspd.core.events import (
    EngineEvent,
    Failed,
    Finished,
    ReasoningDelta,
    ReasoningDone,
    TextDelta,
    ToolCallDelta,
    ToolCallDone,
    ToolCallStarted,
    Usage,
)
from lmspd.core.ids import new_id
from lmspd.core.strict_json import has_surrogate
from lmspd.streaming import steps
from lmspd.streaming.steps import OutputItem, Step

__all__ = ["Encoder", "OutputItem", "ResponseState", "StreamSession", "WireEvent"]

log = logging.getLogger("lmspd.streaming")


@dataclass
class ResponseState:
    """A response as it is being built; every dialect serializes this."""

    id: str
    model: str
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: str = "in_progress"
    output: list[OutputItem] = field(default_factory=list)
    usage: Usage | None = None
    error: dict[str, Any] | None = None
    incomplete_reason: str | None = None
    # Which of the request's stop sequences ended the output, if one did.
    stop_sequence: str | None = None
    completed_at: int | None = None
    # The request fields a dialect echoes back on the Response object.
    echo: dict[str, Any] = field(default_factory=dict)
    # A stored response's lmspd ``extensions`` as they were written: read
    # back, the reports they were made from are gone.
    recorded_extensions: dict[str, Any] | None = None

    @property
    def output_text(self) -> str:
        return "".join(i.text for i in self.output if isinstance(i, Message))


class Encoder(Protocol):
    """How one dialect writes each lifecycle step (``None`` = not sent):
    a ``match`` over the step types of ``lmspd.streaming.steps``."""

    first_sequence_number: int

    def encode(self, step: Step, state: ResponseState, seq: int) -> tuple[str, dict[str, Any]] | None:
        ...


# A wire event: (sequence number, event name, data object).
WireEvent = tuple[int, str, dict[str, Any]]


class StreamSession:
    """Feeds engine events in, gets numbered wire events out."""

    def __init__(self, state: ResponseState, encoder: Encoder, spent: Usage | None = None) -> None:
        self.state = state
        self._encoder = encoder
        # What the model already did for this response before its run (a
        # compaction's summary, ``lmspd.compaction``): the response's usage
        # is that and the run's together.
        self.spent = spent
        self._seq = encoder.first_sequence_number
        self._open_index: int | None = None  # index of the item receiving deltas
        self._calls: dict[int, int] = {}  # engine tool index -> output index
        self._started = False
        self.terminated = False

    @classmethod
    def resume(
        cls, state: ResponseState, encoder: Encoder, *, next_seq: int, open_index: int | None
    ) -> "StreamSession":
        """A session for a response whose earlier events were sent by another
        session (a task's log cut off by a crash, rebuilt from the store):
        numbering continues at ``next_seq`` and ``fail``/``cancel`` close the
        item at ``open_index`` the way the original session would have."""
        session = cls(state, encoder)
        session._seq = next_seq
        session._open_index = open_index
        return session

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> list[WireEvent]:
        """response.created, then (unless queued) in_progress. Once: a turn
        that compacts starts its response before the run that ends it starts
        it again (``lmspd.compaction.CompactingRun``)."""
        if self._started:
            return []
        self._started = True
        out: list[WireEvent] = []
        self._emit(out, steps.ResponseCreated())
        if self.state.status == "queued":
            return out
        self._emit(out, steps.ResponseInProgress())
        return out

    def begin_progress(self) -> list[WireEvent]:
        """For a queued (background) response that starts running."""
        self.state.status = "in_progress"
        out: list[WireEvent] = []
        self._emit(out, steps.ResponseInProgress())
        return out

    def lead(self, items: list[OutputItem]) -> list[WireEvent]:
        """Complete items the response starts with, made once it was in
        progress (a compaction item, whose summary the client waited for
        hearing keep-alives), emitted (added, done) before the run's own."""
        out: list[WireEvent] = []
        for item in items:
            item.status = "completed"
            index = self._add_item(out, item)
            self._emit(out, steps.ItemDone(index, item))
        return out

    def heartbeat(self) -> list[WireEvent]:
        """The stream's keep-alive event, where its dialect has one
        (``steps.Heartbeat``); none before the start or after the end."""
        if self.terminated or self._seq == 0:
            return []
        out: list[WireEvent] = []
        self._emit(out, steps.Heartbeat())
        return out

    def handle(self, event: EngineEvent) -> list[WireEvent]:
        if self.terminated:
            return []
        if _unwritable(event):
            # No UTF-8 writer (SSE, WebSocket, the store) can carry a lone
            # surrogate: the response fails here, with its one terminal
            # event, rather than the writer midway through the stream.
            return self.fail("invalid_model_output", "The model's output is not valid text: it holds a lone "
                             "UTF-16 surrogate (half of a character).")
        out: list[WireEvent] = []
        if isinstance(event, TextDelta):
            self._text_delta(out, event.text)
        elif isinstance(event, ReasoningDelta):
            self._reasoning_delta(out, event.text)
        elif isinstance(event, ReasoningDone):
            item = self._open_item()
            if isinstance(item, Reasoning):
                item.encrypted_content = event.encrypted_content
                self._close_open(out)
        elif isinstance(event, ToolCallStarted):
            self._close_open(out)
            item = ToolCall(
                call_id=event.call_id,
                name=event.name,
                payload="",
                kind=event.kind,
                namespace=event.namespace,
                id=new_id("fc" if event.kind == "function" else "ctc"),
                status="in_progress",
            )
            index = self._add_item(out, item)
            self._calls[event.index] = index
        elif isinstance(event, ToolCallDelta):
            index = self._calls[event.index]
            item = self.state.output[index]
            assert isinstance(item, ToolCall)
            item.payload += event.delta
            self._emit(out, steps.ToolInputDelta(index, item, event.delta))
        elif isinstance(event, ToolCallDone):
            index = self._calls[event.index]
            item = self.state.output[index]
            assert isinstance(item, ToolCall)
            streamed = item.payload
            if len(event.payload) > len(streamed) and event.payload.startswith(streamed):
                # The engine may send a call whole at its end (no deltas, or
                # not all of it): the Chat and Messages streams carry a
                # call's input in deltas only, and would lose the rest.
                item.payload = event.payload
                self._emit(out, steps.ToolInputDelta(index, item, event.payload[len(streamed):]))
            elif event.payload != streamed:
                log.warning("tool call %s: its final input is not what was streamed; "
                            "a client that reads the deltas has other arguments", item.call_id)
            item.payload = event.payload
            self._emit(out, steps.ToolInputDone(index, item))
            item.status = "completed"
            self._emit(out, steps.ItemDone(index, item))
        elif isinstance(event, Finished):
            out += self._finish(event)
        elif isinstance(event, Failed):
            out += self.fail(event.code, event.message, event.usage)
        return out

    def fail(self, code: str, message: str, usage: Usage | None = None) -> list[WireEvent]:
        if self.terminated:
            return []
        out: list[WireEvent] = []
        self._close_open(out, status="incomplete")
        self.state.status = "failed"
        self.state.error = {"code": code, "message": message}
        self.state.usage = self._with_spent(usage or self.state.usage or Usage())
        self._terminate(out, steps.ResponseFailed())
        return out

    def cancel(self, usage: Usage | None = None) -> list[WireEvent]:
        if self.terminated:
            return []
        out: list[WireEvent] = []
        self._close_open(out, status="incomplete")
        self.state.status = "cancelled"
        self.state.usage = self._with_spent(usage or self.state.usage or Usage())
        self._terminate(out, steps.ResponseCancelled())
        return out

    # -- internals -----------------------------------------------------------

    def _finish(self, event: Finished) -> list[WireEvent]:
        if event.reason == "cancelled":
            return self.cancel(event.usage)
        out: list[WireEvent] = []
        incomplete = event.reason in _INCOMPLETE_REASONS
        self._close_open(out, status="incomplete" if incomplete else "completed")
        self.state.usage = self._with_spent(event.usage)
        if incomplete:
            self.state.status = "incomplete"
            # LMSP's own reasons; a dialect with a closed set maps them.
            self.state.incomplete_reason = _INCOMPLETE_REASONS[event.reason]
            self._terminate(out, steps.ResponseIncomplete())
        else:
            self.state.status = "completed"
            self.state.stop_sequence = event.stop_sequence
            self.state.completed_at = int(time.time())
            self._terminate(out, steps.ResponseCompleted())
        return out

    def _with_spent(self, usage: Usage) -> Usage:
        spent = self.spent
        if spent is None:
            return usage
        # The run's own reports (cache source, diagnostics) stay its own.
        return replace(usage, input_tokens=usage.input_tokens + spent.input_tokens,
                       output_tokens=usage.output_tokens + spent.output_tokens,
                       cached_tokens=usage.cached_tokens + spent.cached_tokens,
                       cache_write_tokens=usage.cache_write_tokens + spent.cache_write_tokens,
                       reasoning_tokens=usage.reasoning_tokens + spent.reasoning_tokens)

    def _terminate(self, out: list[WireEvent], step: steps.TerminalStep) -> None:
        # A tool call cut off mid-arguments cannot be executed: close it as
        # incomplete so that every added item also has its done event.
        for index, item in enumerate(self.state.output):
            if item.status == "in_progress":
                item.status = "incomplete"
                self._emit(out, steps.ItemDone(index, item))
        self.terminated = True
        self._emit(out, step)

    def _text_delta(self, out: list[WireEvent], text: str) -> None:
        item = self._open_item()
        if not isinstance(item, Message):
            self._close_open(out)
            item = Message(role="assistant", text="", id=new_id("msg"), status="in_progress")
            self._open_index = self._add_item(out, item)
            self._emit(out, steps.TextPartAdded(self._open_index, item))
        assert self._open_index is not None
        item.text += text
        self._emit(out, steps.TextDelta(self._open_index, item, text))

    def _reasoning_delta(self, out: list[WireEvent], text: str) -> None:
        item = self._open_item()
        if not isinstance(item, Reasoning):
            self._close_open(out)
            item = Reasoning(text="", id=new_id("rs"), status="in_progress")
            self._open_index = self._add_item(out, item)
            self._emit(out, steps.ReasoningPartAdded(self._open_index, item))
        assert self._open_index is not None
        item.text = (item.text or "") + text
        self._emit(out, steps.ReasoningDelta(self._open_index, item, text))

    def _open_item(self) -> OutputItem | None:
        return None if self._open_index is None else self.state.output[self._open_index]

    def _add_item(self, out: list[WireEvent], item: OutputItem) -> int:
        self.state.output.append(item)
        index = len(self.state.output) - 1
        self._emit(out, steps.ItemAdded(index, item))
        return index

    def _close_open(self, out: list[WireEvent], status: str = "completed") -> None:
        index = self._open_index
        if index is None:
            return
        self._open_index = None
        item = self.state.output[index]
        if isinstance(item, Message):
            self._emit(out, steps.TextDone(index, item))
            self._emit(out, steps.TextPartDone(index, item))
        elif isinstance(item, Reasoning):
            self._emit(out, steps.ReasoningDone(index, item))
            self._emit(out, steps.ReasoningPartDone(index, item))
        item.status = status
        self._emit(out, steps.ItemDone(index, item))

    def _emit(self, out: list[WireEvent], step: Step) -> None:
        encoded = self._encoder.encode(step, self.state, self._seq)
        if encoded is None:
            return
        name, data = encoded
        out.append((self._seq, name, data))
        self._seq += 1


def _unwritable(event: EngineEvent) -> bool:
    if isinstance(event, (TextDelta, ReasoningDelta)):
        return has_surrogate(event.text)
    if isinstance(event, ToolCallDelta):
        return has_surrogate(event.delta)
    if isinstance(event, ToolCallStarted):
        return has_surrogate(event.name) or has_surrogate(event.call_id)
    if isinstance(event, ToolCallDone):
        return has_surrogate(event.payload)
    return False


# Why a response is incomplete, by the engine's finish reason. "repetition"
# and "context_window" are LMSP's (its reason set is open); OpenAI Responses,
# whose set is closed (max_output_tokens | content_filter), reports them as
# max_output_tokens, Anthropic the window as model_context_window_exceeded.
_INCOMPLETE_REASONS = {"length": "max_output_tokens", "content_filter": "content_filter",
                       "repetition": "repetition", "context_window": "context_window"}
