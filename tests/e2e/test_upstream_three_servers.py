"""Cache-affinity routing end to end: three real llama.cpp servers
(xllamacpp's llama-server, the bundled GGUF, one slot each) behind one
lmspd, agent sessions of every kind lmspd can route on:

    ada     Responses, stateless replay with ``prompt_cache_key``  -> route=session
    bob     Responses, ``previous_response_id`` chain (stored)     -> route=affinity
    cyd     Chat Completions, stateless replay, no key at all      -> route=prefix

Three sessions x six turns, each round's three turns sent at once. Every
turn from the second on must land on its session's endpoint, and that
endpoint must report a prefix-cache hit (llama-server's
``prompt_tokens_details.cached_tokens``, relayed by lmspd). After round
three one endpoint is killed (SIGKILL) in the middle of a stream: that
stream ends with ``response.failed`` at once, the session moves once (the
log says so) and stays where it moved, the others keep their endpoint,
and no request hangs.

Which endpoint served a response is read from lmspd's own log line
(``upstream … via URL: stop … response=ID``).
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from support.server import ServerProcess

pytest.importorskip("xllamacpp")

from support.llama_server import LlamaServer  # noqa: E402

MODEL = "smol-pool"
TURNS = 6
KILL_AFTER = 3
SERVED = re.compile(r"upstream \S+ via (\S+): \w+ in [\d.]+ ms response=(\S+)")


@pytest.fixture(scope="module")
def llama_servers(tmp_path_factory):
    servers = []
    try:
        for i in range(3):
            servers.append(LlamaServer(tmp_path_factory.mktemp(f"llama-{i}")).start())
        yield servers
    finally:
        for s in servers:
            s.stop()


@pytest.fixture(scope="module")
def pool_lmspd(llama_servers, tmp_path_factory):
    config = tmp_path_factory.mktemp("cfg") / "models.toml"
    urls = ", ".join(f'"{s.url}"' for s in llama_servers)
    config.write_text(f"""
[models.{MODEL}]
engine = "upstream"
urls = [{urls}]
upstream_model = "smol"
context_window = 2048
health_interval_s = 1
""")
    srv = ServerProcess("--config", str(config)).start(timeout=60)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(pool_lmspd):
    # Every request is bounded: a hang fails the test instead of stalling it.
    with httpx.Client(base_url=pool_lmspd.url, timeout=60) as client:
        yield client


def served_by(srv: ServerProcess, response_id: str) -> str:
    """The endpoint lmspd's log names for ``response_id`` (logged as the
    stream ends, which may be just after the client has its reply)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for line in srv.output:
            m = SERVED.search(line)
            if m and m.group(2) == response_id:
                return m.group(1)
        time.sleep(0.05)
    raise AssertionError(f"no log line for {response_id}:\n" + srv.log()[-3000:])


def routing(srv: ServerProcess) -> dict:
    return srv.health()["models"][MODEL]["routing"]


class Session:
    """One agent: a distinct system prompt, a short question per turn."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.system = (f"You are {name.capitalize()}, a terse assistant on the {name} project. "
                       f"Answer every question about the {name} project in five words or fewer.")
        self.history: list[dict] = []
        self.previous: str | None = None

    def question(self, turn: int) -> str:
        return f"{self.name} question {turn}: name one colour."

    def send(self, http: httpx.Client, turn: int) -> tuple[str, int, int]:
        """One turn: (response id, input tokens, cached tokens)."""
        raise NotImplementedError


class KeyedReplay(Session):
    def send(self, http, turn):
        self.history.append({"role": "user", "content": self.question(turn)})
        body = {"model": MODEL, "instructions": self.system, "input": self.history, "store": False,
                "prompt_cache_key": f"agent-{self.name}", "max_output_tokens": 6, "temperature": 0}
        r = http.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        self.history.append({"role": "assistant", "content": data["output_text"] if "output_text" in data
                             else "".join(c["text"] for o in data["output"] for c in o.get("content", []))})
        usage = data["usage"]
        return data["id"], usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]


class Chained(Session):
    def send(self, http, turn):
        body = {"model": MODEL, "instructions": self.system, "input": self.question(turn),
                "previous_response_id": self.previous, "max_output_tokens": 6, "temperature": 0}
        r = http.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        self.previous = data["id"]
        usage = data["usage"]
        return data["id"], usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]


    def interrupted(self, http, kill) -> tuple[str, float]:
        """A long streamed answer whose endpoint is killed at its first
        delta: (the terminal event, seconds from the kill to it)."""
        body = {"model": MODEL, "instructions": self.system, "previous_response_id": self.previous,
                "input": "Tell me a long story about the project, in many sentences.",
                "max_output_tokens": 200, "temperature": 0, "stream": True}
        killed_at = None
        with http.stream("POST", "/v1/responses", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                kind = json.loads(line[6:])["type"]
                if kind == "response.output_text.delta" and killed_at is None:
                    kill()
                    killed_at = time.monotonic()
                if kind in ("response.completed", "response.failed", "response.incomplete"):
                    return kind, time.monotonic() - (killed_at or time.monotonic())
        raise AssertionError("the stream ended without a terminal event")


class ChatReplay(Session):
    def send(self, http, turn):
        if not self.history:
            self.history.append({"role": "system", "content": self.system})
        self.history.append({"role": "user", "content": self.question(turn)})
        body = {"model": MODEL, "messages": self.history, "max_tokens": 6, "temperature": 0}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        self.history.append({"role": "assistant", "content": data["choices"][0]["message"]["content"] or ""})
        usage = data["usage"]
        return data["id"], usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def test_a_claude_code_session_header_pins_the_session(pool_lmspd, http):
    before = routing(pool_lmspd)["routes"]["session"]
    served = []
    for text in ("Say yes.", "Now, in a completely different direction: what is two plus two?"):
        r = http.post("/v1/messages", headers={"x-claude-code-session-id": "cc-0f3a"},
                      json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": text}]})
        assert r.status_code == 200, r.text
        served.append(served_by(pool_lmspd, r.json()["id"]))
    assert served[0] == served[1]
    # The second request shares no prefix with the first: only the header explains it.
    assert routing(pool_lmspd)["routes"]["session"] == before + 1


def test_three_agent_sessions_keep_their_endpoints_and_one_moves_once(pool_lmspd, http, llama_servers):
    sessions = [KeyedReplay("ada"), Chained("bob"), ChatReplay("cyd")]
    start = routing(pool_lmspd)
    homes: dict[str, str] = {}
    moved: dict[str, str] = {}
    killed: str | None = None
    kill_mark = 0
    records = []
    with ThreadPoolExecutor(len(sessions)) as pool:
        for turn in range(1, TURNS + 1):
            if turn == KILL_AFTER + 1:
                # bob's endpoint dies in the middle of one of its streams.
                killed = homes["bob"]
                server = next(s for s in llama_servers if s.url == killed)
                ended, after = sessions[1].interrupted(http, server.kill)
                assert ended == "response.failed" and after < 15, (ended, after)
                kill_mark = len(pool_lmspd.output)
            started = time.monotonic()
            results = list(pool.map(lambda s, turn=turn: s.send(http, turn), sessions))
            assert time.monotonic() - started < 60, "a round took too long"
            for session, (response_id, input_tokens, cached) in zip(sessions, results, strict=False):
                endpoint = served_by(pool_lmspd, response_id)
                records.append((session.name, turn, endpoint, input_tokens, cached))
                if turn == 1:
                    homes[session.name] = endpoint
                    continue
                expected = moved.get(session.name, homes[session.name])
                if endpoint != expected:
                    # Only the killed endpoint's session may move, and only once.
                    assert expected == killed and session.name not in moved, records
                    moved[session.name] = endpoint
                    assert cached < input_tokens // 2, "a move re-prefills (the new endpoint never saw it)"
                    continue
                assert cached >= input_tokens // 2, f"no prefix-cache hit: {records}"
            if turn == 1:
                assert len(set(homes.values())) == 3, f"three sessions, three endpoints: {homes}"

    assert list(moved) == ["bob"] and moved["bob"] != killed
    assert all(r[2] == homes[r[0]] for r in records if r[0] != "bob"), "the others kept their endpoint"
    log = pool_lmspd.log()
    assert f"upstream {killed} dropped a stream: marked down" in log
    assert log.count(f"moved_from={killed} reason=endpoint-down") == 1, log[-4000:]
    # The dropped stream took its endpoint out: nothing was routed there again.
    assert not [line for line in pool_lmspd.output[kill_mark:] if f"endpoint={killed} " in line and "route=" in line]
    end = routing(pool_lmspd)
    delta = {k: end["routes"][k] - start["routes"][k] for k in end["routes"]}
    # Turns 2..6: ada by its key, bob by its chain (but the turn that moved),
    # cyd by its prefix; the first turns and the move by load.
    assert delta["session"] == TURNS - 1 and delta["prefix"] == TURNS - 1
    assert delta["least-loaded"] == 3 + 1
    # (bob's interrupted turn was routed by affinity too.)
    assert delta["affinity"] == TURNS - 2 + 1
    assert end["moved"] - start["moved"] == 1
