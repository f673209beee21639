"""The continuation cache's saved tiers: states kept in RAM and on disk.

A state that leaves its sequence (another request took the sequence, or the
residency kept an exact-state checkpoint of it) is captured once and kept
here: **in RAM**, under a byte budget shared fairly by the owners, the
least recently kept of those over their share first to leave; a state that
leaves RAM is written to the **disk checkpoints** (lmspd.cache.disk) by a
writer thread of its own, so the scheduler thread never waits for the disk
unless four writes are already queued. Without a disk tier a state that
leaves RAM is gone, and the eviction log
(lmspd.cache.diagnostics.EvictionLog) says why. At shutdown every
remembered state goes to disk.

The planner reads the RAM states, through their index (lmspd.cache.index),
and the disk index (lmspd.cache.planner); only the scheduler thread changes
them, and the writer thread adds to the disk.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from lmspd.core.fairness import over_share

from .diagnostics import EvictionLog
from .disk import DiskCheckpoints
from .index import RamStates
from .state import SessionState

log = logging.getLogger("lmspd.cache")


@dataclass
class CacheStats:
    ram_sessions: int = 0
    ram_bytes: int = 0
    disk_checkpoints: int = 0
    disk_writes: int = 0
    disk_restores: int = 0
    ram_restores: int = 0
    evictions: int = 0
    copies: int = 0
    copied_tokens: int = 0
    checkpoints: int = 0  # exact-state checkpoints taken (non-trimmable KV)
    checkpoint_restores: int = 0
    captures_ahead: int = 0  # states captured while the scheduler was idle (``Residency.capture_ahead``)


class Tiers:
    """The RAM states by key, least recently kept first, and the disk tier."""

    def __init__(self, stats: CacheStats, *, budget_bytes: int = 1 << 30,
                 disk: DiskCheckpoints | None = None) -> None:
        self.stats = stats
        self.budget_bytes = budget_bytes
        self.disk = disk
        # What left every tier, and why (diagnostics: ``state_evicted``).
        self.evictions = EvictionLog()
        if disk is not None and disk.on_evict is None:
            disk.on_evict = lambda tokens, owner: self.evictions.record(tokens, owner, "disk_budget")
        # By key, least recently kept first, indexed for the planner.
        self.ram = RamStates()
        self._writes: queue.Queue[SessionState | None] = queue.Queue(maxsize=4)
        self._writer: threading.Thread | None = None
        if disk is not None:
            self._writer = threading.Thread(target=self._write_loop, name="lmspd-kv-writer", daemon=True)
            self._writer.start()

    def remember(self, state: SessionState, displaced: bool = False) -> None:
        """Keep ``state`` in RAM, the least recently kept of the owners over
        their fair share of the budget (lmspd.core.fairness) leaving for
        disk when over it: a key within its share keeps its states however
        many another keeps. ``displaced``: another request took its sequence."""
        self.ram.keep(state)
        while self.ram.nbytes > self.budget_bytes and self.ram:
            old = self.ram.pop_oldest(over_share(self.ram.owner_bytes, self.budget_bytes))
            if self.disk is not None:
                self.write_behind(old)  # leaving RAM: the disk keeps it
            else:
                # Never held at all (the budget is smaller than it), it was
                # lost when the other request took its sequence.
                by = "another_session" if old is state and displaced else "ram_budget"
                self.evictions.record(old.tokens, old.owner, by)
        self.stats.ram_sessions = len(self.ram)
        self.stats.ram_bytes = self.ram.nbytes

    def room_for(self, nbytes: int) -> bool:
        """Whether a state of ``nbytes`` captured ahead of need may be kept:
        within the budget, and with a disk tier to take the states it
        pushes out of RAM, else only in the room the budget has left."""
        if nbytes > self.budget_bytes:
            return False
        return self.disk is not None or self.ram.nbytes + nbytes <= self.budget_bytes

    def forget(self, state: SessionState) -> None:
        """Drop ``state`` from RAM (if it is the one kept under its key)."""
        if self.ram.get(state.key) is state:
            self.ram.drop(state.key)
            self.stats.ram_sessions = len(self.ram)
            self.stats.ram_bytes = self.ram.nbytes

    def write_behind(self, state: SessionState) -> None:
        """Write ``state`` to disk on the writer thread."""
        if self.disk is None:
            return
        try:
            self._writes.put_nowait(state)
        except queue.Full:
            self._save(state)  # back-pressure: never drop a checkpoint silently

    def save_all(self, resident: Iterable[SessionState]) -> None:
        """At shutdown: every RAM state, then ``resident`` (the states the
        sequences hold, captured), to disk, synchronously."""
        if self.disk is None:
            return
        for state in [*self.ram.values(), *resident]:
            self._save(state)

    def flush(self) -> None:
        if self._writer is not None:
            self._writes.put(None)
            self._writer.join(timeout=30)
            self._writer = None

    def _write_loop(self) -> None:
        while True:
            state = self._writes.get()
            if state is None:
                return
            self._save(state)

    def _save(self, state: SessionState) -> None:
        assert self.disk is not None
        try:
            if self.disk.save(state) is not None:
                self.stats.disk_writes += 1
            self.stats.disk_checkpoints = len(self.disk)
        except Exception as exc:  # a failed checkpoint must never fail a generation
            log.warning("could not write KV checkpoint: %s", exc)
