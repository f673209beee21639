"""Compaction, the three wire forms of one operation: the model summarizes
a long window, and the window is replaced by ``[the client's own messages,
the compaction item]`` (``lmspd.core.compaction`` says what the item is and
what it stands for).

- ``POST /v1/responses/compact`` (``compact``): a create-like body in, a
  ``response.compaction`` object out, whose ``output`` (the user messages,
  then the compaction item) is the base input of a new chain;
- a ``compaction_trigger`` as the last input item of ``/v1/responses``
  (Codex's remote compaction): the turn streams exactly one compaction item
  and completes;
- ``context_management: [{"type": "compaction", "compact_threshold": N}]``:
  when the rendered input crosses N tokens, the turn compacts first (the
  compaction item is its first output item), then answers on the reduced
  window.

The summary is written by the served model itself, at temperature 0, with
the fixed ``COMPACTION_PROMPT`` appended to the window as the last user
turn (tools and instructions unchanged, so that the window's KV is reused).
An engine that can prefill without generating (the llama engine) then
evaluates the reduced window into its KV, so the new chain's first turn is
a cache hit. The upstream engine compacts the same way: the summary is one
more Chat Completions request to its provider (there is nothing to prefill).

A turn that compacts (``CompactingRun``) sends response.created and
keep-alives while its summary is written, the longest silence a turn can
have: its refusals before that (the summary's admission) are still HTTP
errors, a failure after it fails the response.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any

from lmspd.core import compaction as item
from lmspd.core.conversation import Conversation, Item, Message, OutputFormat, Sampling, ToolChoice
from lmspd.core.errors import ApiError, invalid
from lmspd.core.events import Finished, Usage
from lmspd.core.ids import new_id
from lmspd.core.run import RunContext
from lmspd.engines.base import CancelToken
from lmspd.service import RunEvents, RunStream, TurnRun, quiet
from lmspd.streaming.session import ResponseState, StreamSession, WireEvent
from lmspd.streaming.steps import Step

if TYPE_CHECKING:
    from lmspd.http import LmspdApp
    from lmspd.service import Run

log = logging.getLogger("lmspd.compaction")

# The summary's length bound (tokens); it is clamped to the room the
# context leaves.
SUMMARY_MAX_TOKENS = 256


class _Silent:
    """An encoder that sends nothing: a summary run has no client."""

    first_sequence_number = 0

    def encode(self, step: Step, state: ResponseState, seq: int) -> None:
        return None


async def _begun(begun: Any) -> "Run":
    return await begun if inspect.isawaitable(begun) else begun


def supports_prefill(app: "LmspdApp", model: str) -> bool:
    return bool(getattr(app.service.model(model).engine, "supports_prefill", False))


def summary_request(conversation: Conversation) -> Conversation:
    """What the model is asked for a summary of ``conversation``'s window."""
    return dataclasses.replace(
        conversation,
        items=list(conversation.items) + [Message(role="user", text=item.COMPACTION_PROMPT)],
        tool_choice=ToolChoice(mode="none"),
        output_format=OutputFormat(),
        sampling=Sampling(temperature=0.0),
        max_output_tokens=SUMMARY_MAX_TOKENS,
        max_output_tokens_is_ceiling=True,
        # A window too long for the model is what compaction is for: the
        # oldest turns go first.
        truncate=True,
        include_encrypted_reasoning=False,
    )


class Summary:
    """A summary run, admitted (``Service.begin``: its refusals come before
    any byte of the turn); ``written`` reads it to its end."""

    def __init__(self, run: "Run", model: str) -> None:
        self.run = run
        self._state = ResponseState(id=new_id("cmp"), model=model)
        self._events = run.events(StreamSession(self._state, _Silent()))

    @classmethod
    async def begin(cls, app: "LmspdApp", run: RunContext, conversation: Conversation) -> "Summary":
        """The summary of ``conversation``'s window, run for ``run``'s owner and session."""
        # A side request: it must not displace the connection's session.
        side = dataclasses.replace(run, prefill_only=False, pin=None)
        return cls(await _begun(app.service.begin(summary_request(conversation), side)), conversation.model)

    async def written(self) -> tuple[str, Usage]:
        """The summary and what writing it cost (an ``ApiError`` if it failed)."""
        async with contextlib.aclosing(self._events) as events:
            async for _ in events:
                pass
        state = self._state
        if state.status == "failed":
            error = state.error or {}
            raise ApiError(error.get("code", "server_error"), f"Compaction failed: {error.get('message', '')}")
        return state.output_text.strip(), state.usage or Usage()

    async def aclose(self) -> None:
        """Gives back what the run holds, read or not."""
        await self._events.aclose()


async def summarize(app: "LmspdApp", run: RunContext, conversation: Conversation) -> tuple[str, Usage]:
    """The model's summary of ``conversation``'s window and what writing it
    cost (an ``ApiError`` if it failed), run for ``run``'s owner and session."""
    return await (await Summary.begin(app, run, conversation)).written()


def compaction_message(app: "LmspdApp", summary: str, owner: str) -> Message:
    return item.summary_message(summary, item.seal(app.sealer, summary, owner), new_id("cmp"))


async def begin_run(app: "LmspdApp", conversation: Conversation, run: RunContext) -> TurnRun:
    """The run of a turn on ``conversation``: admitted by the service, or,
    for a warm-up on an engine that cannot prefill without generating (the
    upstream engine), one with nothing to do: asking the provider would
    generate and bill; the next turn sends the whole context anyway."""
    if run.prefill_only and not supports_prefill(app, conversation.model):
        return FinishedRun()
    return await _begun(app.service.begin(conversation, run))


async def before_turn(app: "LmspdApp", run: RunContext, req: Any, window: list[Item]) -> "CompactingRun | None":
    """The run of a /v1/responses turn that compacts (a trigger, or the
    ``context_management`` threshold crossed), its summary admitted; None
    for a turn that does not. ``run`` is the turn's own
    (``routes.responses.begin_turn``), ``window`` its items, which the
    reduced window replaces once the summary is written."""
    conversation: Conversation = req.conversation
    threshold = req.compact_threshold
    if not req.compaction_trigger:
        if threshold is None:
            return None
        if await app.service.count_tokens(conversation) <= threshold:
            return None
    summary = await Summary.begin(app, run, conversation)
    return CompactingRun(app, run, conversation, summary, window,
                         trigger=req.compaction_trigger, threshold=threshold)


class CompactingRun:
    """A turn that compacts: its events start at once (response.created,
    in progress, then keep-alives while the summary is written), then the
    compaction item, then the run that ends the turn on the reduced window
    (a trigger's warm-up prefill, the threshold's answer). The summary is a
    turn's longest silence (the whole window's prefill, maybe a wait in the
    queue, then up to ``SUMMARY_MAX_TOKENS``), and clients give up on a
    silent stream (Codex after 300 s, proxies often after 60).

    What can be refused before any byte still is: the summary is admitted
    before the turn starts (a full queue, a refusal while preparing) and an
    engine that must reach its provider first does it in ``open``, as the
    routes call it. What happens after the first byte (the summary failing,
    the answer's admission) fails the response. The turn's usage is
    everything the model did for it: the summary, then the run's own
    (``StreamSession.spent``)."""

    def __init__(self, app: "LmspdApp", run: RunContext, conversation: Conversation, summary: Summary,
                 window: list[Item], *, trigger: bool, threshold: int | None) -> None:
        self._app = app
        self._run = run
        self._conversation = conversation
        self._summary = summary
        self._window = window
        self._trigger = trigger
        self._threshold = threshold
        # The run after the summary and its events, once admitted.
        self._then: TurnRun | None = None
        self._then_events: RunStream | None = None
        self.cancel = CancelToken()
        self.cancel.on_cancel(lambda: self._current.cancel.cancel(self.cancel.reason))
        self.ticket = _Places(self)

    @property
    def _current(self) -> TurnRun:
        return self._then if self._then is not None else self._summary.run

    @property
    def opens_first(self) -> bool:
        return self._summary.run.opens_first

    async def open(self) -> None:
        await self._summary.run.open()

    @property
    def started(self) -> bool:
        """Whether the model took the run now under way (one still queued
        leaves the queue only when its task is cancelled)."""
        return bool(self._current.started)

    def events(self, session: StreamSession, on_start: Callable[[], None] | None = None) -> "RunEvents":
        return RunEvents(self, self._events(session, on_start))

    async def _events(self, session: StreamSession,
                      on_start: Callable[[], None] | None) -> AsyncGenerator[WireEvent, None]:
        for wire in session.start():
            yield wire
        try:
            # Queued (a background response): in progress once the model takes the summary.
            waiting = asyncio.ensure_future(self._summary.run.ticket.wait())
            async with contextlib.aclosing(self._quiet(waiting, session)) as heartbeats:
                async for wire in heartbeats:
                    yield wire
            waiting.result()
            progress = session.begin_progress() if session.state.status == "queued" else []
            if on_start is not None:
                on_start()
            for wire in progress:
                yield wire
            writing = asyncio.ensure_future(self._summary.written())
            async with contextlib.aclosing(self._quiet(writing, session)) as heartbeats:
                async for wire in heartbeats:
                    yield wire
            summary, usage = writing.result()
            session.spent = usage
            if self.cancel.cancelled:
                for wire in (session.fail("server_shutting_down", "The server is shutting down.")
                             if self.cancel.reason == "shutdown" else session.cancel()):
                    yield wire
                return
            made = compaction_message(self._app, summary, self._run.owner)
            self._then = await self._next(self._reduced(made))
            if self.cancel.cancelled:
                self._then.cancel.cancel(self.cancel.reason)
            self._then_events = self._then.events(session)
        except ApiError as exc:
            for wire in session.fail(exc.code, exc.message):
                yield wire
            return
        except Exception as exc:  # a bug must still end the stream properly
            log.exception("response %s failed", session.state.id)
            for wire in session.fail("server_error", f"Internal error: {type(exc).__name__}"):
                yield wire
            return
        for wire in session.lead([made]):
            yield wire
        async with contextlib.aclosing(self._then_events) as events:
            async for wire in events:
                yield wire

    async def _settle(self) -> None:
        """Give back what the summary and the run after it hold, read or not."""
        await self._summary.aclose()
        if self._then_events is not None:
            await self._then_events.aclose()

    def _reduced(self, made: Message) -> Conversation:
        conversation = self._conversation
        reduced = dataclasses.replace(conversation, items=item.effective_items(list(conversation.items) + [made]),
                                      previous_response_id=None)
        # What the turn continues from, which a WebSocket connection
        # remembers before the turn's output: without the compaction item,
        # which the output starts with (``session.lead``).
        self._window[:] = reduced.items[:-1]
        log.info("compaction %s: %d items -> %d (%s)", made.id, len(conversation.items), len(reduced.items),
                 "trigger" if self._trigger else f"threshold={self._threshold}")
        return reduced

    async def _next(self, reduced: Conversation) -> TurnRun:
        """The run that ends the turn: the threshold's answer on the reduced
        window; for a trigger, the reduced window prefilled, so that the
        client's next turn continues it (nothing, where the engine cannot)."""
        if not self._trigger:
            return await begin_run(self._app, reduced, self._run)
        if not supports_prefill(self._app, reduced.model):
            return FinishedRun()
        warm = dataclasses.replace(reduced, max_output_tokens=None)
        return await _begun(self._app.service.begin(warm, dataclasses.replace(self._run, prefill_only=True)))

    def _quiet(self, work: "asyncio.Future[Any]", session: StreamSession) -> AsyncGenerator[WireEvent, None]:
        return quiet(work, session, self._app.service.limits.sse_keepalive_s)


class _Places:
    """The queue places a compacting run holds: the summary's, then the
    next run's (a task gives them back should its run never start)."""

    def __init__(self, run: CompactingRun) -> None:
        self._run = run

    def release(self) -> None:
        self._run._summary.run.ticket.release()
        if self._run._then is not None:
            self._run._then.ticket.release()


class FinishedRun:
    """A run with nothing to generate: the turn ends as soon as it starts
    (a compaction trigger, a warm-up, on an engine that cannot prefill)."""

    opens_first = False
    started = True

    def __init__(self) -> None:
        self.cancel = CancelToken()
        self.ticket = _NoTicket()

    async def open(self) -> None:
        return None

    async def events(self, session: StreamSession,
                     on_start: Callable[[], None] | None = None) -> AsyncGenerator[WireEvent, None]:
        for wire in session.start():
            yield wire
        if session.state.status == "queued":
            for wire in session.begin_progress():
                yield wire
        if on_start is not None:
            on_start()
        for wire in session.handle(Finished("stop", Usage())):
            yield wire


class _NoTicket:
    """No queue slot is held: nothing to release."""

    def release(self) -> None:
        return None


# -- POST /v1/responses/compact ----------------------------------------------------

# Fields of a create body that /compact reads; the rest of a create body has
# no meaning for it (streaming, storage, sampling) and is refused by name.
# The SDK's ResponseCompactParams are all here (its ``prompt_cache_options``
# and ``image`` are decoded as a create body's and change nothing here: the
# compacted window is prefilled wherever the engine can, and no model reads images).
COMPACT_FIELDS = {"model", "input", "previous_response_id", "instructions", "prompt_cache_key", "tools",
                  "parallel_tool_calls", "reasoning", "text", "tool_choice", "metadata", "user",
                  "safety_identifier", "include", "service_tier", "prompt_cache_retention", "client_metadata",
                  "prompt_cache_options", "image"}


async def compact(app: "LmspdApp", owner: str, dialect: Any, raw: dict[str, Any], context: Any) -> dict[str, Any]:
    if not isinstance(raw.get("model"), str) or not raw["model"]:
        raise invalid("Missing required parameter: 'model'.", "model")
    for key in raw:
        if key not in COMPACT_FIELDS:
            raise ApiError("unsupported_parameter", f"Unknown parameter: '{key}'.", param=key)
    if isinstance(raw.get("input"), list) and any(isinstance(i, dict) and i.get("type") == "compaction_trigger"
                                                  for i in raw["input"]):
        raise invalid("'input' of /v1/responses/compact cannot hold a compaction_trigger.", "input")
    req = await app.service.decode(lambda: dialect.decode({**raw, "store": False}, app.limits, context=context))
    conversation: Conversation = req.conversation
    summary, usage = await summarize(app, RunContext(owner=owner), conversation)
    made = compaction_message(app, summary, owner)
    kept = [Message(role=i.role, text=i.text, id=new_id("msg")) for i in conversation.items
            if isinstance(i, Message) and i.role == "user" and i.compaction is None]
    output = kept + [made]
    if supports_prefill(app, conversation.model):
        # What the new chain starts with, in the KV before the client asks.
        warm = dataclasses.replace(conversation, items=list(output), previous_response_id=None,
                                   max_output_tokens=None, truncate=False)
        try:
            run = await _begun(app.service.begin(warm, RunContext(owner=owner, prefill_only=True)))
            state = ResponseState(id=new_id("cmp"), model=conversation.model)
            async for _ in run.events(StreamSession(state, _Silent())):
                pass
        except ApiError as exc:  # the summary stands; only the warm-up is lost
            log.info("compaction warm-up skipped: %s", exc.message)
    from lmspd.dialects.openai_responses import input_item_json, usage_object

    return {
        "id": made.id,
        "object": "response.compaction",
        "created_at": _now(),
        "output": [input_item_json(i) for i in output],
        # What writing the summary cost (the warm-up prefill is not billed),
        # in the shape of a Response's usage (the SDK's CompactedResponse).
        "usage": usage_object(usage),
    }


def _now() -> int:
    return int(time.time())
