"""What the scheduler knows of requests still being prepared: whether one
is long enough to take a decode thread away, and whether an idle scheduler
should wait a moment for one to share its first step."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Callable

from lmspd.core.conversation import Conversation


class Preparations:
    """Requests being prepared (render, tokenize, compile: CPU-bound, in the
    service's worker threads) and those just prepared, on their way to the
    scheduler, as the scheduler sees them.

    Only a long preparation takes a decode thread away (``long``): one whose
    input is big, or that has already run for ``grace_s``. The count is read
    once per step and holds for the whole step, so a few-millisecond
    preparation that happened to overlap a step's start (every turn of
    sessions that arrive together) would otherwise halve the threads of a
    whole prefill step: measured, a 242-token step took 2.8 s on one thread
    where it took 1.8 s on two.

    ``arriving``: a request the scheduler, idle, waits for briefly so that
    it shares the first step (``Scheduler._gather``), from the moment the
    service has admitted it to its submission, in three legs, each bounded
    in time (a request that never comes must not hold the others up):
    ``incoming`` (admitted, waiting for a preparing thread: sixteen requests
    released together queue behind the pool's two threads), a short
    preparation still running (``running``), then prepared and not yet
    submitted (``landed``, at most ``handoff_s``: the event loop, busy with
    the others' bodies, takes a while to submit it). A big input is waited
    for in none of them.
    """

    def __init__(self, *, grace_s: float = 0.05, big_chars: int = 1 << 18, handoff_s: float = 0.05) -> None:
        self.grace_s = grace_s
        self.big_chars = big_chars
        self.handoff_s = handoff_s
        self._lock = threading.Lock()
        # Admitted, not yet preparing (by the conversation's id): until when it is waited for.
        self._incoming: dict[int, float] = {}
        # One entry per running preparation: when it starts to count as long.
        self._long_from: dict[int, float] = {}
        # Prepared, not yet submitted (by the prepared object's id): until when it is waited for.
        self._landing: dict[int, float] = {}
        self._next = 0

    @contextmanager
    def incoming(self, conversation: Conversation) -> Iterator[None]:
        """Around a request's way from its admission to its preparation
        (the service's ``announce``): waited for from now, at most
        ``grace_s``, until ``running`` takes it over."""
        if input_chars(conversation) >= self.big_chars:
            yield
            return
        key = id(conversation)
        with self._lock:
            self._incoming[key] = time.monotonic() + self.grace_s
        try:
            yield
        finally:
            with self._lock:
                self._incoming.pop(key, None)

    @contextmanager
    def running(self, conversation: Conversation) -> Iterator[Callable[[object], None]]:
        """Around one preparation; call what it yields with the prepared
        request once it is ready."""
        now = time.monotonic()
        long_from = now if input_chars(conversation) >= self.big_chars else now + self.grace_s
        with self._lock:
            self._incoming.pop(id(conversation), None)
            key = self._next
            self._next += 1
            self._long_from[key] = long_from

        def landed(prepared: object) -> None:
            until = time.monotonic() + self.handoff_s
            with self._lock:
                for k in [k for k, t in self._landing.items() if t < until - self.handoff_s]:
                    del self._landing[k]  # never submitted (refused, client gone)
                self._landing[id(prepared)] = until

        try:
            yield landed
        finally:
            with self._lock:
                del self._long_from[key]

    def submitted(self, prepared: object) -> None:
        if self._landing:
            with self._lock:
                self._landing.pop(id(prepared), None)

    def long(self, now: float | None = None) -> int:
        if not self._long_from:
            return 0
        now = time.monotonic() if now is None else now
        with self._lock:
            return sum(1 for t in self._long_from.values() if t <= now)

    def arriving(self, now: float | None = None) -> bool:
        if not (self._incoming or self._long_from or self._landing):
            return False
        now = time.monotonic() if now is None else now
        with self._lock:
            return any(t > now for waits in (self._incoming, self._long_from, self._landing)
                       for t in waits.values())


def input_chars(conversation: Conversation) -> int:
    """A cheap size of what preparing ``conversation`` renders and tokenizes."""
    n = len(conversation.instructions or "")
    for item in conversation.items:
        for name in ("text", "payload", "output"):
            value = getattr(item, name, None)
            if isinstance(value, str):
                n += len(value)
    return n
