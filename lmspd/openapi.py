"""``GET /openapi.json``: an OpenAPI 3.1 description of every route the app
serves, built from the app's own route table and the pydantic models the
decoders validate request bodies with (``model_json_schema``) — so the
document cannot drift from what the server accepts.

Every (method, path) the app routes must have an entry in ``OPERATIONS``;
:func:`build_spec` refuses to describe an app with an undescribed route
(a test builds it for the real app). Error bodies are declared per dialect:
OpenAI's ``{"error": {...}}``, LMSP's RFC 9457 problem document, and
Anthropic's ``{"type": "error", ...}``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.routing import Mount, Route, WebSocketRoute

from lmspd import __version__
from lmspd.dialects.anthropic_messages import CountTokens, CreateMessage
from lmspd.dialects.chat_completions import ChatCompletionRequest
from lmspd.dialects.lmsp import LmspCreateResponse
from lmspd.dialects.openai_responses import CreateResponse
from lmspd.routes.conversations import AddItems, CreateConversation, UpdateConversation

Dialect = Literal["openai", "lmsp", "anthropic"]
Reply = Literal["json", "sse", "json_or_sse", "text", "html", "asset", "none"]

REF = "#/components/schemas/{model}"
JSON = "application/json"
SSE = "text/event-stream"

OBJECT: dict[str, Any] = {"type": "object"}
SCHEMAS: dict[str, Any] = {
    "OpenAIError": {
        "type": "object", "required": ["error"],
        "properties": {"error": {"type": "object", "required": ["message", "type", "code"], "properties": {
            "message": {"type": "string"}, "type": {"type": "string"},
            "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
    },
    "Problem": {
        "type": "object", "required": ["type", "title", "status", "detail", "code"],
        "properties": {"type": {"type": "string"}, "title": {"type": "string"}, "status": {"type": "integer"},
                       "detail": {"type": "string"}, "code": {"type": "string"}, "param": {"type": "string"}},
    },
    "AnthropicError": {
        "type": "object", "required": ["type", "error"],
        "properties": {"type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"],
                                                            "properties": {"type": {"type": "string"},
                                                                           "message": {"type": "string"}}}},
    },
}
_ERROR_BODY = {"openai": ("OpenAIError", JSON), "lmsp": ("Problem", "application/problem+json"),
               "anthropic": ("AnthropicError", JSON)}


@dataclass(frozen=True)
class Param:
    name: str
    schema: dict[str, Any]
    where: Literal["query", "header"] = "query"
    description: str = ""


@dataclass(frozen=True)
class Op:
    summary: str
    dialect: Dialect = "openai"
    body: type[BaseModel] | None = None
    reply: Reply = "json"
    params: tuple[Param, ...] = ()
    status: int = 200
    tag: str = "responses"
    # Only ever answers with an error (a method a route refuses).
    refused: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


_PAGE = (
    Param("after", {"type": "string", "maxLength": 512}, description="an item id: list after it"),
    Param("limit", {"type": "integer", "minimum": 1, "maximum": 100}),
    Param("order", {"enum": ["asc", "desc"]}),
)
_LMSP_VERSION = Param("LMSP-Version", {"type": "string"}, "header", "1.x (missing means 1.0)")
_RID = "/v1/responses/{response_id}"
_CID = "/v1/conversations/{conversation_id}"
_TID = "/lmsp/v1/tasks/{task_id}"

OPERATIONS: dict[tuple[str, str], Op] = {
    ("GET", "/health"): Op("Liveness, version and each model's queue and cache state.", tag="service",
                           extra={"503": "shutting down"}),
    ("GET", "/metrics"): Op("Prometheus metrics (admin scope when keys are set).", reply="text", tag="service"),
    ("GET", "/openapi.json"): Op("This document.", tag="service"),
    ("GET", "/v1/models"): Op("Served models and the GGUF models found on this machine.", tag="models"),
    ("GET", "/lmsp/v1/models"): Op("Served models with their capabilities (LMSP).", dialect="lmsp",
                                   params=(_LMSP_VERSION,), tag="models"),
    ("POST", "/v1/responses"): Op("Create a response (OpenAI Responses).", body=CreateResponse,
                                  reply="json_or_sse"),
    ("POST", "/v1/responses/compact"): Op(
        "Compact a conversation (the create body's input, instructions, previous_response_id) into a "
        "window that ends with a sealed compaction item."),
    ("POST", "/v1/responses/input_tokens"): Op("Count a create body's input in the model's tokens.",
                                               body=CreateResponse),
    ("GET", _RID): Op("A stored response; ?stream=true follows a background one.", reply="json_or_sse", params=(
        Param("stream", {"enum": ["true", "false", "1", "0"]}),
        Param("starting_after", {"type": "integer", "minimum": 0}))),
    ("DELETE", _RID): Op("Delete a stored response."),
    ("POST", _RID + "/cancel"): Op("Cancel a background response."),
    ("GET", _RID + "/input_items"): Op("The input items of a stored response.", params=_PAGE),
    ("POST", "/v1/conversations"): Op("Create a conversation.", body=CreateConversation, tag="conversations"),
    ("GET", _CID): Op("A conversation.", tag="conversations"),
    ("POST", _CID): Op("Update a conversation's metadata.", body=UpdateConversation, tag="conversations"),
    ("DELETE", _CID): Op("Delete a conversation.", tag="conversations"),
    ("POST", _CID + "/items"): Op("Add items to a conversation.", body=AddItems, tag="conversations"),
    ("GET", _CID + "/items"): Op("A conversation's items.", params=_PAGE, tag="conversations"),
    ("GET", _CID + "/items/{item_id}"): Op("One conversation item.", tag="conversations"),
    ("DELETE", _CID + "/items/{item_id}"): Op("Delete a conversation item.", tag="conversations"),
    ("POST", "/lmsp/v1/responses"): Op("Create a response (LMSP 1.0).", dialect="lmsp", body=LmspCreateResponse,
                                       reply="json_or_sse", params=(_LMSP_VERSION,)),
    ("GET", "/lmsp/v1/responses/{response_id}"): Op("A stored response (LMSP).", dialect="lmsp",
                                                    params=(_LMSP_VERSION,)),
    ("POST", "/lmsp/v1/tasks"): Op("Start a background task (LMSP).", dialect="lmsp", body=LmspCreateResponse,
                                   reply="json_or_sse", status=202, params=(_LMSP_VERSION,), tag="tasks"),
    ("GET", _TID): Op("A task.", dialect="lmsp", params=(_LMSP_VERSION,), tag="tasks"),
    ("GET", _TID + "/events"): Op("A task's events, live (resumable).", dialect="lmsp", reply="sse", tag="tasks",
                                  params=(_LMSP_VERSION, Param("after", {"type": "integer", "minimum": 0}),
                                          Param("Last-Event-ID", {"type": "string"}, "header"))),
    ("POST", _TID + "/cancel"): Op("Cancel a task.", dialect="lmsp", params=(_LMSP_VERSION,), tag="tasks"),
    ("GET", "/lmsp/v1/engine"): Op("Live engine state for the console (admin scope when keys are set).",
                                   dialect="lmsp", params=(_LMSP_VERSION,), tag="service"),
    ("POST", "/v1/chat/completions"): Op("Chat Completions.", body=ChatCompletionRequest, reply="json_or_sse",
                                         tag="compat"),
    ("POST", "/v1/messages"): Op("Anthropic Messages.", dialect="anthropic", body=CreateMessage,
                                 reply="json_or_sse", tag="compat"),
    ("POST", "/v1/messages/count_tokens"): Op("Anthropic token count.", dialect="anthropic", body=CountTokens,
                                              tag="compat"),
    ("GET", "/"): Op("The web console.", reply="html", tag="console"),
    ("GET", "/console/{path}"): Op("The console's static files.", reply="asset", tag="console"),
}
# WebSocket routes: OpenAPI has no operation for them, so they are listed
# under the document's ``x-websockets`` (and must be described all the same).
WEBSOCKETS: dict[str, str] = {
    "/v1/responses": "Responses WebSocket mode: response.create frames in, the same events as SSE out "
                     "(responses:write scope; one connection lives at most websocket_max_age_s).",
}
# Anthropic's routes answer every other method in Anthropic's error shape.
for _path in ("/v1/messages", "/v1/messages/count_tokens"):
    for _method in ("GET", "PUT", "PATCH", "DELETE"):
        OPERATIONS[(_method, _path)] = Op("Not allowed (405).", dialect="anthropic", refused=True, tag="compat")


class UndescribedRoute(LookupError):
    pass


def routed_operations(routes: Iterable[Any]) -> list[tuple[str, str]]:
    """Every (method, path template) the app serves."""
    out: list[tuple[str, str]] = []
    for route in routes:
        if isinstance(route, Route):
            for method in sorted(route.methods or ["GET"]):
                if method != "HEAD":
                    out.append((method, route.path))
        elif isinstance(route, Mount):
            out.append(("GET", route.path.rstrip("/") + "/{path}"))
    return out


def build_spec(routes: Iterable[Any]) -> dict[str, Any]:
    routes = list(routes)
    ops = routed_operations(routes)
    sockets = [r.path for r in routes if isinstance(r, WebSocketRoute)]
    missing = [f"{m} {p}" for m, p in ops if (m, p) not in OPERATIONS]
    missing += [f"WEBSOCKET {p}" for p in sockets if p not in WEBSOCKETS]
    if missing:
        raise UndescribedRoute("routes without an OpenAPI description: " + ", ".join(missing))
    models = sorted({op.body for key, op in OPERATIONS.items() if key in ops and op.body is not None},
                    key=lambda m: m.__name__)
    refs, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF)
    schemas = {**defs.get("$defs", {}), **SCHEMAS}
    paths: dict[str, dict[str, Any]] = {}
    for method, path in ops:
        op = OPERATIONS[(method, path)]
        body_ref = refs[(op.body, "validation")] if op.body is not None else None
        paths.setdefault(path, {})[method.lower()] = _operation(method, path, op, body_ref)
    return {
        "openapi": "3.1.0",
        "info": {"title": "lmspd", "version": __version__,
                 "description": "A local model service: LMSP 1.0 and OpenAI Responses, Chat Completions and "
                                "Anthropic Messages over llama.cpp or an upstream provider."},
        "paths": paths,
        "x-websockets": {p: {"summary": WEBSOCKETS[p]} for p in sockets},
        "components": {"schemas": schemas,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                           "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}}},
        # No key is needed on loopback without --api-key; with one, either header carries it.
        "security": [{}, {"bearer": []}, {"apiKey": []}],
    }


def _operation(method: str, path: str, op: Op, body_ref: dict[str, Any] | None) -> dict[str, Any]:
    error_name, error_type = _ERROR_BODY[op.dialect]
    error = {"description": "An error, in the dialect's shape.",
             "content": {error_type: {"schema": {"$ref": REF.format(model=error_name)}}}}
    out: dict[str, Any] = {
        "operationId": _operation_id(method, path),
        "summary": op.summary,
        "tags": [op.tag],
    }
    params = [{"name": name, "in": "path", "required": True, "schema": {"type": "string", "maxLength": 512}}
              for name in _path_params(path)]
    params += [{"name": p.name, "in": p.where, "required": False, "schema": p.schema,
                **({"description": p.description} if p.description else {})} for p in op.params]
    if params:
        out["parameters"] = params
    if op.body is not None and body_ref is not None:
        out["requestBody"] = {"required": True, "content": {JSON: {"schema": body_ref}}}
    if op.refused:
        out["responses"] = {"405": error, "default": error}
        return out
    content = _reply_content(op.reply)
    responses: dict[str, Any] = {str(op.status): {"description": "Success.", "content": content}}
    if op.status != 200 and op.reply == "json_or_sse":
        # A streamed task answers 200 with its event stream.
        responses["200"] = {"description": "The event stream.", "content": {SSE: {"schema": {"type": "string"}}}}
    responses["default"] = error
    out["responses"] = responses
    return out


def _reply_content(reply: Reply) -> dict[str, Any]:
    stream = {SSE: {"schema": {"type": "string"}}}
    if reply == "json":
        return {JSON: {"schema": OBJECT}}
    if reply == "sse":
        return stream
    if reply == "json_or_sse":
        return {JSON: {"schema": OBJECT}, **stream}
    if reply == "text":
        return {"text/plain": {"schema": {"type": "string"}}}
    if reply == "html":
        return {"text/html": {"schema": {"type": "string"}}}
    return {"*/*": {"schema": {"type": "string"}}}


def _path_params(path: str) -> list[str]:
    return re.findall(r"{([^}:]+)(?::[^}]*)?}", path)


def _operation_id(method: str, path: str) -> str:
    words = [w.strip("{}") for w in path.strip("/").replace(".", "_").split("/") if w] or ["root"]
    return method.lower() + "_" + "_".join(words)
