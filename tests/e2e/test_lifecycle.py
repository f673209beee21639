"""Scheduling and process lifecycle against real server processes: the
bounded FIFO queue, dropped clients, SIGTERM, auth."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from support.server import MODEL, ServerProcess
from support.sse import parse_frames

LONG = {"model": MODEL, "input": "Write a very long story about a dragon and a knight.", "temperature": 0,
        "max_output_tokens": 400}


def wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError("condition not reached")


class OpenStream:
    """A streaming request held open; frames are read on demand (one
    iterator for its whole life: closing an httpx line iterator closes the
    connection, which the server rightly treats as a disconnect)."""

    def __init__(self, url: str, body: dict) -> None:
        self.client = httpx.Client(timeout=60)
        self._cm = self.client.stream("POST", url + "/v1/responses", json={**body, "stream": True})
        self.response = self._cm.__enter__()
        self.status_code = self.response.status_code
        self.frames = parse_frames(self.response.iter_lines())

    def read_deltas(self, n: int) -> list[str]:
        deltas = []
        for frame in self.frames:
            if frame.data != "[DONE]" and frame.json()["type"] == "response.output_text.delta":
                deltas.append(frame.json()["delta"])
                if len(deltas) >= n:
                    break
        return deltas

    def close(self) -> None:
        self._cm.__exit__(None, None, None)
        self.client.close()


def test_client_disconnect_stops_generation(small_server):
    small_server.wait_idle()
    before = small_server.generations()
    stream = OpenStream(small_server.url, LONG)
    assert len(stream.read_deltas(3)) == 3
    stream.close()
    h = small_server.wait_idle(timeout=30)
    stats = h["models"][MODEL]
    assert stats["generations"] == before + 1
    # A few tokens after the client left (how many depends on how soon a
    # loaded machine lets the server see it go), not the 400 it asked for.
    assert stats["last_output_tokens"] <= 3 + 60, stats


def test_queue_bound_and_dropped_waiter(small_server):
    small_server.wait_idle()
    before = small_server.generations()
    a = OpenStream(small_server.url, LONG)
    a.read_deltas(1)  # A is generating
    # B waits in the queue: it gets response.created at once, then waits.
    b = OpenStream(small_server.url, {**LONG, "max_output_tokens": 5})
    assert b.status_code == 200
    wait_for(lambda: small_server.health()["models"][MODEL]["pending"] == 1)
    # C finds the queue full.
    c = httpx.post(small_server.url + "/v1/responses", json={**LONG, "max_output_tokens": 5}, timeout=30)
    assert c.status_code == 503
    assert c.json()["error"]["code"] == "server_overloaded"
    assert int(c.headers["retry-after"]) > 0
    # B's client goes away while it waits: it must never run.
    b.close()
    wait_for(lambda: small_server.health()["models"][MODEL]["pending"] == 0)
    a.close()
    small_server.wait_idle()
    assert small_server.generations() == before + 1, "the dropped waiter must not have generated"


def test_queued_request_runs_after_the_current_one(small_server):
    small_server.wait_idle()
    results = {}

    def call(name, tokens):
        r = httpx.post(small_server.url + "/v1/responses", json={**LONG, "max_output_tokens": tokens}, timeout=300)
        results[name] = (time.monotonic(), r.status_code, r.json())

    first = threading.Thread(target=call, args=("first", 40))
    first.start()
    wait_for(lambda: small_server.health()["models"][MODEL]["busy"])
    second = threading.Thread(target=call, args=("second", 4))
    second.start()
    first.join()
    second.join()
    assert results["first"][1] == results["second"][1] == 200
    assert results["first"][0] <= results["second"][0], "FIFO: the waiting request finishes second"


def test_sigterm_ends_streams_with_a_terminal_event():
    srv = ServerProcess("--ctx", "512").start()
    try:
        stream = OpenStream(srv.url, LONG)
        frames = []
        for frame in stream.frames:
            frames.append(frame)
            if frame.data != "[DONE]" and frame.json()["type"] == "response.output_text.delta":
                break
        started = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        frames.extend(stream.frames)
        stream.close()
        assert frames[-1].data == "[DONE]"
        last = frames[-2].json()
        assert last["type"] == "response.failed", last["type"]
        assert last["response"]["error"]["code"] == "server_shutting_down"
        # Stopped as asked: 0 (uvicorn raised the signal again after its clean
        # shutdown, which ended the process with -15).
        assert srv.proc.wait(timeout=15) == 0
        assert time.monotonic() - started < 15
        srv.wait_for_log("Application shutdown complete")
    finally:
        srv.stop()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_an_idle_server_cleanly(sig):
    """Ctrl-C printed a 25-line KeyboardInterrupt traceback and SIGTERM
    ended in -15: uvicorn raised the signal again after shutting down."""
    srv = ServerProcess("--ctx", "512").start()
    try:
        assert srv.terminate(sig, timeout=30) == 0, srv.log()[-3000:]
        srv.wait_for_log("Application shutdown complete")
        assert "Traceback" not in srv.log(), srv.log()[-3000:]
    finally:
        srv.stop()


def test_api_keys_and_refusal_to_listen_openly(keyed_server):
    srv = keyed_server
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2}
    before = srv.generations()
    r = httpx.post(srv.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    r = httpx.post(srv.url + "/lmsp/v1/responses", json=body, headers={"Authorization": "Bearer nope"},
                   timeout=60)
    assert r.status_code == 401 and r.json()["code"] == "unauthorized"
    assert srv.generations() == before
    for key in ("alice-key", "bob-key"):
        r = httpx.post(srv.url + "/v1/responses", json=body, headers={"Authorization": f"Bearer {key}"},
                       timeout=60)
        assert r.status_code == 200
    assert srv.generations() == before + 2
    assert "alice-key" not in srv.log() and "bob-key" not in srv.log(), "keys must never be logged"
    proc = subprocess.run([sys.executable, "-m", "lmspd", "serve", "--host", "0.0.0.0", "--port", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--api-key" in proc.stderr


def test_bad_model_path_is_a_clear_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lmspd", "serve", "--model", str(tmp_path / "nope.gguf")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "nope.gguf" in proc.stderr


def test_sigterm_to_a_launch_stops_the_server_it_started_and_the_client(tmp_path):
    """``lmspd launch`` stopped the server it had started only in a
    ``finally``, which SIGTERM's default action skips: the server (and the
    client) went on running. Now the client hears the signal too."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ran, heard = tmp_path / "ran", tmp_path / "heard"
    client = tmp_path / "client"
    client.write_text(f"#!/bin/sh\ntrap 'echo TERM > {heard}; exit 0' TERM\ntouch {ran}\n"
                      "while :; do sleep 0.1; done\n")
    client.chmod(0o755)
    launch = subprocess.Popen(
        [sys.executable, "-m", "lmspd", "launch", "claude", "--url", f"http://127.0.0.1:{port}",
         "--data-dir", str(tmp_path / "data"), "--bin", str(client)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        # Its own process group: whatever the launch leaves running is ended below, pass or fail.
        start_new_session=True)
    try:
        wait_for(ran.exists, timeout=180)  # the server started, loaded, answered; the client runs
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
        launch.send_signal(signal.SIGTERM)
        assert launch.wait(timeout=60) == 128 + signal.SIGTERM
        assert heard.read_text() == "TERM\n"

        def port_closed() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) != 0

        wait_for(port_closed, timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launch.pid, signal.SIGKILL)
        launch.wait()
        err = launch.stderr.read() if launch.stderr else ""
        if launch.stderr:
            launch.stderr.close()
    assert "Traceback" not in err, err
