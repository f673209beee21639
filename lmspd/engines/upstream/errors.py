"""Typed failures of an upstream Chat Completions stream.

Every class carries a stable machine ``code`` (what ends up in
``Failed.code`` and in logs) and a ``message`` that is safe to show a client:
messages are fixed strings written here, never provider bytes, so a hostile
or careless provider cannot put credentials, markup or huge text into a
reply. Whatever the provider said is kept on private attributes for logs,
bounded and untrusted, the provider key scrubbed out where it was read
(``private_text``: client.py, chunks.py).

    UpstreamError                          upstream_error
      UpstreamTransportError               upstream_transport_error
        UpstreamCancelled                  upstream_cancelled
        UpstreamTimeout                    upstream_timeout
        UpstreamConnectionLost             upstream_connection_lost
        UpstreamHTTPError                  upstream_http_error
        UpstreamUnavailable                upstream_unavailable
      UpstreamProviderError                upstream_provider_error
      UpstreamContentFiltered              upstream_content_filter
      UpstreamProtocolError                upstream_protocol_error
        UpstreamLimitExceeded              upstream_limit_exceeded
          SSELineTooLong                   upstream_sse_line_too_long
          SSEEventTooLarge                 upstream_sse_event_too_large
          SSEBufferExceeded                upstream_sse_buffer_exceeded
          SSEAggregateExceeded             upstream_aggregate_exceeded
        StreamTruncated                    upstream_truncated
          SSETruncated                     upstream_sse_truncated
        MalformedChunk                     upstream_malformed_chunk
        InvalidToolIndex                   upstream_invalid_tool_index
        DuplicateToolIndex                 upstream_duplicate_tool_index
        DeltaAfterFinish                   upstream_delta_after_finish
        ContradictoryFinish                upstream_contradictory_finish
        DuplicateTerminal                  upstream_duplicate_terminal
        DataAfterDone                      upstream_data_after_done
        DuplicateCallId                    upstream_duplicate_call_id
        MissingToolName                    upstream_missing_tool_name
        UndeclaredTool                     undeclared_tool
        MalformedCustomToolInput           upstream_malformed_custom_tool_input
"""

from __future__ import annotations

from typing import ClassVar

from .credentials import Secret

# Provider text kept for logs is cut here; it is untrusted and never replied.
_PRIVATE_TEXT_LIMIT = 1024

# Provider error codes/types that may be named to a client. An allowlist,
# not a pattern: a provider holds lmspd's key and could echo it back in any
# token-shaped field.
KNOWN_PROVIDER_CODES = frozenset({
    "context_length_exceeded", "rate_limit_exceeded", "insufficient_quota", "invalid_api_key",
    "invalid_request_error", "model_not_found", "server_error", "api_error", "internal_server_error",
    "overloaded_error", "rate_limit_error", "authentication_error", "permission_error", "not_found_error",
    "timeout", "service_unavailable", "bad_request", "content_filter", "content_policy_violation",
    "invalid_prompt", "string_above_max_length", "tokens_exceeded", "model_overloaded",
})


# How servers say that the input does not fit the model's window: OpenAI's
# code and llama.cpp server's type; vLLM and SGLang send only a generic type
# (BadRequestError, code 400), so their wording. Read, never passed on.
_CONTEXT_OVERFLOW_CODES = frozenset({"context_length_exceeded", "exceed_context_size_error"})
_CONTEXT_OVERFLOW_WORDS = (
    "maximum context length",  # vLLM: "This model's maximum context length is N tokens. However, ..."
    "longer than the model's context length",  # SGLang: "The input (N tokens) is longer than ..."
    "longer than the maximum model length",  # vLLM: "The decoder prompt (length N) is longer than ..."
    "exceeds the available context size",  # llama.cpp server
)


def public_provider_code(*candidates: str | None) -> str | None:
    """The first candidate a client may see, or None."""
    return next((c for c in candidates if c in KNOWN_PROVIDER_CODES), None)


def provider_error_code(code: str | None, type_: str | None, message: str | None) -> str | None:
    """The code a client may see for a provider's error: ``context_length_exceeded``
    for each server's way of saying the input does not fit, else ``code`` or
    ``type_`` where allowlisted, else None."""
    if code in _CONTEXT_OVERFLOW_CODES or type_ in _CONTEXT_OVERFLOW_CODES:
        return "context_length_exceeded"
    if message is not None and any(words in message.lower() for words in _CONTEXT_OVERFLOW_WORDS):
        return "context_length_exceeded"
    return public_provider_code(code, type_)


def private_text(text: str | None, secret: Secret | None = None) -> str | None:
    """Provider text as kept for logs: the key scrubbed out, then cut to
    ``_PRIVATE_TEXT_LIMIT``. In that order: a cut through an echoed key
    leaves its head, which no longer matches the key to scrub."""
    if text is None:
        return None
    if secret is not None:
        text = secret.scrub(text)
    return text[:_PRIVATE_TEXT_LIMIT]


class UpstreamError(Exception):
    """Base of every upstream failure."""

    code: ClassVar[str] = "upstream_error"
    default_message: ClassVar[str] = "The upstream provider failed."

    def __init__(self, message: str | None = None) -> None:
        self.message = message or self.default_message
        super().__init__(self.message)


# -- transport -----------------------------------------------------------------


class UpstreamTransportError(UpstreamError):
    """The connection to the provider, not its bytes, went wrong."""

    code = "upstream_transport_error"
    default_message = "The connection to the upstream provider failed."


class UpstreamCancelled(UpstreamTransportError):
    """We cancelled the upstream request (client gone, downstream write failed)."""

    code = "upstream_cancelled"
    default_message = "The upstream request was cancelled."


class UpstreamTimeout(UpstreamTransportError):
    """Connect timeout, or the stream-idle watchdog fired."""

    code = "upstream_timeout"
    default_message = "The upstream provider timed out."


class UpstreamConnectionLost(UpstreamTransportError):
    code = "upstream_connection_lost"
    default_message = "The connection to the upstream provider was lost."


class UpstreamHTTPError(UpstreamTransportError):
    """A non-2xx status or a non-SSE content type before the stream started.

    ``provider_code`` is the provider's error code/type when it is a bare
    token (safe to show); ``detail`` is its message, for logs only;
    ``retry_after`` its Retry-After in seconds when it gave a sane one.
    """

    code = "upstream_http_error"

    def __init__(
        self,
        status: int,
        message: str | None = None,
        *,
        detail: str | None = None,
        provider_code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        self.status = status
        self.detail = private_text(detail)
        self.provider_code = provider_code
        self.retry_after = retry_after
        super().__init__(message or f"The upstream provider returned HTTP {status}.")


class UpstreamUnavailable(UpstreamTransportError):
    """No endpoint of the model accepted a connection."""

    code = "upstream_unavailable"
    default_message = "No upstream provider endpoint is reachable."


# -- provider-reported ----------------------------------------------------------


class UpstreamProviderError(UpstreamError):
    """The provider sent an error payload in the stream."""

    code = "upstream_provider_error"
    default_message = "The upstream provider reported an error."

    def __init__(
        self,
        message: str | None = None,
        *,
        provider_type: str | None = None,
        provider_code: str | None = None,
        provider_message: str | None = None,
    ) -> None:
        self.provider_type = private_text(provider_type)
        self.provider_code = private_text(provider_code)
        self.provider_message = private_text(provider_message)
        super().__init__(message)


class UpstreamContentFiltered(UpstreamError):
    """``finish_reason: content_filter``. The bridge now ends such a stream as
    an incomplete response (``Finished("content_filter")``); the class stays
    for adapters that treat a filtered stream as a failure."""

    code = "upstream_content_filter"
    default_message = "The upstream provider stopped the output with its content filter."


# -- protocol -------------------------------------------------------------------


class UpstreamProtocolError(UpstreamError):
    """The provider's bytes do not form a coherent Chat Completions stream."""

    code = "upstream_protocol_error"
    default_message = "The upstream provider sent a malformed stream."


class UpstreamLimitExceeded(UpstreamProtocolError):
    """The stream needs more memory than ``UpstreamStreamLimits`` allows."""

    code = "upstream_limit_exceeded"

    def __init__(self, limit: str, value: int, message: str | None = None) -> None:
        self.limit = limit
        self.value = value
        super().__init__(message or f"The upstream stream exceeded {limit}={value}.")


class SSELineTooLong(UpstreamLimitExceeded):
    code = "upstream_sse_line_too_long"

    def __init__(self, value: int) -> None:
        super().__init__("max_line_bytes", value)


class SSEEventTooLarge(UpstreamLimitExceeded):
    code = "upstream_sse_event_too_large"

    def __init__(self, value: int) -> None:
        super().__init__("max_event_bytes", value)


class SSEBufferExceeded(UpstreamLimitExceeded):
    code = "upstream_sse_buffer_exceeded"

    def __init__(self, value: int) -> None:
        super().__init__("max_buffered_bytes", value)


class SSEAggregateExceeded(UpstreamLimitExceeded):
    code = "upstream_aggregate_exceeded"

    def __init__(self, value: int) -> None:
        super().__init__("max_aggregate_bytes", value)


class StreamTruncated(UpstreamProtocolError):
    """The stream ended before a finish reason or ``[DONE]``."""

    code = "upstream_truncated"
    default_message = "The upstream stream ended before it finished."


class SSETruncated(StreamTruncated):
    """The stream ended inside an SSE event that carried data."""

    code = "upstream_sse_truncated"
    default_message = "The upstream stream ended inside an event."


class MalformedChunk(UpstreamProtocolError):
    """Bad JSON or a field of the wrong type or value."""

    code = "upstream_malformed_chunk"
    default_message = "The upstream provider sent a malformed chunk."


class InvalidToolIndex(UpstreamProtocolError):
    code = "upstream_invalid_tool_index"
    default_message = "The upstream provider sent a tool call without a valid index."


class DuplicateToolIndex(UpstreamProtocolError):
    code = "upstream_duplicate_tool_index"
    default_message = "The upstream provider repeated a choice or tool index within one chunk."


class DeltaAfterFinish(UpstreamProtocolError):
    code = "upstream_delta_after_finish"
    default_message = "The upstream provider sent output after the choice finished."


class ContradictoryFinish(UpstreamProtocolError):
    code = "upstream_contradictory_finish"
    default_message = "The upstream provider sent contradictory finish reasons."


class DuplicateTerminal(UpstreamProtocolError):
    code = "upstream_duplicate_terminal"
    default_message = "The upstream provider sent a second [DONE]."


class DataAfterDone(UpstreamProtocolError):
    code = "upstream_data_after_done"
    default_message = "The upstream provider sent data after [DONE]."


class DuplicateCallId(UpstreamProtocolError):
    code = "upstream_duplicate_call_id"
    default_message = "The upstream provider sent two tool calls with the same id."


class MissingToolName(UpstreamProtocolError):
    code = "upstream_missing_tool_name"
    default_message = "The upstream provider sent a tool call without a name."


class UndeclaredTool(UpstreamProtocolError):
    """A complete tool name that the request did not declare.

    The name stays private: it is model output a client never asked for.
    """

    code = "undeclared_tool"
    default_message = "The upstream provider called a tool the request did not declare."

    def __init__(self, name: str) -> None:
        self.name = private_text(name)
        super().__init__()


class MalformedCustomToolInput(UpstreamProtocolError):
    code = "upstream_malformed_custom_tool_input"
    default_message = 'The upstream provider sent custom tool arguments that are not {"input": "<string>"}.'


def error_codes() -> dict[str, type[UpstreamError]]:
    """Every code this module can produce, for registries and tests."""
    found: dict[str, type[UpstreamError]] = {}
    pending: list[type[UpstreamError]] = [UpstreamError]
    while pending:
        cls = pending.pop()
        found[cls.code] = cls
        pending.extend(cls.__subclasses__())
    return found
