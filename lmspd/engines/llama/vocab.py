"""Text <-> tokens for one model, with the per-token byte pieces cached.

A sampled token's piece is rendered with special tokens *off*: a model's
control tokens (``<|im_end|>``, ``<|eot_id|>``, a stray ``<|fim_prefix|>``)
are structure, not answer, and must never reach the visible text. The one
exception is the markers the active syntaxes read (``show_markers``): when a
model writes Harmony's ``<|channel|>``/``<|message|>``/``<|call|>`` or
Mistral's ``[TOOL_CALLS]`` as their single special token, the tool-call
parser and the stop matcher must see that text — rendered empty, the call
markup would vanish and its JSON body would leak as text. Those tokens
alone are rendered with their text; the parsers never let markup through.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable

import llama_cpp
from llama_cpp import _internals as internals

from .client_text import llama_tokenize, tokenize_marked
from .fragments import FragmentTokenizer


class Vocabulary:
    def __init__(self, model: internals.LlamaModel) -> None:
        self._model = model
        self.vocab = model.vocab
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self._pieces: dict[int, bytes] = {}
        self._piece_buf = ctypes.create_string_buffer(256)
        self._special_pieces: dict[int, bytes] = {}
        self._eog: dict[int, bool] = {}
        self._bos = llama_cpp.llama_vocab_bos(self.vocab)
        #: Special tokens whose text the output path keeps (``show_markers``).
        self.shown: frozenset[int] = frozenset()
        self._fragments = FragmentTokenizer(self.vocab)

    @property
    def control_texts(self) -> list[str]:
        """The control tokens' texts (``client_text.ClientText``)."""
        return self._fragments.control_texts

    def tokenize(self, text: str) -> list[int]:
        # The template already wrote any BOS it wants; special=True so that
        # markers like <|im_start|> become their single tokens, split at the
        # marks that keep client text from spelling them (client_text.py);
        # each fragment between special tokens tokenized once (fragments.py).
        return tokenize_marked(text, self._fragments.tokenize)

    def detokenize(self, tokens: list[int]) -> str:
        """The text of ``tokens``, special tokens spelled out (the cache's KV
        text). llama-cpp-python's ``detokenize`` appends each piece to a
        growing ``bytes``, quadratic in the length: the cache detokenizes
        whole states (100k tokens) on the scheduler thread. Same bytes,
        from a per-token cache, joined once."""
        pieces = self._special_pieces
        out = []
        buf: ctypes.Array[ctypes.c_char] | None = None
        for token in tokens:
            piece = pieces.get(token)
            if piece is None:
                # A buffer of this call's own: the scheduler and prepare threads both detokenize.
                buf = buf or ctypes.create_string_buffer(256)
                piece = pieces[token] = self._render(token, special=True, buf=buf)
            out.append(piece)
        data = b"".join(out)
        if tokens and tokens[0] == self._bos and data[:1] == b" ":
            data = data[1:]  # as llama-cpp-python's detokenize (a Llama 1 BOS leading space)
        return data.decode("utf-8", errors="replace")

    def show_markers(self, markers: Iterable[str]) -> frozenset[int]:
        """Render these markers' special tokens as their text in ``piece``.

        A marker counts only where it is exactly one token that renders
        empty with special tokens off (a marker spelled by ordinary tokens
        already comes out as text). Returns the tokens now shown; call it
        once, before generating (the piece cache is reset)."""
        shown = set(self.shown)
        for marker in markers:
            if not marker:
                continue
            token = self._single_token(marker)
            if token is None or self._render(token, special=False) != b"":
                continue
            if self._render(token, special=True) == marker.encode():
                shown.add(token)
        self.shown = frozenset(shown)
        self._pieces.clear()
        return self.shown

    def piece(self, token: int) -> bytes:
        """The bytes one sampled token adds to the output (cached: the hot loop asks per token)."""
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._render(token, special=token in self.shown)
            self._pieces[token] = piece
        return piece

    def _single_token(self, text: str) -> int | None:
        tokens = llama_tokenize(self.vocab, text)
        return tokens[0] if len(tokens) == 1 else None

    def _render(self, token: int, *, special: bool, buf: ctypes.Array[ctypes.c_char] | None = None) -> bytes:
        buf = buf or self._piece_buf
        n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:  # longer than the buffer (a long user-defined token)
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        return bytes(buf.raw[: max(n, 0)])

    def is_eog(self, token: int) -> bool:
        # Cached: asked for every sampled token, and a ctypes call releases
        # the GIL (to the event loop thread, for up to the switch interval).
        eog = self._eog.get(token)
        if eog is None:
            eog = self._eog[token] = bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))
        return eog

    def token_text(self, token: int) -> str:
        if token < 0:
            return ""
        return self._model.token_get_text(token)
