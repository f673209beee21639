"""``GET /lmsp/v1/engine``: what the console's engine view reads."""

from __future__ import annotations

from lmspd.core.events import Usage
from support.observe_app import ScriptedEngine, make_client


def test_the_view_lists_queue_cache_and_recent_generations(tmp_path):
    engine = ScriptedEngine(Usage(input_tokens=20, output_tokens=3, cached_tokens=12), "ram")
    stats = engine.stats
    engine.stats = lambda: {**stats(), "sessions": [{"owner": "key_0123456789abcdef", "tokens": 42}]}
    with make_client(tmp_path, engine) as client:
        assert client.post("/v1/responses", json={"model": "m", "input": "hi"}).status_code == 200
        r = client.get("/lmsp/v1/engine")
    assert r.status_code == 200 and r.headers["LMSP-Version"] == "1.0"
    view = r.json()
    (model,) = view["models"]
    assert model["queue"] == {"pending": 0, "running": 0, "concurrency": 1, "max_pending": 32}
    assert model["cache"]["ram_bytes"] == 1234
    # The owner is a short tag, never the credential-derived id itself.
    (session,) = model["sessions"]
    assert session["tokens"] == 42 and len(session["owner"]) == 6
    assert "key_0123456789abcdef" not in r.text
    (last,) = view["recent"]
    assert (last["cache_source"], last["reused_tokens"], last["prefilled_tokens"]) == ("ram", 12, 8)
    assert last["response_id"].startswith("resp_") and last["ttft_ms"] is not None


def test_the_view_is_admin_only_when_keys_are_set(tmp_path):
    with make_client(tmp_path, ScriptedEngine(Usage(), "cold"), api_keys=["k"]) as client:
        assert client.get("/lmsp/v1/engine").status_code == 401
        assert client.get("/lmsp/v1/engine", headers={"Authorization": "Bearer k"}).status_code == 200
        # The console page and its files need no key (the page asks for one).
        page = client.get("/")
        assert page.status_code == 200 and "default-src 'self'" in page.headers["content-security-policy"]
        assert client.get("/console/console.js").status_code == 200
        assert client.get("/console/../app.py").status_code == 404
