"""``GET /metrics`` in process: a scripted engine, a real store, the real app.

The generation counters must move by exactly the usage the engine reported,
requests are labelled by route template (never by raw path), and the route
sits behind the same credential check as the rest of the API.
"""

from __future__ import annotations

from lmspd.core.events import Usage
from support.observe_app import ScriptedEngine, make_client, samples


def test_counters_move_by_the_reported_usage(tmp_path):
    engine = ScriptedEngine(Usage(input_tokens=50, output_tokens=7, cached_tokens=30), "ram")
    with make_client(tmp_path, engine) as client:
        before = samples(client.get("/metrics").text)
        for _ in range(2):
            r = client.post("/v1/responses", json={"model": "m", "input": "hi"})
            assert r.status_code == 200, r.text
        client.get("/v1/responses/resp_doesnotexist")
        after_resp = client.get("/metrics")
        assert after_resp.headers["content-type"].startswith("text/plain")
        after = samples(after_resp.text)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert delta("lmspd_reused_tokens_total", model="m", cache_source="ram") == 60
    assert delta("lmspd_prefill_tokens_total", model="m", cache_source="ram") == 40
    assert delta("lmspd_output_tokens_total", model="m") == 14
    assert delta("lmspd_generations_total", model="m", outcome="stop") == 2
    assert delta("lmspd_time_to_first_token_seconds_count", model="m") == 2
    assert delta("lmspd_decode_tokens_per_second_count", model="m") == 2
    assert delta("lmspd_http_requests_total", route="/v1/responses", method="POST", status="200") == 2
    # The template, not the id: the label set stays bounded.
    assert delta("lmspd_http_requests_total", route="/v1/responses/{response_id}", method="GET", status="404") == 1
    # Stored responses were written, and each write was timed.
    assert delta("lmspd_store_write_seconds_count", operation="put_response") >= 2
    # Engine state is read at scrape time.
    assert after[("lmspd_kv_ram_bytes", (("model", "m"),))] == 1234
    assert after[("lmspd_kv_disk_bytes", (("model", "m"),))] == 5678
    assert after[("lmspd_queue_depth", (("model", "m"),))] == 0
    assert after[("lmspd_sequences_busy", (("model", "m"),))] == 0


def test_unknown_paths_share_one_label(tmp_path):
    with make_client(tmp_path, ScriptedEngine(Usage(), "cold")) as client:
        for path in ("/nope/1", "/nope/2", "/x" * 50):
            assert client.get(path).status_code == 404
        after = samples(client.get("/metrics").text)
    routes = {dict(k[1]).get("route") for k in after if k[0] == "lmspd_http_requests_total"}
    assert "unmatched" in routes
    assert not any(r and r.startswith("/nope") for r in routes)


def test_metrics_need_a_key_when_keys_are_set(tmp_path):
    with make_client(tmp_path, ScriptedEngine(Usage(), "cold"), api_keys=["k1"]) as client:
        assert client.get("/metrics").status_code == 401
        ok = client.get("/metrics", headers={"Authorization": "Bearer k1"})
        assert ok.status_code == 200
        assert "lmspd_http_requests_total" in ok.text


def test_upstream_endpoints_are_gauges(tmp_path):
    engine = ScriptedEngine(Usage(), "cold")
    engine.stats = lambda: {"endpoints": [
        {"url": "http://a/v1", "healthy": True, "outstanding": 1, "requests": 5, "failures": 0},
        {"url": "http://b/v1", "healthy": False, "outstanding": 0, "requests": 2, "failures": 2},
    ]}
    with make_client(tmp_path, engine) as client:
        after = samples(client.get("/metrics").text)
    assert after[("lmspd_upstream_endpoint_healthy", (("endpoint", "http://a/v1"), ("model", "m")))] == 1
    assert after[("lmspd_upstream_endpoint_healthy", (("endpoint", "http://b/v1"), ("model", "m")))] == 0
    assert after[("lmspd_upstream_endpoint_requests_total", (("endpoint", "http://b/v1"), ("model", "m")))] == 2


def test_unknown_methods_leave_metrics_the_same_size(tmp_path):
    """An HTTP method is any token to ASGI (llhttp, in front of lmspd,
    takes some thirty beyond the usual ones): each distinct one must not
    become a label set kept forever."""
    with make_client(tmp_path, ScriptedEngine(Usage(), "cold")) as client:
        # The first unknown method on each route makes its one 'other' series.
        client.request("FROB", "/v1/models")
        client.request("FROB", "/health")
        client.get("/metrics")  # and the scrape's own series
        size = len(client.get("/metrics").content)
        for n in range(50):
            client.request(f"X{n:04d}" + "Y" * 2000, "/v1/models")
            client.request(f"Z{n:04d}", "/health")
        text = client.get("/metrics").text
    assert len(text.encode()) <= size + 64, "distinct unknown methods grew /metrics"
    methods = {dict(k[1]).get("method") for k in samples(text) if k[0] == "lmspd_http_requests_total"}
    assert methods <= {"GET", "other"}, methods


def test_a_conversation_turns_one_write_is_timed(tmp_path):
    """A turn of a conversation ends in one transaction (``end_turn``):
    timed like every other store write."""
    engine = ScriptedEngine(Usage(input_tokens=5, output_tokens=2), "cold")
    with make_client(tmp_path, engine) as client:
        conversation = client.post("/v1/conversations", json={}).json()["id"]
        before = samples(client.get("/metrics").text)
        r = client.post("/v1/responses", json={"model": "m", "input": "hi", "conversation": conversation})
        assert r.status_code == 200, r.text
        after = samples(client.get("/metrics").text)
    key = ("lmspd_store_write_seconds_count", (("operation", "end_turn"),))
    assert after.get(key, 0) - before.get(key, 0) == 1
