"""Scoped API keys: every route × every scope, through the whole ASGI app.

A route's scope is the README's table (Auth). A key lacking it gets 403
``forbidden`` in the route's dialect shape; one that has it gets past the
credential check (whatever the handler then answers, never 401/403).
"""

from __future__ import annotations

import asyncio
import json

import pytest

from lmspd.auth import ALL_SCOPES, parse_key, read_keys_file
from support.inprocess import MODEL, client, make_app

SCOPES = sorted(ALL_SCOPES - {"admin"})
RESPONSE = {"model": MODEL, "input": "hi"}

# (method, path, body, scope, dialect): every route of lmspd.app except /health.
ROUTES = [
    ("POST", "/v1/responses", RESPONSE, "responses:write", "openai"),
    ("GET", "/v1/responses/resp_x", None, "responses:read", "openai"),
    ("DELETE", "/v1/responses/resp_x", None, "responses:write", "openai"),
    ("POST", "/v1/responses/resp_x/cancel", None, "responses:write", "openai"),
    ("GET", "/v1/responses/resp_x/input_items", None, "responses:read", "openai"),
    ("POST", "/v1/conversations", {}, "responses:write", "openai"),
    ("GET", "/v1/conversations/conv_x", None, "responses:read", "openai"),
    ("POST", "/v1/conversations/conv_x", {"metadata": {}}, "responses:write", "openai"),
    ("DELETE", "/v1/conversations/conv_x", None, "responses:write", "openai"),
    ("POST", "/v1/conversations/conv_x/items", {"items": []}, "responses:write", "openai"),
    ("GET", "/v1/conversations/conv_x/items", None, "responses:read", "openai"),
    ("GET", "/v1/conversations/conv_x/items/msg_x", None, "responses:read", "openai"),
    ("DELETE", "/v1/conversations/conv_x/items/msg_x", None, "responses:write", "openai"),
    ("POST", "/lmsp/v1/responses", RESPONSE, "responses:write", "lmsp"),
    ("GET", "/lmsp/v1/responses/resp_x", None, "responses:read", "lmsp"),
    ("POST", "/lmsp/v1/tasks", RESPONSE, "responses:write", "lmsp"),
    ("GET", "/lmsp/v1/tasks/task_x", None, "tasks:read", "lmsp"),
    ("GET", "/lmsp/v1/tasks/task_x/events", None, "tasks:read", "lmsp"),
    ("POST", "/lmsp/v1/tasks/task_x/cancel", None, "responses:write", "lmsp"),
    ("GET", "/v1/models", None, "responses:read", "openai"),
    ("GET", "/lmsp/v1/models", None, "responses:read", "lmsp"),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
     "responses:write", "openai"),
    ("POST", "/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
     "responses:write", "anthropic"),
    ("POST", "/v1/messages/count_tokens", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
     "responses:read", "anthropic"),
]

KEYS = {scope: f"key-{scope.replace(':', '-')}:{scope}" for scope in SCOPES}
KEYS["admin"] = "key-admin:admin"
KEYS["all"] = "key-all"  # no scopes given: every scope, as before scopes existed


def token(name: str) -> str:
    return parse_key(KEYS[name]).key


def assert_forbidden(r, dialect: str) -> None:
    assert r.status_code == 403, r.text
    body = r.json()
    if dialect == "lmsp":
        assert r.headers["content-type"].startswith("application/problem+json")
        assert body["code"] == "forbidden" and body["status"] == 403
    elif dialect == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "permission_error"
    else:
        assert body["error"]["code"] == "forbidden" and body["error"]["type"] == "permission_error"


def test_every_route_needs_its_scope(tmp_path) -> None:
    app, store = make_app(tmp_path, keys=list(KEYS.values()))

    async def go() -> list[str]:
        seen = []
        for name in [*SCOPES, "admin", "all"]:
            async with client(app, {"Authorization": f"Bearer {token(name)}"}) as c:
                for method, path, body, scope, dialect in ROUTES:
                    headers = {"LMSP-Version": "1.0"} if dialect == "lmsp" else {}
                    if body is not None:
                        headers["content-type"] = "application/json"
                    r = await c.request(method, path, headers=headers,
                                        content=None if body is None else json.dumps(body))
                    allowed = name in ("admin", "all") or name == scope
                    if allowed:
                        assert r.status_code not in (401, 403), (name, method, path, r.text)
                        assert r.status_code < 500, (name, method, path, r.text)
                    else:
                        assert_forbidden(r, dialect)
                    seen.append(f"{name} {method} {path} {r.status_code}")
        return seen

    seen = asyncio.run(go())
    assert len(seen) == len(ROUTES) * (len(SCOPES) + 2)
    store.close()


def test_a_read_only_key_creates_nothing(tmp_path) -> None:
    app, store = make_app(tmp_path, keys=["writer", "reader:responses:read,tasks:read"])

    async def go() -> None:
        async with client(app, {"Authorization": "Bearer reader"}) as c:
            for path in ("/v1/responses", "/lmsp/v1/tasks", "/v1/chat/completions"):
                r = await c.post(path, json={**RESPONSE, "store": True}, headers={"LMSP-Version": "1.0"})
                assert r.status_code == 403
            assert (await c.post("/v1/conversations", json={})).status_code == 403
        engine = app.state.lmspd.service.models[MODEL].engine
        assert engine.prepared == 0 and engine.generations == 0

    asyncio.run(go())
    store.close()


def test_health_shows_engine_internals_to_admin_only(tmp_path) -> None:
    app, store = make_app(tmp_path, keys=["key-admin:admin", "key-read:responses:read", "key-all"])

    async def health(headers: dict[str, str]) -> dict:
        async with client(app, headers) as c:
            r = await c.get("/health")
            assert r.status_code == 200
            return r.json()

    for headers, sees in (({}, False), ({"Authorization": "Bearer nope"}, False),
                          ({"Authorization": "Bearer key-read"}, False),
                          ({"Authorization": "Bearer key-admin"}, True), ({"x-api-key": "key-all"}, True)):
        body = asyncio.run(health(headers))
        assert body["status"] == "ok"
        assert ("models" in body) is sees, headers
    store.close()


def test_key_specs_and_keys_files(tmp_path) -> None:
    assert parse_key("plain").scopes == ALL_SCOPES
    assert parse_key("k:responses:read,tasks:read").scopes == {"responses:read", "tasks:read"}
    assert parse_key("k:admin").key == "k"
    # A suffix that is not a scope list is part of the key.
    assert parse_key("sk-proj:ABC/def==").key == "sk-proj:ABC/def=="
    with pytest.raises(ValueError, match="unknown API key scope responses:wrte"):
        parse_key("k:responses:wrte")
    keys = tmp_path / "keys"
    keys.write_text("# team keys\nalpha responses:read, tasks:read\n\nbeta # my laptop\ngamma:admin\n"
                    "delta#1\tadmin\t# tab-separated\nepsilon\tresponses:read, tasks:read\nzeta\t admin\n")
    assert read_keys_file(keys) == ["alpha:responses:read,tasks:read", "beta", "gamma:admin", "delta#1:admin",
                                    "epsilon:responses:read,tasks:read", "zeta:admin"]
    keys.write_text("alpha (my laptop)\n")
    with pytest.raises(ValueError, match=r"keys:1: what follows the key is not a list of scopes"):
        read_keys_file(keys)
    keys.write_text("alpha my laptop\n")
    with pytest.raises(ValueError, match=r"keys:1: unknown API key scope mylaptop"):
        read_keys_file(keys)
    keys.write_text("alpha root\n")
    with pytest.raises(ValueError, match=r"keys:1: unknown API key scope root") as info:
        read_keys_file(keys)
    assert "alpha" not in str(info.value), "a key never appears in an error"
    for empty in ("", "# no keys yet\n\n   # still none\n", "#sekrit-starts-with-hash\n"):
        keys.write_text(empty)
        with pytest.raises(ValueError, match=r"holds no API key") as info:
            read_keys_file(keys)
        assert "sekrit" not in str(info.value)


def test_health_never_shows_a_raw_owner(tmp_path) -> None:
    """As the engine view: each owner is a tag, never the credential-derived id."""
    from lmspd.auth import _owner
    from support.inprocess import ScriptedEngine

    owner = _owner("key-admin")
    engine = ScriptedEngine(stats={"cache": {"sequences": [{"id": 0, "owner": owner, "tokens": 5}]},
                                   "prefilling": [{"seq": 1, "owner": owner}]})
    app, store = make_app(tmp_path, keys=["key-admin:admin"], engine=engine)

    async def health() -> str:
        async with client(app, {"Authorization": "Bearer key-admin"}) as c:
            r = await c.get("/health")
            return r.text

    text = asyncio.run(health())
    assert "sequences" in text and "prefilling" in text
    assert owner not in text and "key_" not in text, text
    store.close()


def test_found_models_are_listed_to_admin_only(tmp_path) -> None:
    """GGUFs found on the machine (the operator's HF, Ollama, LM Studio
    stores: private repository names) are not every key's business."""
    from support.gguf_writer import gguf_bytes, model_metadata

    found = tmp_path / "models"
    found.mkdir()
    (found / "Private-Repo-Q4_K_M.gguf").write_bytes(gguf_bytes(model_metadata(name="Private Repo")))
    app, store = make_app(tmp_path / "data", keys=["key-admin:admin", "key-read:responses:read"],
                          models_dir=found)

    async def listed(key: str) -> list[dict]:
        async with client(app, {"Authorization": f"Bearer {key}"}) as c:
            r = await c.get("/v1/models")
            assert r.status_code == 200, r.text
            return r.json()["data"]

    admin = asyncio.run(listed("key-admin"))
    assert any(not m["served"] and m["id"] == "private-repo-q4_k_m" for m in admin), admin
    reader = asyncio.run(listed("key-read"))
    assert [m["id"] for m in reader] == [MODEL] and all(m["served"] for m in reader), reader
    store.close()
