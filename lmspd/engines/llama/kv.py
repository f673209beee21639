"""KV lifecycle on one llama.cpp context, by sequence id: capture, restore,
copy, trim. The cache (lmspd.cache) decides what happens; this is how.

The context keeps one KV stream per sequence (``kv_unified = false``): each
sequence attends only over its own cells and always has the full context
window. A copy between sequences is therefore a copy of the whole stream
(llama.cpp only copies across streams whole), trimmed to the shared prefix
afterwards; llama.cpp performs it at the start of the next ``llama_decode``.
"""

from __future__ import annotations

import ctypes

import llama_cpp
from llama_cpp import _internals as internals


class SequenceKv:
    def __init__(self, ctx: internals.LlamaContext) -> None:
        self._ctx = ctx
        self._mem = ctx.memory

    def capture(self, seq: int) -> bytes:
        """Copy one sequence's KV out of the context (not the logits buffer
        that a whole-context state would also hold)."""
        ctx = self._ctx.ctx
        size = llama_cpp.llama_state_seq_get_size(ctx, seq)
        buf = (ctypes.c_uint8 * size)()
        n = llama_cpp.llama_state_seq_get_data(ctx, buf, size, seq)
        return bytes(memoryview(buf)[:n])

    def restore(self, seq: int, data: bytes) -> bool:
        self.clear(seq)
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        ok = llama_cpp.llama_state_seq_set_data(self._ctx.ctx, buf, len(data), seq) == len(data)
        if not ok:
            self.clear(seq)
        return ok

    def copy(self, src: int, dst: int, n_tokens: int) -> None:
        """Make ``dst`` hold the first ``n_tokens`` of ``src``."""
        self.clear(dst)
        llama_cpp.llama_memory_seq_cp(self._mem, src, dst, -1, -1)
        self.trim(dst, n_tokens)

    def trim(self, seq: int, keep: int) -> None:
        """Drop everything from position ``keep`` on."""
        llama_cpp.llama_memory_seq_rm(self._mem, seq, keep, -1)

    def clear(self, seq: int) -> None:
        llama_cpp.llama_memory_seq_rm(self._mem, seq, -1, -1)

    def n_tokens(self, seq: int) -> int:
        return llama_cpp.llama_memory_seq_pos_max(self._mem, seq) + 1
