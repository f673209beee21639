"""One scripted engine for every in-process test: it implements the engine
protocol (lmspd.engines.base.Engine) without a model, so protocol and state
behaviour (ids, errors, idempotency, ownership, tasks, stored responses,
stream-session invariants) is tested in milliseconds. Anything that depends
on what a model says or on the KV cache is tested against the real model
(tests/e2e) instead.

It behaves as the llama engine does where the core can tell: it counts
generations and preparations, honours the cancel token between events
(``Finished("cancelled")``, or ``Failed("server_shutting_down")`` on a
shutdown), and ends every generation with exactly one terminal event.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from lmspd.core.conversation import Conversation, ToolOutput
from lmspd.core.events import (
    EngineEvent,
    Failed,
    Finished,
    TextDelta,
    ToolCallDelta,
    ToolCallDone,
    ToolCallStarted,
    Usage,
)
from lmspd.core.run import LOCAL, RunContext
from lmspd.engines.base import CancelToken, ModelInfo

MODEL = "scripted"
FULL_CAPABILITIES = {"streaming": True, "tools": True, "structured_output": True}


@dataclass
class ScriptedPrepared:
    conversation: Conversation
    input_tokens: int = 3
    response_id: str | None = None
    run: RunContext = LOCAL


Script = Callable[[Conversation], Iterable[EngineEvent]]


class ScriptedEngine:
    """Answers every request with ``words``, one token each (or, given ``script``, with the
    events ``script(conversation)`` returns), ``delay_s`` apart, the first
    after ``first_delay_s``.

    ``usage`` and ``cache_source`` are reported on the terminal ``Finished``
    (as the llama engine reports them); ``stats`` is merged into ``stats()``.
    """

    def __init__(self, words: tuple[str, ...] = ("Hello", " there"), delay_s: float = 0.0, *,
                 model: str = MODEL, context_window: int = 4096, max_concurrency: int = 1,
                 capabilities: dict[str, bool] | None = None, script: Script | None = None,
                 usage: Usage | None = None, cache_source: str | None = None,
                 stats: dict[str, Any] | None = None, first_delay_s: float = 0.0) -> None:
        self.info = ModelInfo(id=model, context_window=context_window,
                              capabilities=dict(FULL_CAPABILITIES if capabilities is None else capabilities),
                              max_concurrency=max_concurrency)
        self.words = words
        self.delay_s = delay_s
        # Silence before the first event, as a long prefill is.
        self.first_delay_s = first_delay_s
        self.script = script
        self.usage = usage
        self.cache_source = cache_source
        self.extra_stats = stats or {}
        self.generations = 0
        self.prepared = 0
        self.cancelled = 0
        # Every conversation prepared, in order: what the core handed the
        # engine (history resolved from previous_response_id, conversations,
        # item references).
        self.conversations: list[Conversation] = []
        # The run context each came with (owner, session, agent lineage, ...).
        self.runs: list[RunContext] = []

    opens_first = False  # the Engine protocol: nothing to reach before generating

    async def open(self, prepared: ScriptedPrepared, cancel: CancelToken) -> None:
        return None

    async def discard(self, prepared: ScriptedPrepared) -> None:
        return None

    def announce(self, conversation: Conversation) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def prepare(self, conversation: Conversation, run: RunContext = LOCAL) -> ScriptedPrepared:
        self.prepared += 1
        self.conversations.append(conversation)
        self.runs.append(run)
        return ScriptedPrepared(conversation, run=run)

    def _events(self, conversation: Conversation) -> list[EngineEvent]:
        if self.script is not None:
            return list(self.script(conversation))
        # One word is one token: ``max_output_tokens`` cuts the reply as the
        # model's token cap does (``length``).
        cap = conversation.max_output_tokens
        words = self.words if cap is None else self.words[:cap]
        reason = "length" if len(words) < len(self.words) else "stop"
        usage = self.usage or Usage(input_tokens=3, output_tokens=len(words))
        if self.cache_source is not None:
            usage = dataclasses.replace(usage, cache_source=self.cache_source)
        return [*(TextDelta(w) for w in words), Finished(reason, usage)]

    async def generate(self, prepared: ScriptedPrepared, cancel: CancelToken, response_id: str | None = None):
        self.generations += 1
        prepared.response_id = response_id
        if self.first_delay_s:
            await asyncio.sleep(self.first_delay_s)
        for event in self._events(prepared.conversation):
            if cancel.cancelled:
                self.cancelled += 1
                if cancel.reason == "shutdown":
                    yield Failed("server_shutting_down", "The server is shutting down.")
                else:
                    yield Finished("cancelled", Usage(input_tokens=3))
                return
            yield event
            # A real engine yields to the loop between tokens.
            await asyncio.sleep(self.delay_s)

    def count_tokens(self, conversation: Conversation) -> int:
        return 3

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"generations": self.generations}
        if self.cache_source is not None:
            out["last_cache_source"] = self.cache_source
        return {**out, **self.extra_stats}

    async def aclose(self) -> None:
        pass


# Codex's Responses Lite tools: apply_patch (custom) and exec_command, both in the "functions" namespace.
CODEX_PATCH = "*** Begin Patch\n*** Add File: a.txt\n+a\n*** End Patch\n"


def codex_namespaced_calls(conversation: Conversation) -> list[EngineEvent]:
    """A ``ScriptedEngine`` script: the engines' events for a model's calls of
    Codex's namespaced tools (it wrote ``functions__apply_patch``): the
    member's own name and the namespace apart; once the outputs are in, an
    answer."""
    if any(isinstance(item, ToolOutput) for item in conversation.items):
        return [TextDelta("Done."), Finished("stop", Usage(3, 1))]
    return [ToolCallStarted(0, "call_p", "apply_patch", "custom", "functions"), ToolCallDelta(0, CODEX_PATCH),
            ToolCallDone(0, CODEX_PATCH),
            ToolCallStarted(1, "call_x", "exec_command", "function", "functions"), ToolCallDone(1, '{"cmd": "ls"}'),
            Finished("tool_calls", Usage(3, 2))]
