"""Text <-> tokens for one model, with the per-token byte pieces cached."""

from __future__ import annotations

import ctypes

import llama_cpp
from llama_cpp import _internals as internals

from .client_text import llama_tokenize, tokenize_marked


class Vocabulary:
    def __init__(self, model: internals.LlamaModel) -> None:
        self._model = model
        self.vocab = model.vocab
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self._pieces: dict[int, bytes] = {}
        self._piece_buf = ctypes.create_string_buffer(256)

    def tokenize(self, text: str) -> list[int]:
        # The template already wrote any BOS it wants; special=True so that
        # markers like <|im_start|> become their single tokens, split at the
        # marks that keep client text from spelling them (client_text.py).
        return tokenize_marked(text, lambda piece: llama_tokenize(self.vocab, piece))

    def detokenize(self, tokens: list[int]) -> str:
        return self._model.detokenize(tokens, special=True).decode("utf-8", errors="replace")

    def piece(self, token: int) -> bytes:
        """The bytes one sampled token adds to the output (cached: the hot loop asks per token)."""
        piece = self._pieces.get(token)
        if piece is None:
            buf = self._piece_buf
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
            piece = bytes(buf.raw[: max(n, 0)])
            self._pieces[token] = piece
        return piece

    def is_eog(self, token: int) -> bool:
        return llama_cpp.llama_vocab_is_eog(self.vocab, token)

    def token_text(self, token: int) -> str:
        if token < 0:
            return ""
        return self._model.token_get_text(token)
