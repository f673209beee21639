"""Compiled grammars for one model: its vocabulary as an llguidance
tokenizer, and matchers compiled once per grammar and kept by content.

The tokenizer is built from the GGUF's own vocabulary (``_tokenizer``;
every end-of-generation token of the model ends a grammar, not only its
EOS). Building it walks the whole vocabulary (~0.4 s for SmolLM2's 49k
tokens, seconds for Gemma 3's 262k), so it happens once, beside the
server's start-up.

Compiling is bounded twice: the inputs are bounded before they get here
(``grammars``: schema and grammar bytes, rule count, depth), and
llguidance's own fuel limits (``LLParserLimits``) stop a grammar whose
lexer or parser would grow too large, which is a 400 too. A compiled
matcher is cached (``RequestLimits.grammar_cache_entries``, least recently
used out) and each generation gets its own copy (``deep_copy`` is cheap),
so a client that sends the same schema or tools every turn pays the
compile once. A refusal is cached too: a non-strict tool whose schema
llguidance refuses is refused, then built again leniently
(``Preparation._compile``) on every turn, and pays for the refusal once.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import llama_cpp
import llguidance

from lmspd.core.errors import ApiError, RequestField
from lmspd.core.limits import DEFAULT_LIMITS, RequestLimits

__all__ = ["GrammarCompiler", "VocabularyWalkCancelled"]

# About 20 ms of lexer construction (llguidance builds ~50k fuel/ms) and a
# grammar of at most this many symbols; beyond that a request is refused
# rather than allowed to stall generation.
_PARSER_LIMITS: dict[str, Any] = dict(initial_lexer_fuel=1_000_000, max_grammar_size=200_000, step_lexer_fuel=200_000)


class VocabularyWalkCancelled(Exception):
    """The engine closed while its grammar tokenizer was being built: the
    vocabulary it walks is about to be freed."""


# Tokens walked between checks of ``cancel``: a few milliseconds.
_CANCEL_EVERY = 4096


def _tokenizer(vocab: Any, n_vocab: int, eos: list[int],
               cancel: threading.Event | None = None) -> llguidance.LLTokenizer:
    """llguidance's ``llamacpp.lltokenizer_from_vocab``, written out: that
    helper calls a llama.cpp binding deprecated under a new name once per
    token, and silencing the warning means ``warnings.catch_warnings``, which
    swaps process-wide state and is not safe on the background thread this
    runs on (a test's own warning filters raced it). Same bytes: a control
    token, or a user-defined one that looks like one, is marked special with
    a 0xff prefix."""
    size = 16 * 1024
    buffer = ctypes.create_string_buffer(size + 1)
    special = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
    user = llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
    pieces: list[bytes] = []
    for token in range(n_vocab):
        if cancel is not None and token % _CANCEL_EVERY == 0 and cancel.is_set():
            raise VocabularyWalkCancelled
        n = llama_cpp.llama_token_to_piece(vocab, token, buffer, size, 0, True)
        if n < 0:
            raise ValueError(f"token {token} does not fit {size} bytes")
        piece = ctypes.string_at(buffer, n)
        attr = llama_cpp.llama_vocab_get_attr(vocab, token)
        if attr & special or (attr & user and piece.startswith(b"<") and piece.endswith(b">")):
            piece = b"\xff" + piece
        pieces.append(piece)
    tokenize = ctypes.cast(llama_cpp.llama_cpp._lib.llama_tokenize, ctypes.c_void_p).value
    # from_llamacpp is missing from llguidance's type stubs.
    return llguidance.LLTokenizer.from_llamacpp(  # type: ignore[attr-defined]
        tokens=pieces, vocab_ptr=vocab, tokenize_fptr=tokenize, eos_token=eos, slices=None)


class GrammarCompiler:
    def __init__(self, vocab: Any, limits: RequestLimits = DEFAULT_LIMITS.request,
                 cancel: threading.Event | None = None) -> None:
        """``cancel``: set, the vocabulary walk stops with
        ``VocabularyWalkCancelled`` (the engine is closing)."""
        # Before anything reads ``vocab``: once the engine closes it may be freed.
        if cancel is not None and cancel.is_set():
            raise VocabularyWalkCancelled
        n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
        eog = [t for t in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t)]
        self.tokenizer = _tokenizer(vocab, n_vocab, eog or [llama_cpp.llama_vocab_eos(vocab)], cancel)
        self.n_vocab = n_vocab
        self.eog = eog
        self._limits = limits
        # A compiled matcher, or llguidance's refusal (its message).
        self._cache: OrderedDict[str, llguidance.LLMatcher | str] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0
        self.last_compile_ms = 0.0
        # special_markers by marker set: every request asks for its tool
        # format's, and tokenizing them cost ~0.2 ms of each one's prepare.
        self._specials: dict[tuple[str, ...], frozenset[str]] = {}

    def special_markers(self, markers: Iterable[str]) -> frozenset[str]:
        """The ``markers`` that are one special token of this model (a
        grammar writes them as that token, ``<|python_tag|>``)."""
        key = tuple(markers)
        known = self._specials.get(key)
        if known is not None:
            return known
        out = set()
        for marker in key:
            tokens = self.tokenizer.tokenize_str(marker, parse_special=True)
            if len(tokens) == 1 and self.tokenizer.is_special_token(tokens[0]):
                out.add(marker)
        # Two preparing threads may both compute it: the same set either way.
        self._specials[key] = found = frozenset(out)
        return found

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher for ``grammar``; ``ApiError`` if it does not compile."""
        with self._lock:
            cached = self._cache.get(grammar)
            if cached is not None:
                self._cache.move_to_end(grammar)
                if isinstance(cached, str):
                    raise _refused(cached)
                return cached.deep_copy()
        started = time.perf_counter()
        # Constructing drops the GIL: other requests keep being served.
        compiled = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0,
                                        limits=llguidance.LLParserLimits(**_PARSER_LIMITS))
        self.last_compile_ms = (time.perf_counter() - started) * 1000
        refused = None
        if compiled.is_error():
            lines = compiled.get_error().strip().splitlines()
            refused = lines[0][:300] if lines else "refused"
        with self._lock:
            if refused is None:
                self.compiles += 1
            self._cache[grammar] = compiled if refused is None else refused
            while len(self._cache) > max(1, self._limits.grammar_cache_entries):
                self._cache.popitem(last=False)
        if refused is not None:
            raise _refused(refused)
        return compiled.deep_copy()


def _refused(message: str) -> ApiError:
    return ApiError("unsupported_capability",
                    f"The requested output shape could not be compiled into a grammar for this model: {message}",
                    path=(RequestField.OUTPUT_FORMAT,))
