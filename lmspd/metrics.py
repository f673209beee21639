"""What the service measures, in one place: Prometheus metrics for
``GET /metrics`` and the recent-generation log the console's engine view
shows.

Four kinds of source, each read where it is cheapest:

- per HTTP request (route template, method, status): an ASGI middleware,
  :class:`RequestMetrics`, counting when the response starts;
- per generation (TTFT, decode rate, prefill and reused tokens by
  ``cache_source``): :meth:`Metrics.observe` wraps an engine's event stream
  in the service, so every dialect and background tasks are counted once;
- engine state (queue depth, busy sequences, KV bytes in RAM and on disk,
  upstream endpoint health): read from ``engine.stats()`` and the model
  queues at scrape time by :class:`_EngineCollector`, never polled;
- store writes (their latency): :meth:`Metrics.timed_store` wraps the store
  the app uses.

Each ``Service`` owns one :class:`Metrics` with its own registry, so two
apps in one process (tests) never share counters.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from starlette.routing import Match

from lmspd.core.events import EngineEvent, Failed, Finished, ReasoningDelta, TextDelta, ToolCallStarted

if TYPE_CHECKING:
    from lmspd.engines.base import Engine
    from lmspd.service import Service

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# How many generations the engine view lists (a bounded ring, not a history).
RECENT_GENERATIONS = 64
# Label value for a request no route matched: unbounded paths never become labels.
UNMATCHED = "unmatched"
# Label values for the request method: any other method (the parser takes
# some thirty more, WebDAV's among them) counts as OTHER_METHOD, or each
# distinct one would be a label set kept forever.
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "CONNECT"})
OTHER_METHOD = "other"

_FIRST_OUTPUT = (TextDelta, ReasoningDelta, ToolCallStarted)
# Store methods that write; their latency is lmspd_store_write_seconds.
STORE_WRITES = frozenset({
    "put_response", "update_response", "delete_response", "create_conversation", "update_conversation",
    "delete_conversation", "append_conversation_items", "delete_conversation_item", "create_task",
    "set_task_status", "append_event", "append_events", "end_turn", "idempotency_begin", "idempotency_finish",
    "idempotency_abandon",
})


@dataclass(frozen=True, slots=True)
class GenerationRecord:
    """One finished generation, as the engine view shows it."""

    at: float  # unix time it ended
    model: str
    response_id: str | None
    outcome: str  # a finish reason, or the failure code
    cache_source: str
    reused_tokens: int
    prefilled_tokens: int
    output_tokens: int
    ttft_ms: float | None
    decode_tokens_per_s: float | None

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("lmspd_http_requests", "HTTP requests by route template, method and status.",
                                ["route", "method", "status"], registry=r)
        self.generations = Counter("lmspd_generations", "Finished generations by model and outcome.",
                                   ["model", "outcome"], registry=r)
        self.ttft = Histogram("lmspd_time_to_first_token_seconds",
                              "From the model taking the request (after the queue) to its first output.",
                              ["model"], registry=r,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.decode = Histogram("lmspd_decode_tokens_per_second",
                                "Output tokens per second after the first, per generation.",
                                ["model"], registry=r, buckets=(1, 5, 10, 25, 50, 100, 200, 400, 800, 1600))
        self.prefill_tokens = Counter("lmspd_prefill_tokens", "Prompt tokens the model had to compute.",
                                      ["model", "cache_source"], registry=r)
        self.reused_tokens = Counter("lmspd_reused_tokens", "Prompt tokens served from a cache (cached_tokens).",
                                     ["model", "cache_source"], registry=r)
        self.output_tokens = Counter("lmspd_output_tokens", "Tokens generated.", ["model"], registry=r)
        self.store_write = Histogram("lmspd_store_write_seconds", "Latency of stored-state writes.",
                                     ["operation"], registry=r,
                                     buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1))
        self.recent: deque[GenerationRecord] = deque(maxlen=RECENT_GENERATIONS)
        self._service: Service | None = None

    def bind(self, service: "Service") -> None:
        """Read ``service``'s engines and queues at scrape time."""
        if self._service is None:
            self.registry.register(_EngineCollector(service))
        self._service = service

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def observe(self, engine: "Engine", response_id: Callable[[], str | None],
                      events: AsyncIterator[EngineEvent], start: float) -> AsyncIterator[EngineEvent]:
        """Pass ``events`` through, timing the first output from ``start``
        (when the generation was asked for: it may run before it is read)
        and counting the terminal event's usage. Costs two clock reads per
        generation plus an isinstance per event."""
        model = engine.info.id
        first: float | None = None
        try:
            async for event in events:
                if first is None and isinstance(event, _FIRST_OUTPUT):
                    first = time.perf_counter()
                elif isinstance(event, (Finished, Failed)):
                    self._finished(engine, model, response_id(), event, start, first, time.perf_counter())
                yield event
        finally:
            # A consumer that stops early stops the engine's stream with it.
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()

    def _finished(self, engine: "Engine", model: str, response_id: str | None, event: Finished | Failed,
                  start: float, first: float | None, end: float) -> None:
        usage = event.usage
        # The embedded engine names how it matched its KV cache (on the
        # generation's own usage: several run at once); a provider only
        # reports cached_tokens.
        source = usage.cache_source or "upstream"
        reused = max(0, usage.cached_tokens)
        prefilled = max(0, usage.input_tokens - reused)
        self.prefill_tokens.labels(model, source).inc(prefilled)
        self.reused_tokens.labels(model, source).inc(reused)
        self.output_tokens.labels(model).inc(max(0, usage.output_tokens))
        outcome = event.reason if isinstance(event, Finished) else event.code
        self.generations.labels(model, outcome).inc()
        ttft = None
        rate = None
        if first is not None:
            ttft = first - start
            self.ttft.labels(model).observe(ttft)
            if usage.output_tokens > 1 and end > first:
                rate = (usage.output_tokens - 1) / (end - first)
                self.decode.labels(model).observe(rate)
        self.recent.append(GenerationRecord(
            at=time.time(), model=model, response_id=response_id, outcome=outcome, cache_source=source,
            reused_tokens=reused, prefilled_tokens=prefilled, output_tokens=usage.output_tokens,
            ttft_ms=None if ttft is None else round(ttft * 1000, 1),
            decode_tokens_per_s=None if rate is None else round(rate, 1),
        ))

    def timed_store(self, store: Any) -> Any:
        return _TimedStore(store, self.store_write)


def _engine_stats(engine: Any) -> dict[str, Any]:
    try:
        stats = engine.stats()
    except Exception:  # a scrape must not fail on one engine's trouble
        return {}
    return stats if isinstance(stats, dict) else {}


class _EngineCollector:
    """Gauges read from the service at scrape time (nothing to keep in sync)."""

    def __init__(self, service: "Service") -> None:
        self._service = service

    def describe(self) -> Iterable[Any]:
        return []  # families are known only at scrape time

    def collect(self) -> Iterable[Any]:
        queue = GaugeMetricFamily("lmspd_queue_depth", "Requests waiting for a busy model.", labels=["model"])
        busy = GaugeMetricFamily("lmspd_sequences_busy", "Generations running now.", labels=["model"])
        ram = GaugeMetricFamily("lmspd_kv_ram_bytes", "KV cache sessions held in RAM.", labels=["model"])
        ram_sessions = GaugeMetricFamily("lmspd_kv_ram_sessions", "KV cache sessions held in RAM.",
                                         labels=["model"])
        disk = GaugeMetricFamily("lmspd_kv_disk_bytes", "KV checkpoints on disk.", labels=["model"])
        healthy = GaugeMetricFamily("lmspd_upstream_endpoint_healthy", "1 when the endpoint takes requests.",
                                    labels=["model", "endpoint"])
        outstanding = GaugeMetricFamily("lmspd_upstream_endpoint_outstanding", "Requests open at the endpoint.",
                                        labels=["model", "endpoint"])
        routed = CounterMetricFamily("lmspd_upstream_endpoint_requests",
                                     "Requests routed to the endpoint (routing decisions).",
                                     labels=["model", "endpoint"])
        failures = CounterMetricFamily("lmspd_upstream_endpoint_failures", "Failed requests at the endpoint.",
                                       labels=["model", "endpoint"])
        host = HistogramMetricFamily("lmspd_step_host_seconds",
                                     "Time per scheduler step outside llama_decode (batch, sampling, parsers, "
                                     "hand-over).", labels=["model"])
        drafted = CounterMetricFamily("lmspd_speculative_drafted_tokens", "Draft tokens proposed, by source.",
                                      labels=["model", "source"])
        accepted = CounterMetricFamily("lmspd_speculative_accepted_tokens", "Draft tokens accepted, by source.",
                                       labels=["model", "source"])
        for model_id, served in list(self._service.models.items()):
            queue.add_metric([model_id], served.queue.pending)
            busy.add_metric([model_id], served.queue.running)
            stats = _engine_stats(served.engine)
            cache = stats.get("cache")
            if isinstance(cache, dict):
                ram.add_metric([model_id], cache.get("ram_bytes", 0))
                ram_sessions.add_metric([model_id], cache.get("ram_sessions", 0))
                disk.add_metric([model_id], cache.get("disk_bytes", 0))
            steps = stats.get("step_host_seconds")
            if isinstance(steps, dict) and steps.get("count"):
                host.add_metric([model_id], steps["buckets"], steps["sum_s"])
            speculation = stats.get("speculation")
            if isinstance(speculation, dict):
                for source, counts in speculation.get("by_source", {}).items():
                    drafted.add_metric([model_id, source], counts["drafted"])
                    accepted.add_metric([model_id, source], counts["accepted"])
            for ep in stats.get("endpoints") or []:
                labels = [model_id, str(ep.get("url"))]
                healthy.add_metric(labels, 1 if ep.get("healthy") else 0)
                outstanding.add_metric(labels, ep.get("outstanding", 0))
                routed.add_metric(labels, ep.get("requests", 0))
                failures.add_metric(labels, ep.get("failures", 0))
        return [queue, busy, ram, ram_sessions, disk, healthy, outstanding, routed, failures, host, drafted, accepted]


class _TimedStore:
    """The store, with the latency of each write observed; every other
    method passes straight through."""

    def __init__(self, store: Any, histogram: Histogram) -> None:
        self._store = store
        self._histogram = histogram

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr  # a plain attribute: always read through
        if name in STORE_WRITES:
            child = self._histogram.labels(name)
            method = attr

            def timed(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return method(*args, **kwargs)
                finally:
                    child.observe(time.perf_counter() - start)

            attr = timed
        # Methods are found once: later lookups skip __getattr__.
        self.__dict__[name] = attr
        return attr


class RequestMetrics:
    """ASGI middleware: one count per HTTP response, labelled by the route
    template that matched (``/v1/responses/{response_id}``), never by the
    raw path."""

    def __init__(self, app: Any, metrics: Metrics, routes: list[Any]) -> None:
        self.app = app
        self._metrics = metrics
        self._routes = routes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = self._route(scope)
        method = scope.get("method", "GET")
        if method not in KNOWN_METHODS:
            method = OTHER_METHOD
        counted = False

        async def counting_send(message: dict) -> None:
            nonlocal counted
            if message["type"] == "http.response.start" and not counted:
                counted = True
                self._metrics.requests.labels(route, method, str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except BaseException:
            if not counted:
                self._metrics.requests.labels(route, method, "500").inc()
            raise

    def _route(self, scope: dict) -> str:
        partial = None
        for route in self._routes:
            match, _ = route.matches(scope)
            if match is Match.FULL:
                return route.path
            if match is Match.PARTIAL and partial is None:
                partial = route.path  # the path exists; the method does not (405)
        return partial or UNMATCHED
