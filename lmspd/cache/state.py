"""What the engine remembers about a generation it ran, and what each of
its sequences holds.

A ``SessionState`` pairs the exact token sequence in the KV (prompt, sampled
tokens, hidden reasoning — everything the model saw) with the *visible
transcript*: the prompt text a client will render when it replays the
conversation, output included. The two differ on purpose: a client replays
what it was shown, the KV holds what the model produced.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lmspd.core.conversation import Item, SessionPin


def state_key(owner: str, tokens: list[int]) -> str:
    """A saved state's stable identity: the hash of its owner and its exact
    tokens (known before its KV is captured)."""
    return hashlib.sha256(f"{owner}\n{tokens!r}".encode()).hexdigest()[:32]

@dataclass
class SessionState:
    tokens: list[int]
    # Text of exactly ``tokens`` (special tokens spelled out): for matching
    # an ordinary replay by rendered text when token boundaries differ.
    kv_text: str
    # The visible transcript, as far as the KV covers it; None when the
    # template's rendering of the turn could not be aligned with the KV.
    visible: str | None = None
    # The conversation as the client knows it (input + output items), so a
    # request carrying only tool outputs can be rendered on top of it.
    items: list[Item] = field(default_factory=list)
    call_ids: frozenset[str] = frozenset()
    response_id: str | None = None
    # The KV bytes, once captured (RAM session or disk checkpoint).
    kv: bytes | bytearray | None = None
    # Whose request left this state; only that owner's requests reuse it.
    owner: str = "local"
    # The shortest prefix the KV bytes can be trimmed to and stay exact (0:
    # any; ``len(tokens)``: none, e.g. a recurrent state). Set at capture.
    floor: int = 0
    # An exact-state checkpoint kept at a semantic boundary (``input``: the
    # end of a prompt; ``breakpoint``: a client-declared or implicit one;
    # ``reasoning``: the end of a generation's reasoning section;
    # ``response``: the end of a turn a later one extended) for a model
    # whose KV cannot be trimmed; None for an ordinary state.
    boundary: str | None = None
    # The request's tool names and system text (lmspd.cache.diagnostics.Signature),
    # to name what changed when a later prompt parts from this state.
    signature: Any = None
    # (tokens, characters), ascending: points where the KV's first ``tokens``
    # hold exactly the first ``characters`` of ``aligned_text``, the prompt
    # of the turn that left this state (where each turn's prompt started and
    # ended). After a sampled turn the KV holds the model's own tokens of
    # it, which no tokenization of the replayed text reproduces, so a branch
    # (an edit of the last message or tool result) shares only a short token
    # prefix with the state; through these it keeps all the turns before the
    # edit.
    aligned: tuple[tuple[int, int], ...] = ()
    aligned_text: str = ""

    # (owner, tokens list, its length) -> key: the hash of a long state's
    # tokens costs ms (~1.5 ms at 10k tokens), and the scheduler thread asks
    # for the key several times a placement. A state's tokens are a list of
    # its own, never changed in place (every state is built from a copy);
    # the list's identity and length are checked all the same.
    _key: tuple[str, int, int, str] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def key(self) -> str:
        cached = self._key
        tokens = self.tokens
        if cached is not None and cached[:3] == (self.owner, id(tokens), len(tokens)):
            return cached[3]
        key = state_key(self.owner, tokens)
        self._key = (self.owner, id(tokens), len(tokens), key)
        return key

    @property
    def nbytes(self) -> int:
        return (len(self.kv or b"") + 4 * len(self.tokens) + 2 * len(self.kv_text) + 2 * len(self.visible or "")
                + 2 * len(self.aligned_text))


@dataclass
class Resident:
    """One sequence of the context and what its KV holds."""

    seq: int
    # The tokens evaluated in this sequence: exactly what its KV holds.
    tokens: list[int] = field(default_factory=list)
    # The finished turn it holds (None while a request runs on it, or empty).
    state: SessionState | None = None
    owner: str | None = None
    busy: bool = False
    last_used: float = 0.0
    # The state is already captured in RAM (no second capture on eviction).
    saved: bool = False
    # While busy: the whole prompt it is prefilling (for shared-prefix waits),
    # the request's text, and how many of ``prompt`` it kept (for the visible
    # transcript of a checkpoint taken during the prefill).
    prompt: list[int] = field(default_factory=list)
    prompt_text: str = ""
    prompt_keep: int = 0
    # While busy: the alignment points (``SessionState.aligned``) of the
    # state it continues that still hold for this prompt.
    prompt_aligned: tuple[tuple[int, int], ...] = ()
    # The agent whose turn it holds or runs, and that agent's parent.
    agent: str | None = None
    parent_agent: str | None = None
    # The connection whose session this sequence holds (see ``pinned``).
    pin: SessionPin | None = None

    @property
    def pinned(self) -> bool:
        """Held by a connection that is still open: evicted last."""
        return self.pin is not None and self.pin.open


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """How many leading tokens (or characters) two sequences share. Bisects
    with slice comparisons (C speed): the cache compares every request with
    every remembered state, checkpoints included, on the scheduler thread."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo
