"""Sampling under a grammar without paying for the grammar on every token.

Computing the set of tokens a grammar allows costs a walk over the whole
vocabulary (llguidance: ~40 µs for SmolLM2's 49k tokens; llama.cpp's GBNF
sampler: more than a small model's forward pass). Most tokens a model
samples under a grammar are allowed anyway, so ``GrammarFirstRejection``
does what llama.cpp's ``common_sampler`` does: sample from the
unconstrained distribution (llama.cpp's own sampler call, as free decoding
does), ask the matcher about that one token (about a microsecond), and
only when it is rejected mask the full vocabulary and sample again.

The result has the same distribution as applying the grammar first (an
allowed token is kept with probability p; a rejection resamples from the
allowed tokens, renormalized), and with greedy sampling it is the same
token.

Lazy grammars (tool calls under ``tool_choice: auto``): the matcher sleeps
while the text is free and wakes where the output first shows a trigger
text; it is then fed the output from the trigger on, and constrains every
token after. A trigger followed by something the grammar does not take
(``<tool_calls are fun``) leaves the text free and the search goes on. A
trigger written ``^…`` counts only at the start of the reply (after
whitespace).
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable, cast

import llguidance
import numpy as np
from llama_cpp import _internals as internals
from llama_cpp import llama_cpp

__all__ = ["GrammarFirstRejection", "Greedy", "greedy_tokens", "logits_row"]

_WS = b" \t\r\n"


def _logits_function(name: str, *argtypes: Any) -> Callable[..., int | None]:
    """llama.cpp's ``name`` (``llama_get_logits[_ith]``) returning an address
    as an int: a numpy view of it is then two cheap calls (``_floats``),
    where ``np.ctypeslib.as_array`` on llama-cpp-python's float pointer
    costs ~10 µs a row (it builds a ctypes array type and casts through it).
    The call releases the GIL: the first one after a decode waits for an
    asynchronous backend (a GPU) to finish."""
    lib = getattr(llama_cpp, "_lib", None)
    if lib is not None:
        fn = lib[name]  # an object of our own: llama-cpp-python's keeps its restype
        fn.argtypes = [ctypes.c_void_p, *argtypes]
        fn.restype = ctypes.c_void_p
        return fn
    binding = getattr(llama_cpp, name)

    def fallback(*args: int) -> int | None:
        return ctypes.cast(binding(*args), ctypes.c_void_p).value
    return fallback


_LOGITS_ITH = _logits_function("llama_get_logits_ith", ctypes.c_int32)
_LOGITS = _logits_function("llama_get_logits")


def _address(ctx: internals.LlamaContext, idx: int) -> int:
    addr = _LOGITS_ITH(ctx.ctx, idx)
    if not addr:
        raise RuntimeError(f"llama.cpp has no logits for batch row {idx}")
    return addr


def _floats(addr: int, count: int) -> np.ndarray:
    return np.frombuffer(cast(Any, (ctypes.c_float * count).from_address(addr)), dtype=np.float32)


def logits_row(ctx: internals.LlamaContext, idx: int, n_vocab: int) -> np.ndarray:
    """The logits of batch row ``idx`` (a view, valid until the next decode)."""
    return _floats(_address(ctx, idx), n_vocab)


def greedy_tokens(ctx: internals.LlamaContext, rows: list[int], n_outputs: int, n_vocab: int) -> list[int]:
    """The first highest-logit token of each of the last decode's output
    ``rows``; ``n_outputs``: how many rows it has. llama.cpp's logits buffer
    holds a row for each batch position that asked for logits, in batch
    order (however it split the batch, it puts them back in that order), so
    a position's row is how many positions before it asked.

    One call for the whole buffer, not one per row: right after a decode,
    which has streamed the weights through the caches, each call into
    llama.cpp costs several microseconds. The rows are read once either
    way, ~35 µs each for a 49k vocabulary fresh from the decode; one
    ``argmax`` over the block saves the per-row calls when most rows are
    asked for."""
    addr = _LOGITS(ctx.ctx)
    if not addr:
        raise RuntimeError("llama.cpp has no logits for the last decode")
    block = _floats(addr, n_outputs * n_vocab).reshape(n_outputs, n_vocab)
    if 2 * len(rows) >= n_outputs:
        tops = block.argmax(axis=1).tolist()
        return [tops[r] for r in rows]
    return [int(block[r].argmax()) for r in rows]


class Greedy:
    """Temperature 0 without a grammar: the first token of highest logit,
    read straight off the logits row. llama.cpp's greedy sampler picks the
    same token (the first maximum), but ``llama_sampler_sample`` first fills
    a candidate array of the whole vocabulary (~0.2 ms for SmolLM2's 49k
    tokens, per sequence per step, on the scheduler thread)."""

    __slots__ = ("_n_vocab",)

    def __init__(self, n_vocab: int) -> None:
        self._n_vocab = n_vocab

    def sample(self, ctx: internals.LlamaContext, idx: int = -1, top: int | None = None) -> int:
        """``top``: the row's highest-logit token, where the scheduler read
        it already (``greedy_tokens``, for every greedy row of a step at once)."""
        if top is not None:
            return top
        return int(logits_row(ctx, idx, self._n_vocab).argmax())

    def close(self) -> None:
        pass


class GrammarFirstRejection:
    def __init__(self, matcher: llguidance.LLMatcher, tokenizer: llguidance.LLTokenizer, n_vocab: int,
                 chain: internals.LlamaSampler, triggers: list[str] | None = None, *, greedy: bool = False) -> None:
        """``greedy``: ``chain`` is llama.cpp's greedy sampler alone
        (temperature 0), so the first try reads the highest logit straight
        off the row, as ``Greedy`` does."""
        self._matcher = matcher
        self._greedy = greedy
        self._tokenizer = tokenizer
        self._chain = chain
        self._n_vocab = n_vocab
        self._eos = tokenizer.eos_token
        self._eog = frozenset(tokenizer.eos_tokens)
        # One candidate array for the whole vocabulary, reused every token.
        self._data = (llama_cpp.llama_token_data * n_vocab)()
        self._view = np.ctypeslib.as_array(self._data)
        self._ids = np.arange(n_vocab, dtype=np.int32)
        self._all = llama_cpp.llama_token_data_array(
            data=ctypes.cast(self._data, llama_cpp.llama_token_data_p), size=n_vocab, selected=-1, sorted=False)
        self.rejections = 0
        # Lazy: asleep until a trigger shows in the output.
        self._awake = not triggers
        self._anywhere = [t.encode() for t in triggers or () if not t.startswith("^")]
        self._at_start = [t[1:].encode() for t in triggers or () if t.startswith("^")]
        self._out = bytearray()
        self._tokens: list[int] = []
        self._starts: list[int] = []
        self._scanned = 0

    @property
    def greedy(self) -> bool:
        return self._greedy

    def sample(self, ctx: internals.LlamaContext, idx: int = -1, top: int | None = None) -> int:
        """``top``: as ``Greedy.sample``'s (greedy only)."""
        # The first try is the free path's own: greedy, the first highest
        # logit (``Greedy``); else llama.cpp's sample-and-accept (filling
        # the candidate array from Python costs ~0.4 ms a token on a 49k
        # vocabulary). llama.cpp's greedy sampler would pick the same token
        # but first writes a 49k-entry candidate array (~0.6 MB, more than
        # a core's L2 here) every token, which free decoding never does.
        # The chain's accept of a token the grammar then rejects is
        # harmless: greedy, top-k, top-p, min-p, temperature and dist keep no
        # per-token state.
        if self._greedy:
            token = top if top is not None else int(logits_row(ctx, idx, self._n_vocab).argmax())
        else:
            token = self._chain.sample(ctx, idx)
        if not self.allows(token):
            self.rejections += 1
            allowed = self._allowed()
            logits = logits_row(ctx, idx, self._n_vocab)
            if allowed is None:  # nothing allowed is the matcher's error state: end the turn
                token = self._eos
            elif self._greedy:
                # What llama.cpp's greedy sampler picks from the masked
                # candidates (the first highest logit), without filling the
                # 49k-entry candidate array (~0.3 ms).
                token = int(np.where(allowed, logits, -np.inf).argmax())
            else:
                token = self._pick(logits, allowed)
            self._chain.accept(token)
        self.accept(token)
        return token

    def allows(self, token: int) -> bool:
        """Whether the grammar lets ``token`` come next (a microsecond)."""
        if not self._awake:
            return True
        if token in self._eog:
            # validate_tokens never commits an end-of-generation token.
            return self._matcher.is_accepting()
        return self._matcher.validate_tokens([token]) == 1

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (none while a lazy grammar
        sleeps, or once it is done): a draft that is right unless the
        sampler ends the turn first."""
        if not self._awake or self._matcher.is_stopped() or self._matcher.is_error():
            return []
        # A forced token is one whose bytes are all forced: where no byte is
        # (inside a free string, most of a long argument), there is none,
        # and asking costs ~2 µs where compute_ff_tokens costs ~20 (it
        # tokenizes what is forced, asked once per step per sequence).
        if not self._matcher.compute_ff_bytes():
            return []
        return self._matcher.compute_ff_tokens()

    def accept(self, token: int) -> None:
        if self._awake:
            self._matcher.consume_token(token)
        else:
            self._watch(token)

    def _allowed(self) -> np.ndarray | None:
        mask = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(mask, bitorder="little")[: self._n_vocab].astype(bool)
        return allowed if allowed.any() else None

    def _pick(self, logits: np.ndarray, allowed: np.ndarray | None = None) -> int:
        view, arr = self._view, self._all
        # Samplers sort and shrink the array in place: restore it whole.
        view["id"] = self._ids
        view["logit"] = logits
        view["p"] = 0.0
        if allowed is not None:
            view["logit"][~allowed] = -np.inf
        arr.size, arr.selected, arr.sorted = self._n_vocab, -1, False
        llama_cpp.llama_sampler_apply(self._chain.sampler, ctypes.byref(arr))
        return int(self._data[arr.selected].id)

    # -- lazy grammars -----------------------------------------------------------

    def _watch(self, token: int) -> None:
        self._starts.append(len(self._out))
        self._tokens.append(token)
        self._out += self._tokenizer.decode_bytes([token])
        at = self._trigger()
        while at is not None:
            if self._wake(at):
                return
            self._scanned = at + 1
            at = self._trigger()

    def _trigger(self) -> int | None:
        out = self._out
        found = [i for t in self._anywhere if (i := out.find(t, self._scanned)) >= 0]
        if self._at_start:
            rest = bytes(out).lstrip(_WS)
            if any(rest.startswith(t) for t in self._at_start):
                self._at_start = []  # one chance, at the start
                found.append(len(out) - len(rest))
            elif rest and not any(t.startswith(rest[: len(t)]) for t in self._at_start):
                self._at_start = []  # the reply did not start with a call
        if not found:
            # Only the tail that could still begin a trigger needs a second look.
            longest = max((len(t) for t in self._anywhere), default=1)
            self._scanned = max(self._scanned, len(out) - longest + 1)
            return None
        return min(found)

    def _wake(self, at: int) -> bool:
        """Feed the matcher the output from ``at``; whether it took all of it."""
        k = max(i for i, start in enumerate(self._starts) if start <= at)
        feed = self._tokens[k + 1:]
        if self._starts[k] == at:
            feed = [self._tokens[k]] + feed
        else:
            head = bytes(self._out[at: self._starts[k + 1] if k + 1 < len(self._starts) else len(self._out)])
            feed = self._tokenizer.tokenize_bytes(head) + feed
        if self._matcher.try_consume_tokens(feed) == len(feed) and not self._matcher.is_error():
            self._awake = True
            self._out.clear()
            self._tokens.clear()
            self._starts.clear()
            return True
        self._matcher.reset()
        return False

    def close(self) -> None:
        if self._chain is not None:
            self._chain.close()
            self._chain = None  # type: ignore[assignment]  # closed: never used again

    def __del__(self) -> None:
        self.close()
