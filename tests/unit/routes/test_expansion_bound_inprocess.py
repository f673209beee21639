"""The expanded-input bound (``RequestLimits.max_expanded_chars``) on every
path that expands stored history: a ``previous_response_id`` chain (both
Responses dialects), a ``conversation``, ``item_reference``s, a WebSocket
connection's own latest response; each distinct reference is read once.
In process with the bound shrunk; the black-box test with the real bound,
/health and RSS is tests/e2e/test_expansion_bound.py."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lmspd.core.conversation import Message
from lmspd.core.limits import DEFAULT_LIMITS
from lmspd.dialects.responses_items import Expansion
from lmspd.history import StoredContext
from lmspd.routes.websocket import ConnectionContext, Latest
from support.engine import MODEL
from support.inprocess import serving

BOUND = 2000
LIMITS = replace(DEFAULT_LIMITS, request=replace(DEFAULT_LIMITS.request, max_expanded_chars=BOUND))
LMSP = {"LMSP-Version": "1.0"}


@pytest.fixture
def app(tmp_path):
    with serving(tmp_path, limits=LIMITS) as app:
        yield app


def body(input, **extra):
    return {"model": MODEL, "input": input, "max_output_tokens": 8, **extra}


def refused(r, param: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"] if "error" in r.json() else {"param": r.json().get("param"),
                                                            "message": r.json()["detail"]}
    assert err["param"] == param, err
    assert "max_expanded_chars" in err["message"] and str(BOUND) in err["message"], err


def test_item_references_count_each_time_and_are_read_once(app, monkeypatch):
    http = app.http
    stored = http.post("/v1/responses", json=body("x" * 600)).json()
    item_id = http.get(f"/v1/responses/{stored['id']}/input_items").json()["data"][0]["id"]
    reads = []
    find_item = app.store.find_item
    monkeypatch.setattr(app.store, "find_item", lambda *a: reads.append(a) or find_item(*a))
    refs = [{"type": "item_reference", "id": item_id}] * 3
    assert http.post("/v1/responses", json=body(refs)).status_code == 200
    assert len(reads) == 1, "one read for one distinct reference"
    seen = app.engine.conversations[-1].items
    assert [m.text for m in seen] == ["x" * 600] * 3 and len({id(m) for m in seen}) == 3
    # The fourth reference takes the input past the bound: refused there,
    # whichever route expands it.
    for path in ("/v1/responses", "/v1/responses/input_tokens"):
        refused(http.post(path, json=body(refs + refs[:1])), "input[3]")
    refused(http.post("/lmsp/v1/responses", json=body(refs + refs[:1]), headers=LMSP), "input[3]")


def test_a_previous_response_chain_past_the_bound_is_refused(app):
    http = app.http
    first = http.post("/v1/responses", json=body("y" * 1500)).json()
    generations = app.generations()
    # Its history alone is within the bound; with this input it is not.
    refused(http.post("/v1/responses", json=body("z" * 600, previous_response_id=first["id"])),
            "previous_response_id")
    refused(http.post("/lmsp/v1/responses", json=body("z" * 600, previous_response_id=first["id"]),
                      headers=LMSP), "previous_response_id")
    assert app.generations() == generations
    assert http.post("/v1/responses", json=body("z" * 10, previous_response_id=first["id"])).status_code == 200


def test_a_conversation_past_the_bound_is_refused(app):
    http = app.http
    conv = http.post("/v1/conversations", json={"items": [
        {"type": "message", "role": "user", "content": "w" * 900} for _ in range(3)]}).json()
    refused(http.post("/v1/responses", json=body("hi", conversation=conv["id"])), "conversation")
    refused(http.post("/v1/responses/input_tokens", json=body("hi", conversation=conv["id"])), "conversation")


def test_a_websocket_connections_latest_response_counts(tmp_path):
    latest = Latest("resp_1", [Message("user", "v" * 1500), Message("assistant", "v" * 600)], stored=False)
    context = ConnectionContext(StoredContext(store=None, owner="local"), latest)  # type: ignore[arg-type]
    with pytest.raises(Exception) as caught:
        context.history("resp_1", None, Expansion(LIMITS.request))
    assert caught.value.param == "previous_response_id" and "max_expanded_chars" in caught.value.message
    assert len(context.history("resp_1", None, Expansion(DEFAULT_LIMITS.request))) == 2


ITEM_BOUND = 8
ITEM_LIMITS = replace(DEFAULT_LIMITS, request=replace(DEFAULT_LIMITS.request, max_expanded_items=ITEM_BOUND))
EMPTY = {"type": "message", "role": "user", "content": ""}


def refused_items(r, param: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"] if "error" in r.json() else {"param": r.json().get("param"),
                                                            "message": r.json()["detail"]}
    assert err["param"] == param, err
    assert "max_expanded_items" in err["message"] and str(ITEM_BOUND) in err["message"], err


@pytest.fixture
def item_app(tmp_path):
    with serving(tmp_path, limits=ITEM_LIMITS) as app:
        yield app


def test_a_conversation_past_the_item_bound_is_refused_though_it_holds_no_text(item_app):
    # Empty messages cost no characters: only the item bound sees them.
    http = item_app.http
    full = http.post("/v1/conversations", json={"items": [EMPTY] * ITEM_BOUND}).json()
    generations = item_app.generations()
    for path in ("/v1/responses", "/v1/responses/input_tokens"):
        refused_items(http.post(path, json=body("", conversation=full["id"])), "conversation")
    assert item_app.generations() == generations
    # One item fewer and the input fits exactly.
    fits = http.post("/v1/conversations", json={"items": [EMPTY] * (ITEM_BOUND - 1)}).json()
    assert http.post("/v1/responses", json=body("", conversation=fits["id"])).status_code == 200
    assert len(item_app.engine.conversations[-1].items) == ITEM_BOUND


def test_a_previous_response_chain_past_the_item_bound_is_refused(item_app):
    http = item_app.http
    first = http.post("/v1/responses", json=body([EMPTY] * 4)).json()
    held = 4 + len(first["output"])
    room = ITEM_BOUND - held
    assert room > 0, first["output"]
    refused_items(http.post("/v1/responses", json=body([EMPTY] * (room + 1), previous_response_id=first["id"])),
                  "previous_response_id")
    refused_items(http.post("/lmsp/v1/responses", json=body([EMPTY] * (room + 1), previous_response_id=first["id"]),
                            headers=LMSP), "previous_response_id")
    assert http.post("/v1/responses", json=body([EMPTY] * room, previous_response_id=first["id"])).status_code == 200


def test_item_references_count_against_the_item_bound(item_app):
    http = item_app.http
    stored = http.post("/v1/responses", json=body("")).json()
    item_id = http.get(f"/v1/responses/{stored['id']}/input_items").json()["data"][0]["id"]
    refs = [{"type": "item_reference", "id": item_id}] * ITEM_BOUND
    assert http.post("/v1/responses", json=body(refs)).status_code == 200
    refused_items(http.post("/v1/responses", json=body(refs + [EMPTY])), f"input[{ITEM_BOUND}]")


def test_instructions_are_bounded_as_text_and_count_toward_the_expanded_input(tmp_path):
    """The model reads the instructions with the input: one text field is
    at most ``max_text_chars``, and they count toward the expansion bound."""
    limits = replace(LIMITS, request=replace(LIMITS.request, max_text_chars=1500))
    with serving(tmp_path, limits=limits) as app:
        r = app.http.post("/v1/responses", json=body("hi", instructions="x" * 1501))
        assert r.status_code == 400 and r.json()["error"]["param"] == "instructions", r.text
        assert "1501" in r.json()["error"]["message"] and "1500" in r.json()["error"]["message"]
        refused(app.http.post("/v1/responses", json=body("y" * 600, instructions="x" * 1500)), "input")
        assert app.http.post("/v1/responses", json=body("y" * 400, instructions="x" * 1500)).status_code == 200
        assert app.engine.conversations[-1].instructions == "x" * 1500
