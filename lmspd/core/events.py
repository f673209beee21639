"""Neutral semantic events: what an engine produces, whatever the dialect.

An engine yields these in order; the stream session (lmspd.streaming) turns
them into output items, numbers them and serializes them per dialect. Engines
never build wire events themselves.

Ordering contract an engine keeps:
- text and reasoning deltas may interleave with tool calls only at item
  boundaries: a ``ToolCallStarted`` closes any open text/reasoning item;
- every ``ToolCallStarted`` is followed by zero or more ``ToolCallDelta`` for
  the same ``index`` and exactly one ``ToolCallDone`` before the next call
  starts;
- the stream ends with exactly one ``Finished`` or ``Failed``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Union

ToolKind = Literal["function", "custom"]
# ``content_filter``: the provider stopped the output with its own filter.
FinishReason = Literal["stop", "length", "context_window", "tool_calls", "content_filter", "repetition", "cancelled"]


@dataclass(frozen=True, slots=True)
class TextDelta:
    """Visible assistant text."""

    text: str


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """Model reasoning (``<think>`` content or a provider's reasoning_content)."""

    text: str


@dataclass(frozen=True, slots=True)
class ReasoningDone:
    """The reasoning item is complete; ``encrypted_content`` carries the hidden
    reasoning across a stateless replay (when the client asked for it)."""

    encrypted_content: str | None = None


@dataclass(frozen=True, slots=True)
class ToolCallStarted:
    """A tool call whose name is final and on the request's allowlist."""

    index: int
    call_id: str
    name: str
    kind: ToolKind = "function"
    namespace: str | None = None


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A fragment of the call's arguments (function) or raw input (custom)."""

    index: int
    delta: str


@dataclass(frozen=True, slots=True)
class ToolCallDone:
    """The call is complete; ``payload`` is the whole arguments JSON / raw input."""

    index: int
    payload: str


@dataclass(slots=True)
class Usage:
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    reasoning_tokens: int = 0
    # Where the reused prefix came from (the llama engine's cache plan);
    # None for engines that do not say.
    cache_source: str | None = None
    # The llama engine's lmspd.cache.diagnostics.CacheReport (why a prompt
    # reused less than the cache remembers); None for other engines.
    cache_report: Any = None
    # The llama engine's drafted and accepted tokens by source
    # (lmspd.engines.llama.speculation.DecodeStats); None: no speculation.
    decode_report: Any = None

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


@dataclass(frozen=True, slots=True)
class Finished:
    """Generation ended normally (``stop``/``tool_calls``), by the token cap
    (``length``), by the end of the context window where the request set no
    lower cap (``context_window``), by a provider's content filter (``content_filter``), by
    the engine's repetition guard (``repetition``: the output looped) or
    because it was cancelled."""

    reason: FinishReason
    usage: Usage = field(default_factory=Usage)
    # The request's stop sequence that ended the output (not part of it).
    stop_sequence: str | None = None


@dataclass(frozen=True, slots=True)
class Failed:
    """Generation failed; ``code`` is machine-readable (e.g. ``upstream_error``,
    ``upstream_timeout``, ``server_shutting_down``)."""

    code: str
    message: str
    usage: Usage = field(default_factory=Usage)


EngineEvent = Union[
    TextDelta, ReasoningDelta, ReasoningDone, ToolCallStarted, ToolCallDelta, ToolCallDone, Finished, Failed
]
TERMINAL_EVENTS = (Finished, Failed)
