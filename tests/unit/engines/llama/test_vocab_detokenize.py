"""Vocabulary.detokenize: the cache's KV text. llama-cpp-python's own
detokenize renders into a 32-byte buffer and slices a longer piece short
(``buffer[:n]`` with n < 0): 47 of SmolLM2's tokens (runs of spaces, code
indentation among them) came out truncated. It is also quadratic in the
length, and the cache detokenizes whole states on the scheduler thread."""

from __future__ import annotations

import random

import llama_cpp
import pytest

from lmspd.engines.llama.vocab import Vocabulary
from support.cache_rig import GGUF


@pytest.fixture(scope="module")
def vocab():
    llm = llama_cpp.Llama(str(GGUF), vocab_only=True, verbose=False)
    yield Vocabulary(llm._model)  # llm owns the model: held until the module is done
    llm.close()


def piece(vocab: Vocabulary, token: int) -> bytes:
    size = 4096
    buf = llama_cpp.ctypes.create_string_buffer(size)
    n = llama_cpp.llama_token_to_piece(vocab.vocab, token, buf, size, 0, True)
    assert 0 <= n <= size
    return buf.raw[:n]


def test_every_token_detokenizes_to_its_whole_piece(vocab):
    long = [t for t in range(vocab.n_vocab) if len(piece(vocab, t)) > 32]
    assert long, "the model has pieces longer than llama-cpp-python's buffer (else this tests little)"
    for t in range(vocab.n_vocab):
        if t == llama_cpp.llama_vocab_bos(vocab.vocab):
            continue
        assert vocab.detokenize([t]) == piece(vocab, t).decode("utf-8", errors="replace"), t


def test_a_sequence_is_its_pieces_joined(vocab):
    rnd = random.Random(7)
    tokens = [rnd.randrange(vocab.n_vocab) for _ in range(5000)]
    joined = b"".join(piece(vocab, t) for t in tokens).decode("utf-8", errors="replace")
    assert vocab.detokenize(tokens) == joined
    text = "def f():\n" + " " * 40 + "return 1\n<|im_start|>user\nhi<|im_end|>\n"
    assert vocab.detokenize(vocab.tokenize(text)) == text
