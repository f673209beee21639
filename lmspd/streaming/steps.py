"""The lifecycle steps a ``StreamSession`` hands each dialect's encoder.

One small dataclass per step, so that an encoder is a ``match`` over their
types and a type checker sees which item each step carries (a text delta's
item is a ``Message``, an input delta's a ``ToolCall``). The steps describe
what happened to the response, not how any wire writes it: the session
decides the order (``streaming.session``), the encoder only the shape, or
that a step is not sent at all.

The response-level steps carry no data: the encoder reads the response
itself (``ResponseState``) as it stands when the step is taken. Item steps
carry the output ``index`` and the item, read at the same moment (an item's
``status`` changes between its steps).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lmspd.core.conversation import Message, Reasoning, ToolCall

OutputItem = Message | ToolCall | Reasoning


# -- the response ----------------------------------------------------------------
#
# ``event`` is the step's name in LMSP 1.0 (whose event names the Responses
# dialects share); a dialect that names them otherwise maps the type.


@dataclass(slots=True)
class ResponseCreated:
    event: ClassVar[str] = "response.created"


@dataclass(slots=True)
class ResponseInProgress:
    event: ClassVar[str] = "response.in_progress"


@dataclass(slots=True)
class Heartbeat:
    """Nothing to say for a while (a wait in the queue, a long prefill).
    SSE comments and WebSocket pings keep a connection open, but some
    clients time out on silence between *events* (Codex: its
    ``stream_idle_timeout``, 300 s, over SSE and WebSocket alike): a
    dialect whose protocol has an event for it sends that event."""

    event: ClassVar[str] = "response.in_progress"


@dataclass(slots=True)
class ResponseCompleted:
    event: ClassVar[str] = "response.completed"


@dataclass(slots=True)
class ResponseIncomplete:
    event: ClassVar[str] = "response.incomplete"


@dataclass(slots=True)
class ResponseFailed:
    event: ClassVar[str] = "response.failed"


@dataclass(slots=True)
class ResponseCancelled:
    event: ClassVar[str] = "response.cancelled"


ResponseStep = (ResponseCreated | ResponseInProgress | Heartbeat | ResponseCompleted | ResponseIncomplete
                | ResponseFailed | ResponseCancelled)
# The steps that end a response: exactly one per session.
TerminalStep = ResponseCompleted | ResponseIncomplete | ResponseFailed | ResponseCancelled


# -- any output item -------------------------------------------------------------


@dataclass(slots=True)
class ItemAdded:
    """An item joins the output (``status`` in_progress, or completed for a lead item)."""

    index: int
    item: OutputItem


@dataclass(slots=True)
class ItemDone:
    """An item is final (``status`` completed or incomplete)."""

    index: int
    item: OutputItem


# -- a message's text ------------------------------------------------------------


@dataclass(slots=True)
class TextPartAdded:
    index: int
    item: Message


@dataclass(slots=True)
class TextDelta:
    index: int
    item: Message
    delta: str


@dataclass(slots=True)
class TextDone:
    index: int
    item: Message


@dataclass(slots=True)
class TextPartDone:
    index: int
    item: Message


# -- reasoning text --------------------------------------------------------------


@dataclass(slots=True)
class ReasoningPartAdded:
    index: int
    item: Reasoning


@dataclass(slots=True)
class ReasoningDelta:
    index: int
    item: Reasoning
    delta: str


@dataclass(slots=True)
class ReasoningDone:
    index: int
    item: Reasoning


@dataclass(slots=True)
class ReasoningPartDone:
    index: int
    item: Reasoning


# -- a tool call's arguments (function) or input (custom) ------------------------


@dataclass(slots=True)
class ToolInputDelta:
    index: int
    item: ToolCall
    delta: str


@dataclass(slots=True)
class ToolInputDone:
    index: int
    item: ToolCall


Step = (ResponseStep | ItemAdded | ItemDone | TextPartAdded | TextDelta | TextDone | TextPartDone
        | ReasoningPartAdded | ReasoningDelta | ReasoningDone | ReasoningPartDone | ToolInputDelta
        | ToolInputDone)
