"""The upstream engine: a Chat Completions provider behind lmspd's Responses.

    prepare   Conversation -> Chat Completions JSON (request.py), no I/O
    open      route (routing.py), POST to the chosen endpoint; status and
              content type checked
              (client.py) -- *before* any downstream byte, so a 4xx/5xx is
              still an HTTP error reply (``Run.open`` calls it ahead of the
              response headers; otherwise ``Run.events`` does, and a refusal
              becomes ``response.failed``)
    generate  provider bytes -> BridgeDecoder -> neutral events, ending in
              exactly one ``Finished``/``Failed``

Why the request is sent in ``open`` and not in ``prepare``: ``prepare`` is
synchronous and runs in a preparing thread under a time bound, and a
provider can take seconds to send its headers; ``open`` is awaited, after
the model's queue slot.

Stopping: a client that goes away cancels the task that drives
``generate``; the ``finally`` closes the provider body, so the provider sees
the disconnect and stops. A request ``open`` sent that no ``generate`` took
(its run's events dropped before the generation started) is closed by
``discard``, which ``Run`` calls. A ``CancelToken`` (shutdown) interrupts a
pending read at once instead of waiting for the provider's next byte. The
stream-idle watchdog and the bound on time without output are the client's
(see client.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import anyio

from lmspd.core.conversation import Conversation
from lmspd.core.errors import ApiError, RequestField
from lmspd.core.events import EngineEvent, Failed, Finished, ReasoningDelta, TextDelta, ToolCallDone, ToolCallStarted
from lmspd.core.limits import UpstreamStreamLimits
from lmspd.core.run import LOCAL, RunContext
from lmspd.engines.base import CancelToken, ModelInfo

from .bridge import BridgeDecoder
from .client import ProviderClient, ProviderStream, ReadInterrupted, Timeouts
from .credentials import Secret
from .errors import UpstreamConnectionLost, UpstreamError, UpstreamHTTPError, UpstreamProviderError
from .pool import Endpoint, EndpointPool
from .request import PROFILES, ProviderRequest, build_chat_request
from .routing import Decision, Router, RouteRequest, RoutingSettings, conversation_anchor, response_anchor
from .window import DEFAULT_CONTEXT_WINDOW

__all__ = ["UpstreamEngine", "UpstreamPrepared", "UpstreamSpec", "to_api_error"]

log = logging.getLogger("lmspd.upstream")

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


@dataclass
class UpstreamSpec:
    """One served model backed by a provider (from flags or a config file)."""

    served_model: str
    upstream_model: str
    urls: list[str]
    profile: str = "generic"
    # Key source: this environment variable, else the key saved under
    # ``key_name`` (``lmspd config set-key --name``), else LMSPD_UPSTREAM_API_KEY,
    # else the key saved as "default" (credentials.resolve_key).
    api_key_env: str | None = None
    key_name: str | None = None
    idle_timeout_s: float | None = None  # None: limits.upstream.idle_timeout_s
    progress_timeout_s: float | None = None  # None: limits.upstream.progress_timeout_s
    connect_timeout_s: float = 10.0
    max_concurrency: int = 256
    # None: what the provider says at start, else DEFAULT_CONTEXT_WINDOW (window.py).
    context_window: int | None = None
    health_interval_s: float = 10.0
    # Which endpoint takes a request (routing.py): "affinity" (continuation,
    # session, prefix, then load), "least-loaded" or "round-robin".
    routing: str = "affinity"
    affinity_slack: int = 4
    prefix_threshold: float = 0.5

    @property
    def routing_settings(self) -> RoutingSettings:
        return RoutingSettings(policy=self.routing, affinity_slack=self.affinity_slack,
                               prefix_threshold=self.prefix_threshold)

    def __post_init__(self) -> None:
        self.routing_settings  # noqa: B018 - validates the routing fields (ValueError)
        if self.profile not in PROFILES:
            raise ValueError(f"unknown upstream profile {self.profile!r}; one of: {', '.join(PROFILES)}")
        if not self.urls:
            raise ValueError(f"model {self.served_model!r}: an upstream model needs at least one URL")
        if self.max_concurrency < 1 or (self.context_window is not None and self.context_window < 1):
            raise ValueError(f"model {self.served_model!r}: max_concurrency and context_window must be >= 1")
        for name in ("idle_timeout_s", "progress_timeout_s", "connect_timeout_s"):
            value = getattr(self, name)
            # (``not value > 0`` refuses NaN too.)
            if value is not None and not value > 0:
                raise ValueError(f"model {self.served_model!r}: {name} must be > 0")
        if not self.health_interval_s >= 0:
            raise ValueError(f"model {self.served_model!r}: health_interval_s must be >= 0 (0: no probes)")


@dataclass
class UpstreamPrepared:
    conversation: Conversation
    request: ProviderRequest
    body: bytes
    input_tokens: int
    # What the router matches on: the body's messages (all but the closing
    # bracket, so that a later turn's prompt extends this one's) and a hash
    # of its tools (rendered before the messages by chat templates).
    route_prompt: memoryview = memoryview(b"")
    route_seed: int = 0
    response_id: str | None = None
    # Set by ``open``: the accepted provider response, consumed by ``generate``.
    stream: ProviderStream | None = None
    opened_at: float = field(default_factory=time.perf_counter)
    # Who the run is for and the client session it belongs to (routing affinity).
    run: RunContext = LOCAL


def to_api_error(exc: UpstreamError) -> ApiError:
    """A failure before the stream started, as the reply a client gets."""
    if not isinstance(exc, UpstreamHTTPError):
        return ApiError(exc.code, exc.message)
    status = exc.status
    if status == 429:
        return ApiError("rate_limited", "The upstream provider is rate limiting requests; retry later.",
                        headers={"Retry-After": str(exc.retry_after if exc.retry_after is not None else 1)})
    if exc.provider_code == "context_length_exceeded":
        return ApiError("context_length_exceeded", "The input does not fit the upstream model's context window.",
                        path=(RequestField.ITEMS,))
    if status in (408, 504):
        return ApiError("upstream_timeout", exc.message)
    if 400 <= status < 500 and status not in (401, 403, 404):
        # The provider refused this request (not lmspd's setup): a 4xx, so
        # that clients do not retry it as they would a 5xx.
        return ApiError("upstream_rejected_request", exc.message)
    # 401/403/404 mean lmspd's key or model name is wrong; 5xx the provider.
    return ApiError("upstream_http_error", exc.message)


class UpstreamEngine:
    def __init__(
        self, spec: UpstreamSpec, *, key: Secret | None = None, limits: UpstreamStreamLimits | None = None
    ) -> None:
        self.spec = spec
        self._limits = limits or UpstreamStreamLimits()
        self._profile = PROFILES[spec.profile]
        self._key = key
        idle = spec.idle_timeout_s if spec.idle_timeout_s is not None else self._limits.idle_timeout_s
        progress = (spec.progress_timeout_s if spec.progress_timeout_s is not None
                    else self._limits.progress_timeout_s)
        self.pool = EndpointPool(spec.urls)
        self.router = Router(self.pool, spec.routing_settings, model=spec.served_model)
        self.client = ProviderClient(
            self.pool,
            key=key,
            timeouts=Timeouts(connect_s=spec.connect_timeout_s, idle_s=idle, progress_s=progress),
            max_connections=spec.max_concurrency,
            health_interval_s=spec.health_interval_s,
        )
        self.info = ModelInfo(
            id=spec.served_model,
            context_window=spec.context_window if spec.context_window is not None else DEFAULT_CONTEXT_WINDOW,
            capabilities={"streaming": True, "tools": True, "structured_output": True, "reasoning": True},
            source=f"{spec.upstream_model} at " + ", ".join(e.label for e in self.pool.endpoints),
            max_concurrency=spec.max_concurrency,
        )
        self._generations = 0
        self._outcomes: dict[str, int] = {}

    # -- preparing ---------------------------------------------------------------

    def announce(self, conversation: Conversation) -> AbstractContextManager[None]:
        return contextlib.nullcontext()  # each request goes to the provider on its own

    def prepare(self, conversation: Conversation, run: RunContext = LOCAL) -> UpstreamPrepared:
        request = build_chat_request(conversation, self.spec.upstream_model, self._profile)
        body, messages_end, tools = _encode_body(request.body)
        return UpstreamPrepared(conversation, request, body, input_tokens=_estimate_tokens(body),
                                route_prompt=memoryview(body)[:messages_end], route_seed=hash(tools), run=run)

    def count_tokens(self, conversation: Conversation) -> int:
        # The provider's tokenizer is not ours to run; a byte-based estimate.
        return self.prepare(conversation).input_tokens

    # -- running -----------------------------------------------------------------

    # The provider's status and content type are checked before the first byte.
    opens_first = True

    async def open(self, prepared: UpstreamPrepared, cancel: CancelToken) -> None:
        if prepared.stream is not None:
            return
        prepared.opened_at = time.perf_counter()
        route = _route_request(prepared)
        decisions: list[Decision] = []

        def choose(tried: Sequence[int]) -> Endpoint | None:
            decision = self.router.choose(route, tried)
            if decision is None:
                return None
            decisions.append(decision)
            return decision.endpoint

        try:
            prepared.stream = await self.client.open(prepared.body, choose)
            self.router.served(route, decisions[-1])
        except UpstreamError as exc:
            self._count(exc.code)
            detail = getattr(exc, "detail", None)
            log.warning("upstream %s refused before streaming: %s%s", self.info.id, exc.code,
                        f" ({self._scrub(detail)})" if detail else "")
            raise to_api_error(exc) from None
        except BaseException:
            # Anything else, once the provider had the request (a
            # cancellation inside client.open closes its own): not left streaming.
            await self.discard(prepared)
            raise

    async def discard(self, prepared: UpstreamPrepared) -> None:
        # Taken out first, as generate takes it: a call after generate
        # started, or a second one, finds nothing (the request is closed and
        # counted once).
        stream, prepared.stream = prepared.stream, None
        if stream is None:
            return
        self._count("cancelled")
        # Shielded, as generate's own close: under a cancelled anyio scope
        # the close would be cancelled too, leaving the provider streaming.
        with anyio.CancelScope(shield=True):
            await stream.aclose()
        log.info("upstream %s via %s: discarded before generating, %.1f ms after opening", self.info.id,
                 stream.endpoint.label, (time.perf_counter() - prepared.opened_at) * 1000)

    async def generate(self, prepared: UpstreamPrepared, cancel: CancelToken,
                       response_id: str | None = None) -> AsyncIterator[EngineEvent]:
        if prepared.stream is None:
            await self.open(prepared, cancel)
        stream, prepared.stream = prepared.stream, None
        assert stream is not None
        if response_id is not None:
            prepared.response_id = response_id
        if prepared.response_id is not None:
            # A request that continues this response goes where its prefix is.
            self.router.remember(prepared.response_id, stream.endpoint, prepared.run.owner)
        request = prepared.request
        bridge = BridgeDecoder(request.allowed_function_names, request.custom_wrappers, self._limits,
                               secret=self._key, input_tokens=prepared.input_tokens)
        self._generations += 1
        loop = asyncio.get_running_loop()
        remove = cancel.on_cancel(lambda: loop.call_soon_threadsafe(stream.interrupt))
        outcome = "cancelled"
        clean = False  # ended by the provider's own terminal marker
        first_output = True
        try:
            while True:
                if cancel.cancelled:
                    outcome = self._stop_code(cancel)
                    yield self._stopped(cancel)
                    return
                try:
                    raw = await stream.next_chunk()
                except StopAsyncIteration:
                    events: Iterable[EngineEvent] = bridge.close()
                except ReadInterrupted:
                    outcome = self._stop_code(cancel)
                    yield self._stopped(cancel)
                    return
                except UpstreamError as exc:
                    if isinstance(exc, UpstreamConnectionLost) and stream.endpoint.healthy:
                        # A dropped connection mid-stream is how a dying
                        # endpoint looks: the next request goes elsewhere at
                        # once (a health check brings it back if it is up).
                        self.pool.mark_down(stream.endpoint)
                        log.warning("upstream %s dropped a stream: marked down", stream.endpoint.label)
                    events = bridge.fail(exc)
                else:
                    events = bridge.iter_feed(raw)
                progress = bridge.progress
                for event in events:
                    if isinstance(event, ToolCallStarted):
                        event = self._public_call(event, request)
                    elif isinstance(event, Finished):
                        outcome, clean = event.reason, True
                    elif isinstance(event, Failed):
                        outcome = event.code
                    yield event
                    if first_output and isinstance(event, (TextDelta, ReasoningDelta, ToolCallDone)):
                        # Let the first output reach the client now, not with
                        # the rest of a burst (the writer joins what is produced
                        # without a pause; this is the pause).
                        first_output = False
                        await asyncio.sleep(0)
                if bridge.done:
                    return
                if bridge.progress != progress:
                    # Output came: the time without it starts again (bytes
                    # that are not output leave it running, client.py).
                    stream.progressed()
        finally:
            remove()
            if clean:
                self.client.release(stream)
            else:
                # Closing the body is what tells the provider to stop.
                # Shielded: under a cancelled anyio scope (Starlette's
                # disconnect handling) every await would be cancelled again,
                # leaving the provider connection open.
                with anyio.CancelScope(shield=True):
                    await stream.aclose()
            self._count(outcome)
            level = logging.INFO if clean or outcome == "cancelled" else logging.WARNING
            log.log(level, "upstream %s via %s: %s in %.1f ms response=%s%s", self.info.id, stream.endpoint.label,
                    outcome, (time.perf_counter() - prepared.opened_at) * 1000, prepared.response_id,
                    self._provider_said(bridge.error))

    def _public_call(self, event: ToolCallStarted, request: ProviderRequest) -> ToolCallStarted:
        call_id = event.call_id
        if self._key is not None and self._key.reveal() in call_id:
            # A provider holds our key and could echo it as a call id.
            call_id = f"call_{event.index}"
        public = request.tools[event.name]
        return ToolCallStarted(event.index, call_id, public.name, public.kind, public.namespace)

    @staticmethod
    def _stop_code(cancel: CancelToken) -> str:
        return "server_shutting_down" if cancel.reason == "shutdown" else "cancelled"

    @staticmethod
    def _stopped(cancel: CancelToken) -> EngineEvent:
        if cancel.reason == "shutdown":
            return Failed("server_shutting_down", "The server is shutting down.")
        return Finished("cancelled")

    def _provider_said(self, error: UpstreamError | None) -> str:
        """What a provider's in-stream error said, for operators (never sent on)."""
        if not isinstance(error, UpstreamProviderError):
            return ""
        # Each value scrubbed before repr: repr escapes a backslash in the
        # key, and what it wrote would no longer match the key.
        fields = (("type", error.provider_type), ("code", error.provider_code), ("message", error.provider_message))
        said = [f"{k}={self._scrub(v)!r}" for k, v in fields if v]
        return f" (provider: {', '.join(said)})" if said else ""

    def _scrub(self, text: str) -> str:
        # Already done where the provider's text was read and bounded (the
        # client, the bridge); again here for whatever reaches a log line.
        return self._key.scrub(text) if self._key is not None else text

    def _count(self, outcome: str) -> None:
        self._outcomes[outcome] = self._outcomes.get(outcome, 0) + 1

    # -- the rest ------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return {
            "engine": "upstream",
            "generations": self._generations,
            "outcomes": dict(self._outcomes),
            "endpoints": self.pool.snapshot(),
            "routing": self.router.stats(),
        }

    async def aclose(self) -> None:
        await self.client.aclose()


def _route_request(prepared: UpstreamPrepared) -> RouteRequest:
    conversation = prepared.conversation
    continues = []
    if conversation.previous_response_id:
        continues.append(response_anchor(conversation.previous_response_id))
    if conversation.conversation_id:
        continues.append(conversation_anchor(conversation.conversation_id))
    # Every pin and prefix the request matches or leaves is its owner's
    # (routing.py, "Owners"): another key's prompts and sessions never steer it.
    return RouteRequest(prompt=prepared.route_prompt, seed=prepared.route_seed, continues=tuple(continues),
                        session=conversation.prompt_cache_key or prepared.run.session_key,
                        owner=prepared.run.owner)


def _encode_body(body: dict[str, Any]) -> tuple[bytes, int, bytes]:
    """The request body as JSON (the same bytes ``_dumps(body)`` gives), with
    where its messages array ends and its tools' JSON, each encoded once."""
    head = {"model": body["model"]}
    messages = _dumps(body["messages"]).encode("utf-8")
    tools = _dumps(body["tools"]).encode("utf-8") if "tools" in body else b""
    rest = {k: v for k, v in body.items() if k not in ("model", "messages", "tools")}
    out = bytearray(_dumps(head)[:-1].encode("utf-8"))
    out += b',"messages":'
    out += messages
    messages_end = len(out) - 1
    if tools:
        out += b',"tools":'
        out += tools
    out += b"," + _dumps(rest)[1:].encode("utf-8") if rest else b"}"
    return bytes(out), messages_end, tools


def _estimate_tokens(body: bytes) -> int:
    # About four bytes a token for English and JSON; only a hint (the
    # provider reports the true count in usage).
    return max(1, len(body) // 4)
