"""Every route that reads a body reads it strictly: a non-finite number in
any numeric field, on every dialect, is a 400 naming that field, and nothing
is run or stored."""

from __future__ import annotations

import asyncio
import json
import sqlite3

import pytest

from support.inprocess import MODEL, client, make_app

# Each route with a body, and a body whose every numeric field is named.
ROUTES = {
    "/v1/responses": {"model": MODEL, "input": "hi", "temperature": 1, "top_p": 1, "max_output_tokens": 5,
                      "top_logprobs": 0, "max_tool_calls": 2},
    "/lmsp/v1/responses": {"model": MODEL, "input": "hi", "temperature": 1, "top_p": 1, "max_output_tokens": 5},
    "/lmsp/v1/tasks": {"model": MODEL, "input": "hi", "temperature": 1, "max_output_tokens": 5},
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 1,
                             "top_p": 1, "max_tokens": 5, "max_completion_tokens": 5, "seed": 1,
                             "frequency_penalty": 0, "presence_penalty": 0},
    "/v1/messages": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                     "temperature": 1, "top_p": 1, "top_k": 5},
    "/v1/messages/count_tokens": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                  "x-number": 1},
    "/v1/conversations": {"items": [], "metadata": {}, "x-number": 1},
}
CASES = [(path, key) for path, body in ROUTES.items() for key, value in body.items() if isinstance(value, int)]


def rows(path) -> int:
    with sqlite3.connect(path) as db:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return sum(db.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0] for t in tables)


@pytest.mark.parametrize("path, key", CASES)
def test_non_finite_numbers_in_every_numeric_field(tmp_path, path, key) -> None:
    app, store = make_app(tmp_path)
    engine = app.state.lmspd.service.models[MODEL].engine

    async def go() -> None:
        async with client(app, {"LMSP-Version": "1.0", "content-type": "application/json"}) as c:
            for bad in ("NaN", "Infinity", "-Infinity", "1e400"):
                text = json.dumps({**ROUTES[path], key: "__BAD__"}).replace('"__BAD__"', bad)
                r = await c.post(path, content=text)
                assert r.status_code == 400, (path, key, bad, r.text)
                body = r.json()
                if path.startswith("/v1/messages"):
                    assert key in body["error"]["message"]
                elif path.startswith("/lmsp/"):
                    assert body["param"] == key
                else:
                    assert body["error"]["param"] == key

    before = rows(tmp_path / "lmspd.sqlite3")
    asyncio.run(go())
    assert rows(tmp_path / "lmspd.sqlite3") == before
    assert engine.prepared == 0 and engine.generations == 0
    store.close()


@pytest.mark.parametrize("path", ["/v1/responses", "/lmsp/v1/responses", "/lmsp/v1/tasks"])
def test_a_previous_response_id_longer_than_any_id_is_refused(tmp_path, path) -> None:
    """One bound for every dialect that names a response
    (``MAX_RESPONSE_ID_CHARS``): LMSP took any length, and quoted it back."""
    from lmspd.core.limits import MAX_RESPONSE_ID_CHARS

    app, store = make_app(tmp_path)

    async def go() -> dict:
        async with client(app, {"LMSP-Version": "1.0"}) as c:
            r = await c.post(path, json={**ROUTES[path], "previous_response_id": "resp_" + "x" * MAX_RESPONSE_ID_CHARS})
            assert r.status_code == 400, r.text
            return r.json()

    body = asyncio.run(go())
    error = body if path.startswith("/lmsp/") else body["error"]
    assert error["param"] == "previous_response_id"
    assert error["code"] != "previous_response_not_found", "refused as sent, never looked up"
    store.close()
