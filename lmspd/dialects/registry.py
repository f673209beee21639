"""The two Responses dialects side by side: what the shared handlers, the
task runner and crash recovery need to know of each, and nothing more."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable

from lmspd.core.conversation import Item, SamplingDefaults
from lmspd.core.errors import ApiError, RequestField
from lmspd.streaming.session import Encoder, ResponseState
from lmspd.streaming.sse import SSE_DONE, sse_event

from . import lmsp, openai_responses
from .decoded import ResponsesRequest
from .fields import FieldNames, responses_items

# Rebuilds a response from its event log: (events, model, created_at) ->
# (state, index of the item still open).
Rebuild = Callable[[list[tuple[str, dict[str, Any]]], str, int], tuple[ResponseState, "int | None"]]


def _no_echo(req: ResponsesRequest, sampling: SamplingDefaults) -> dict[str, Any]:
    return {}


def _openai_echo(req: ResponsesRequest, sampling: SamplingDefaults) -> dict[str, Any]:
    assert isinstance(req, openai_responses.OpenAIRequest)
    return openai_responses.echo_fields(req, sampling)


@dataclass(frozen=True)
class Dialect:
    name: str
    decode: Callable[..., ResponsesRequest]
    encoder: Callable[[], Encoder]
    response_json: Callable[[ResponseState], dict[str, Any]]
    # One wire event as SSE: (wire seq, name, data) -> bytes.
    frame: Callable[[int, str, dict[str, Any]], bytes]
    # What ends a stream after its terminal event (OpenAI's [DONE]).
    trailer: bytes | None
    # The stream-level ``error`` event, for a follower whose stream cannot
    # reach the terminal event: (error, wire seq it would take) -> bytes.
    stream_error: Callable[[ApiError, int], bytes]
    headers: dict[str, str]
    rebuild: Rebuild
    # Wire seq of the first event; a task's log numbers from 1 whatever the
    # dialect, so store seq = wire seq - first_seq + 1.
    first_seq: int
    # The request fields the response object repeats (OpenAI's echo of
    # instructions, tools, sampling...; LMSP repeats none), with the
    # model's own sampling settings where the request left them unset.
    echo: Callable[[ResponsesRequest, SamplingDefaults], dict[str, Any]] = _no_echo
    # What its requests call the neutral fields of the core's errors.
    field_names: Mapping[RequestField, str] = field(
        default_factory=lambda: MappingProxyType({RequestField.ITEMS: "input"}))

    def names(self, req: ResponsesRequest, items: Sequence[Item]) -> FieldNames:
        """``req``'s names for the core's fields, ``items`` being the
        conversation it handed the core (its history, then its input)."""
        return FieldNames(self.field_names, responses_items(items, req.input_items))

    def store_seq(self, wire_seq: int) -> int:
        return wire_seq - self.first_seq + 1

    def wire_seq(self, store_seq: int) -> int:
        return store_seq + self.first_seq - 1


OPENAI = Dialect(
    name="openai",
    decode=openai_responses.decode_request,
    encoder=openai_responses.OpenAIEncoder,
    response_json=openai_responses.response_json,
    frame=lambda seq, name, data: sse_event(name, data),
    trailer=SSE_DONE,
    stream_error=lambda exc, seq: sse_event("error", openai_responses.error_event(exc, seq)),
    headers={},
    rebuild=lambda events, model, created_at: openai_responses.state_from_log(events),
    first_seq=openai_responses.OpenAIEncoder.first_sequence_number,
    echo=_openai_echo,
    field_names=MappingProxyType({RequestField.ITEMS: "input", RequestField.OUTPUT_FORMAT: "text.format"}),
)

LMSP = Dialect(
    name="lmsp",
    decode=lmsp.decode_request,
    encoder=lmsp.LmspEncoder,
    response_json=lmsp.response_json,
    frame=lambda seq, name, data: sse_event(name, data, seq),
    trailer=None,
    # No id: it is not one of the response's events, so Last-Event-ID never names it.
    stream_error=lambda exc, seq: sse_event("error", lmsp.error_event(exc)),
    headers={"LMSP-Version": lmsp.VERSION},
    rebuild=lambda events, model, created_at: lmsp.state_from_log(events, model=model, created_at=created_at),
    first_seq=lmsp.LmspEncoder.first_sequence_number,
    field_names=MappingProxyType({RequestField.ITEMS: "input", RequestField.OUTPUT_FORMAT: "response_format"}),
)

DIALECTS = {d.name: d for d in (OPENAI, LMSP)}
