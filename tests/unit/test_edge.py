"""The HTTP edge under uvicorn as lmspd configures it: a header flood is a
431 in the dialect's shape, and a 500 leaves the connection usable."""

from __future__ import annotations

import socket
from urllib.parse import urlparse

import httpx
import pytest

from lmspd.core.limits import DEFAULT_LIMITS
from lmspd.store.sqlite import SQLiteStore
from support.inprocess import ThreadedServer, make_app


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
