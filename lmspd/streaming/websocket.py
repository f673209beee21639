"""The WebSocket framing of a stream session's wire events.

Responses WebSocket mode sends each event as one text frame holding the
exact JSON object an SSE ``data:`` line carries (same ``type``, same
``sequence_number``), with no ``event:`` framing and no ``[DONE]``: a
client would read ``[DONE]`` as the end of its *next* turn.
"""

from __future__ import annotations

from typing import Any

from lmspd.core.errors import ApiError
from lmspd.streaming.sse import Spliced, dumps


def event_frame(data: dict[str, Any], stream_id: str | None = None) -> str:
    """``stream_id``: the lane the turn's ``response.create`` named, which
    each of its events echoes (the SDK's ``Response*WsEvent`` types)."""
    if type(data) is Spliced:  # a large response's lifecycle event (lmspd.streaming.framing)
        return data.text() if stream_id is None else data.text(stream_id=stream_id)
    return dumps(data if stream_id is None else {**data, "stream_id": stream_id})


def error_frame(exc: ApiError, stream_id: str | None = None) -> str:
    return event_frame(exc.websocket_event(), stream_id)
