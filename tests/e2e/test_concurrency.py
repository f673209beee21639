"""Several requests at once on one model (``--parallel``): sequences decoded
in one batch, each stream valid and complete, every resident session keeps
its KV in place, a shared instructions prefix is prefilled once."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from support.server import MODEL, ServerProcess
from support.sse import parse_frames
from support.validate import validate_openai_stream

LONG = "Write a very long story about a dragon and a knight."
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the weather for a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}, "strict": True}
INSTRUCTIONS = ("You are a coding agent working in a repository. Read files before editing them, keep changes "
                "small, run the tests after every change and report what you did in one short paragraph. ") * 6


@pytest.fixture(scope="module")
def srv():
    # No repetition guard: greedy tokens depend a little on which sequences
    # share a batch, and a loop it cut would end a long stream early.
    server = ServerProcess("--ctx", "2048", "--parallel", "4", "--kv-disk-space-mb", "0",
                           "--repetition-window", "0").start()
    yield server
    server.stop()


def health(server) -> dict:
    return server.health()["models"][MODEL]


class Stream(threading.Thread):
    """A streaming /v1/responses request on its own thread, each event timed."""

    def __init__(self, server, body: dict, *, stop_after_deltas: int | None = None) -> None:
        super().__init__(daemon=True)
        self.url = server.url
        self.body = {"model": MODEL, "temperature": 0, **body, "stream": True}
        self.stop_after = stop_after_deltas
        self.events: list[dict] = []
        self.times: list[float] = []
        self.done_frames = False
        self.error: BaseException | None = None
        self.deltas = threading.Event()  # set at the first text delta

    def run(self) -> None:
        try:
            with httpx.Client(timeout=900) as client, client.stream("POST", self.url + "/v1/responses",
                                                                    json=self.body) as r:
                assert r.status_code == 200, r.read()
                n = 0
                for frame in parse_frames(r.iter_lines()):
                    if frame.data == "[DONE]":
                        self.done_frames = True
                        break
                    event = json.loads(frame.data)
                    self.events.append(event)
                    self.times.append(time.monotonic())
                    if event["type"] == "response.output_text.delta":
                        self.deltas.set()
                        n += 1
                        if self.stop_after is not None and n >= self.stop_after:
                            return  # the client goes away mid-stream
        except BaseException as exc:  # noqa: BLE001 - reported by result()
            self.error = exc
        finally:
            self.deltas.set()

    def result(self, timeout: float = 900) -> dict:
        self.join(timeout)
        assert not self.is_alive(), "stream did not end"
        if self.error is not None:
            raise self.error
        assert self.done_frames, "stream ended without [DONE]"
        return validate_openai_stream(self.events)

    def delta_times(self) -> list[float]:
        return [t for t, e in zip(self.times, self.events, strict=False) if e["type"] == "response.output_text.delta"]


def post(server, body: dict) -> dict:
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL, "temperature": 0, **body}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_two_streams_interleave_and_both_complete(srv):
    srv.wait_idle()
    a = Stream(srv, {"input": LONG, "max_output_tokens": 48})
    b = Stream(srv, {"input": "Write a long poem about the sea.", "max_output_tokens": 48})
    a.start()
    b.start()
    ra, rb = a.result(), b.result()
    for r in (ra, rb):
        assert r["status"] == "incomplete" and r["usage"]["output_tokens"] == 48
    ta, tb = a.delta_times(), b.delta_times()
    # Interleaved in time: each stream had deltas while the other was still streaming.
    assert tb[0] < ta[-1] and ta[0] < tb[-1], "one stream waited for the other"
    both = sorted([(t, "a") for t in ta] + [(t, "b") for t in tb])
    switches = sum(1 for x, y in zip(both, both[1:], strict=False) if x[1] != y[1])
    assert switches >= 10, f"deltas of the two streams barely interleave ({switches} switches)"


def test_short_request_starts_during_a_long_generation(srv):
    srv.wait_idle()
    long = Stream(srv, {"input": LONG, "max_output_tokens": 256})
    long.start()
    assert long.deltas.wait(120)
    short = Stream(srv, {"input": "Say hi.", "max_output_tokens": 4})
    short.start()
    rs = short.result()
    rl = long.result()
    # The long story may end before 256 tokens (its greedy path depends on
    # the batches it shared): what counts is that it still ran.
    assert rs["status"] in ("completed", "incomplete") and rl["usage"]["output_tokens"] > 32
    first_short = short.delta_times()[0] if short.delta_times() else short.times[-1]
    assert first_short < long.times[-1], "the short request waited for the whole long generation"
    assert short.times[-1] < long.times[-1], "the short request should finish while the long one streams"


def test_four_agent_sessions_stay_resident(srv):
    """Four sessions, three turns each, all at once: from turn 2 on, every
    turn reuses its whole prior context (nothing was evicted or restored)."""
    srv.wait_idle()
    before = health(srv)["cache"]
    histories = [[{"role": "user", "content": f"Agent {i}: list three facts about the number {i + 3}."}]
                 for i in range(4)]
    prior: list[dict | None] = [None] * 4
    failures: list[str] = []

    def session(i: int) -> None:
        for turn in range(3):
            reply = post(srv, {"input": histories[i], "max_output_tokens": 12})
            cached = reply["usage"]["input_tokens_details"]["cached_tokens"]
            if prior[i] is not None:
                p = prior[i]["usage"]
                # The state holds the prompt, every sampled token and, after
                # a natural stop, the end-of-turn token.
                expected = p["input_tokens"] + p["output_tokens"] + (prior[i]["status"] == "completed")
                if cached != expected:
                    failures.append(f"session {i} turn {turn + 1}: cached {cached}, prior context {expected}")
            prior[i] = reply
            histories[i] = histories[i] + reply["output"] + [{"role": "user", "content": "Go on."}]

    threads = [threading.Thread(target=session, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not failures, failures
    after = health(srv)["cache"]
    assert after["ram_restores"] == before["ram_restores"]
    assert after["disk_restores"] == before["disk_restores"]


def test_forced_tool_call_and_free_text_batched_together(srv):
    srv.wait_idle()
    text = Stream(srv, {"input": LONG, "max_output_tokens": 96})
    text.start()
    assert text.deltas.wait(120)
    call = Stream(srv, {"input": "What is the weather in Oslo?", "tools": [WEATHER], "tool_choice": "required",
                        "parallel_tool_calls": False})
    call.start()
    rc, rt = call.result(), text.result()
    assert call.times[-1] < text.times[-1], "the tool call should have been decoded alongside the text"
    calls = [o for o in rc["output"] if o["type"] == "function_call"]
    assert len(calls) == 1 and calls[0]["name"] == "get_weather"
    args = json.loads(calls[0]["arguments"])
    assert set(args) == {"city"} and isinstance(args["city"], str)
    message = rt["output"][-1]
    assert message["type"] == "message" and rt["usage"]["output_tokens"] == 96
    assert "<tool_call>" not in message["content"][0]["text"]


def test_a_client_that_leaves_frees_its_sequence():
    """Two sequences, both streaming; one client disconnects: the next
    request starts on the freed sequence while the other still streams."""
    # No repetition guard: greedy tokens depend a little on which sequences
    # share a batch (timing), and a loop the guard cuts would end ``keep``
    # before the next request does.
    server = ServerProcess("--ctx", "1024", "--parallel", "2", "--kv-disk-space-mb", "0",
                           "--repetition-window", "0").start()
    try:
        keep = Stream(server, {"input": LONG, "max_output_tokens": 256})
        leave = Stream(server, {"input": "Write a long essay about mountains.", "max_output_tokens": 256},
                       stop_after_deltas=3)
        keep.start()
        leave.start()
        leave.join(120)
        assert not leave.is_alive() and leave.error is None
        nxt = Stream(server, {"input": "Say hi.", "max_output_tokens": 4})
        nxt.start()
        nxt.result()
        rk = keep.result()
        assert rk["usage"]["output_tokens"] > 32
        assert nxt.times[-1] < keep.times[-1], "the next request waited for the running one"
        stats = server.wait_idle()["models"][MODEL]
        assert stats["generations"] == 3
        # A finished sequence evaluates its last token in the step after the
        # reply, so it is released up to one step after the client is done
        # (a second or more on a loaded machine).
        deadline = time.monotonic() + 30
        while any(s["busy"] for s in stats["sequences"]) and time.monotonic() < deadline:
            time.sleep(0.05)
            stats = server.health()["models"][MODEL]
        assert not any(s["busy"] for s in stats["sequences"]), stats["sequences"]
    finally:
        server.stop()


def test_four_sessions_with_the_same_instructions_prefill_them_once(srv):
    srv.wait_idle()
    before = health(srv)
    replies: list[dict] = [{}] * 4

    def run(i: int) -> None:
        replies[i] = post(srv, {"instructions": INSTRUCTIONS, "input": f"Task {i}: rename the function f{i}.",
                                "max_output_tokens": 4})

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    after = health(srv)
    prefilled = after["prefilled_tokens"] - before["prefilled_tokens"]
    inputs = [r["usage"]["input_tokens"] for r in replies]
    cached = sorted(r["usage"]["input_tokens_details"]["cached_tokens"] for r in replies)
    shared = min(inputs) - 20  # the instructions, give or take the task line
    assert after["cache"]["copies"] - before["cache"]["copies"] >= 3, after["cache"]
    assert all(c >= shared for c in cached[1:]), cached
    # Prefilled once, not four times.
    assert prefilled < sum(inputs) - 2.5 * shared, (prefilled, inputs)
