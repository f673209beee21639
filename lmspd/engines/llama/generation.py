"""One sequence's output: sampled tokens -> text -> (reasoning splitter,
stop matcher, tool-call parser) -> events on that sequence's own stream.

The scheduler drives it a token at a time (``on_token``) and evaluates what
it returns; nothing here touches the context except through the sampler.
It also says where the reasoning section ended (``take_reasoning_end``), for
the exact-state checkpoint the cache keeps there on a KV that cannot be
trimmed.
"""

from __future__ import annotations

import codecs
from typing import Callable

from lmspd.cache.manager import CachePlan
from lmspd.cache.state import SessionState
from lmspd.core.conversation import Item, Message, Reasoning, ToolCall
from lmspd.core.events import (
    EngineEvent,
    Failed,
    Finished,
    ReasoningDelta,
    ReasoningDone,
    TextDelta,
    ToolCallDelta,
    ToolCallDone,
    ToolCallStarted,
    Usage,
)
from lmspd.core.ids import new_id
from lmspd.engines.base import CancelToken

from .preparation import LlamaPrepared
from .reasoning import BUDGETS, ReasoningSplitter
from .repetition import RepetitionGuard
from .runtime import LlamaRuntime
from .tool_formats import ToolCallError, ToolCallParser


class Generation:
    def __init__(self, runtime: LlamaRuntime, prepared: LlamaPrepared, plan: CachePlan, cancel: CancelToken,
                 emit: Callable[[EngineEvent], None], usage: Usage, *, response_id: str | None,
                 kv_tokens: list[int], remember: Callable[[SessionState], None]) -> None:
        self.runtime = runtime
        self.vocab = runtime.vocab
        self.prepared = prepared
        self.plan = plan
        self.cancel = cancel
        self.emit = emit
        self.usage = usage
        self.response_id = response_id
        # The tokens evaluated in this generation's sequence (the scheduler appends).
        self.kv_tokens = kv_tokens
        self._remember_state = remember
        self.sampler = runtime.sampler(prepared)
        self.parser: ToolCallParser | None = (
            runtime.tool_format.parser(prepared.tools, lambda: new_id("call"))
            if prepared.tools or runtime.parse_always else None
        )
        # Visible text, for the transcript: pieces, joined once at the end
        # (``str +=`` on an attribute copies the whole text every token).
        self._text_parts: list[str] = []
        self.raw = bytearray()  # everything sampled, for the KV's text
        self.calls: dict[int, ToolCall] = {}
        # A call's argument deltas until its payload is done (joined where a turn ends without it).
        self._call_parts: dict[int, list[str]] = {}
        syntax = runtime.reasoning
        # A call the model opens inside its reasoning ends the reasoning
        # (when the request lets it call: ``prepared.tools``).
        markers = runtime.tool_format.triggers if prepared.tools and runtime.tool_format is not None else ()
        self.splitter = ReasoningSplitter(syntax, markers) if syntax is not None else None
        self.reasoning_open = False
        # Where the reasoning section ended, once, until the scheduler takes
        # it (``take_reasoning_end``): the KV's token count there and the
        # text sampled (and forced) past the prompt that those tokens hold.
        self._reasoning_end: tuple[int, str] | None = None
        # How much of ``raw`` the KV holds: all of it but the token being taken.
        self._raw_evaluated = 0
        # Tokens lmspd wrote into the output (a reasoning block's forced
        # close): output as much as sampled ones, in the limit and the window.
        self.forced = 0
        self._close_tokens: list[int] | None = None  # that close, tokenized once
        conv = prepared.conversation
        self.budget = BUDGETS.get(conv.reasoning_effort, BUDGETS[None])
        if prepared.grammar is not None and not prepared.lazy_patterns:
            # The reply has a required shape: no free-form thinking first.
            self.budget = 0
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # The client's stop sequences delimit the answer: inside the
        # reasoning they stay dormant (a model restating "Question:" while it
        # thinks must not end the turn before it answers). Where a splitter
        # sees the reasoning they are matched on the visible text alone
        # (``_route``); where the format's parser marks it (Harmony's
        # analysis channel), on the text outside it, token by token
        # (``_text``). So is a call's opening where none may be made
        # (tool_choice none): in the reasoning the model may think about one.
        # A tool result's marker (the model inventing the next turn) ends
        # the turn anywhere.
        fmt = runtime.tool_format
        no_call = [fmt.trigger] if fmt is not None and not prepared.tools and fmt.trigger in prepared.stop else []
        self._channels = self.parser is not None and fmt is not None and fmt.reasoning_channels
        marked = self.splitter is not None or self._channels
        answer = [s for s in (*conv.sampling.stop, *no_call) if s] if marked else []
        self.stops = StopMatcher([s for s in prepared.stop if s not in answer])
        self.answer_stops = StopMatcher(answer) if answer else None
        self._answer_hit: str | None = None
        limits = runtime.limits
        # No max_output_tokens means "up to the context" (prepare's room),
        # capped by the server's default ceiling.
        self.max_new = prepared.max_new_tokens
        if conv.max_output_tokens is None and limits.max_output_tokens_default > 0:
            self.max_new = min(self.max_new, limits.max_output_tokens_default)
        # What ends a generation that runs to ``max_new``: the request's
        # (or the server's) cap, or the window, which Anthropic's clients
        # tell apart (model_context_window_exceeded: compact, not continue).
        window = prepared.window_bound and self.max_new == prepared.max_new_tokens
        self.reason = "context_window" if window else "length"
        guard = RepetitionGuard(limits.repetition_window, limits.repetition_max_period)
        self.guard: RepetitionGuard | None = guard if guard.enabled else None
        self.sampled: list[int] = []
        self.eog_text: str | None = None
        self.stopped_by: str | None = None  # the stop sequence that ended the text
        self.done = False

    # -- driven by the scheduler --------------------------------------------------

    @property
    def left(self) -> int:
        """Output tokens the limit still allows (``max_new``, the window's
        room at most): forced tokens take cells of the KV as sampled ones do."""
        return self.max_new - len(self.sampled) - self.forced

    def before_sample(self) -> list[int]:
        """Tokens to evaluate before the next sample: the end of a thinking
        block whose budget is spent (written into the KV), else none. Only
        a close that leaves room for a sampled token after it is forced;
        otherwise the block runs on to the limit, which ends the turn there."""
        splitter = self.splitter
        if splitter is None or not splitter.in_reasoning or self.usage.reasoning_tokens < self.budget:
            return []
        text = splitter.syntax.forced_close
        if self._close_tokens is None:
            self._close_tokens = self.vocab.tokenize(text)
        if len(self._close_tokens) >= self.left:
            return []
        tokens = list(self._close_tokens)  # the scheduler consumes what it is handed
        self.forced += len(tokens)
        self.raw += text.encode()
        try:
            # Reasoning held back as the possible start of a stop sequence
            # (``<`` of ``<tool_response``) is the reasoning's, in front of
            # its close: released after it, it came out as visible text.
            self._route(splitter.feed(self.stops.flush() + text))
        except ToolCallError as exc:
            self._invalid_call(exc, None)
            return []
        return tokens

    def on_token(self, token: int) -> list[int]:
        """Take one sampled token; returns the tokens to evaluate next (the
        token itself, which after the terminal event only serves the next
        turn's cache). ``done`` is set once the terminal event is out."""
        self._raw_evaluated = len(self.raw)
        try:
            if self.vocab.is_eog(token):
                self.reason = "stop"
                eog_text = self.vocab.detokenize([token])
                if self.runtime.transcript.turn_ends_with(eog_text):
                    self.eog_text = eog_text
                    return self._complete(token)
                # An end token the template never writes after a turn (Gemma's
                # <eos>, the only end a grammar admits, where a replay renders
                # <end_of_turn>): kept out of the KV, so that the state ends
                # where the replay's turn closer begins and the next turn
                # continues it in place.
                return self._complete(None)
            self.sampled.append(token)
            if (self.splitter is not None and self.splitter.in_reasoning) or (
                    self.parser is not None and self.parser.in_reasoning):
                self.usage.reasoning_tokens += 1
            piece = self.vocab.piece(token)
            self.raw += piece
            text = self.decoder.decode(piece)
            # Text goes out before the token is evaluated: the client
            # should not wait a decode step for what is already known.
            hit: str | None = None
            if text:
                text, hit = self.stops.feed(text)
                if text:
                    self._text(text)
            if self._answer_hit is not None:  # earlier in the text than any other
                hit = self._answer_hit
            if hit:
                self.reason, self.stopped_by = "stop", hit
            elif self.guard is not None and self.guard.feed(token):
                self.reason = "repetition"
                return self._complete(token)
            if hit or self.left <= 0:
                return self._complete(token)
            return [token]
        except ToolCallError as exc:
            return self._invalid_call(exc, token)

    def take_reasoning_end(self) -> tuple[int, str] | None:
        """Once, right after the token that showed the reasoning section is
        over (the first visible text, or the end of the turn): how many
        tokens the KV holds at its end and the sampled text they hold past
        the prompt. The KV is still exactly there: the token that showed it
        is evaluated after this call. None when there is nothing to take."""
        end, self._reasoning_end = self._reasoning_end, None
        return end

    def failed(self, code: str, message: str) -> None:
        """The scheduler ends this generation with an error (a fault, a
        failed decode); its usage counts what was output until then."""
        self._finish_tokens()
        self.done = True
        self.emit(Failed(code, message, self.usage))

    def cancelled(self, pending: list[int]) -> list[int]:
        """The client left or the server is shutting down. The state keeps
        what was sampled, ``pending`` included (evaluated after the terminal
        event, so that the KV matches the state's text)."""
        self._finish_tokens()
        self._remember(None, pending)
        self.reason = "cancelled"
        if self.cancel.reason == "shutdown":
            self.emit(Failed("server_shutting_down", "The server is shutting down.", self.usage))
        else:
            self.emit(Finished("cancelled", self.usage))
        self.done = True
        return pending

    # -- the end of a turn ----------------------------------------------------------

    def keep_prefilled(self) -> None:
        """``prefill_only`` (a ``generate: false`` turn): nothing is sampled;
        the evaluated prompt becomes this sequence's remembered state under the
        response id, so that the next turn continues it by
        ``previous_response_id`` (or by its visible prefix)."""
        self._finish_tokens()
        conversation = self.prepared.conversation
        self._remember_state(SessionState(
            tokens=list(self.kv_tokens),
            kv_text=self.plan.base_text,
            visible=self.prepared.text,
            items=list(conversation.items),
            response_id=self.response_id,
            owner=self.prepared.run.owner,
        ))
        self.emit(Finished("stop", self.usage))
        self.done = True

    def _complete(self, last_token: int | None) -> list[int]:
        if self.stopped_by is None:
            tail = self.decoder.decode(b"", final=True) + self.stops.flush()
            if tail:
                self._text(tail)
        # Cut off by max_output_tokens (or the repetition guard), a call may be mid-arguments: the
        # response is incomplete (the session closes that call as
        # incomplete), not an invalid call. What the parser still holds
        # is at most the start of call markup, never shown as text.
        if self.splitter is not None:
            self._route(self.splitter.feed("", final=True))
        if self.answer_stops is not None and self._answer_hit is None and (held := self.answer_stops.flush()):
            self._visible(held)
        if self._answer_hit is not None and self.stopped_by is None:
            self.reason, self.stopped_by = "stop", self._answer_hit
        if self.splitter is not None:
            self._close_reasoning()
        if self.parser is not None and self.reason not in ("length", "context_window", "repetition"):
            self._events(self.parser.finish())
        self._finish_tokens()
        reason = self.reason
        if reason == "stop" and self.calls:
            reason = "tool_calls"
        # Only the client's own stop sequences are named (not the tool
        # format's markers the engine also stops at).
        named = self.stopped_by if self.stopped_by in self.prepared.conversation.sampling.stop else None
        return self._end(Finished(reason, self.usage, named), last_token)  # type: ignore[arg-type]

    def _invalid_call(self, exc: ToolCallError, last_token: int | None) -> list[int]:
        self._finish_tokens()
        return self._end(Failed("invalid_tool_call", f"The model produced an invalid tool call: {exc}", self.usage),
                         last_token)

    def _end(self, terminal: EngineEvent, last_token: int | None) -> list[int]:
        """The state is remembered before the terminal event (a client's next
        request may look up its calls the moment it has the reply); the last
        token is evaluated after it — also the end-of-turn token, which the
        next turn's prompt has right there."""
        pending = [last_token] if last_token is not None else []
        self._remember(self.eog_text, pending)
        self.emit(terminal)
        self.done = True
        return pending

    # -- text and events ------------------------------------------------------------

    def _text(self, text: str) -> None:
        if self.splitter is not None:
            self._route(self.splitter.feed(text))
            return
        if self._channels and self.answer_stops is not None:
            assert self.parser is not None
            if self._answer_hit is not None:
                return
            if self.parser.in_reasoning:
                # Inside the analysis channel (its markers are tokens of
                # their own, so a token's text does not cross its edge):
                # what the answer's matcher held went before it.
                self._visible(self.answer_stops.flush() + text)
                return
        self._answer(text)

    def _answer(self, text: str) -> None:
        """Text of the answer: past the client's stop sequences, if any."""
        if self.answer_stops is not None:
            text, self._answer_hit = self.answer_stops.feed(text)
        if text:
            self._visible(text)

    def _route(self, pieces: list[tuple[str, str]]) -> None:
        for kind, piece in pieces:
            if self._answer_hit is not None:
                return  # the answer ended at a stop sequence: nothing after it is output
            if kind == "reasoning":
                self.reasoning_open = True
                self.emit(ReasoningDelta(piece))
                continue
            self._close_reasoning()
            self._answer(piece)

    def _close_reasoning(self) -> None:
        if not self.reasoning_open:
            return
        self.reasoning_open = False
        sealed = None
        runtime = self.runtime
        if self.prepared.conversation.include_encrypted_reasoning and runtime.sealer is not None:
            # Only a sealed replay renders this reasoning again (prompt.py),
            # so only then can a later request resume at its end.
            self._mark_reasoning_end()
            assert self.splitter is not None  # reasoning_open: a splitter opened it
            sealed = runtime.sealer.seal(runtime.model_id, self.splitter.hidden,
                                        owner=self.prepared.run.owner)
        self.emit(ReasoningDone(sealed))

    def _mark_reasoning_end(self) -> None:
        """Where a sealed replay that keeps this reasoning but parts after it
        (an edited answer, a re-serialized call) can resume: the KV as it is
        now, if all it holds past the prompt is hidden text. Not when the KV
        already holds visible text too (a stop matcher held the close back),
        nor when nothing was sampled in the block (the end of the input is
        a checkpoint already, a few forced tokens before)."""
        splitter = self.splitter
        if splitter is None or self.usage.reasoning_tokens == 0:
            return
        evaluated = bytes(self.raw[:self._raw_evaluated])
        if not splitter.hidden[len(splitter.syntax.prompt_tail):].encode().startswith(evaluated):
            return
        try:
            self._reasoning_end = (len(self.kv_tokens), evaluated.decode())
        except UnicodeDecodeError:  # the KV ends inside a character: no text prefix to match
            return

    @property
    def text(self) -> str:
        return "".join(self._text_parts)

    def _visible(self, text: str) -> None:
        if self.parser is None:
            self._text_parts.append(text)
            self.emit(TextDelta(text))
            return
        self._events(self.parser.feed(text))

    def _events(self, events: list[EngineEvent]) -> None:
        for event in events:
            if isinstance(event, TextDelta):
                self._text_parts.append(event.text)
            elif isinstance(event, ToolCallStarted):
                call = ToolCall(call_id=event.call_id, name=event.name, payload="", kind=event.kind,
                                namespace=event.namespace)
                self.calls[event.index] = call
                self._call_parts[event.index] = []
            elif isinstance(event, ToolCallDelta):
                self._call_parts[event.index].append(event.delta)
            elif isinstance(event, ToolCallDone):
                self.calls[event.index].payload = event.payload
                del self._call_parts[event.index]
            self.emit(event)

    def _finish_tokens(self) -> None:
        self.usage.output_tokens = len(self.sampled) + self.forced
        stats = self.runtime.stats
        stats.last_output_tokens = len(self.sampled)
        stats.last_output_token_ids = self.sampled

    def _remember(self, eog_text: str | None, pending: list[int]) -> None:
        """Make what is in the KV, plus the ``pending`` tokens about to be
        evaluated, this sequence's remembered state."""
        outputs: list[Item] = []
        if self.splitter is not None and self.splitter.hidden:
            # The client replays it (without the hidden text unless sealed).
            outputs.append(Reasoning(text=self.splitter.reasoning))
        text = self.text
        if text:
            outputs.append(Message(role="assistant", text=text))
        for index, parts in self._call_parts.items():  # cut off before its end
            self.calls[index].payload = "".join(parts)
        outputs += [self.calls[index] for index in sorted(self.calls)]
        conversation = self.prepared.conversation
        visible = self.runtime.transcript.visible(conversation, outputs, eog_text)
        kv_text = self.plan.base_text + self.raw.decode("utf-8", errors="replace") + (eog_text or "")
        self._remember_state(SessionState(
            tokens=list(self.kv_tokens) + pending,
            kv_text=kv_text,
            visible=visible,
            items=list(conversation.items) + outputs,
            call_ids=frozenset(c.call_id for c in self.calls.values()),
            response_id=self.response_id,
            owner=self.prepared.run.owner,
        ))


class StopMatcher:
    """Stop sequences over streamed text, holding back only a possible prefix."""

    def __init__(self, stops: list[str]) -> None:
        self._stops = [s for s in stops if s]
        self._held = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """The text that is safe to show, and the stop sequence that ended
        it (the earliest in the text), if one did."""
        if not self._stops:
            return text, None
        buf = self._held + text
        found = [(at, stop) for stop in self._stops if (at := buf.find(stop)) >= 0]
        if found:
            at, stop = min(found)
            self._held = ""
            return buf[:at], stop
        keep = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(buf)), 0, -1):
                if buf.endswith(stop[:k]):
                    keep = max(keep, k)
                    break
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], None

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held
