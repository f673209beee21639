"""The router over scripted endpoints (no I/O): continuation, session and
prefix affinity, the load bound, failover that moves a session once, the
comparison policies, bounded memory, and one log line per decision."""

from __future__ import annotations

import logging
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmspd.engines.upstream.pool import EndpointPool
from lmspd.engines.upstream.routing import (
    PinMap,
    PrefixIndex,
    Router,
    RouteRequest,
    RoutingSettings,
    block_chain,
    conversation_anchor,
    response_anchor,
)

URLS = ["http://a:1/v1", "http://b:2/v1", "http://c:3/v1"]


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def router(policy: str = "affinity", n: int = 3, **kw) -> Router:
    return Router(EndpointPool(URLS[:n], clock=Clock()), RoutingSettings(policy=policy, **kw), model="m")


def send(r: Router, request: RouteRequest, exclude=()):
    """Route and, as the engine does once the endpoint accepted, learn."""
    decision = r.choose(request, exclude)
    assert decision is not None
    r.served(request, decision)
    return decision


def prompt(*turns: str) -> bytes:
    # Shaped like what the engine routes on: a body's messages, unclosed.
    messages = ",".join(f'{{"role":"user","content":"{t}"}}' for t in turns)
    return f'{{"model":"m","messages":[{messages}'.encode()


def session_turns(session: str, n: int) -> list[bytes]:
    turns = [f"{session} turn {i}: " + "lorem ipsum dolor sit amet " * 8 for i in range(n)]
    return [prompt(*turns[: i + 1]) for i in range(n)]


# -- the three preferences ------------------------------------------------------------


def test_new_sessions_spread_then_each_stays_on_its_endpoint():
    r = router()
    homes = {}
    for turn in range(4):
        for s in ("s1", "s2", "s3"):
            d = send(r, RouteRequest(prompt=session_turns(s, 4)[turn], session=s))
            if turn == 0:
                assert d.route == "least-loaded"
                homes[s] = d.endpoint.index
            else:
                assert (d.route, d.endpoint.index) == ("session", homes[s])
    assert sorted(homes.values()) == [0, 1, 2], "three new sessions, three endpoints"
    assert r.stats()["routes"]["session"] == 9


def test_previous_response_id_goes_where_that_response_was_made():
    r = router()
    first = send(r, RouteRequest(prompt=b"x" * 50))
    r.remember("resp_1", first.endpoint, "local")
    # Another request makes a different endpoint the least loaded choice.
    first.endpoint.outstanding = 2
    d = send(r, RouteRequest(prompt=b"y" * 50, continues=(response_anchor("resp_1"),)))
    assert (d.route, d.endpoint) == ("affinity", first.endpoint)
    # An unknown id (another instance's, or from before a restart) falls through.
    d = r.choose(RouteRequest(prompt=b"z" * 50, continues=(response_anchor("resp_unknown"),)))
    assert d.route == "least-loaded"


def test_continuation_wins_over_the_session_pin():
    r = router()
    a = send(r, RouteRequest(prompt=b"a" * 50, session="k"))
    others = [e for e in r.pool.endpoints if e is not a.endpoint]
    r.remember("resp_9", others[0], "local")
    d = r.choose(RouteRequest(prompt=b"b" * 50, continues=(response_anchor("resp_9"),), session="k"))
    assert (d.route, d.endpoint) == ("affinity", others[0])


def test_stateless_replays_follow_their_prefix():
    r = router()
    homes = {}
    for turn in range(5):
        for s in ("alpha", "beta", "gamma"):
            d = send(r, RouteRequest(prompt=session_turns(s, 5)[turn]))
            if turn == 0:
                homes[s] = d.endpoint.index
            else:
                assert (d.route, d.endpoint.index) == ("prefix", homes[s]), (s, turn)
                previous = len(session_turns(s, 5)[turn - 1])
                # Block-granular: all whole blocks of the previous prompt but its tail.
                assert previous - 2 * 128 < d.matched <= previous
    assert len(set(homes.values())) == 3


def test_a_short_shared_prefix_is_not_enough():
    r = router(prefix_threshold=0.5)
    system = "s" * 300
    send(r, RouteRequest(prompt=(system + "first user " * 10).encode()))
    # Shares 300 of its 1300 bytes with what endpoint A has seen: under half.
    d = r.choose(RouteRequest(prompt=(system + "another one " * 80).encode()))
    assert d.route == "least-loaded" and d.matched == 0
    # A prompt shorter than one block is never matched.
    assert r.choose(RouteRequest(prompt=b"tiny")).route == "least-loaded"


# -- owners ---------------------------------------------------------------------------------
# One credential's routing state never steers another's request: its route
# would otherwise say whether another key sent a prompt or uses a session key.

SECRET = "A's confidential system prompt: the merger with ACME closes on 2026-03-01. " * 20


def with_system(system: str, user: str) -> bytes:
    return (f'{{"model":"m","messages":[{{"role":"system","content":"{system}"}},'
            f'{{"role":"user","content":"{user}"}}').encode()


def test_another_owners_prompt_does_not_steer_a_request():
    def probes(first: bytes) -> tuple[list[tuple[str, int, int]], Router]:
        r = router(n=2)
        send(r, RouteRequest(prompt=first, owner="key-A"))
        guesses = (with_system(SECRET, "guess"), with_system(SECRET.replace("ACME", "EMCA"), "guess"))
        return [(d.route, d.endpoint.index, d.matched)
                for d in (r.choose(RouteRequest(prompt=g, owner="key-B")) for g in guesses)], r

    # key-B's routes are the same whether key-A sent the secret or an
    # unrelated prompt of the same size: they say nothing of key-A's prompt.
    after_secret, r = probes(with_system(SECRET, "hello"))
    after_other, _ = probes(with_system("x" * len(SECRET), "hello"))
    assert after_secret == after_other
    assert all(route == "least-loaded" and matched == 0 for route, _, matched in after_secret)
    # key-A's own next turn still follows its prefix.
    home = r.stats()["prefix_blocks"].index(max(r.stats()["prefix_blocks"]))
    d = r.choose(RouteRequest(prompt=with_system(SECRET, "hello again"), owner="key-A"))
    assert (d.route, d.endpoint.index) == ("prefix", home) and d.matched > len(SECRET)


def test_a_session_key_is_pinned_per_owner():
    r = router(n=2)
    a_home = send(r, RouteRequest(prompt=b"a" * 200, session="team-42", owner="key-A")).endpoint
    assert send(r, RouteRequest(prompt=b"a" * 300, session="team-42", owner="key-A")).route == "session"
    # key-B naming key-A's session key starts a session of its own.
    b = send(r, RouteRequest(prompt=b"b" * 200, session="team-42", owner="key-B"))
    assert b.route == "least-loaded" and b.endpoint is not a_home
    d = send(r, RouteRequest(prompt=b"b" * 300, session="team-42", owner="key-B"))
    assert (d.route, d.endpoint) == ("session", b.endpoint)
    d = send(r, RouteRequest(prompt=b"a" * 400, session="team-42", owner="key-A"))
    assert (d.route, d.endpoint) == ("session", a_home)
    assert r.stats()["pinned_sessions"] == 2


def test_continuation_anchors_are_per_owner():
    r = router()
    conv = conversation_anchor("conv_1")
    home = send(r, RouteRequest(prompt=b"c" * 50, continues=(conv,), owner="key-A")).endpoint
    r.remember("resp_a", home, "key-A")
    home.outstanding = 2  # makes another endpoint the least loaded choice
    for anchor in (conv, response_anchor("resp_a")):
        d = r.choose(RouteRequest(prompt=b"d" * 50, continues=(anchor,), owner="key-B"))
        assert d.route == "least-loaded" and d.endpoint is not home
        d = r.choose(RouteRequest(prompt=b"d" * 50, continues=(anchor,), owner="key-A"))
        assert (d.route, d.endpoint) == ("affinity", home)


# -- the load bound ---------------------------------------------------------------------


def test_a_hot_endpoint_sheds_but_keeps_its_sessions():
    r = router(affinity_slack=2)
    home = send(r, RouteRequest(prompt=b"p" * 200, session="k")).endpoint
    home.outstanding = 1
    assert r.choose(RouteRequest(prompt=b"p" * 200, session="k")).endpoint is home
    home.outstanding = 2  # two above the idle ones
    d = send(r, RouteRequest(prompt=b"p" * 300, session="k"))
    assert d.route == "least-loaded" and d.shed_from is home and d.endpoint is not home
    home.outstanding = 0
    d = r.choose(RouteRequest(prompt=b"p" * 400, session="k"))
    assert (d.route, d.endpoint) == ("session", home), "shedding one request does not move the session"
    assert r.stats()["shed"] == 1


def test_a_new_session_shed_from_a_hot_prefix_is_pinned_where_it_went():
    r = router(affinity_slack=1)
    turns = session_turns("x", 2)
    home = send(r, RouteRequest(prompt=turns[0])).endpoint
    home.outstanding = 1
    d = send(r, RouteRequest(prompt=turns[1], session="new"))
    assert d.shed_from is home
    home.outstanding = 0
    assert r.choose(RouteRequest(prompt=turns[1], session="new")).endpoint is d.endpoint


# -- failover -----------------------------------------------------------------------------


def test_a_session_whose_endpoint_died_moves_once(caplog):
    r = router()
    homes = {s: send(r, RouteRequest(prompt=b"q" * 200, session=s)).endpoint for s in ("s1", "s2", "s3")}
    dead = homes["s2"]
    r.pool.mark_down(dead)
    with caplog.at_level(logging.INFO, logger="lmspd.upstream.routing"):
        moved = send(r, RouteRequest(prompt=b"q" * 250, session="s2"))
    assert moved.moved_from is dead and moved.endpoint is not dead
    assert f"moved_from={dead.label} reason=endpoint-down" in caplog.text
    # The old endpoint comes back: the session stays where it moved.
    r.pool.mark_up(dead)
    for _ in range(3):
        d = send(r, RouteRequest(prompt=b"q" * 300, session="s2"))
        assert (d.route, d.endpoint, d.moved_from) == ("session", moved.endpoint, None)
    for s in ("s1", "s3"):
        assert r.choose(RouteRequest(prompt=b"q", session=s)).endpoint is homes[s]
    assert r.stats()["moved"] == 1


def test_an_endpoint_that_refuses_the_connection_moves_the_request():
    r = router()
    home = send(r, RouteRequest(prompt=b"w" * 200, session="k")).endpoint
    # The engine's retry: the first choice could not be reached.
    d = send(r, RouteRequest(prompt=b"w" * 200, session="k"), exclude=[home.index])
    assert d.moved_from is home and d.endpoint is not home
    assert r.choose(RouteRequest(prompt=b"w", session="k")).endpoint is d.endpoint
    every = [e.index for e in r.pool.endpoints]
    assert r.choose(RouteRequest(prompt=b"w", session="k"), every) is None


def test_a_dead_endpoint_forgets_its_prefixes():
    r = router()
    turns = session_turns("z", 3)
    home = send(r, RouteRequest(prompt=turns[0])).endpoint
    assert r.choose(RouteRequest(prompt=turns[1])).endpoint is home
    r.pool.mark_down(home)
    r.pool.mark_up(home)  # restarted: its cache is empty
    assert r.choose(RouteRequest(prompt=turns[1])).route == "least-loaded"


def test_all_down_still_tries_one():
    clock = Clock()
    r = Router(EndpointPool(URLS[:2], clock=clock), RoutingSettings())
    for e in r.pool.endpoints:
        r.pool.mark_down(e)
    assert r.choose(RouteRequest(prompt=b"")) is not None


# -- the comparison policies ----------------------------------------------------------------


def test_round_robin_and_least_loaded_ignore_sessions():
    rr = router("round-robin")
    seen = [send(rr, RouteRequest(prompt=b"r" * 300, session="k")).endpoint.index for _ in range(6)]
    assert Counter(seen) == {0: 2, 1: 2, 2: 2}
    ll = router("least-loaded")
    a, b, c = ll.pool.endpoints
    a.outstanding, b.outstanding, c.outstanding = 3, 1, 2
    assert all(send(ll, RouteRequest(prompt=b"r" * 300, session="k")).endpoint is b for _ in range(3))
    assert set(rr.stats()["routes"]) >= {"round-robin"} and rr.stats()["pinned_sessions"] == 0


def test_unknown_policy_and_bad_settings_are_refused():
    with pytest.raises(ValueError, match="unknown routing policy"):
        RoutingSettings(policy="random")
    with pytest.raises(ValueError):
        RoutingSettings(prefix_threshold=0)


# -- one log line and one count per decision ---------------------------------------------------


def test_every_decision_is_one_log_line_and_one_count(caplog):
    r = router()
    turns = session_turns("log", 2)
    with caplog.at_level(logging.INFO, logger="lmspd.upstream.routing"):
        first = send(r, RouteRequest(prompt=turns[0]))
        send(r, RouteRequest(prompt=turns[1]))
        send(r, RouteRequest(prompt=turns[1], session="k"))
        send(r, RouteRequest(prompt=turns[1], session="k"))
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "lmspd.upstream.routing"]
    assert len(lines) == 4
    assert lines[0] == f"route=least-loaded endpoint={first.endpoint.label} matched=0 model=m"
    assert lines[1].startswith(f"route=prefix endpoint={first.endpoint.label} matched=")
    assert lines[3].startswith("route=session ")
    routes = r.stats()["routes"]
    assert (routes["least-loaded"], routes["prefix"], routes["session"]) == (1, 2, 1)


# -- bounded memory -------------------------------------------------------------------------------


def test_pin_maps_are_bounded_lru_and_count_per_endpoint():
    pins = PinMap(limit=3, endpoints=2)
    for key, index in (("a", 0), ("b", 1), ("c", 0)):
        pins.set(key, index)
    assert pins.get("a") == 0  # now the most recent
    pins.set("d", 1)
    assert "b" not in pins and len(pins) == 3
    assert pins.counts == [2, 1]
    pins.set("a", 1)
    assert pins.counts == [1, 2]


def test_prefix_index_is_bounded_and_trims_branches_from_their_ends():
    index = PrefixIndex(max_blocks=8)
    first = block_chain(b"a" * 128 * 6, 128, 1 << 20)
    index.insert(first)
    second = block_chain(b"b" * 128 * 6, 128, 1 << 20)
    index.insert(second)
    assert len(index) == 8
    assert index.match(second) == (6, True)
    # The older path lost its leaves, not its root.
    assert index.match(first) == (2, False)


def test_only_the_first_prefix_max_bytes_are_indexed():
    r = router(prefix_max_bytes=1024)
    big = b"k" * 100_000
    send(r, RouteRequest(prompt=big))
    assert sorted(r.stats()["prefix_blocks"]) == [0, 0, 8]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=40), min_size=1, max_size=6), st.binary(max_size=60))
def test_prefix_match_is_the_longest_block_prefix_of_what_was_inserted(inserted, query):
    block = 4
    index = PrefixIndex(max_blocks=10_000)
    for p in inserted:
        index.insert(block_chain(p, block, 1 << 20))

    def common(a: bytes, b: bytes) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    whole = lambda p: len(p) // block * block  # noqa: E731 - only whole blocks are indexed
    expected = max(min(common(query, p), whole(p), whole(query)) // block for p in inserted)
    assert index.match(block_chain(query, block, 1 << 20))[0] == expected


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10,
)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=10), st.lists(st.dictionaries(st.text(max_size=8), json_values, max_size=3), max_size=4),
       st.one_of(st.none(), st.lists(json_values, max_size=3)),
       st.dictionaries(st.sampled_from(["temperature", "stream", "max_tokens", "tool_choice"]), json_values))
def test_the_body_encoded_in_pieces_is_the_plain_encoding(model, messages, tools, rest):
    from lmspd.engines.upstream.engine import _dumps, _encode_body

    body = {"model": model, "messages": messages, **({"tools": tools} if tools is not None else {}), **rest}
    encoded, messages_end, tools_json = _encode_body(body)
    assert encoded == _dumps(body).encode("utf-8")
    head = _dumps({"model": model, "messages": messages})
    assert encoded[:messages_end] == head[:-2].encode("utf-8"), "the messages, without the closing bracket"
    assert tools_json == (_dumps(tools).encode("utf-8") if tools is not None else b"")
