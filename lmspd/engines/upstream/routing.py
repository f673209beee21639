"""Which endpoint serves a request: the one whose prefix cache already holds it.

A provider's prefix cache (vLLM, SGLang, llama.cpp's server) only helps a
follow-up turn that lands on the endpoint that served the turn before; one
that lands elsewhere prefills the whole history again. With the
``affinity`` policy (the default) each request is routed by, in order:

    affinity      the endpoint that served the response it continues
                  (``previous_response_id``, or the last turn of its
                  ``conversation``): a bounded map response id -> endpoint
    session       the endpoint its session key is pinned to (the
                  Conversation's ``prompt_cache_key``, or the run's
                  ``RunContext.session_key``: a client's session header,
                  see lmspd/dialects/session.py);
                  a new key is pinned where its first request goes
    prefix        the endpoint whose prompts routed so far share the longest
                  prefix with this one (an approximate prefix tree per
                  endpoint, see ``PrefixIndex``), when this prompt extends
                  a whole prompt routed there (the next turn of a stateless
                  replay), or the shared prefix is at least
                  ``prefix_threshold`` of the prompt (a fork, an edit)
    least-loaded  fewest requests in flight; ties go to the endpoint with
                  the fewest pinned sessions, then in turn

Always bounded by load: an endpoint chosen by preference (the first three)
that has ``affinity_slack`` or more requests in flight beyond the least
loaded live endpoint sheds this request to the least loaded one (logged as
``shed_from``); a pinned session stays pinned (the overload is taken to
pass), a new one is pinned where it went.

Failover: a request whose pinned endpoint is down (a refused connection, a
stream dropped midway or a failed health check, see pool.py) moves to the
next choice, once: the pin follows
it, so the session stays on its new endpoint even when the old one returns.
The log line says ``moved_from=…``.

Every decision is one log line on ``lmspd.upstream.routing``::

    route=session endpoint=http://10.0.0.2:8000/v1 matched=0 model=qwen

(``matched``: prompt bytes the prefix index matched) and one count in
``stats()``. The ``round-robin`` and ``least-loaded`` policies ignore all of
the above (kept for comparison: ``bench/routing.py``).

State is per lmspd process and bounded: ``max_pins`` entries per map (least
recently used go first), ``prefix_blocks`` blocks per endpoint's index.

Owners: every pin and every indexed block belongs to the credential whose
request left it (``RouteRequest.owner``, the run's owner): a session pin
and a continuation anchor are keyed by (owner, key), and a prompt's block
chain is seeded by its owner as well as its tools, so another owner's
identical prompt hashes to other blocks and never matches. Without that, a
key could learn another key's prompts by where its own requests go (a
guessed system prompt routed ``prefix`` to the endpoint that holds it, one
word off routed elsewhere; ``prompt_cache_key="team-42"`` following another
key's session), and then read the provider's ``cached_tokens`` (relayed in
usage) as an oracle. The provider's own prefix cache is shared across keys
by its nature -- lmspd cannot keep a provider from caching -- but lmspd must
not steer one owner's requests by another owner's history. What all owners
do share is load: requests in flight and how many sessions an endpoint
holds (tie-breaks among equally loaded endpoints), which says nothing of
any prompt. The owners share the same bounded maps and indexes (one LRU
for all; no structure per owner), so the bounds above are unchanged.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from lmspd.core.run import LOCAL

from .pool import Endpoint, EndpointPool

__all__ = ["POLICIES", "Decision", "PrefixIndex", "RouteRequest", "Router", "RoutingSettings"]

log = logging.getLogger("lmspd.upstream.routing")

POLICIES = ("affinity", "least-loaded", "round-robin")
ROUTES = ("affinity", "session", "prefix", "least-loaded", "round-robin")


@dataclass(frozen=True)
class RoutingSettings:
    policy: str = "affinity"
    # An endpoint this many requests in flight above the least loaded one
    # takes no request routed by preference.
    affinity_slack: int = 4
    # The share of a prompt (bytes) that must match an endpoint's index.
    prefix_threshold: float = 0.5
    # Prompt bytes per index block: the match granularity.
    prefix_block_bytes: int = 128
    # Blocks kept per endpoint (128 B each: 64 Ki blocks index 8 MiB of
    # prompts in about 7 MiB of memory).
    prefix_blocks: int = 65536
    # Only the first this many bytes of a prompt are indexed: the hashing
    # runs on the event loop, so its cost is bounded whatever the prompt
    # (2048 blocks: about a millisecond). Two turns of one conversation
    # longer than this still match (the same capped chain), two forks that
    # share it do not differ.
    prefix_max_bytes: int = 256 << 10
    # Entries per pin map (response/conversation ids; session keys).
    max_pins: int = 100_000

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r}; one of: {', '.join(POLICIES)}")
        if self.affinity_slack < 1 or self.max_pins < 1 or self.prefix_blocks < 1 or self.prefix_block_bytes < 1:
            raise ValueError("affinity_slack, max_pins, prefix_blocks and prefix_block_bytes must be >= 1")
        if not 0.0 < self.prefix_threshold <= 1.0:
            raise ValueError("prefix_threshold must be in (0, 1]")


@dataclass
class RouteRequest:
    """What a request offers the router; nothing here names a dialect."""

    # The request's messages as the provider gets them (JSON, without the
    # closing bracket): two turns of one conversation share a byte prefix
    # as long as their prompts do.
    prompt: bytes | memoryview
    # What the prompt is rendered after (a hash of the tools).
    seed: int = 0
    # Ids whose endpoint this request continues: ``resp:…``, ``conv:…``.
    continues: tuple[str, ...] = ()
    session: str | None = None
    # The credential's owner the request runs for: the pins it matches and
    # leaves, and its prompt's blocks, are this owner's alone.
    owner: str = LOCAL.owner
    # The prompt's block chain, hashed once for choosing and learning.
    chain: list[int] | None = field(default=None, repr=False, compare=False)


@dataclass
class Decision:
    route: str
    endpoint: Endpoint
    matched: int = 0
    moved_from: Endpoint | None = None
    shed_from: Endpoint | None = None

    def describe(self, model: str) -> str:
        line = f"route={self.route} endpoint={self.endpoint.label} matched={self.matched} model={model}"
        if self.moved_from is not None:
            line += f" moved_from={self.moved_from.label} reason=endpoint-down"
        if self.shed_from is not None:
            line += f" shed_from={self.shed_from.label} reason=load"
        return line


K = TypeVar("K", bound=Hashable)


class PinMap(Generic[K]):
    """A bounded LRU map key -> endpoint index, counting keys per endpoint."""

    def __init__(self, limit: int, endpoints: int) -> None:
        self._limit = limit
        self._map: OrderedDict[K, int] = OrderedDict()
        self.counts = [0] * endpoints

    def get(self, key: K) -> int | None:
        index = self._map.get(key)
        if index is not None:
            self._map.move_to_end(key)
        return index

    def __contains__(self, key: object) -> bool:
        return key in self._map

    def set(self, key: K, index: int) -> None:
        old = self._map.get(key)
        if old is not None:
            self.counts[old] -= 1
        self._map[key] = index
        self._map.move_to_end(key)
        self.counts[index] += 1
        while len(self._map) > self._limit:
            _, evicted = self._map.popitem(last=False)
            self.counts[evicted] -= 1

    def __len__(self) -> int:
        return len(self._map)


class PrefixIndex:
    """An approximate prefix tree of the prompts routed to one endpoint.

    A prompt is cut into fixed-size blocks; block *i* is identified by a hash
    chained over blocks 0..i, so a set of chain hashes is a radix tree whose
    edges are blocks (vLLM's and SGLang's routers index the same way, by
    block hash and by characters). Matching walks the chain until a hash is
    missing: the matched length is exact up to block granularity and hash
    collisions (64-bit, in-process). Bounded by LRU over blocks; a path is
    refreshed leaf first, so a parent is never older than its children and
    eviction trims branches from their ends.
    """

    def __init__(self, max_blocks: int) -> None:
        self._max = max_blocks
        # Chain hash -> whether an inserted prompt ended at this block.
        self._blocks: OrderedDict[int, bool] = OrderedDict()
        self.epoch = 0

    def match(self, chain: Sequence[int]) -> tuple[int, bool]:
        """How many leading blocks of ``chain`` are in the index, and whether
        an inserted prompt ended at the last of them (``chain`` extends it)."""
        blocks = self._blocks
        n, end = 0, False
        for h in chain:
            flag = blocks.get(h)
            if flag is None:
                break
            n, end = n + 1, flag
        return n, end

    def insert(self, chain: Sequence[int]) -> None:
        if not chain:
            return
        blocks = self._blocks
        blocks[chain[-1]] = True
        blocks.move_to_end(chain[-1])
        for h in reversed(chain[:-1]):
            blocks[h] = blocks.get(h, False)
            blocks.move_to_end(h)
        while len(blocks) > self._max:
            blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()

    def __len__(self) -> int:
        return len(self._blocks)


def block_chain(prompt: bytes | memoryview, block: int, limit: int, seed: int = 0) -> list[int]:
    """The chained hashes of the prompt's whole blocks (a partial last block
    is left out: only whole blocks are compared)."""
    view = memoryview(prompt)[: min(len(prompt), limit)]
    chain: list[int] = []
    h = seed
    for start in range(0, len(view) - block + 1, block):
        h = hash((h, bytes(view[start:start + block])))
        chain.append(h)
    return chain


@dataclass
class _Counters:
    routes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ROUTES, 0))
    moved: int = 0
    shed: int = 0


class Router:
    def __init__(self, pool: EndpointPool, settings: RoutingSettings = RoutingSettings(), *, model: str = "") -> None:
        self.pool = pool
        self.settings = settings
        self._model = model
        n = len(pool.endpoints)
        # Keyed by (owner, anchor) and (owner, session key): see "Owners" above.
        self._continuations: PinMap[tuple[str, str]] = PinMap(settings.max_pins, n)
        self._sessions: PinMap[tuple[str, str]] = PinMap(settings.max_pins, n)
        self._indexes = [PrefixIndex(settings.prefix_blocks) for _ in range(n)]
        self._turn = itertools.count()
        self._counters = _Counters()

    # -- choosing ---------------------------------------------------------------------

    def choose(self, request: RouteRequest, exclude: Iterable[int] = ()) -> Decision | None:
        """The endpoint for ``request``, or None when every one was tried.
        Logs and counts the decision."""
        decision = self._decide(request, set(exclude))
        if decision is not None:
            counters = self._counters
            counters.routes[decision.route] += 1
            counters.moved += decision.moved_from is not None
            counters.shed += decision.shed_from is not None
            log.info("%s", decision.describe(self._model))
        return decision

    def _decide(self, request: RouteRequest, excluded: set[int]) -> Decision | None:
        live = self.pool.live(excluded)
        if not live:
            return None
        policy = self.settings.policy
        if policy == "round-robin":
            return Decision("round-robin", live[next(self._turn) % len(live)])
        if policy == "least-loaded":
            least = min(e.outstanding for e in live)
            tied = [e for e in live if e.outstanding == least]
            return Decision("least-loaded", tied[next(self._turn) % len(tied)])

        moved_from: Endpoint | None = None
        owner = request.owner
        pinned: list[tuple[str, int | None]] = [("affinity", self._continuation(owner, k)) for k in request.continues]
        if request.session is not None:
            pinned.append(("session", self._sessions.get((owner, request.session))))
        for route, index in pinned:
            if index is None:
                continue
            endpoint = self.pool.endpoints[index]
            if endpoint.healthy and index not in excluded:
                return self._bounded(Decision(route, endpoint, moved_from=moved_from), live)
            # Its endpoint is gone: a later pin may still hold the session,
            # else the request goes wherever a new one would.
            moved_from = moved_from or endpoint

        decision = self._by_prefix(request, live) or Decision("least-loaded", self._least_loaded(live))
        decision.moved_from = moved_from
        return self._bounded(decision, live) if decision.route == "prefix" else decision

    def _continuation(self, owner: str, anchor: str) -> int | None:
        return self._continuations.get((owner, anchor))

    def _by_prefix(self, request: RouteRequest, live: list[Endpoint]) -> Decision | None:
        s = self.settings
        considered = min(len(request.prompt), s.prefix_max_bytes)
        if considered < s.prefix_block_bytes:
            return None
        chain = self._chain(request)
        best: tuple[int, bool, int] = (0, False, 0)  # (blocks matched, extends a prompt, -outstanding)
        chosen: Endpoint | None = None
        for endpoint in live:
            blocks, extends = self._index(endpoint).match(chain)
            key = (blocks, extends, -endpoint.outstanding)
            if blocks and key > best:
                best, chosen = key, endpoint
        matched = best[0] * s.prefix_block_bytes
        if chosen is None or not (best[1] or matched >= s.prefix_threshold * considered):
            return None
        return Decision("prefix", chosen, matched=matched)

    def _least_loaded(self, live: list[Endpoint]) -> Endpoint:
        turn = next(self._turn)
        counts = self._sessions.counts
        return min(live, key=lambda e: (e.outstanding, counts[e.index], (e.index - turn) % len(self.pool.endpoints)))

    def _bounded(self, decision: Decision, live: list[Endpoint]) -> Decision:
        least = self._least_loaded(live)
        if decision.endpoint.outstanding < least.outstanding + self.settings.affinity_slack:
            return decision
        return Decision("least-loaded", least, moved_from=decision.moved_from, shed_from=decision.endpoint)

    def _index(self, endpoint: Endpoint) -> PrefixIndex:
        index = self._indexes[endpoint.index]
        if index.epoch != endpoint.epoch:
            # The endpoint went down since: whatever it cached is gone.
            index.clear()
            index.epoch = endpoint.epoch
        return index

    # -- learning -----------------------------------------------------------------------

    def served(self, request: RouteRequest, decision: Decision) -> None:
        """The endpoint accepted the request: pin its session and the ids it
        continues there, and index its prompt. A shed request leaves an
        existing pin where it was."""
        if self.settings.policy != "affinity":
            return
        index = decision.endpoint.index
        keep = decision.shed_from is not None
        owner = request.owner
        pins = self._continuations
        for key in request.continues:
            if not (keep and (owner, key) in pins):
                pins.set((owner, key), index)
        if request.session is not None:
            session = (owner, request.session)
            if not (keep and session in self._sessions):
                self._sessions.set(session, index)
        self._index(decision.endpoint).insert(self._chain(request))

    def _chain(self, request: RouteRequest) -> list[int]:
        if request.chain is None:
            s = self.settings
            # Seeded by the owner as well as the tools: one owner's blocks
            # never match another's prompt (see "Owners" above).
            seed = hash((request.owner, request.seed))
            request.chain = block_chain(request.prompt, s.prefix_block_bytes, s.prefix_max_bytes, seed)
        return request.chain

    def remember(self, response_id: str, endpoint: Endpoint, owner: str) -> None:
        """The response ``response_id`` of ``owner`` was generated at ``endpoint``."""
        if self.settings.policy == "affinity":
            self._continuations.set((owner, response_anchor(response_id)), endpoint.index)

    # -- reporting ------------------------------------------------------------------------

    def stats(self) -> dict[str, object]:
        c = self._counters
        return {
            "policy": self.settings.policy,
            "routes": dict(c.routes),
            "moved": c.moved,
            "shed": c.shed,
            "pinned_ids": len(self._continuations),
            "pinned_sessions": len(self._sessions),
            "prefix_blocks": [len(i) for i in self._indexes],
        }


def response_anchor(response_id: str) -> str:
    return "resp:" + response_id


def conversation_anchor(conversation_id: str) -> str:
    return "conv:" + conversation_id
