"""Preparing a request for the llama engine: render, tokenize, fit the
context window, constrain (grammar, stop sequences) — in the service's
preparing threads (``Service.off_loop``, bounded in time; several at once),
before any byte is sent. Nothing here touches the KV; the cache is only
read (its published snapshot of remembered states).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import random
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import llguidance
from llama_cpp import _internals as internals

from lmspd.cache.diagnostics import Signature
from lmspd.cache.manager import CacheRequest, ContinuationCache
from lmspd.core.conversation import (
    Conversation,
    CustomTool,
    FunctionTool,
    Item,
    Message,
    Reasoning,
    Role,
    SamplingDefaults,
    ToolCall,
    orphan_tool_outputs,
)
from lmspd.core.errors import FIELD, ApiError, RequestField
from lmspd.core.limits import Limits, RequestLimits
from lmspd.core.run import LOCAL, RunContext
from lmspd.core.sealing import Sealer

from . import breakpoints, grammars
from .matchers import GrammarCompiler, VocabularyWalkCancelled
from .prompt import template_messages
from .reasoning import ReasoningSyntax
from .sampling import GrammarFirstRejection, Greedy
from .template import ChatTemplate
from .tool_formats import ToolFormat
from .truncation import Fit, fewest_dropped
from .vocab import Vocabulary

# How many times a warm-up's cut may move back (past trailing whitespace, or a
# word) to where the next prompt's tokens break.
_WARM_CUT_TRIES = 8


@dataclass
class LlamaPrepared:
    # What the engine runs: the request's conversation as preparation left
    # it (repaired, sealed reasoning opened, a remembered turn's history in
    # front, truncated), a copy wherever it differs from the one decoded.
    conversation: Conversation
    text: str
    tokens: list[int]
    max_new_tokens: int
    # Who the run is for and how it runs (owner, session, prefill only, pin).
    run: RunContext = LOCAL
    grammar: str | None = None
    lazy_patterns: list[str] | None = None
    tools: list[FunctionTool | CustomTool] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    requires_state: str | None = None
    reuse_cache: bool = True
    needs_reasoning_state: bool = False
    # The tool names in the order they were rendered (diagnostics compare it).
    tool_order: tuple[str, ...] = ()
    # The matcher compiled when the grammar was checked, for the first
    # sampler (the next one copies it from the compiler's cache).
    matcher: llguidance.LLMatcher | None = field(default=None, repr=False, compare=False)
    # Token positions of client-declared cache breakpoints (non-trimmable KV only).
    breakpoints: tuple[int, ...] = ()
    # ``max_new_tokens`` is the room the window leaves, not a lower cap the
    # request set: generating all of it ends as ``context_window``.
    window_bound: bool = False

    @property
    def input_tokens(self) -> int:
        return len(self.tokens)

    def cache_request(self) -> CacheRequest:
        conv, run = self.conversation, self.run
        system = [conv.instructions or ""]
        for item in conv.items:
            if not (isinstance(item, Message) and item.role in ("system", "developer")):
                break
            system.append(item.text)
        return CacheRequest(
            signature=Signature(tools=self.tool_order, system="\n\n".join(system)),
            text=self.text,
            tokens=self.tokens,
            items=conv.items,
            previous_response_id=conv.previous_response_id,
            reuse=self.reuse_cache,
            requires_state=self.requires_state,
            max_new_tokens=self.max_new_tokens,
            clamp_output=self.window_bound or conv.max_output_tokens_is_ceiling,
            needs_reasoning_state=self.needs_reasoning_state,
            owner=run.owner,
            pin=run.pin,
            breakpoints=self.breakpoints,
            agent=run.agent_id,
            parent_agent=run.parent_agent_id,
        )


# Claude Code's first system block: ``x-anthropic-billing-header: cc_version=…;
# cc_entrypoint=…; cch=<per-request nonce>;`` — billing metadata for
# Anthropic's API that changes every request and tells the model nothing.
BILLING_HEADER = re.compile(r"\Ax-anthropic-billing-header:[^\n]*(?:\n+|\Z)")


@dataclass
class Repairs:
    """Request changes that carry nothing the model needs but would defeat
    the continuation cache; each can be turned off (``lmspd serve`` flags)."""

    # Drop Claude Code's per-request billing line from the system prompt.
    strip_billing_header: bool = True
    # Render tools sorted by name: a client that reorders its tool list
    # between turns still renders the same prompt.
    canonical_tool_order: bool = True


def _shifted(breakpoints: tuple[int, ...], cut: int) -> tuple[int, ...]:
    """Breakpoint offsets into a text whose first ``cut`` characters were
    removed (the billing line): each moves with the text after it, and one
    inside the removed part is gone."""
    return tuple(at - cut for at in breakpoints if at > cut)


# The efforts the Responses and Chat dialects accept, as the chat templates
# that read ``reasoning_effort`` know them (gpt-oss: low, medium, high).
TEMPLATE_EFFORTS = {"none": "low", "minimal": "low", "xhigh": "high"}


class Preparation:
    def __init__(self, *, model_id: str, vocab: Vocabulary, template: ChatTemplate, tool_format: ToolFormat,
                 reasoning: ReasoningSyntax | None, cache: ContinuationCache, n_ctx: int, limits: RequestLimits,
                 sealer: Sealer | None, repairs: Repairs | None = None,
                 sampling: SamplingDefaults | None = None) -> None:
        self.repairs = repairs or Repairs()
        # What a request leaves unset is sampled with (the model's own
        # settings under the operator's).
        self.sampling = sampling or SamplingDefaults()
        self.model_id = model_id
        self.vocab = vocab
        self.template = template
        self.tool_format = tool_format
        self.reasoning = reasoning
        self.cache = cache
        self.n_ctx = n_ctx
        self.limits = limits
        self.sealer = sealer
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()
        self._grammar_thread: threading.Thread | None = None
        self._closing = threading.Event()

    def render(self, conversation: Conversation, *, add_generation_prompt: bool = True) -> str:
        if self.repairs.canonical_tool_order and len(conversation.tools) > 1:
            # Tool order means nothing to the model; a stable order keeps
            # the prompt (and the cache) the same when a client shuffles it.
            conversation = dataclasses.replace(conversation, tools=sorted(conversation.tools, key=lambda t: t.name))
        messages, tools = template_messages(conversation, self.template, self.tool_format)
        options = {}
        if conversation.reasoning_effort is not None:
            # A template that takes the effort (gpt-oss's: "Reasoning: high"
            # in its system message) is told it; unset, it keeps its own
            # default. Others never read the variable.
            options["reasoning_effort"] = TEMPLATE_EFFORTS.get(conversation.reasoning_effort,
                                                               conversation.reasoning_effort)
        return self.template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt, **options)

    def prepare(self, conversation: Conversation, run: RunContext = LOCAL) -> LlamaPrepared:
        """``conversation`` and ``run`` ready to generate. Neither is
        written: each step that changes the conversation (repairs, opened
        reasoning, a remembered turn's history, truncation) makes a new one,
        and the prepared form holds the last."""
        conversation = self._repair(conversation)
        conversation = self._open_sealed_reasoning(conversation, run.owner)
        conversation, requires_state = self._attach_live_history(conversation, run.owner)
        n_ctx = self.n_ctx
        if run.prefill_only:
            text, tokens = self._warm_prefix(conversation)
        else:
            text = self.render(conversation)
            tokens = self._tokenize(conversation, text, run.owner)
        requested = asked = conversation.max_output_tokens
        answer = self._answer_room(requested)
        if conversation.truncate and len(tokens) + answer > n_ctx:
            conversation, text, tokens = self._truncate(conversation, text, tokens, n_ctx - answer,
                                                        add_generation_prompt=not run.prefill_only)
            if run.prefill_only:  # of the items truncation kept
                text, tokens = self._warm_prefix(conversation)
        room = n_ctx - len(tokens)
        if conversation.max_output_tokens_is_ceiling and requested is not None and room >= 1:
            requested = min(requested, room)
        if (requested is not None and requested > room) or room < 1:
            need = len(tokens) + (requested or 1)
            raise ApiError(
                "context_length_exceeded",
                f"This request needs {need} tokens ({len(tokens)} of input"
                + (f" + {requested} max_output_tokens" if requested else "")
                + f") but the model's context window is {n_ctx} tokens.",
                path=(RequestField.MAX_OUTPUT_TOKENS,) if requested and len(tokens) < n_ctx else (RequestField.ITEMS,),
            )
        prepared = LlamaPrepared(
            conversation=conversation,
            run=run,
            text=text,
            tokens=tokens,
            max_new_tokens=requested if requested is not None else room,
            stop=list(conversation.sampling.stop),
            requires_state=requires_state,
            reuse_cache=conversation.cache_reuse,
            needs_reasoning_state=self._needs_reasoning_state(conversation),
            window_bound=asked is None or asked > room,
        )
        if not self.cache.trimmable:
            # A trimmable KV is cut back to any breakpoint; this one keeps an
            # exact state there, and at the end of the instructions.
            prepared.breakpoints = breakpoints.token_positions(conversation, text, tokens, self.vocab.tokenize,
                                                               implicit=True, tools_end=self._tools_end(conversation, text))
        names = [t.name for t in conversation.tools]
        prepared.tool_order = tuple(sorted(names) if self.repairs.canonical_tool_order else names)
        self._constrain(prepared)
        if self.cache.disk is not None:
            # The disk read this request likely needs, here rather than on
            # the scheduler thread (ContinuationCache.prefetch).
            self.cache.prefetch(prepared.cache_request())
        return prepared

    def _tokenize(self, conversation: Conversation, text: str, owner: str) -> list[int]:
        """The prompt's tokens. A turn that continues a response the engine
        still holds (a WebSocket connection's latest response, a
        ``previous_response_id`` chain) tokenizes only what follows that
        response's transcript: the KV's own tokens stand for the rest, as
        the cache keeps them (``Planner._continue``, lmspd.cache.planner), hidden
        reasoning included, so the context check counts what the sequence
        will hold. Re-tokenizing the whole history costs ~2 µs a token
        every turn (tens of ms at an agent's context sizes). Not on a KV
        that cannot be trimmed: its breakpoints are found by tokenizing
        prefixes of the text, which must agree with the prompt's tokens."""
        previous = conversation.previous_response_id
        if previous and conversation.cache_reuse and self.cache.enabled and self.cache.trimmable:
            state = self.cache.continued_state(previous, owner, text)
            if state is not None and state.visible is not None:
                return state.tokens + self.vocab.tokenize(text[len(state.visible):])
        return self.vocab.tokenize(text)

    def _warm_prefix(self, conversation: Conversation) -> tuple[str, list[int]]:
        """A prefill-only (``generate: false``) prompt: the part of it that
        the next turn's prompt starts with, whatever that turn appends —
        found, like ``_tools_end``, as what renders with different messages
        appended share. Not simply the prompt without the assistant's
        header: leading developer messages join the system message ahead
        of the tool list, so the warm-up of Codex's base instructions alone
        (its startup prewarm, which Codex gives up on after 15 s) prefilled
        a tool list that its real turn has after a second developer
        message, and that turn reused only the instructions.

        The cut must also be where the next prompt's tokens break: "\n\n"
        at the end of a text is one token, before "<" two. Where its tokens
        do not begin every probe's, it moves back before the trailing
        whitespace, then a word at a time, until they do."""
        whole = self.render(conversation, add_generation_prompt=False)
        roles: tuple[Role, ...] = ("developer", "user")
        probes = [self._render_with(conversation, conversation.items, role, word)
                  for role in roles for word in ("Yes", "No")]
        text = whole[:len(os.path.commonprefix([whole, *probes]))]
        probe_tokens = [self.vocab.tokenize(p) for p in probes[::2]]  # one per role
        for attempt in range(_WARM_CUT_TRIES):
            if attempt:
                text = text.rstrip() if text != text.rstrip() else text[:max(text.rfind(" "), text.rfind("\n"), 0)]
            tokens = self.vocab.tokenize(text)
            if tokens and all(p[:len(tokens)] == tokens for p in probe_tokens):
                return text, tokens
        # No stable cut found: the whole prompt, as before the probes.
        return whole, self.vocab.tokenize(whole)

    def _tools_end(self, conversation: Conversation, text: str) -> int | None:
        """Where the rendered tool definitions end in the prompt ``text``, for
        a breakpoint on the tool list: the part of the prompt before its
        first conversational message (the template puts the tools there, in
        the system turn or in front of it), found as what two renders of the
        tools and system part, each followed by a different one-word user
        message, share. None when the prompt does not start with it (a
        template that puts the tools elsewhere)."""
        if not conversation.tools_breakpoint or not conversation.tools:
            return None
        leading: list[Item] = []
        for item in conversation.items:
            if not (isinstance(item, Message) and item.role in ("system", "developer")):
                break
            leading.append(item)
        probes = [self._render_with(conversation, leading, "user", word) for word in ("Yes", "No")]
        end = len(os.path.commonprefix(probes))
        return end if end and text.startswith(probes[0][:end]) else None

    def _render_with(self, conversation: Conversation, items: list[Item], role: Role, word: str) -> str:
        """A probe: ``conversation`` rendered as ``items`` and one more
        one-word message. What probes that differ only in that message
        share is the part of the prompt a next message cannot change."""
        return self.render(dataclasses.replace(conversation, items=[*items, Message(role=role, text=word)]))

    def _repair(self, conversation: Conversation) -> Conversation:
        """``conversation`` with the ``Repairs`` applied (itself if none changes it)."""
        if self.repairs.strip_billing_header:
            if conversation.instructions:
                instructions = BILLING_HEADER.sub("", conversation.instructions, count=1) or None
                if instructions != conversation.instructions:
                    cut = len(conversation.instructions) - len(instructions or "")
                    return dataclasses.replace(
                        conversation, instructions=instructions,
                        instructions_breakpoints=_shifted(conversation.instructions_breakpoints, cut))
            elif conversation.items and isinstance(conversation.items[0], Message) \
                    and conversation.items[0].role in ("system", "developer"):
                first = conversation.items[0]
                stripped = BILLING_HEADER.sub("", first.text, count=1)
                if stripped != first.text:
                    first = dataclasses.replace(first, text=stripped,
                                                breakpoints=_shifted(first.breakpoints, len(first.text) - len(stripped)))
                    return dataclasses.replace(conversation, items=[first] + conversation.items[1:])
        return conversation

    def _answer_room(self, requested: int | None) -> int:
        """The tokens ``truncation: auto`` leaves for the answer: those asked
        for, or without ``max_output_tokens`` a quarter of the window, at
        most the server's default cap (``max_output_tokens_default``). Room
        for one token, what the prompt needs to fit, left a prompt that
        filled the window a few tokens to answer in (``context_window``)."""
        if requested is not None:
            return requested
        room = self.n_ctx // 4
        ceiling = self.limits.max_output_tokens_default
        return max(1, min(room, ceiling) if ceiling > 0 else room)

    def _truncate(self, conversation: Conversation, text: str, tokens: list[int], budget: int, *,
                  add_generation_prompt: bool) -> tuple[Conversation, str, list[int]]:
        """``truncation: auto`` (``truncation.fewest_dropped``): the
        conversation with the items kept (all droppable ones gone when
        nothing fits), and its whole prompt's ``text`` and ``tokens``."""

        def render(items: list[Item]) -> str:
            return self.render(dataclasses.replace(conversation, items=items),
                               add_generation_prompt=add_generation_prompt)

        whole = Fit(list(conversation.items), text, tokens)
        fit = fewest_dropped(whole.items, whole, budget, render=render, tokenize=self.vocab.tokenize)
        return dataclasses.replace(conversation, items=fit.items), fit.text, fit.tokens

    def _open_sealed_reasoning(self, conversation: Conversation, owner: str) -> Conversation:
        """Replayed reasoning this server sealed for this model renders
        exactly as sampled: ``conversation`` with each such item's ``hidden``
        text opened (in a copy of the item: the decoded one is not written)."""
        opened: list[Item] | None = None
        for i, item in enumerate(conversation.items):
            if isinstance(item, Reasoning) and item.encrypted_content:
                if self.sealer is None or self.reasoning is None:
                    continue  # this model renders no hidden reasoning
                if not Sealer.sealed_by_lmspd(item.encrypted_content):
                    # Another provider's (a session that began elsewhere):
                    # the turn renders without it, as a visible-only replay.
                    continue
                hidden = self.sealer.open(self.model_id, item.encrypted_content,
                                          f"input[{i}].encrypted_content", owner=owner)
                if hidden is None:
                    continue  # sealed for another model: rendered without it, as above
                if opened is None:
                    opened = list(conversation.items)
                opened[i] = dataclasses.replace(item, hidden=hidden)
        return conversation if opened is None else dataclasses.replace(conversation, items=opened)

    def _needs_reasoning_state(self, conversation: Conversation) -> bool:
        """A replayed tool-call turn of a reasoning model without its reasoning
        item cannot be rendered as the model saw it."""
        if self.reasoning is None or not conversation.require_reasoning_state:
            return False
        reasoning_seen = False
        for item in conversation.items:
            if isinstance(item, Reasoning):
                reasoning_seen = True
            elif isinstance(item, ToolCall):
                if not reasoning_seen:
                    return True
            elif isinstance(item, Message) and item.role != "assistant":
                reasoning_seen = False
        return False

    def _attach_live_history(self, conversation: Conversation, owner: str) -> tuple[Conversation, str | None]:
        """A tool output must answer a call in the replayed history — or one the
        engine still remembers, whose history is then put in front of it (in
        the conversation returned, with the remembered state's key)."""
        orphans = orphan_tool_outputs(conversation.items)
        if not orphans:
            return conversation, None
        state = (self.cache.state_for_calls({call_id for _, call_id in orphans}, owner)
                 if self.cache.enabled else None)
        # Only a request that starts with the outputs continues a remembered
        # turn; outputs after some replayed history must find their call there.
        if state is None or orphans[0][0] != 0:
            index, call_id = orphans[0]
            raise ApiError(
                "invalid_request",
                f"No tool call found for the tool output with call_id {call_id!r} ({FIELD}), and the "
                "server holds no live state that produced it. Replay the full history: include the "
                "function_call item that produced this call_id before its output.",
                path=(RequestField.ITEMS, index, "call_id"),
            )
        return dataclasses.replace(conversation, items=list(state.items) + conversation.items), state.key

    def _constrain(self, prepared: LlamaPrepared) -> None:
        """Grammars only for requests that demand a shape; none otherwise."""
        conv = prepared.conversation
        fmt = conv.output_format
        choice = conv.tool_choice
        limits = Limits(request=self.limits)
        specials = self._grammars().special_markers(self.tool_format.markers)
        build: Callable[..., str] | None = None  # build(check=...): see _compile
        if conv.tools and choice.mode != "none":
            names = choice.allowed if choice.allowed is not None else [t.name for t in conv.tools]
            prepared.tools = [t for t in conv.tools if t.name in names]
            if choice.mode == "required":
                # A forced call ends the turn (see grammars): one call unless
                # the request explicitly allowed parallel calls.
                calls = self._max_calls(conv, True)
                self._compile(prepared, functools.partial(
                    grammars.tool_call_grammar, self.tool_format, conv.tools, allowed_names=names,
                    parallel=calls > 1, max_calls=calls, specials=specials, limits=limits))
                return
        if conv.tools and fmt.type == "text":
            # The tools are in the prompt: a tool result the model writes
            # itself ends its turn, and so does a call where none may be made
            # (tool_choice none); neither markup ever reaches output_text.
            prepared.stop += self.tool_format.result_markers
            if not prepared.tools:
                prepared.stop.append(self.tool_format.trigger)
        if fmt.type == "json_schema" and fmt.schema is not None:
            build = functools.partial(grammars.json_schema_grammar, fmt.schema, param=fmt.param, limits=limits)
        elif fmt.type != "text":
            build = grammars.json_object_grammar
        elif prepared.tools:
            # auto: free text until the model starts a call, then the call is constrained.
            calls = self._max_calls(conv, False)
            build = functools.partial(
                grammars.tool_call_grammar, self.tool_format, conv.tools, allowed_names=[t.name for t in prepared.tools],
                parallel=calls > 1, max_calls=calls, specials=specials, limits=limits)
            prepared.lazy_patterns = grammars.lazy_triggers(self.tool_format)
        if fmt.type != "text" and prepared.tools:
            # The reply must be JSON: the model cannot also call tools.
            prepared.tools = []
        if build is not None:
            self._compile(prepared, build)

    def _max_calls(self, conv: Conversation, forced: bool) -> int:
        """Calls one turn may make: under a forced tool_choice only an explicit
        ``parallel_tool_calls: true`` allows more than one; under auto only
        an explicit false forbids them."""
        allowed = conv.parallel_tool_calls is True if forced else conv.parallel_tool_calls is not False
        return self.limits.max_parallel_tool_calls if allowed else 1

    def build_grammars_in_background(self) -> None:
        """Build the grammar compiler now, beside the server's start-up: it
        walks the whole vocabulary (~0.4 s for SmolLM2's 49k tokens, ~5 s
        for Gemma 3's 262k on the shared 2-core machine), which the first
        request with a grammar — the first turn after a restart, in an agent
        loop — would otherwise wait for."""
        self._grammar_thread = threading.Thread(target=self._build_grammars, name="lmspd-grammar-vocab", daemon=True)
        self._grammar_thread.start()

    def _build_grammars(self) -> None:
        try:
            self._grammars()
        except ApiError:
            pass  # the engine is closing

    def close(self) -> None:
        """Stop a background build and wait for it (blocking, a few ms):
        it reads the model's vocabulary, which the engine frees next (a
        server stopped in its first seconds crashed there)."""
        self._closing.set()
        if self._grammar_thread is not None:
            self._grammar_thread.join()
        # A request's own build (no background one, or it was cancelled
        # under the request) holds the lock until it stops too.
        with self._grammar_lock:
            pass

    def _grammars(self) -> GrammarCompiler:
        # Built once; a request that needs it while it is being built waits.
        with self._grammar_lock:
            if self._grammar_compiler is None:
                try:
                    self._grammar_compiler = GrammarCompiler(self.vocab.vocab, self.limits, cancel=self._closing)
                except VocabularyWalkCancelled:
                    raise ApiError("server_shutting_down", "The server is shutting down.") from None
            return self._grammar_compiler

    def _compile(self, prepared: LlamaPrepared, build: Callable[..., str]) -> None:
        """The request's grammar, compiled (or found in the cache) now, so
        that a grammar llguidance refuses is this request's 400, not a
        failure mid-generation. ``build(check)`` writes it; llguidance
        compiles it once (grammars: "Compiled once"), and only a refused
        grammar is built again validating piece by piece, for a 400 that
        names the tool, JSON path or grammar line (or a non-strict tool's
        fallback, which then compiles)."""
        compiler = self._grammars()
        grammar = build(check=False)
        try:
            matcher = compiler.matcher(grammar)
        except ApiError:
            checked = build(check=True)
            if checked == grammar:
                raise  # every piece compiles alone: the whole is what llguidance refused
            grammar, matcher = checked, compiler.matcher(checked)
        prepared.grammar, prepared.matcher = grammar, matcher

    def sampler(self, prepared: LlamaPrepared) -> internals.LlamaSampler | Greedy | GrammarFirstRejection:
        """A fresh sampler for one sequence: ``sample(ctx, idx)`` reads the
        logits of batch row ``idx``."""
        sampling, defaults = prepared.conversation.sampling, self.sampling
        temperature = defaults.temperature_of(sampling)
        if temperature <= 0 and prepared.grammar is None:
            return Greedy(self.vocab.n_vocab)
        chain = internals.LlamaSampler()
        if temperature <= 0:
            chain.add_greedy()
        else:
            # llama.cpp's order: top-k, top-p, min-p, then the temperature.
            # Each keeps no per-token state, which speculation's verification
            # relies on (sampling.py).
            top_k, top_p, min_p = defaults.top_k_of(sampling), defaults.top_p_of(sampling), defaults.min_p_of(sampling)
            if top_k > 0:
                chain.add_top_k(top_k)
            if top_p < 1.0:
                chain.add_top_p(top_p, 1)
            if min_p > 0:
                chain.add_min_p(min_p, 1)
            chain.add_temp(temperature)
            seed = sampling.seed if sampling.seed is not None else random.getrandbits(32)
            chain.add_dist(seed)
        if prepared.grammar is None:
            return chain
        compiler = self._grammars()
        matcher, prepared.matcher = prepared.matcher or compiler.matcher(prepared.grammar), None
        return GrammarFirstRejection(matcher, compiler.tokenizer, self.vocab.n_vocab, chain, prepared.lazy_patterns,
                                     greedy=temperature <= 0)
