"""One error type for every failure a client can see, rendered per dialect.

Handlers and engines raise ``ApiError``; the dialect at the edge decides the
wire shape: RFC 9457 ``application/problem+json`` on ``/lmsp/v1``, OpenAI's
``{"error": {...}}`` on ``/v1``, Anthropic's ``{"type": "error", ...}`` on
``/v1/messages``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# code -> (HTTP status, problem title, OpenAI error type)
_CODES: dict[str, tuple[int, str, str]] = {
    "invalid_request": (400, "Invalid request", "invalid_request_error"),
    "invalid_json": (400, "Invalid JSON", "invalid_request_error"),
    "unsupported_media_type": (415, "Unsupported media type", "invalid_request_error"),
    "request_too_large": (413, "Request body too large", "invalid_request_error"),
    "unsupported_capability": (400, "Unsupported capability", "invalid_request_error"),
    "unsupported_parameter": (400, "Unsupported parameter", "invalid_request_error"),
    "context_length_exceeded": (400, "Context length exceeded", "invalid_request_error"),
    "unsupported_version": (400, "Unsupported LMSP version", "invalid_request_error"),
    "model_not_found": (404, "Model not found", "not_found_error"),
    "response_not_found": (404, "Response not found", "not_found_error"),
    "conversation_not_found": (404, "Conversation not found", "not_found_error"),
    "task_not_found": (404, "Task not found", "not_found_error"),
    "not_found": (404, "Not found", "not_found_error"),
    "method_not_allowed": (405, "Method not allowed", "invalid_request_error"),
    "event_history_expired": (410, "Event history expired", "invalid_request_error"),
    "unauthorized": (401, "Unauthorized", "authentication_error"),
    "forbidden": (403, "Forbidden", "permission_error"),
    "idempotency_conflict": (422, "Idempotency conflict", "invalid_request_error"),
    "idempotency_in_progress": (409, "Request still in progress", "conflict_error"),
    "rate_limited": (429, "Too many requests", "rate_limit_error"),
    "server_overloaded": (503, "Server overloaded", "server_error"),
    "server_shutting_down": (503, "Server shutting down", "server_error"),
    "upstream_error": (502, "Upstream error", "server_error"),
    "upstream_timeout": (504, "Upstream timeout", "server_error"),
    "server_error": (500, "Internal server error", "server_error"),
    "invalid_tool_call": (500, "Invalid tool call", "model_error"),
    "undeclared_tool": (502, "Undeclared tool", "model_error"),
}


# Codes minted elsewhere (an engine's failure codes such as upstream_timeout)
# still render; they are server-side failures.
_UNKNOWN = (500, "Server error", "server_error")


@dataclass
class ApiError(Exception):
    """A failure with a machine-readable ``code`` and a message a person can act on."""

    code: str
    message: str
    param: str | None = None
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status is None:
            self.status = _CODES.get(self.code, _UNKNOWN)[0]
        super().__init__(self.message)

    @property
    def title(self) -> str:
        return _CODES.get(self.code, _UNKNOWN)[1]

    @property
    def openai_type(self) -> str:
        return _CODES.get(self.code, _UNKNOWN)[2]

    def problem(self) -> dict:
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

    def openai(self) -> dict:
        """OpenAI ``{"error": {...}}`` body."""
        return {
            "error": {
                "message": self.message,
                "type": self.openai_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def short(self) -> dict:
        """``{code, message}`` as carried inside a failed Response object."""
        return {"code": self.code, "message": self.message}


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError("invalid_request", message, param=param)


def unsupported(param: str, message: str | None = None) -> ApiError:
    return ApiError(
        "unsupported_parameter",
        message or f"Parameter {param!r} is not supported by lmspd.",
        param=param,
    )
