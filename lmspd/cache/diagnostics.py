"""Why a request reused less of its prompt than the cache remembers.

After the cache placed a request, ``diagnose`` compares its prompt with the
remembered state (resident, RAM, disk) that shares the longest token prefix
with it, and names the reason the request does not simply extend that
state — or, when it reused less than that prefix, why not:

- ``reuse_off``: the server or the request turned reuse off;
- ``checkpoint_missing``: the KV cannot be trimmed (sliding window,
  recurrent) and no exact-state checkpoint lies at or before the divergence;
- ``below_min_reuse``: the shared prefix is too short to be worth a restore
  or a copy (``MIN_COPY_TOKENS``);
- ``tools_reordered``, ``tools_changed``: the tool list differs (same names in
  another order, or other names);
- ``system_nonce``: the system prompt differs only by a per-request nonce
  (Claude Code's ``cch=`` billing header when its repair is off);
- ``system_changed``: the instructions or leading system messages differ;
- ``reasoning_stripped``: a replayed turn lacks the reasoning the model
  produced in front of it;
- ``messages_changed``: an earlier message or tool result was edited
  (a branch);
- ``state_evicted``: the state it would have continued is gone, and
  ``evicted_by`` says what pushed it out: ``another_session`` (another
  session's request took its sequence and RAM could not hold it at all),
  ``ram_budget`` (it left RAM for newer states and there is no disk tier),
  ``disk_budget`` (it left the disk tier for newer checkpoints, or never fit
  in it). ``EvictionLog`` remembers the last few evicted states' tokens for
  this, nothing else.

The divergence point is reported as the first differing item index of the
request's input and the token offset where the prompts part.
"""

from __future__ import annotations

import re
import threading
from array import array
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

from lmspd.core.conversation import Item, Message, Reasoning, ToolCall, ToolOutput

from .state import SessionState, common_prefix

NONCE = re.compile(r"cch=[0-9A-Za-z_.-]+")


@dataclass
class Signature:
    """What of a request is not in its items: the tool names in the order
    sent, and the system text (instructions and leading system messages)."""

    tools: tuple[str, ...] = ()
    system: str = ""


@dataclass
class CacheReport:
    source: str
    reused: int
    prefilled: int
    longest_prefix: int = 0
    miss_reason: str | None = None
    divergence_item: int | None = None
    divergence_token: int | None = None
    # Tokens of the remembered state the prompt was compared with.
    remembered: int = 0
    # ``state_evicted``: what evicted it (``EvictionLog``).
    evicted_by: str | None = None

    @property
    def missed_tokens(self) -> int:
        """Remembered tokens this request prefilled again."""
        return max(min(self.remembered, self.reused + self.prefilled) - self.reused, 0)

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"source": self.source, "reused": self.reused, "prefilled": self.prefilled,
                               "longest_prefix": self.longest_prefix, "miss_reason": self.miss_reason}
        if self.divergence_token is not None:
            out["divergence"] = {"item": self.divergence_item, "token": self.divergence_token}
        if self.evicted_by is not None:
            out["evicted_by"] = self.evicted_by
        return out

    def anthropic_json(self) -> dict[str, Any] | None:
        """Anthropic's ``diagnostics`` object, when part of the prompt missed."""
        kind = self.anthropic_reason
        if kind is None:
            return None
        return {"cache_miss_reason": {"type": kind, "cache_missed_input_tokens": self.missed_tokens}}

    @property
    def anthropic_reason(self) -> str | None:
        """Anthropic's ``diagnostics.cache_miss_reason.type`` vocabulary."""
        if self.miss_reason is None or self.miss_reason == "state_evicted":
            # Anthropic names no eviction: the prompt itself did not change
            # (lmspd's own extension and log line say what evicted it).
            return None
        return {"tools_reordered": "tools_changed", "tools_changed": "tools_changed",
                "system_nonce": "system_changed", "system_changed": "system_changed"}.get(
                    self.miss_reason, "messages_changed")


class EvictionLog:
    """The token sequences of the last ``size`` states that left every tier,
    each with what evicted it, per owner: enough to tell a request that its
    state was there and who pushed it out. Written from the scheduler and the
    disk writer threads.

    Full, it drops the oldest entry of the owner with the most: one key's
    traffic does not push another's few entries out (it did: the 64 were
    shared first come, first gone)."""

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, bytes], str] = OrderedDict()

    def record(self, tokens: list[int], owner: str, by: str) -> None:
        key = (owner, array("i", tokens).tobytes())
        with self._lock:
            self._entries[key] = by
            self._entries.move_to_end(key)
            while len(self._entries) > self.size:
                held = Counter(o for o, _ in self._entries)
                most = max(held.values())
                # Oldest first: the first entry of an owner holding the most.
                del self._entries[next(k for k in self._entries if held[k[0]] == most)]

    def longest(self, tokens: list[int], owner: str) -> tuple[int, int, str] | None:
        """(shared prefix, evicted state's length, evicted by) of the evicted
        state of ``owner`` that shares the most leading tokens with ``tokens``."""
        with self._lock:
            entries = [(raw, by) for (o, raw), by in self._entries.items() if o == owner]
        best: tuple[int, int, str] | None = None
        for raw, by in entries:
            old = array("i")
            old.frombytes(raw)
            common = common_prefix(old.tolist(), tokens)
            if common and (best is None or common >= best[0]):
                best = (common, len(old), by)
        return best


def _norm(item: Item) -> tuple:
    """An item as the prompt sees it (ids and statuses aside)."""
    if isinstance(item, Message):
        return ("message", item.role, item.text)
    if isinstance(item, ToolCall):
        return ("call", item.call_id, item.name, item.payload)
    if isinstance(item, ToolOutput):
        return ("output", item.call_id, item.output)
    if isinstance(item, Reasoning):
        return ("reasoning", item.encrypted_content or item.text)
    return (type(item).__name__,)


def first_difference(a: list[Item], b: list[Item]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if _norm(x) != _norm(y):
            return i
    return None if len(a) <= len(b) else len(b)


def classify(state: SessionState, items: list[Item], signature: Signature) -> tuple[str, int | None]:
    """Why a prompt parts from ``state``: (reason, first differing item)."""
    old = state.signature
    if old is not None:
        if old.tools != signature.tools:
            return ("tools_reordered" if sorted(old.tools) == sorted(signature.tools) else "tools_changed"), None
        if old.system != signature.system:
            same = NONCE.sub("cch=", old.system) == NONCE.sub("cch=", signature.system)
            return ("system_nonce" if same else "system_changed"), None
    if not state.items:
        return "messages_changed", None
    i = first_difference(state.items, items)
    if i is None:
        return "messages_changed", None
    if isinstance(state.items[i], Reasoning) and not (i < len(items) and isinstance(items[i], Reasoning)):
        return "reasoning_stripped", i
    return "messages_changed", i
