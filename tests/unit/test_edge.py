"""The HTTP edge under uvicorn as lmspd configures it: a header flood is a
431 in the dialect's shape, and a 500 leaves the connection usable; heads
and bodies that stop arriving are timed out, but never a response being
sent; connections past the cap are a 503; a large body does not stall
other requests; a refusal never lands inside a response still streaming."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from urllib.parse import urlparse

import httpx
import pytest

from lmspd import bodies
from lmspd.core.limits import DEFAULT_LIMITS
from lmspd.store.sqlite import SQLiteStore
from support.inprocess import ScriptedEngine, ThreadedServer, make_app


class BrokenReads(SQLiteStore):
    """A store whose reads of one response fail like a bug would."""

    def get_response(self, owner, response_id):
        if response_id == "resp_boom":
            raise RuntimeError("simulated bug")
        return super().get_response(owner, response_id)


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    data = tmp_path_factory.mktemp("edge")
    app, store = make_app(data, store=BrokenReads(data / "lmspd.sqlite3"))
    with ThreadedServer(app) as base:
        yield base
    store.close()


FLOOD = {f"x-flood-{i}": "v" * 8000 for i in range(100)}


@pytest.mark.parametrize("path, shape", [("/v1/responses", "openai"), ("/lmsp/v1/responses", "lmsp"),
                                         ("/v1/messages", "anthropic")])
def test_a_header_flood_is_a_431_in_the_dialects_shape(url, path, shape) -> None:
    r = httpx.post(url + path, headers=FLOOD, json={}, timeout=30)
    assert r.status_code == 431, r.text
    body = r.json()
    if shape == "lmsp":
        assert r.headers["content-type"].startswith("application/problem+json")
        assert body["code"] == "headers_too_large" and body["status"] == 431
    elif shape == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    else:
        assert body["error"]["code"] == "headers_too_large"


def test_headers_just_over_the_limit_are_a_431_too(url) -> None:
    limit = DEFAULT_LIMITS.request.max_header_bytes
    r = httpx.get(url + "/v1/models", headers={"x-big": "v" * (limit + 100)}, timeout=30)
    assert r.status_code == 431 and r.json()["error"]["code"] == "headers_too_large"
    # And under the limit, the same request is served.
    assert httpx.get(url + "/v1/models", headers={"x-big": "v" * (limit - 1000)}, timeout=30).status_code == 200


def _exchange(sock: socket.socket, request: bytes) -> bytes:
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int([line.split(b":", 1)[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")][0])
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def test_after_a_500_the_connection_stays_usable(url) -> None:
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=10) as sock:
        first = _exchange(sock, b"GET /v1/responses/resp_boom HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert first.startswith(b"HTTP/1.1 500")
        assert b'"code":"server_error"' in first and b"simulated" not in first
        # The same socket answers the next request.
        second = _exchange(sock, b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert second.startswith(b"HTTP/1.1 200")


def test_a_keep_alive_client_survives_a_500(url) -> None:
    with httpx.Client(base_url=url, timeout=10) as client:
        for _ in range(3):
            r = client.get("/lmsp/v1/responses/resp_boom", headers={"LMSP-Version": "1.0"})
            assert r.status_code == 500 and r.json()["code"] == "server_error"
            assert client.get("/v1/models").status_code == 200


def _read_reply(sock: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return data


def _trickle_head(sock: socket.socket, request_line: bytes) -> bytes:
    """A head that never ends, sent a header at a time; the reply."""
    limit = DEFAULT_LIMITS.request.max_header_bytes
    sock.sendall(request_line + b"Host: localhost\r\n")
    try:
        for i in range(4 * limit // 1000):
            sock.sendall(b"x-piece-%d: %s\r\n" % (i, b"v" * 1000))
    except (BrokenPipeError, ConnectionResetError):
        pass
    return _read_reply(sock)


def test_a_head_trickled_in_small_pieces_is_refused_once_past_the_bound(url) -> None:
    # httptools keeps no bound of its own: lmspd.http11 counts what arrives
    # while the head is incomplete, read by read.
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=10) as sock:
        reply = _trickle_head(sock, b"POST /lmsp/v1/responses HTTP/1.1\r\n")
    assert reply.startswith(b"HTTP/1.1 431"), reply[:200]
    assert b'"code":"headers_too_large"' in reply and b"problem+json" in reply


def test_the_bound_applies_again_to_the_next_request_on_a_connection(url) -> None:
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=10) as sock:
        first = _exchange(sock, b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert first.startswith(b"HTTP/1.1 200")
        reply = _trickle_head(sock, b"GET /v1/models HTTP/1.1\r\n")
    assert reply.startswith(b"HTTP/1.1 431"), reply[:200]
    assert b'"code":"headers_too_large"' in reply


# -- time, connections, and what a large body costs the others ------------------------

TIMEOUT_S = 0.5
QUICK = replace(DEFAULT_LIMITS, request=replace(DEFAULT_LIMITS.request, head_timeout_s=TIMEOUT_S,
                                                body_timeout_s=TIMEOUT_S, max_connections=8))
# Twenty words 0.1 s apart: a stream four times longer than the timeouts.
WORDS = tuple(f"w{i} " for i in range(20))


@contextmanager
def _serve(data, limits=QUICK, keep_alive_s: float = TIMEOUT_S):
    app, store = make_app(data, limits=limits, engine=ScriptedEngine(WORDS, delay_s=0.1))
    server = ThreadedServer(app, limits)
    server.server.config.timeout_keep_alive = keep_alive_s  # read by each new connection
    try:
        with server as base:
            u = urlparse(base)
            yield base, (u.hostname, u.port)
    finally:
        store.close()


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    with _serve(tmp_path_factory.mktemp("quick")) as served:
        yield served


@contextmanager
def _errors_logged():
    """ERROR records of lmspd's and uvicorn's loggers (uvicorn's do not reach the root)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(logging.ERROR)
    loggers = [logging.getLogger(), logging.getLogger("uvicorn.error")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield records
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def _until_closed(sock: socket.socket, within_s: float) -> tuple[bytes, float]:
    """What the server sends until it closes the connection, and when it closed."""
    start = time.monotonic()
    sock.settimeout(within_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"still open after {within_s} s; got {data[:200]!r}")
    return data, time.monotonic() - start


def test_bodies_held_on_many_connections_share_one_bound(tmp_path) -> None:
    """A body received in part holds its bytes; past the process's bound
    for bodies in flight, another connection's body is a 503 in its
    dialect's shape and its connection closes. Once the held body goes,
    the same body is served."""
    limits = replace(QUICK, request=replace(QUICK.request, body_timeout_s=30, max_bodies_in_flight_bytes=100_000))
    body = b'{"model": "scripted", "store": false, "input": "' + b"x" * 20_000 + b'"}'
    post = (b"POST /v1/responses HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)) + body
    with _serve(tmp_path, limits) as (base, address):
        held = socket.create_connection(address)
        held.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 200000\r\n\r\n" + b'{"input": "' + b"x" * 89_989)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and bodies.IN_FLIGHT.bytes < 90_000:
            time.sleep(0.01)
        with socket.create_connection(address, timeout=10) as sock:
            sock.sendall(post)
            refused, _ = _until_closed(sock, 10)
        held.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and bodies.IN_FLIGHT.bytes:
            time.sleep(0.01)
        with socket.create_connection(address, timeout=10) as sock:
            served = _exchange(sock, post)
    assert refused.startswith(b"HTTP/1.1 503"), refused[:300]
    assert b'"code":"server_overloaded"' in refused and b"retry-after: 1" in refused.lower()
    assert served.startswith(b"HTTP/1.1 200"), served[:300]


def test_a_connection_that_sends_nothing_is_closed(quick) -> None:
    _, address = quick
    with socket.create_connection(address) as sock:
        data, after = _until_closed(sock, 10)
    assert data == b"" and after < 5


def test_a_head_that_stops_arriving_is_a_408_in_the_dialects_shape(quick) -> None:
    _, address = quick
    with socket.create_connection(address) as sock:
        sock.sendall(b"POST /lmsp/v1/responses HTTP/1.1\r\n")
        data, after = _until_closed(sock, 10)
    assert data.startswith(b"HTTP/1.1 408"), data[:200]
    assert b"application/problem+json" in data and b"did not arrive within 0.5 s" in data
    assert after < 5


def test_a_body_that_stops_arriving_is_a_408_and_the_connection_closes(quick) -> None:
    _, address = quick
    with socket.create_connection(address) as sock:
        sock.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{")
        data, after = _until_closed(sock, 10)
    assert data.startswith(b"HTTP/1.1 408"), data[:200]
    assert b"stopped arriving" in data and after < 5


def test_a_stream_longer_than_the_timeouts_is_not_cut(quick) -> None:
    base, _ = quick
    with httpx.Client(base_url=base, timeout=30) as client:
        for _ in range(2):  # and the connection serves the next one
            with client.stream("POST", "/v1/responses", json={"model": "scripted", "input": "hi", "stream": True,
                                                              "store": False}) as r:
                start = time.monotonic()
                text = "".join(r.iter_text())
            assert time.monotonic() - start > 3 * TIMEOUT_S
            assert "event: response.completed" in text and "w19" in text


def test_connections_past_the_cap_are_a_503_in_the_dialects_shape(tmp_path) -> None:
    with _serve(tmp_path, keep_alive_s=30) as (base, address):
        idle = [socket.create_connection(address) for _ in range(QUICK.request.max_connections)]
        try:
            time.sleep(0.3)  # all of them accepted
            with socket.create_connection(address) as sock:
                sock.sendall(b"GET /lmsp/v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n")
                data, after = _until_closed(sock, 10)
            assert data.startswith(b"HTTP/1.1 503"), data[:200]
            assert b"application/problem+json" in data and b"retry-after: 1" in data.lower()
            assert b'"code":"server_overloaded"' in data and after < 2
        finally:
            for sock in idle:
                sock.close()
        time.sleep(0.3)
        assert httpx.get(base + "/health", timeout=10).status_code == 200


def test_an_oversized_pipelined_head_waits_for_the_stream_before_it(quick) -> None:
    _, address = quick
    body = b'{"model":"scripted","input":"hi","stream":true,"store":false}'
    request = (b"POST /v1/responses HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % len(body)) + body
    with _errors_logged() as errors, socket.create_connection(address) as sock:
        sock.sendall(request)
        time.sleep(0.5)  # the response streams
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * 80_000)
        data, _ = _until_closed(sock, 20)
    stream, refusal = data.split(b"0\r\n\r\nHTTP/1.1 431", 1)
    assert b"event: response.completed" in stream and b"HTTP/1.1 431" not in stream
    assert b'"code":"headers_too_large"' in refusal
    assert not errors, [r.getMessage() for r in errors]


def test_a_request_httptools_cannot_frame_is_a_400_in_the_dialects_shape(quick) -> None:
    _, address = quick
    with socket.create_connection(address) as sock:
        sock.sendall(b"POST /lmsp/v1/responses HTTP/1.1\r\nHost: localhost\r\nContent-Length: 4\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
        data, _ = _until_closed(sock, 10)
    assert data.startswith(b"HTTP/1.1 400"), data[:200]
    assert b"application/problem+json" in data and b"Transfer-Encoding can't be present with Content-Length" in data


def test_a_client_that_leaves_mid_body_is_no_error(quick) -> None:
    base, address = quick
    with _errors_logged() as errors:
        with socket.create_connection(address) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\":")
            time.sleep(0.2)
        time.sleep(0.3)
        metrics = httpx.get(base + "/metrics", timeout=10).text
    assert not errors, [r.getMessage() for r in errors]
    counted = [line for line in metrics.splitlines() if line.startswith("lmspd_http_requests_total")
               and 'route="/v1/chat/completions"' in line]
    assert counted and all('status="499"' in line for line in counted), counted


@pytest.mark.alone
def test_a_large_body_does_not_stall_the_other_requests(url) -> None:
    # 2.8M empty arrays in 8 MiB: the JSON parser held the interpreter lock
    # for most of a second, in a decode thread but stalling every stream.
    body = (b'{"model":"scripted","input":[' + b",".join([b"[]"] * 2_800_000))[:8 * 1024 * 1024 - 2] + b"]}"
    latencies: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=url, timeout=30) as client:
            while not stop.is_set():
                start = time.perf_counter()
                client.get("/health")
                latencies.append(time.perf_counter() - start)
                time.sleep(0.005)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        time.sleep(0.2)
        r = httpx.post(url + "/v1/responses", content=body, headers={"content-type": "application/json"}, timeout=60)
        time.sleep(0.2)
    finally:
        stop.set()
        prober.join()
    assert max(latencies) < 0.25, f"/health took up to {max(latencies) * 1000:.0f} ms"
    assert r.status_code == 413 and "max_json_values" in r.json()["error"]["message"]


# A process out of file descriptors: its loop's server listens, then every
# descriptor is taken, so each accept fails (EMFILE) as connections arrive.
_OUT_OF_FDS = """
import asyncio, logging, os, resource, sys
from lmspd.http11 import quiet_accept_errors
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

async def main():
    quiet_accept_errors(asyncio.get_running_loop())
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    held = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.sleep(2.5)  # accepting fails, is paused a second, fails again

asyncio.run(main())
"""


def test_a_process_out_of_file_descriptors_says_so_once_without_a_traceback() -> None:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _OUT_OF_FDS], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    clients = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(8)]
    _, err = proc.communicate(timeout=30)
    for c in clients:
        c.close()
    assert proc.returncode == 0, err
    warnings = [line for line in err.splitlines() if "cannot accept connections" in line]
    assert len(warnings) == 1, err
    assert "ulimit -n is 64" in warnings[0] and "Too many open files" in warnings[0], warnings
    assert "Traceback" not in err and "out of system resource" not in err, err


# -- what a client sends after a body, and what it never reads ---------------------

TRAILERS = {
    "fields": lambda n: b"".join(b"t%d: v\r\n" % i for i in range(n, n + 2000)),
    "one endless value": lambda n: b"v" * 16000,
}


@pytest.mark.parametrize("kind", list(TRAILERS))
def test_an_endless_trailer_section_is_refused_as_a_head_would_be(url, kind) -> None:
    """A chunked body's trailer fields came after the head's bound and
    outside the body's: uvicorn appended each to the request's headers,
    with no bound and no key needed (5.6 GiB of memory for 505 MiB sent).
    They are bounded as a head is, and dropped."""
    host, port = urlparse(url).hostname, urlparse(url).port
    with socket.create_connection((host, port)) as sock:
        sock.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n" + (b"X-T: " if kind != "fields" else b""))
        sent = 0
        reply = b""
        while sent < 8 * 1024 * 1024 and not reply:  # far past the head's bound (64 KiB)
            piece = TRAILERS[kind](sent)
            sock.sendall(piece)
            sent += len(piece)
            time.sleep(0.002)
            with contextlib.suppress(BlockingIOError):
                reply = sock.recv(65536, socket.MSG_DONTWAIT)
        data, _ = _until_closed(sock, 10)
    assert sent < 1024 * 1024, f"{sent} bytes of trailers taken"
    reply += data
    assert reply.startswith(b"HTTP/1.1 431") and b'"code":"headers_too_large"' in reply, reply[:300]


def test_a_client_that_reads_nothing_of_its_responses_is_dropped(tmp_path) -> None:
    """Requests pipelined and none of their answers read: the responses'
    writes waited on full buffers and every timer waited for them, so the
    connection was held for as long as the client liked (no key needed),
    and enough of them took every connection. Dropped after
    ``write_stall_s`` without a byte read."""
    limits = replace(QUICK, request=replace(QUICK.request, write_stall_s=0.5))
    with _serve(tmp_path, limits) as (_, address):
        with socket.create_connection(address) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            # Parsed in one read, so all of them are answered, none read.
            sock.sendall(b"GET /console/console.js HTTP/1.1\r\nHost: localhost\r\n\r\n" * 3000)
            _, after = _until_closed_unread(sock, 20)
    assert after < 10


def _until_closed_unread(sock: socket.socket, within_s: float) -> tuple[None, float]:
    """When the server closed ``sock``, read nothing of: a probe byte sent
    every 0.1 s fails once it has."""
    start = time.monotonic()
    while time.monotonic() - start < within_s:
        try:
            sock.send(b"\r\n", socket.MSG_DONTWAIT)
        except (BrokenPipeError, ConnectionResetError):
            return None, time.monotonic() - start
        except BlockingIOError:
            pass
        time.sleep(0.1)
    pytest.fail(f"still connected after {within_s} s of unread responses")
