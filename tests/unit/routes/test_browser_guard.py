"""A browser is not a client (lmspd.origins), through the whole app in
process: a foreign ``Origin`` is a 403 on a WebSocket upgrade and on HTTP,
a foreign ``Host`` is a 421 when bound to loopback, each in its dialect's
shape; loopback names and addresses, the server's own origin and the
origins --allowed-origins names are served."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient, WebSocketDenialResponse

from lmspd.origins import split_origins
from support.inprocess import MODEL, serving

CREATE = json.dumps({"type": "response.create", "model": MODEL, "input": "hi"})


def ws_turn(http: TestClient, headers: dict[str, str]) -> str:
    # TestClient names its WebSocket host "testserver" unless told the URL.
    url = str(http.base_url).replace("http://", "ws://", 1).rstrip("/") + "/v1/responses"
    with http.websocket_connect(url, headers=headers) as ws:
        ws.send_text(CREATE)
        while True:
            event = json.loads(ws.receive_text())
            if event["type"] in ("response.completed", "response.failed", "error"):
                return str(event["type"])


def ws_denied(http: TestClient, headers: dict[str, str]) -> WebSocketDenialResponse:
    with pytest.raises(WebSocketDenialResponse) as info:
        ws_turn(http, headers)
    return info.value


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("guard"), allowed_origins=["https://app.example,http://10.0.0.5:3000"]) as a:
        yield a


@pytest.mark.parametrize("origin", ["https://evil.example", "http://evil.example:8080", "null",
                                    "http://127.0.0.1.evil.example", "https://localhost.evil.example",
                                    "file://", "chrome-extension://abcdef", "http://app.example",
                                    "http://[", "http://[::1", "http://a]b"])
def test_a_foreign_origin_cannot_open_a_websocket(app, origin) -> None:
    denied = ws_denied(app.http, {"origin": origin})
    assert denied.status_code == 403
    error = json.loads(denied.content)["error"]
    assert error["code"] == "forbidden" and "--allowed-origins" in error["message"]


@pytest.mark.parametrize("origin", ["http://[", "http://[::1", "http://a]b"])
def test_an_origin_that_is_no_url_is_refused_not_a_server_error(app, origin) -> None:
    """urlsplit raises on these (an IPv6 bracket left open): a 500 and a
    logged traceback for every such request, from anyone on the network."""
    r = app.http.get("/health", headers={"origin": origin})
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"


def test_a_foreign_origin_is_refused_over_http_in_the_dialects_shape(app) -> None:
    evil = {"origin": "https://evil.example"}
    r = app.http.post("/v1/responses", json={"model": MODEL, "input": "hi"}, headers=evil)
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    r = app.http.post("/v1/messages", json={"model": MODEL, "max_tokens": 2,
                                            "messages": [{"role": "user", "content": "hi"}]}, headers=evil)
    assert r.status_code == 403 and r.json()["type"] == "error"
    r = app.http.get("/lmsp/v1/engine", headers=evil)
    assert r.status_code == 403 and r.headers["content-type"] == "application/problem+json"


@pytest.mark.parametrize("origin", [None, "http://localhost:8080", "http://127.0.0.1:9999", "http://[::1]:8080",
                                    "http://dev.localhost:5173", "https://app.example", "http://10.0.0.5:3000",
                                    "http://localhost"])
def test_clients_and_loopback_and_allowed_origins_are_served(app, origin) -> None:
    headers = {} if origin is None else {"origin": origin}
    assert ws_turn(app.http, headers) == "response.completed"
    r = app.http.post("/v1/responses", json={"model": MODEL, "input": "hi"}, headers=headers)
    assert r.status_code == 200, r.text


def test_the_servers_own_origin_is_served(app) -> None:
    # The console, served from the server itself, opens sockets with its own origin.
    own = TestClient(app.app, base_url="http://127.0.0.2:8080")
    assert ws_turn(own, {"origin": "http://127.0.0.2:8080"}) == "response.completed"


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8080", "127.0.0.1.nip.io", "192.168.1.10:8080",
                                  "localhost.evil.example", "[::2]:8080"])
def test_a_foreign_host_is_a_421_when_bound_to_loopback(app, host) -> None:
    for path, shape in (("/v1/models", "openai"), ("/lmsp/v1/engine", "lmsp"), ("/health", "openai")):
        r = app.http.get(path, headers={"host": host})
        assert r.status_code == 421, (path, r.text)
        body = r.json()
        if shape == "lmsp":
            assert body["status"] == 421 and "loopback" in body["detail"]
        else:
            assert body["error"]["code"] == "misdirected_request"
    own = TestClient(app.app, base_url=f"http://{host}")
    with pytest.raises(WebSocketDenialResponse) as info:
        ws_turn(own, {})
    assert info.value.status_code == 421


@pytest.mark.parametrize("host", ["localhost", "localhost:8080", "127.0.0.1", "127.0.0.1:8080", "[::1]",
                                  "[::1]:8080", "LOCALHOST:1", "app.localhost:8080", "127.1.2.3:80",
                                  "app.example", "10.0.0.5:3000"])
def test_loopback_hosts_are_served(app, host) -> None:
    assert app.http.get("/v1/models", headers={"host": host}).status_code == 200
    assert ws_turn(TestClient(app.app, base_url=f"http://{host}"), {}) == "response.completed"


def test_off_loopback_any_host_is_served(tmp_path) -> None:
    # Bound to every interface (keys required): the name clients use is theirs to choose.
    with serving(tmp_path, host="0.0.0.0", keys=["k"], key="k") as a:
        r = a.http.get("/v1/models", headers={"host": "lmspd.lan:8080"})
        assert r.status_code == 200, r.text
        # A web page is still not a client.
        r = a.http.get("/v1/models", headers={"host": "lmspd.lan:8080", "origin": "https://evil.example"})
        assert r.status_code == 403


def test_allowed_origins_are_checked_and_normalized() -> None:
    assert split_origins(["https://App.Example:8443, http://x", "*", ""]) == [
        "https://app.example:8443", "http://x", "*"]
    for bad in ("app.example", "https://app.example/path", "ftp://x", "https://"):
        with pytest.raises(ValueError, match="is not an origin"):
            split_origins([bad])
