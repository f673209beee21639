"""Several provider URLs behind one model: the endpoints and their health.

Which endpoint takes a request is routing.py's choice; this module keeps
what it chooses from: per endpoint, the requests in flight and whether it
is up. Health is learnt two ways: a refused connection, or a stream whose
connection drops midway (engine.py), marks an endpoint down at once (with a
growing back-off before it is tried again), and with more than one
endpoint a background probe (``GET <base>/models``, see client.py) brings
endpoints back, or takes them out, between requests.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

__all__ = ["Endpoint", "EndpointPool", "join_url", "normalize_base_url", "redact_url"]

_MAX_BACKOFF_S = 30.0


def redact_url(url: str) -> str:
    """The URL without user info, query or fragment: safe for logs and stats."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def normalize_base_url(url: str) -> str:
    """``http://host:8000/v1`` (also accepted: the same with
    ``/chat/completions`` at the end). A query, such as Azure's
    ``?api-version=``, is kept: ``join_url`` puts it after every path."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"upstream URL {redact_url(url)!r} must be an http(s) URL such as http://127.0.0.1:8000/v1")
    if parts.username is not None or parts.password is not None:
        # Credentials in a URL end up in logs and process listings.
        raise ValueError("put the provider key in LMSPD_UPSTREAM_API_KEY or `lmspd config set-key`, not in the URL")
    path = parts.path.rstrip("/")
    if path.endswith("/chat/completions"):
        path = path[: -len("/chat/completions")]
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def join_url(base_url: str, path: str) -> str:
    """``path`` under the base URL, before its query: ``http://h/v1?v=1``
    and ``/models`` make ``http://h/v1/models?v=1``."""
    parts = urlsplit(base_url)
    return urlunsplit((parts.scheme, parts.netloc, parts.path + path, parts.query, ""))


@dataclass
class Endpoint:
    index: int
    base_url: str
    outstanding: int = 0
    healthy: bool = True
    failures: int = 0
    retry_at: float = 0.0
    requests: int = 0
    # Times it went down: whatever it had cached before is gone.
    epoch: int = 0

    @property
    def label(self) -> str:
        return redact_url(self.base_url)

    def url(self, path: str) -> str:
        return join_url(self.base_url, path)

    def snapshot(self) -> dict[str, object]:
        return {
            "url": self.label,
            "healthy": self.healthy,
            "outstanding": self.outstanding,
            "requests": self.requests,
            "failures": self.failures,
        }


class EndpointPool:
    def __init__(self, urls: Iterable[str], *, clock: Callable[[], float] = time.monotonic) -> None:
        self.endpoints = [Endpoint(i, normalize_base_url(u)) for i, u in enumerate(urls)]
        if not self.endpoints:
            raise ValueError("an upstream model needs at least one URL")
        self._clock = clock

    def live(self, exclude: Iterable[int] = ()) -> list[Endpoint]:
        """The endpoints a request may go to now, leaving out ``exclude``
        (those it already tried); empty when all were tried."""
        excluded = set(exclude)
        candidates = [e for e in self.endpoints if e.index not in excluded]
        now = self._clock()
        # A down endpoint is tried again once its back-off has passed; if
        # every one is down, trying beats refusing (one may be back).
        return [e for e in candidates if e.healthy or now >= e.retry_at] or candidates

    def mark_down(self, endpoint: Endpoint) -> None:
        if endpoint.healthy:
            endpoint.epoch += 1
        endpoint.healthy = False
        endpoint.failures += 1
        endpoint.retry_at = self._clock() + min(_MAX_BACKOFF_S, 0.5 * 2 ** min(endpoint.failures, 8))

    def mark_up(self, endpoint: Endpoint) -> None:
        endpoint.healthy = True
        endpoint.failures = 0
        endpoint.retry_at = 0.0

    def snapshot(self) -> list[dict[str, object]]:
        return [e.snapshot() for e in self.endpoints]
