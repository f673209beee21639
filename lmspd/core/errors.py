"""One error type for every failure a client can see, rendered per dialect.

Handlers and engines raise ``ApiError``; the dialect at the edge decides the
wire shape: RFC 9457 ``application/problem+json`` on ``/lmsp/v1``, OpenAI's
``{"error": {...}}`` on ``/v1``, Anthropic's ``{"type": "error", ...}`` on
``/v1/messages``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

# code -> (HTTP status, problem title, OpenAI error type)
_CODES: dict[str, tuple[int, str, str]] = {
    "invalid_request": (400, "Invalid request", "invalid_request_error"),
    "invalid_json": (400, "Invalid JSON", "invalid_request_error"),
    "unsupported_media_type": (415, "Unsupported media type", "invalid_request_error"),
    "request_too_large": (413, "Request body too large", "invalid_request_error"),
    "headers_too_large": (431, "Request header fields too large", "invalid_request_error"),
    "request_timeout": (408, "Request timeout", "invalid_request_error"),
    "unsupported_capability": (400, "Unsupported capability", "invalid_request_error"),
    "unsupported_parameter": (400, "Unsupported parameter", "invalid_request_error"),
    "context_length_exceeded": (400, "Context length exceeded", "invalid_request_error"),
    "unsupported_version": (400, "Unsupported LMSP version", "invalid_request_error"),
    "model_not_found": (404, "Model not found", "not_found_error"),
    "response_not_found": (404, "Response not found", "not_found_error"),
    # previous_response_id names something the request cannot build on: a 400
    # (the request is wrong), as OpenAI answers it, not a 404 of the route.
    "previous_response_not_found": (400, "Previous response not found", "invalid_request_error"),
    "conversation_not_found": (404, "Conversation not found", "not_found_error"),
    "task_not_found": (404, "Task not found", "not_found_error"),
    "not_found": (404, "Not found", "not_found_error"),
    "method_not_allowed": (405, "Method not allowed", "invalid_request_error"),
    "event_history_expired": (410, "Event history expired", "invalid_request_error"),
    "unauthorized": (401, "Unauthorized", "authentication_error"),
    "forbidden": (403, "Forbidden", "permission_error"),
    # A Host this server does not answer for (lmspd.origins: DNS rebinding).
    "misdirected_request": (421, "Misdirected request", "invalid_request_error"),
    "idempotency_conflict": (422, "Idempotency conflict", "invalid_request_error"),
    "idempotency_in_progress": (409, "Request still in progress", "conflict_error"),
    # A second response.create while one runs on the same WebSocket.
    "concurrent_request": (409, "A response is already in progress", "invalid_request_error"),
    "websocket_connection_limit_reached": (400, "Connection limit reached", "invalid_request_error"),
    "rate_limited": (429, "Too many requests", "rate_limit_error"),
    "server_overloaded": (503, "Server overloaded", "server_error"),
    "server_shutting_down": (503, "Server shutting down", "server_error"),
    "prepare_timeout": (503, "Preparing the request took too long", "server_error"),
    "store_unavailable": (503, "Could not store the response", "server_error"),
    # A model configured to load on first use is loading (or waiting for room).
    "model_loading": (503, "Model loading", "server_error"),
    "upstream_error": (502, "Upstream error", "server_error"),
    "upstream_timeout": (504, "Upstream timeout", "server_error"),
    # The provider refused this request (4xx): not worth retrying as is.
    "upstream_rejected_request": (400, "Upstream rejected the request", "invalid_request_error"),
    "server_error": (500, "Internal server error", "server_error"),
    # A task or background response cut off by a crash or restart.
    "server_restarted": (500, "Server restarted", "server_error"),
    "invalid_tool_call": (500, "Invalid tool call", "model_error"),
    # Output no UTF-8 writer can carry (a lone surrogate): the stream fails.
    "invalid_model_output": (500, "Invalid model output", "model_error"),
    "undeclared_tool": (502, "Undeclared tool", "model_error"),
}


# Codes minted elsewhere (an engine's failure codes such as upstream_timeout)
# still render; they are server-side failures.
_UNKNOWN = (500, "Server error", "server_error")
# The upstream engine's many typed codes (upstream_connection_lost,
# upstream_sse_line_too_long, ...) are all a bad gateway to the client.
_UPSTREAM = (502, "Upstream error", "server_error")


def _lookup(code: str) -> tuple[int, str, str]:
    found = _CODES.get(code)
    if found is not None:
        return found
    return _UPSTREAM if code.startswith("upstream_") else _UNKNOWN


class RequestField(enum.Enum):
    """A request field as the core and the engines name it in an error,
    before any dialect's name for it: each dialect says what its clients
    call it (``ITEMS`` is Responses' ``input``, Chat's and Anthropic's
    ``messages``; ``lmspd.dialects.fields``)."""

    # The conversation's items: stored history, then the request's input.
    ITEMS = "items"
    MAX_OUTPUT_TOKENS = "max_output_tokens"
    OUTPUT_FORMAT = "output_format"
    TOOLS = "tools"
    MODEL = "model"


# A neutral field path: a ``RequestField``, then the keys and indexes below it.
# ``(RequestField.ITEMS, 3, "call_id")`` is the call id of the conversation's
# fourth item, whatever the dialect calls the list and wherever that item
# sat in the request.
FieldPath = tuple[RequestField, *tuple[str | int, ...]]

# Where an error's message names the field: replaced by the dialect's name
# once it is known (an Anthropic error has no ``param``; its message is all
# that points at the field).
FIELD = "{field}"


def join_path(head: str, rest: tuple[str | int, ...]) -> str:
    """``("messages", (1, "content"))`` -> ``messages[1].content``."""
    return head + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in rest)


@dataclass
class ApiError(Exception):
    """A failure with a machine-readable ``code`` and a message a person can act on.

    ``param`` is the field in the client's own words. What the core and the
    engines raise names a neutral ``path`` instead, which the dialect that
    decoded the request turns into its ``param`` (``named``)."""

    code: str
    message: str
    param: str | None = None
    # 0: the status the code's row in the table gives.
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    path: FieldPath | None = None
    # The message as raised, ``FIELD`` still in it (a neutral path's error).
    _template: str | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.status:
            self.status = _lookup(self.code)[0]
        super().__init__(self.message)
        if self.path is not None and self.param is None:
            self._template = self.message
            # Until a dialect names it: the neutral name, never none.
            self._name(join_path(self.path[0].value, self.path[1:]))

    def named(self, param: str) -> "ApiError":
        """This error in a dialect's words: ``param`` is what the request
        calls the neutral ``path`` (a no-op for an error that had a ``param``)."""
        if self._template is not None:
            self._name(param)
        return self

    def _name(self, param: str) -> None:
        assert self._template is not None
        self.param = param
        self.message = self._template.replace(FIELD, param)
        self.args = (self.message,)

    @property
    def title(self) -> str:
        return _lookup(self.code)[1]

    @property
    def openai_type(self) -> str:
        return _lookup(self.code)[2]

    def problem(self) -> dict[str, Any]:
        """RFC 9457 problem document (LMSP)."""
        body = {
            "type": f"https://lmspd.dev/problems/{self.code}",
            "title": self.title,
            "status": self.status,
            "detail": self.message,
            "code": self.code,
        }
        if self.param is not None:
            body["param"] = self.param
        return body

    def openai(self) -> dict[str, Any]:
        """OpenAI ``{"error": {...}}`` body."""
        return {
            "error": {
                "message": self.message,
                "type": self.openai_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def websocket_event(self) -> dict[str, Any]:
        """A Responses WebSocket ``error`` frame: ends the turn, not the
        connection; ``status`` is what the same failure gets over HTTP."""
        return {"type": "error", "status": self.status, **self.openai()}

    @property
    def anthropic_type(self) -> str:
        return _anthropic_type(self.status or 500)

    def anthropic(self) -> dict[str, Any]:
        """Anthropic ``{"type": "error", "error": {...}}`` body (``/v1/messages``)."""
        return {"type": "error", "error": {"type": self.anthropic_type, "message": self.message}}

    def short(self) -> dict[str, Any]:
        """``{code, message}`` as carried inside a failed Response object."""
        return {"code": self.code, "message": self.message}


# Anthropic names its error types by HTTP status, not by cause; anything not
# listed is a client error (4xx) or an ``api_error`` (5xx).
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def _anthropic_type(status: int) -> str:
    return _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError("invalid_request", message, param=param)


def tag(value: object, param: str) -> str | None:
    """A discriminator read from a request (a ``type``, a ``role``): a string
    or absent. Anything else is the client's error, named by ``param`` — and
    is never used as a lookup key (a list is unhashable)."""
    if value is None or isinstance(value, str):
        return value
    raise invalid(f"'{param}' must be a string.", param)


def unsupported(param: str, message: str | None = None) -> ApiError:
    return ApiError(
        "unsupported_parameter",
        message or f"Parameter {param!r} is not supported by lmspd.",
        param=param,
    )
