"""KV lifecycle on one llama.cpp context, by sequence id: capture, restore,
copy, trim. The cache (lmspd.cache) decides what happens; this is how.

The context keeps one KV stream per sequence (``kv_unified = false``): each
sequence attends only over its own cells and always has the full context
window. llama.cpp copies across streams only whole: every cell of the
window, used or not (SmolLM2-135M at the default 32k window: ~750 MB, and
on a stream never written before as many first-touch page faults), done at
the start of the next ``llama_decode``, so every running stream waits for
it. A short source is instead copied cell by cell through the sequence
state API (only its used cells, at once); the whole-stream copy is kept for
a source that fills most of the window, where it moves less.

Not every model's KV can be cut anywhere. A sliding-window layer keeps only
the cells of its last window (llama.cpp prunes older ones unless the SWA
cache is full-size), and a recurrent layer keeps one state with no history
at all. ``floor`` says how far back a sequence can still be trimmed exactly;
the cache falls back to an exact-state checkpoint below it.
"""

from __future__ import annotations

import ctypes

import llama_cpp
from llama_cpp import _internals as internals


class SequenceKv:
    def __init__(self, ctx: internals.LlamaContext, model: internals.LlamaModel, *, swa_full: bool) -> None:
        self._ctx = ctx
        self._mem = ctx.memory
        m = model.model
        self.recurrent = bool(llama_cpp.llama_model_is_recurrent(m) or llama_cpp.llama_model_is_hybrid(m))
        self.n_swa = int(llama_cpp.llama_model_n_swa(m))
        # A full-size SWA cache keeps every cell: trimmable like plain attention.
        self.trimmable = not self.recurrent and (self.n_swa == 0 or swa_full)
        self.n_ctx = int(llama_cpp.llama_n_ctx_seq(ctx.ctx))
        # Sequences a whole-stream copy goes into at the next decode: until
        # then their cells are not what they will be (see ``copy``).
        self._stream_copies_into: set[int] = set()

    @property
    def kind(self) -> str:
        """What the KV is, for logs and /health: ``attention``, ``swa`` or ``recurrent``."""
        if self.recurrent:
            return "recurrent"
        return "swa" if self.n_swa and not self.trimmable else "attention"

    def floor(self, seq: int, n_tokens: int) -> int:
        """The shortest prefix ``seq`` (holding ``n_tokens``) can be trimmed to
        and still be exact: 0 for plain attention, ``n_tokens`` for a
        recurrent state; for sliding windows, the first position whose whole
        window is still in the cells (llama.cpp server's own test)."""
        if self.recurrent:
            return n_tokens
        pos_min = llama_cpp.llama_memory_seq_pos_min(self._mem, seq)
        if pos_min <= 0:
            return 0
        if not self.n_swa:
            return n_tokens  # cells gone for a reason we cannot reason about
        return min(n_tokens, pos_min + self.n_swa)

    def capture(self, seq: int) -> bytearray:
        """Copy one sequence's KV out of the context (not the logits buffer
        that a whole-context state would also hold). llama.cpp writes
        straight into the buffer that is returned: at ~12 MB a state (Gemma
        3 270M at 1k tokens) each further copy costs milliseconds of the
        turn it runs in (the end-of-input checkpoint precedes the first
        sampled token)."""
        ctx = self._ctx.ctx
        size = llama_cpp.llama_state_seq_get_size(ctx, seq)
        out = bytearray(size)
        if not size:
            return out
        n = llama_cpp.llama_state_seq_get_data(ctx, (ctypes.c_uint8 * size).from_buffer(out), size, seq)
        if n < size:
            del out[n:]
        return out

    def restore(self, seq: int, data: bytes | bytearray) -> bool:
        """Put a captured state into ``seq``, read in place (no copy of it)."""
        self.clear(seq)
        n = len(data)
        if not n:
            return False
        ok = llama_cpp.llama_state_seq_set_data(self._ctx.ctx, _pointer(data), n, seq) == n
        if not ok:
            self.clear(seq)
        return ok

    def copy(self, src: int, dst: int, n_tokens: int) -> None:
        """Make ``dst`` hold the first ``n_tokens`` of ``src``."""
        self.clear(dst)
        if self.cell_copy_cheaper(src) and self._copy_cells(src, dst):
            self.trim(dst, n_tokens)
            return
        llama_cpp.llama_memory_seq_cp(self._mem, src, dst, -1, -1)
        self._stream_copies_into.add(dst)
        self.trim(dst, n_tokens)

    def cell_copy_cheaper(self, src: int) -> bool:
        """Whether copying ``src``'s used cells (written out, then read in:
        a few passes over them) moves less than the whole stream does, and
        ``src``'s cells are settled (no whole-stream copy into it pending)."""
        return (self.trimmable and src not in self._stream_copies_into
                and 4 * self.n_tokens(src) <= self.n_ctx)

    def _copy_cells(self, src: int, dst: int) -> bool:
        ctx = self._ctx.ctx
        size = llama_cpp.llama_state_seq_get_size(ctx, src)
        buf = (ctypes.c_uint8 * size)()
        n = llama_cpp.llama_state_seq_get_data(ctx, buf, size, src)
        if n and llama_cpp.llama_state_seq_set_data(ctx, buf, n, dst) == n:
            return True
        self.clear(dst)
        return False

    def decoded(self) -> None:
        """A ``llama_decode`` ran: pending whole-stream copies are done."""
        self._stream_copies_into.clear()

    def trim(self, seq: int, keep: int) -> None:
        """Drop everything from position ``keep`` on."""
        llama_cpp.llama_memory_seq_rm(self._mem, seq, keep, -1)

    def clear(self, seq: int) -> None:
        llama_cpp.llama_memory_seq_rm(self._mem, seq, -1, -1)

    def n_tokens(self, seq: int) -> int:
        return llama_cpp.llama_memory_seq_pos_max(self._mem, seq) + 1


def _pointer(data: bytes | bytearray) -> "ctypes._Pointer[ctypes.c_uint8]":
    """A pointer to ``data``'s own buffer: llama.cpp only reads from it."""
    if isinstance(data, bytearray):
        return ctypes.cast((ctypes.c_uint8 * len(data)).from_buffer(data), ctypes.POINTER(ctypes.c_uint8))
    return ctypes.cast(ctypes.c_char_p(data), ctypes.POINTER(ctypes.c_uint8))
