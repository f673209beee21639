"""A hypothesis-driven fuzz of every route through the whole ASGI app:
methods, path parameters, query strings, headers, content types, encodings
and bodies. Nothing may be a 5xx, and a refused request changes nothing."""

from __future__ import annotations

import asyncio
import gzip
import json
import sqlite3
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.inprocess import MODEL, client, make_app

ROUTES = [
    "/v1/responses", "/v1/responses/{id}", "/v1/responses/{id}/cancel", "/v1/responses/{id}/input_items",
    "/v1/conversations", "/v1/conversations/{id}", "/v1/conversations/{id}/items",
    "/v1/conversations/{id}/items/{item}", "/lmsp/v1/responses", "/lmsp/v1/responses/{id}", "/lmsp/v1/tasks",
    "/lmsp/v1/tasks/{id}", "/lmsp/v1/tasks/{id}/events", "/lmsp/v1/tasks/{id}/cancel", "/v1/models",
    "/lmsp/v1/models", "/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens", "/health",
    "/v1/messages/batches", "/nope",
]
_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=24)
segment = st.one_of(st.sampled_from(["resp_x", "conv_x", "task_x", "msg_x", "..", "%zz", "%00", "a" * 300]),
                    _text.filter(bool).map(lambda s: quote(s, safe="")))
json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | _text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4), max_leaves=20)
# Near-valid bodies reach deep into the decoders, where the bugs live.
valid = st.sampled_from([
    {"model": MODEL, "input": "hi"},
    {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    {"items": [{"type": "message", "role": "user", "content": "hi"}]},
    {"metadata": {"a": "b"}},
])


@st.composite
def bodies(draw) -> bytes | None:
    kind = draw(st.sampled_from(["none", "bytes", "json", "mutated", "raw"]))
    if kind == "none":
        return None
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "raw":
        return draw(st.sampled_from([b'{"model": NaN}', b'{"a": 1, "a": 2}', b'{"input": "\\ud800"}', b"[]",
                                     b'{"input": 1e999}', b"\xef\xbb\xbf{}", b"{" * 200, b'"x"']))
    if kind == "json":
        return json.dumps(draw(json_value)).encode()
    body = dict(draw(valid))
    key = draw(st.sampled_from([*body, "stream", "store", "background", "tools", "text", "temperature",
                                "previous_response_id", "conversation", "tool_choice", "extensions"]))
    body[key] = draw(json_value)
    return json.dumps(body).encode()


headers = st.fixed_dictionaries({}, optional={
    "content-type": st.sampled_from(["application/json", "application/json; charset=utf-8", "text/plain",
                                     "application/problem+json", "multipart/form-data", "", "application/x"]),
    "content-encoding": st.sampled_from(["gzip", "zstd", "br", "identity", "gzip, gzip", "x"]),
    "lmsp-version": st.sampled_from(["1.0", "2.0", "", "1"]),
    "last-event-id": st.sampled_from(["0", "-1", "x", "99999999999999999999"]),
    "idempotency-key": _text.filter(lambda s: s.isprintable() and s.isascii()),
    "authorization": st.sampled_from(["Bearer x", "Basic y", "Bearer"]),
    "accept": st.sampled_from(["text/event-stream", "*/*", "application/json"]),
})
queries = st.dictionaries(st.sampled_from(["stream", "starting_after", "after", "limit", "order", "include",
                                           "include_obfuscation", "x"]),
                          st.sampled_from(["true", "false", "1", "-1", "0", "x", "", "asc", "99999999999999999999"]),
                          max_size=3)


def snapshot(path) -> dict[str, int]:
    with sqlite3.connect(path) as db:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {t: db.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0] for t in tables}


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    data = tmp_path_factory.mktemp("fuzz")
    app, store = make_app(data)
    loop = asyncio.new_event_loop()
    c = client(app)
    yield loop, c, data / "lmspd.sqlite3"
    loop.run_until_complete(c.aclose())
    loop.close()
    store.close()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(st.sampled_from(ROUTES), st.lists(segment, min_size=2, max_size=2),
       st.sampled_from(["GET", "POST", "DELETE", "PUT", "PATCH", "HEAD", "OPTIONS"]), queries, headers, bodies(),
       st.booleans())
def test_no_request_is_a_5xx_and_a_refusal_changes_nothing(rig, route, ids, method, query, hdrs, body, packed):
    loop, c, db = rig
    path = route.replace("{id}", ids[0]).replace("{item}", ids[1])
    if body is not None and packed and hdrs.get("content-encoding") == "gzip":
        body = gzip.compress(body)
    before = snapshot(db)
    r = loop.run_until_complete(c.request(method, path, params=query, headers=hdrs, content=body))
    assert r.status_code < 500, (method, path, query, hdrs, body, r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert snapshot(db) == before, (method, path, r.status_code, r.text[:300])
        if method != "HEAD" and r.content:
            json.loads(r.content)  # every error is JSON, never a traceback or plain text
