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
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator

from lmspd.core import compaction as item
from lmspd.core.conversation import Conversation, Message, OutputFormat, Sampling, ToolChoice
from lmspd.core.errors import ApiError, invalid
from lmspd.core.events import Finished, Usage
from lmspd.core.ids import new_id
from lmspd.core.run import RunContext
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


async def summarize(app: "LmspdApp", run: RunContext, conversation: Conversation) -> tuple[str, Usage]:
    """The model's summary of ``conversation``'s window and what writing it
    cost (an ``ApiError`` if it failed), run for ``run``'s owner and session."""
    conv = dataclasses.replace(
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
    # A side request: it must not displace the connection's session.
    side = dataclasses.replace(run, prefill_only=False, pin=None)
    summary_run = await _begun(app.service.begin(conv, side))
    state = ResponseState(id=new_id("cmp"), model=conv.model)
    async for _ in summary_run.events(StreamSession(state, _Silent())):
        pass
    if state.status == "failed":
        error = state.error or {}
        raise ApiError(error.get("code", "server_error"), f"Compaction failed: {error.get('message', '')}")
    return state.output_text.strip(), state.usage or Usage()


def compaction_message(app: "LmspdApp", summary: str, owner: str) -> Message:
    return item.summary_message(summary, item.seal(app.sealer, summary, owner), new_id("cmp"))


@dataclass
class Lead:
    """A turn that compacts: the compaction item it emits first, the
    reduced conversation, (for a trigger) the run that ends the turn, and
    what writing the summary cost. The turn's usage is everything the model
    did for it: that summary (what ``/v1/responses/compact`` reports), then
    the run's own, the answer or a trigger's warm-up prefill, which a
    ``generate: false`` turn reports too (``StreamSession.spent``). Without
    it the summary, the turn's main cost, went unreported: a trigger's
    usage was all zeros."""

    item: Message
    conversation: Conversation
    summary_usage: Usage
    run: Any = None


async def before_turn(app: "LmspdApp", run: RunContext, req: Any, dialect: Any) -> Lead | None:
    """Whether this /v1/responses turn compacts (a trigger, or the
    ``context_management`` threshold crossed), and how; ``run`` is the
    turn's own (``routes.responses.begin_turn``)."""
    conversation: Conversation = req.conversation
    threshold = req.compact_threshold
    if not req.compaction_trigger:
        if threshold is None:
            return None
        if await app.service.count_tokens(conversation) <= threshold:
            return None
    summary, usage = await summarize(app, run, conversation)
    made = compaction_message(app, summary, run.owner)
    reduced = dataclasses.replace(conversation, items=item.effective_items(list(conversation.items) + [made]),
                                  previous_response_id=None)
    log.info("compaction %s: %d items -> %d (%s)", made.id, len(conversation.items), len(reduced.items),
             "trigger" if req.compaction_trigger else f"threshold={threshold}")
    if not req.compaction_trigger:
        return Lead(made, reduced, usage)
    # The turn ends after the compaction item; the reduced window is
    # prefilled meanwhile, so that the client's next turn continues it.
    if supports_prefill(app, conversation.model):
        warm = dataclasses.replace(reduced, max_output_tokens=None)
        return Lead(made, reduced, usage,
                    await _begun(app.service.begin(warm, dataclasses.replace(run, prefill_only=True))))
    return Lead(made, reduced, usage, FinishedRun())


class FinishedRun:
    """A run with nothing to generate: the turn ends as soon as it starts
    (a compaction trigger, a warm-up, on an engine that cannot prefill)."""

    opens_first = False
    started = True

    def __init__(self) -> None:
        from lmspd.engines.base import CancelToken

        self.cancel = CancelToken()
        self.ticket = _NoTicket()

    async def events(self, session: StreamSession, on_start: Any = None) -> AsyncIterator[WireEvent]:
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
COMPACT_FIELDS = {"model", "input", "previous_response_id", "instructions", "prompt_cache_key", "tools",
                  "parallel_tool_calls", "reasoning", "text", "tool_choice", "metadata", "user",
                  "safety_identifier", "include", "service_tier", "prompt_cache_retention", "client_metadata"}


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
