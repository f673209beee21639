"""Prompt tokenizing as llama.cpp does it, with each fragment's tokens kept.

llama.cpp tokenizes a prompt (special tokens on) in two stages: it cuts the
text at every occurrence of a special token's text (control, user-defined
and unknown tokens, longest first), then tokenizes each fragment of plain
text between them on its own. Both stages cost more than the text: each
fragment pays a fixed ~15-50 µs (the BPE pre-tokenizer builds its regular
expressions per call), and the cut scans the text once per special token
(Gemma 3 has 6,414). A 121-byte ChatML prompt of five fragments took
~300 µs, and an agent's prompt has a fragment per message.

Here the cut is one pass of a compiled pattern (a trie of the special
texts, longest match first), and each fragment's tokens are kept in a
bounded LRU: an agent's prompt is mostly fragments it sent before (its
instructions, its tool list, the conversation so far). That is exact
because llama.cpp tokenizes fragments independently of each other — and
because, for the vocabularies this takes (``exact_cut``), cutting at the
leftmost longest match finds the same occurrences as llama.cpp's longest
token first: no special text overlaps or contains another, except runs of
one repeated byte (Gemma's runs of newlines and spaces), which cut alike
either way. Any other vocabulary is tokenized by llama.cpp itself.
"""

from __future__ import annotations

import array
import contextlib
import re
import threading
from collections import OrderedDict
from typing import Any

# llama_token_attr bits (llama.h).
_UNKNOWN, _CONTROL, _USER_DEFINED, _LSTRIP, _RSTRIP = 1, 8, 16, 64, 128
# The tokens llama.cpp cuts at (its cache_special_tokens).
_CUT = _UNKNOWN | _CONTROL | _USER_DEFINED
# llama_vocab_type: the types whose fragments are known to tokenize on their own.
_SPM, _BPE = 1, 2

# What the fragment cache holds: its keys' bytes plus 4 per token. A
# fragment over the per-fragment bound is tokenized every time.
CACHE_BYTES = 16 << 20
FRAGMENT_BYTES = 1 << 20
# A larger prompt is cut by llama.cpp, without the GIL: the cut here holds
# it for ~1-3 µs a fragment (Gemma makes every newline a fragment's end).
PROMPT_BYTES = 1 << 20


def exact_cut(specials: dict[bytes, Any]) -> str | None:
    """Why cutting at the leftmost longest match would not give llama.cpp's
    fragments for these special texts, or None when it would.

    llama.cpp takes the longest texts first, each at every occurrence left
    to right. When no text contains or overlaps another, the occurrences
    are disjoint and the order does not matter. Runs of one byte (``\\n``
    × 1..31) contain each other, but a run is cut into the longest first,
    from its left, either way."""
    if b"" in specials:
        return "a special token with no text"
    prefixes: dict[bytes, bool] = {}  # proper prefix -> every text it begins is a run of its byte
    for text in specials:
        run = _run(text)
        for k in range(1, len(text)):
            prefixes[text[:k]] = prefixes.get(text[:k], True) and run
    pattern = _trie_pattern(list(specials))
    for text in specials:
        run = _run(text)
        if len(text) > 1 and not run:
            inner = pattern.search(text, 1) or pattern.search(text, 0, len(text) - 1)
            if inner is not None:
                return f"{text!r} contains {inner.group()!r}"
        for k in range(1, len(text)):
            all_runs = prefixes.get(text[k:])
            if all_runs is not None and not (run and all_runs):
                return f"{text!r} overlaps another special token's text"
    return None


def _run(text: bytes) -> bool:
    return len(set(text)) == 1


def _trie_pattern(texts: list[bytes]) -> re.Pattern[bytes]:
    """One pattern matching any of ``texts``, the longest where several
    begin at one place (a trie: at each byte one branch, a text that ends
    there made optional after the longer ones)."""
    root: dict[int | None, Any] = {}
    for text in texts:
        node = root
        for byte in text:
            node = node.setdefault(byte, {})
        node[None] = {}
    return re.compile(_trie_source(root), re.DOTALL)


def _trie_source(node: dict[int | None, Any]) -> bytes:
    branches = [re.escape(bytes([byte])) + _trie_source(child) for byte, child in node.items() if byte is not None]
    if not branches:
        return b""
    body = branches[0] if len(branches) == 1 else b"(?:" + b"|".join(branches) + b")"
    return b"(?:" + body + b")?" if None in node else body


class FragmentTokenizer:
    """``tokenize(text)``: the tokens llama.cpp's ``llama_tokenize`` gives
    ``text`` with special tokens on and no BOS. Thread-safe: the preparing
    pool and the scheduler thread both tokenize."""

    def __init__(self, vocab: Any, *, cache_bytes: int = CACHE_BYTES, fragment_bytes: int = FRAGMENT_BYTES) -> None:
        import llama_cpp

        from .client_text import llama_tokenize_bytes

        self._vocab = vocab
        self._llama_tokenize = llama_tokenize_bytes
        self._cache: OrderedDict[bytes, array.array[int]] = OrderedDict()
        self._cache_bytes = cache_bytes
        self._fragment_bytes = fragment_bytes
        self._held = 0
        self._lock = threading.Lock()
        specials: dict[bytes, list[int]] = {}
        stripping = False
        #: The control tokens' texts (``client_text.ClientText``: one walk of the vocabulary serves both).
        self.control_texts: list[str] = []
        for token in range(llama_cpp.llama_vocab_n_tokens(vocab)):
            attr = llama_cpp.llama_vocab_get_attr(vocab, token)
            if attr & _CUT:
                text = llama_cpp.llama_vocab_get_text(vocab, token) or b""
                specials.setdefault(text, []).append(token)
                stripping = stripping or bool(attr & (_LSTRIP | _RSTRIP))
                if attr & _CONTROL and text:
                    self.control_texts.append(text.decode("utf-8", errors="ignore"))
        kind = llama_cpp.llama_vocab_type(vocab)
        #: Why llama.cpp cuts the prompt itself (None: this class does).
        self.fallback: str | None = (
            f"vocabulary type {kind}" if kind not in (_SPM, _BPE)
            else "special tokens that strip the whitespace beside them" if stripping
            else exact_cut(specials))
        self._ids: dict[bytes, int] = {}
        self._pattern: re.Pattern[bytes] | None = None
        if self.fallback is None and specials:
            for text, tokens in specials.items():
                if len(tokens) > 1:
                    # One text, several tokens: whichever llama.cpp's cut picks.
                    tokens = self._llama_tokenize(vocab, text, True)
                    if len(tokens) != 1:
                        self.fallback = f"{text!r} is the text of several tokens"
                        break
                self._ids[text] = tokens[0]
            else:
                self._pattern = _trie_pattern(list(specials))
        if self.fallback is not None:
            self._ids.clear()
        self._texts = {token: text for text, token in self._ids.items()}

    def tokenize(self, text: str) -> list[int]:
        """``text``'s tokens: llama.cpp's, special tokens on, no BOS."""
        raw = text.encode("utf-8")
        if self.fallback is not None or len(raw) > PROMPT_BYTES:
            return self._llama_tokenize(self._vocab, raw, True)
        # The prompt as fragments (bytes) and special tokens (ids), in order.
        parts: list[bytes | int] = []
        at = 0
        if self._pattern is not None:
            for match in self._pattern.finditer(raw):
                if match.start() > at:
                    parts.append(raw[at:match.start()])
                parts.append(self._ids[match.group()])
                at = match.end()
        if at < len(raw):
            parts.append(raw[at:])
        kept = [self._kept(part) if isinstance(part, bytes) else None for part in parts]
        tokens: list[int] = []
        i = 0
        while i < len(parts):
            part = parts[i]
            if isinstance(part, int):
                tokens.append(part)
            elif kept[i] is not None:
                tokens += kept[i]  # type: ignore[arg-type]
            else:
                # Fragments not kept, and the special tokens between them:
                # one llama.cpp call, whose fixed cost is per call (Gemma's
                # is ~20 µs, SmolLM2's ~40), then kept fragment by fragment.
                j = i + 1
                while j < len(parts) and (isinstance(parts[j], int) or kept[j] is None):
                    j += 1
                tokens += self._first_pass(parts[i:j])
                i = j - 1
            i += 1
        return tokens

    def _kept(self, fragment: bytes) -> array.array[int] | None:
        # No lock: each OrderedDict call is atomic under the GIL, and a
        # fragment evicted in between is still a right answer.
        kept = self._cache.get(fragment)
        if kept is not None:
            with contextlib.suppress(KeyError):
                self._cache.move_to_end(fragment)
        return kept

    def _first_pass(self, run: list[bytes | int]) -> list[int]:
        """Tokens of fragments and the special tokens between them (the
        run starts with a fragment), each fragment's then kept."""
        if len(run) == 1:
            fragment = run[0]
            assert isinstance(fragment, bytes)
            tokens = self._llama_tokenize(self._vocab, fragment, False)
            self._keep([(fragment, tokens)])
            return tokens
        span = b"".join(part if isinstance(part, bytes) else self._texts[part] for part in run)
        tokens = self._llama_tokenize(self._vocab, span, True)
        # Split where the special tokens are: no fragment's tokens include
        # one (the cut took every special token's text out of them), and
        # two fragments are never adjacent.
        pieces: list[tuple[bytes, list[int]]] = []
        at = 0
        for k, part in enumerate(run):
            if isinstance(part, int):
                at += 1
                continue
            end = tokens.index(run[k + 1], at) if k + 1 < len(run) else len(tokens)  # type: ignore[arg-type]
            pieces.append((part, tokens[at:end]))
            at = end
        self._keep(pieces)
        return tokens

    def _keep(self, pieces: list[tuple[bytes, list[int]]]) -> None:
        with self._lock:
            for fragment, tokens in pieces:
                if len(fragment) > self._fragment_bytes or fragment in self._cache:
                    continue
                self._cache[fragment] = array.array("i", tokens)
                self._held += len(fragment) + 4 * len(tokens)
            while self._held > self._cache_bytes and self._cache:
                old, old_tokens = self._cache.popitem(last=False)
                self._held -= len(old) + 4 * len(old_tokens)

    @property
    def held_bytes(self) -> int:
        """What the fragment cache holds now (its bound: ``cache_bytes``)."""
        return self._held
