"""A scripted Chat Completions provider, for tests only.

It serves ``POST /v1/chat/completions`` (and ``GET /v1/models`` for health
checks and the context window, ``GET /props`` as llama.cpp's server does)
from a background thread, replaying exactly the bytes a test scripts:
well-formed streams, hostile ones, error statuses, stalls. Every request is
recorded (body and headers) so a test can check what lmspd sent.

    provider = ScriptedProvider().start()
    provider.push(Reply(parts=[text_chunk("Hi"), finish_chunk("stop"), DONE]))
    ...lmspd --engine upstream --upstream-url provider.url ...
    provider.requests[-1].body["messages"]

Or decide per request (real agent clients, several turns)::

    provider.responder = lambda request: Reply(...)
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

DONE = b"data: [DONE]\n\n"


# -- stream builders ----------------------------------------------------------------


def sse(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def chunk(delta: dict | None = None, finish: str | None = None, *, usage: dict | None = None,
          index: int = 0, chunk_id: str = "chatcmpl-PRIVATE-ID", model: str = "provider-private-model") -> bytes:
    body: dict[str, Any] = {
        "id": chunk_id, "object": "chat.completion.chunk", "created": 1, "model": model,
        "choices": [{"index": index, "delta": delta or {}, "finish_reason": finish}],
    }
    if usage is not None:
        body["choices"] = []
        body["usage"] = usage
    return sse(body)


def text_chunk(text: str) -> bytes:
    return chunk({"content": text})


def reasoning_chunk(text: str) -> bytes:
    return chunk({"reasoning_content": text})


def tool_chunk(index: int, *, id: str | None = None, name: str | None = None, args: str | None = None) -> bytes:
    call: dict[str, Any] = {"index": index}
    if id is not None:
        call["id"] = id
        call["type"] = "function"
    function: dict[str, Any] = {}
    if name is not None:
        function["name"] = name
    if args is not None:
        function["arguments"] = args
    call["function"] = function
    return chunk({"tool_calls": [call]})


def finish_chunk(reason: str) -> bytes:
    return chunk(finish=reason)


def usage_chunk(prompt: int, completion: int) -> bytes:
    return chunk(usage={"prompt_tokens": prompt, "completion_tokens": completion,
                        "total_tokens": prompt + completion})


def text_stream(text: str, pieces: int = 3, reason: str = "stop") -> list[bytes]:
    step = max(1, len(text) // pieces)
    parts = [chunk({"role": "assistant", "content": ""})]
    parts += [text_chunk(text[i:i + step]) for i in range(0, len(text), step)]
    return parts + [finish_chunk(reason), usage_chunk(11, 7), DONE]


def tool_stream(name: str, arguments: dict | str, call_id: str = "call_abc123") -> list[bytes]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    half = len(args) // 2
    return [
        chunk({"role": "assistant", "content": None}),
        tool_chunk(0, id=call_id, name=name, args=""),
        tool_chunk(0, args=args[:half]),
        tool_chunk(0, args=args[half:]),
        finish_chunk("tool_calls"),
        usage_chunk(20, 9),
        DONE,
    ]


def error_reply_body(type_: str = "server_error", message: str = "nope", code: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "code": code}}).encode()


def split_every_byte(parts: list[bytes]) -> list[bytes]:
    return [bytes([b]) for b in b"".join(parts)]


# -- the server ---------------------------------------------------------------------


@dataclass
class Reply:
    """One scripted answer. ``parts`` are written one by one (each its own
    chunk on the wire); a float in ``parts`` is a pause in seconds. After
    the parts, ``stall_s`` keeps the connection open and silent."""

    parts: list[bytes | float] = field(default_factory=list)
    status: int = 200
    content_type: str = "text/event-stream"
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes | None = None  # for non-stream replies (errors)
    stall_s: float = 0.0
    # A wait before the status line and headers (a provider still queueing).
    head_delay_s: float = 0.0
    # A pause after every part, so that parts really arrive apart (without
    # it the kernel may coalesce tiny writes into one read).
    pace_s: float = 0.0
    # Set by the server: the stream ended because the client went away.
    disconnected: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)


@dataclass
class Recorded:
    path: str
    headers: dict[str, str]
    body: Any
    # The client's port: which connection the request came on.
    client_port: int = 0


class ScriptedProvider:
    def __init__(self) -> None:
        self.requests: list[Recorded] = []
        self._queue: deque[Reply] = deque()
        self.responder: Callable[[Recorded], Reply] | None = None
        self.model_list_status = 200
        # What GET /v1/models lists (a test may add vLLM's max_model_len or
        # llama.cpp's meta) and, where set, what GET /props answers (llama.cpp).
        self.model_entries: list[dict[str, Any]] = [{"id": "scripted", "object": "model"}]
        self.props: dict[str, Any] | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def push(self, *replies: Reply) -> list[Reply]:
        self._queue.extend(replies)
        return list(replies)

    def clear(self) -> None:
        self._queue.clear()
        self.requests.clear()

    # -- app -------------------------------------------------------------------------

    async def _chat(self, request: Request) -> Response:
        raw = await request.body()
        try:
            body: Any = json.loads(raw)
        except ValueError:
            body = raw.decode("utf-8", "replace")
        recorded = Recorded(request.url.path, dict(request.headers), body,
                            request.client.port if request.client else 0)
        self.requests.append(recorded)
        if self._queue:
            reply = self._queue.popleft()
        elif self.responder is not None:
            reply = self.responder(recorded)
        else:
            reply = Reply(status=500, content_type="application/json",
                          body=b'{"error": {"message": "no scripted reply", "type": "server_error"}}')
        if reply.head_delay_s:
            await asyncio.sleep(reply.head_delay_s)
        if reply.body is not None or reply.status != 200:
            reply.finished.set()
            return Response(reply.body or b"", status_code=reply.status, headers=reply.headers,
                            media_type=reply.content_type)
        return StreamingResponse(self._stream(reply), status_code=reply.status, headers=reply.headers,
                                 media_type=reply.content_type)

    async def _stream(self, reply: Reply):
        try:
            for part in reply.parts:
                if isinstance(part, float):
                    await asyncio.sleep(part)
                else:
                    yield part
                    if reply.pace_s:
                        await asyncio.sleep(reply.pace_s)
            if reply.stall_s:
                await asyncio.sleep(reply.stall_s)
            reply.finished.set()
        except (asyncio.CancelledError, GeneratorExit):
            reply.disconnected.set()
            raise

    async def _models(self, request: Request) -> Response:
        self.requests.append(Recorded(request.url.path, dict(request.headers), None))
        return JSONResponse({"object": "list", "data": self.model_entries}, status_code=self.model_list_status)

    async def _props(self, request: Request) -> Response:
        self.requests.append(Recorded(request.url.path, dict(request.headers), None))
        if self.props is None:
            return JSONResponse({"error": {"message": "not found"}}, status_code=404)
        return JSONResponse(self.props)

    # -- lifecycle ---------------------------------------------------------------------

    def start(self, port: int = 0) -> "ScriptedProvider":
        app = Starlette(routes=[
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/props", self._props, methods=["GET"]),
        ])
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the scripted provider did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._server.force_exit = True
        if self._thread is not None:
            self._thread.join(10)
