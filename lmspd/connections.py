"""How many Responses WebSocket connections may be open: in all, and per
credential. Each holds a session's pin on the KV, a remembered history and
a task; unbounded, one key could hold them all."""

from __future__ import annotations

from collections import Counter

from lmspd.core.errors import ApiError
from lmspd.core.limits import Limits


class ConnectionSlots:
    """Counted on the event loop (no lock): ``take`` at the upgrade,
    ``give_back`` when the connection ends."""

    def __init__(self, limits: Limits) -> None:
        self._total = limits.websocket_max_connections
        self._per_owner = limits.websocket_max_connections_per_owner
        self._open: Counter[str] = Counter()

    def take(self, owner: str) -> None:
        if sum(self._open.values()) >= self._total:
            raise ApiError("rate_limited", f"The server has {self._total} WebSocket connections open, its limit; "
                           "close one or retry later.", headers={"Retry-After": "5"})
        if self._open[owner] >= self._per_owner:
            raise ApiError("rate_limited", f"This credential has {self._per_owner} WebSocket connections open, "
                           "its limit; close one or retry later.", headers={"Retry-After": "5"})
        self._open[owner] += 1

    def give_back(self, owner: str) -> None:
        self._open[owner] -= 1
        if self._open[owner] <= 0:
            del self._open[owner]
