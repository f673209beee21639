"""What a dialect's decoder hands the rest of lmspd: one protocol for the
four per-dialect request holders (``LmspRequest``, ``OpenAIRequest``,
``ChatCompletionsRequest``, ``MessagesRequest``), so that handlers, tasks and
compaction are typed against it rather than against one dialect."""

from __future__ import annotations

from typing import Protocol

from lmspd.core.conversation import Conversation, Item
from lmspd.dialects.fields import FieldNames

__all__ = ["CompatRequest", "DecodedRequest", "ResponsesRequest"]


class DecodedRequest(Protocol):
    """A decoded request: the neutral conversation the core runs, and
    whether the reply streams."""

    @property
    def conversation(self) -> Conversation: ...

    @property
    def stream(self) -> bool: ...


class ResponsesRequest(DecodedRequest, Protocol):
    """A Responses request (LMSP or OpenAI): stored state and background runs."""

    @property
    def input_items(self) -> list[Item]:
        """This request's own input; ``conversation.items`` puts the stored
        history (previous response chain, conversation) before it."""
        ...

    @property
    def store(self) -> bool: ...

    @property
    def background(self) -> bool: ...

    @property
    def previous_response_id(self) -> str | None: ...

    @property
    def conversation_id(self) -> str | None: ...


class CompatRequest(DecodedRequest, Protocol):
    """A Chat Completions or Messages request: its messages become neutral
    items (one message may become several); the errors the core raises name
    neutral fields, which ``field_names`` names as this request does."""

    @property
    def field_names(self) -> FieldNames:
        """The request's names for the neutral fields, and the wire path
        of each neutral item (``messages[2].content[1]``)."""
        ...
