"""The bridge: a provider's Chat Completions stream -> neutral engine events.

Text and reasoning stream through as they arrive. Tool calls do not: Chat
Completions has no marker that says a tool name is complete, so an allowed
``lookup`` may still grow into an undeclared ``lookupEvil`` in the next
fragment. The bridge therefore retains tool calls (bounded) and releases
them only at the terminal boundary — ``[DONE]``, or end of stream after
every choice reported a finish reason — and only when every name is on the
request's allowlist. One undeclared name fails the whole stream and
releases no call at all.

Identity: the stream session owns every public id. The one provider value
that passes through is a tool call's id, as ``call_id``, because the client
sends it back with the tool output and the provider expects to see it again
on the next turn. It passes only if it is a short plain token; otherwise, or
when the provider sent none, the call gets the deterministic
``call_<choice>_<tool>``. Provider response ids, model and creation time
stay on the bridge as private correlation metadata.

Every failure becomes exactly one ``Failed`` event; after a terminal event
the bridge returns nothing and parses nothing more.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from lmspd.core.errors import ApiError
from lmspd.core.events import (
    EngineEvent,
    Failed,
    Finished,
    ReasoningDelta,
    TextDelta,
    ToolCallDelta,
    ToolCallDone,
    ToolCallStarted,
    Usage,
)
from lmspd.core.limits import UpstreamStreamLimits
from lmspd.core.strict_json import decode_json

from .chunks import (
    ChatChunk,
    ChatChunkDecoder,
    ChunkChoice,
    ChunkUsage,
    Done,
    ProviderError,
    StreamItem,
    ToolCallFragment,
)
from .credentials import Secret
from .errors import (
    ContradictoryFinish,
    DeltaAfterFinish,
    DuplicateCallId,
    MalformedChunk,
    MalformedCustomToolInput,
    MissingToolName,
    StreamTruncated,
    UndeclaredTool,
    UpstreamError,
    UpstreamLimitExceeded,
    UpstreamProviderError,
    provider_error_code,
)

__all__ = ["BridgeDecoder"]

_FINISH_REASONS = frozenset({"stop", "length", "tool_calls", "content_filter"})
# A provider call id becomes a public call_id only if it looks like one.
_PUBLIC_CALL_ID = re.compile(r"[A-Za-z0-9_.:\-]+\Z")


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8"))


@dataclass(slots=True)
class _ToolCall:
    provider_id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)
    argument_bytes: int = 0
    # An ``arguments`` field (even "") has been seen: the name is past its start.
    arguments_started: bool = False


@dataclass(slots=True)
class _Choice:
    finish_reason: str | None = None
    # By key: the provider's index, except for a call that came at an index
    # another call holds (``BridgeDecoder._key``): a key past every other.
    calls: dict[int, _ToolCall] = field(default_factory=dict)
    # The provider's index → the key of the call its fragments now go to,
    # where the two differ.
    moved: dict[int, int] = field(default_factory=dict)


def _taken(state: _Choice, index: int) -> bool:
    """``index`` is the key of a call that another index's fragments moved to."""
    return index in state.moved.values()


def _usage(usage: ChunkUsage) -> Usage:
    return Usage(
        input_tokens=usage.prompt_tokens,
        output_tokens=usage.completion_tokens,
        cached_tokens=usage.cached_tokens,
        cache_write_tokens=usage.cache_write_tokens,
        reasoning_tokens=usage.reasoning_tokens,
    )


def _unwrap_custom_input(arguments: str) -> str:
    # The synthetic function's only parameter is the raw custom-tool input.
    try:
        # As strict as every other JSON a provider sends: {"input": "a",
        # "input": "b"} is no one input (json.loads took the last).
        wrapper = decode_json(arguments)
    except ApiError:
        raise MalformedCustomToolInput() from None
    if not isinstance(wrapper, dict) or wrapper.keys() != {"input"}:
        raise MalformedCustomToolInput()
    raw = wrapper["input"]
    if not isinstance(raw, str):
        raise MalformedCustomToolInput()
    return raw


def _provider_failure(error: ProviderError) -> UpstreamProviderError:
    message = None
    token = provider_error_code(error.code, error.type, error.message)
    if token is not None:
        message = f"The upstream provider reported an error ({token})."
    return UpstreamProviderError(
        message,
        provider_type=error.type,
        provider_code=error.code,
        provider_message=error.message,
    )


class BridgeDecoder:
    """Provider stream bytes in, neutral ``EngineEvent``s out.

    ``allowed_tool_names``: the function names the request declared.
    ``custom_tool_wrappers``: synthetic function name -> custom tool name; a
    call to the synthetic name is unwrapped from ``{"input": "<raw>"}`` and
    released as a ``kind="custom"`` call under the real name.
    ``secret``: the provider key, scrubbed out of any error text the provider
    sends (which is kept for logs).

    lmspd asks providers for one choice. ``limits.max_choices`` bounds what a
    provider may send anyway; were it raised, text from every choice would
    stream in arrival order and calls would be released ordered by (choice,
    tool index) — one neutral stream has no notion of choices.
    """

    def __init__(
        self,
        allowed_tool_names: Iterable[str] = (),
        custom_tool_wrappers: Mapping[str, str] | None = None,
        limits: UpstreamStreamLimits | None = None,
        *,
        secret: Secret | None = None,
        input_tokens: int = 0,
    ) -> None:
        """``input_tokens``: the request's estimated size; given, usage the
        provider never sent is estimated (``_usage_or_estimate``)."""
        self._allowed = frozenset(allowed_tool_names)
        self._input_estimate = input_tokens
        self._output_chars = 0  # text, reasoning and call bytes: the output's size where no usage says it
        self._wrappers = dict(custom_tool_wrappers or {})
        self._limits = limits or UpstreamStreamLimits()
        self._chunks = ChatChunkDecoder(self._limits, secret=secret)
        self._choices: dict[int, _Choice] = {}
        self._tool_calls = 0
        self._retained_bytes = 0
        self._usage: Usage | None = None
        self._most_output = 0  # the most output tokens a usage has said (``progress``)
        self._done = False
        self._progress = 0
        self.error: UpstreamError | None = None
        # Private correlation metadata; never copied into public ids.
        self.provider_response_id: str | None = None
        self.provider_model: str | None = None
        self.provider_created: int | None = None

    @property
    def done(self) -> bool:
        """True once a terminal event was returned; nothing more will be."""
        return self._done

    @property
    def progress(self) -> int:
        """Grows with each piece of output the provider sent: text,
        reasoning, a tool call's id, name or argument bytes, a choice's
        finish reason, usage that changed. Comments, empty deltas, a role, a
        repeated id, name or finish reason do not count: bytes that can keep
        a stream alive forever without it getting anywhere (the engine
        bounds the time between two increments)."""
        return self._progress

    def feed(self, data: bytes) -> list[EngineEvent]:
        return list(self.iter_feed(data))

    def iter_feed(self, data: bytes) -> Iterator[EngineEvent]:
        """Like ``feed`` but lazy: one provider read can hold a whole burst
        of events, and the first of them should not wait for the decoding
        of the rest."""
        if self._done:
            return
        out: list[EngineEvent] = []
        try:
            for item in self._chunks.iter_feed(data):
                self._push(item, out)
                yield from out
                out.clear()
                if self._done:
                    break  # no read-ahead: later bytes are not even parsed
        except UpstreamError as exc:
            yield from out
            yield self._fail(exc)

    def push(self, item: StreamItem) -> list[EngineEvent]:
        """Handle one already-decoded item (for adapters that decode elsewhere)."""
        if self._done:
            return []
        out: list[EngineEvent] = []
        try:
            self._push(item, out)
        except UpstreamError as exc:
            out.append(self._fail(exc))
        return out

    def close(self) -> list[EngineEvent]:
        """End of the provider body. Without ``[DONE]`` the stream counts as
        complete only if every choice reported a finish reason."""
        if self._done:
            return []
        try:
            self._chunks.close()
            if any(c.finish_reason is None for c in self._choices.values()):
                raise StreamTruncated()
            return self._terminal()
        except UpstreamError as exc:
            return [self._fail(exc)]

    def fail(self, error: UpstreamError) -> list[EngineEvent]:
        """End the stream with a failure from outside the bytes (timeout,
        cancellation, lost connection); nothing if it already ended."""
        if self._done:
            return []
        return [self._fail(error)]

    # -- items -----------------------------------------------------------------

    def _push(self, item: StreamItem, out: list[EngineEvent]) -> None:
        if isinstance(item, Done):
            out.extend(self._terminal())
        elif isinstance(item, ProviderError):
            raise _provider_failure(item)
        else:
            self._chunk(item, out)

    def _chunk(self, chunk: ChatChunk, out: list[EngineEvent]) -> None:
        if self.provider_response_id is None:
            self.provider_response_id = chunk.id
            self.provider_model = chunk.model
            self.provider_created = chunk.created
        for choice in chunk.choices:
            self._choice(choice, out)
        if chunk.usage is not None:
            # Providers that report usage more than once report running totals.
            usage = _usage(chunk.usage)
            # Only more output is progress (hidden reasoning shows only
            # there): any change was, and a provider that alternated its
            # prompt count held its request open without one token.
            if usage.output_tokens > self._most_output:
                self._most_output = usage.output_tokens
                self._progress += 1
            self._usage = usage

    def _choice(self, choice: ChunkChoice, out: list[EngineEvent]) -> None:
        limits = self._limits
        if choice.index >= limits.max_choices:
            raise UpstreamLimitExceeded("max_choices", limits.max_choices)
        state = self._choices.get(choice.index)
        if state is None:
            state = self._choices[choice.index] = _Choice()
        delta = choice.delta
        # Some providers send both fields with the same text; never emit it twice.
        reasoning = delta.reasoning_content or delta.reasoning
        finished = state.finish_reason is not None
        if finished and (reasoning or delta.content or delta.refusal):
            raise DeltaAfterFinish()
        if reasoning:
            out.append(ReasoningDelta(reasoning))
        if delta.content:
            out.append(TextDelta(delta.content))
        if delta.refusal:
            # No neutral refusal event yet; a refusal is visible text.
            out.append(TextDelta(delta.refusal))
        if reasoning or delta.content or delta.refusal:
            self._progress += 1
            self._output_chars += len(reasoning or "") + len(delta.content or "") + len(delta.refusal or "")
        for fragment in delta.tool_calls:
            self._fragment(state, fragment)
        if choice.finish_reason is not None:
            self._finish(state, choice.finish_reason)

    def _fragment(self, state: _Choice, fragment: ToolCallFragment) -> None:
        limits = self._limits
        trailing = state.finish_reason is not None
        key = self._key(state, fragment)
        call = state.calls.get(key)
        if call is None:
            if trailing:
                raise DeltaAfterFinish("The upstream provider started a tool call after the choice finished.")
            if fragment.index >= limits.max_tool_calls or self._tool_calls >= limits.max_tool_calls:
                raise UpstreamLimitExceeded("max_tool_calls", limits.max_tool_calls)
            call = state.calls[key] = _ToolCall()
            self._tool_calls += 1
        name_piece = fragment.name
        if name_piece and call.arguments_started and name_piece == call.name:
            # llama-cpp-python's server repeats the whole name with every
            # argument fragment. Once arguments flow, a fragment equal to the
            # whole name is that repeat; anything else still appends (so
            # ``lookup`` + ``Evil`` stays ``lookupEvil`` and fails below).
            name_piece = None
        # Only argument fragments of already-started calls may trail a
        # tool_calls finish; a name or id change would rewrite a finished call.
        if trailing and (state.finish_reason != "tool_calls" or name_piece):
            raise DeltaAfterFinish()
        if fragment.id and fragment.id != call.provider_id:
            # An exact repeat is some providers' habit of resending the id
            # with every fragment; anything else is the next piece of it.
            if trailing:
                raise DeltaAfterFinish()
            provider_id = call.provider_id + fragment.id
            if len(provider_id) > limits.max_tool_call_id_chars:
                raise UpstreamLimitExceeded("max_tool_call_id_chars", limits.max_tool_call_id_chars)
            self._retain(_utf8_len(fragment.id))
            call.provider_id = provider_id
            self._progress += 1
        if name_piece:
            name = call.name + name_piece
            if len(name) > limits.max_tool_name_chars:
                raise UpstreamLimitExceeded("max_tool_name_chars", limits.max_tool_name_chars)
            self._retain(_utf8_len(name_piece))
            call.name = name
            self._progress += 1
        if fragment.arguments is not None:
            call.arguments_started = True
        if fragment.arguments:
            size = _utf8_len(fragment.arguments)
            if call.argument_bytes + size > limits.max_tool_argument_bytes:
                raise UpstreamLimitExceeded("max_tool_argument_bytes", limits.max_tool_argument_bytes)
            self._retain(size)
            call.arguments.append(fragment.arguments)
            call.argument_bytes += size
            self._output_chars += size
            self._progress += 1

    @staticmethod
    def _key(state: _Choice, fragment: ToolCallFragment) -> int:
        """Where ``fragment`` goes. Some providers send every parallel call
        at index 0, each with its own id (Ollama, LiteLLM's bridge, some
        gateways): a fragment that brings a new id and a name to a call whose
        arguments have begun is the next call, not more of that one (merged,
        two calls of one function became one with arguments ``{..}{..}``).
        It gets a key past every call's, and the index's later fragments
        follow it there."""
        index = fragment.index
        key = state.moved.get(index, index)
        call = state.calls.get(key)
        starts_another = (call is not None and call.arguments_started and bool(fragment.id) and bool(fragment.name)
                          and fragment.id != call.provider_id and state.finish_reason is None)
        if starts_another or (key == index and index not in state.moved and _taken(state, index)):
            key = max(state.calls) + 1
            state.moved[index] = key
        return key

    def _usage_or_estimate(self) -> Usage:
        """The provider's usage; where it never sent one (it ignored
        ``stream_options.include_usage``, or closed before that chunk), an
        estimate, about four characters a token: zeros read as real counts,
        and a client that compacts by its usage never would."""
        if self._usage is not None:
            return self._usage
        if not self._input_estimate:  # not told the request's size: nothing to estimate from
            return Usage()
        return Usage(input_tokens=self._input_estimate, output_tokens=-(-self._output_chars // 4))

    def _retain(self, size: int) -> None:
        # Charged before the state changes, so a refused fragment is not kept.
        if self._retained_bytes + size > self._limits.max_aggregate_bytes:
            raise UpstreamLimitExceeded("max_aggregate_bytes", self._limits.max_aggregate_bytes)
        self._retained_bytes += size

    def _finish(self, state: _Choice, reason: str) -> None:
        if reason not in _FINISH_REASONS:
            raise MalformedChunk("The upstream provider sent an unknown finish_reason.")
        if state.finish_reason is None:
            state.finish_reason = reason
            self._progress += 1
        elif state.finish_reason != reason:
            raise ContradictoryFinish()

    # -- terminal ----------------------------------------------------------------

    def _terminal(self) -> list[EngineEvent]:
        """Validate and release everything retained, then finish.

        Builds the whole list before returning, so a bad call anywhere means
        no call is released.
        """
        if not self._choices or any(c.finish_reason is None and c.calls for c in self._choices.values()):
            # Nothing at all, or [DONE] without a finish reason after a call
            # began: its arguments may be cut off, and a half-written call
            # must not be released as complete. (Text without a finish
            # reason before [DONE] is a common provider quirk: it completes.)
            raise StreamTruncated()
        reasons = {c.finish_reason for c in self._choices.values()}
        usage = self._usage_or_estimate()
        for cut_off in ("content_filter", "length"):
            if cut_off in reasons:
                # Output stopped by the provider's filter or the token cap is
                # incomplete; releasing its calls would invite a client to
                # execute half an argument list.
                self._done = True
                return [Finished(cut_off, usage)]

        events: list[EngineEvent] = []
        # The provider's own ids first: a stand-in for a missing one must
        # not collide with a real one that comes later.
        provider_ids: set[str] = set()
        for choice in self._choices.values():
            for call in choice.calls.values():
                if _PUBLIC_CALL_ID.match(call.provider_id):
                    if call.provider_id in provider_ids:
                        raise DuplicateCallId()
                    provider_ids.add(call.provider_id)
        call_ids: set[str] = set()
        released = 0
        for choice_index in sorted(self._choices):
            calls = self._choices[choice_index].calls
            for tool_index in sorted(calls):
                call = calls[tool_index]
                if not call.name:
                    raise MissingToolName()
                custom_name = self._wrappers.get(call.name)
                if custom_name is None and call.name not in self._allowed:
                    raise UndeclaredTool(call.name)
                call_id = call.provider_id
                if not _PUBLIC_CALL_ID.match(call_id):
                    call_id = base = f"call_{choice_index}_{tool_index}"
                    n = 1
                    while call_id in provider_ids or call_id in call_ids:
                        call_id, n = f"{base}_{n}", n + 1
                call_ids.add(call_id)
                payload = "".join(call.arguments)
                if custom_name is not None:
                    payload = _unwrap_custom_input(payload)
                    events.append(ToolCallStarted(released, call_id, custom_name, kind="custom"))
                else:
                    # Clients JSON-parse arguments; a no-argument call is "{}".
                    payload = payload or "{}"
                    events.append(ToolCallStarted(released, call_id, call.name))
                if payload:
                    events.append(ToolCallDelta(released, payload))
                events.append(ToolCallDone(released, payload))
                released += 1
        events.append(Finished("tool_calls" if released else "stop", usage))
        self._done = True
        return events

    def _fail(self, error: UpstreamError) -> Failed:
        self._done = True
        # Kept for the engine's log line (the client gets only code and message).
        self.error = error
        return Failed(error.code, error.message, self._usage or Usage())
