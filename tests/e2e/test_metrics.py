"""``GET /metrics`` on a real server: a two-turn loop moves the token
counters by exactly the usage each turn reported."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from support.server import MODEL


def scrape(server) -> dict[tuple[str, tuple], float]:
    r = httpx.get(server.url + "/metrics", timeout=30)
    assert r.status_code == 200
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def matching(samples, name, **labels) -> list[float]:
    """The values of ``name``'s samples that carry ``labels`` (among others)."""
    want = set(labels.items())
    return [v for (n, ls), v in samples.items() if n == name and want <= set(ls)]


def total(samples, name, **labels) -> float:
    return sum(matching(samples, name, **labels))


def present(samples, name, **labels) -> bool:
    return bool(matching(samples, name, **labels))


def turn(server, body):
    r = httpx.post(server.url + "/v1/responses",
                   json={"model": MODEL, "temperature": 0, "max_output_tokens": 12, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_two_turn_loop_moves_the_counters_by_its_usage(server):
    s0 = scrape(server)
    first = turn(server, {"instructions": "Answer briefly.", "input": "Name a colour."})
    s1 = scrape(server)
    # Instructions are not carried over from the previous response (OpenAI's rule): a client
    # resends them, and without them the prompt's system part would differ. Before, this
    # turn reused tokens only when an earlier test had left a default-system prompt behind.
    second = turn(server, {"instructions": "Answer briefly.", "previous_response_id": first["id"],
                           "input": "And another one?"})
    s2 = scrape(server)
    u1, u2 = first["usage"], second["usage"]
    cached2 = u2["input_tokens_details"]["cached_tokens"]
    assert cached2 > 0  # the continuation came from the cache

    assert total(s2, "lmspd_reused_tokens_total") - total(s1, "lmspd_reused_tokens_total") == cached2
    assert total(s2, "lmspd_prefill_tokens_total") - total(s1, "lmspd_prefill_tokens_total") == \
        u2["input_tokens"] - cached2
    assert total(s1, "lmspd_prefill_tokens_total") - total(s0, "lmspd_prefill_tokens_total") == \
        u1["input_tokens"] - u1["input_tokens_details"]["cached_tokens"]
    # The second turn is counted under the source the engine logged for it.
    source = server.health()["models"][MODEL]["last_cache_source"]
    assert source != "cold"
    assert total(s2, "lmspd_reused_tokens_total", cache_source=source) - \
        total(s1, "lmspd_reused_tokens_total", cache_source=source) == cached2
    assert total(s2, "lmspd_output_tokens_total") - total(s0, "lmspd_output_tokens_total") == \
        u1["output_tokens"] + u2["output_tokens"]
    key = dict(route="/v1/responses", method="POST", status="200")
    assert total(s2, "lmspd_http_requests_total", **key) - total(s0, "lmspd_http_requests_total", **key) == 2
    assert total(s2, "lmspd_time_to_first_token_seconds_count", model=MODEL) - \
        total(s0, "lmspd_time_to_first_token_seconds_count", model=MODEL) == 2
    assert total(s2, "lmspd_store_write_seconds_count", operation="put_response") > \
        total(s0, "lmspd_store_write_seconds_count", operation="put_response")
    # Gauges: there, and what an idle server with a RAM tier says.
    assert present(s2, "lmspd_queue_depth", model=MODEL) and total(s2, "lmspd_queue_depth", model=MODEL) == 0
    assert present(s2, "lmspd_kv_ram_bytes", model=MODEL) and total(s2, "lmspd_kv_ram_bytes", model=MODEL) >= 0
