"""Speculative decoding, as a client and an operator see it, against a real
server: ``extensions["lmspd.decode"]`` on both Responses dialects (drafted
and accepted tokens by source), ``{"lmspd.speculative": false}`` turning it
off for one request, ``--speculative off`` for the server, and /metrics
carrying the host cost of a step and the drafted/accepted counters."""

from __future__ import annotations

import os

import httpx
import pytest

from support.server import MODEL, ServerProcess

CODE = "\n".join(f"def scale_{i}(x):\n    return x * {i} + {3 * i}" for i in range(6))
# Whether drafting pays is learned from measured step times, and the
# module's server takes every core (``srv``): nothing may run beside it
# (tests/conftest.py).
pytestmark = pytest.mark.alone

BODY = {"model": MODEL, "temperature": 0, "max_output_tokens": 24, "store": False,
        "input": "Repeat this code exactly:\n\n" + CODE}


@pytest.fixture(scope="module")
def srv():
    # Every core (the module runs alone): with a worker's share, one thread
    # on two cores, a batch costs nearly a token per token, the measured
    # costs soon said drafting barely pays, and CI's second request drafted
    # nothing (the rule adapting as it should, not what this module tests).
    server = ServerProcess("--ctx", "1024", "--parallel", "1", "--threads", str(os.cpu_count() or 2)).start()
    yield server
    server.stop()


def post(server, path, **extra):
    r = httpx.post(server.url + path, json={**BODY, **extra}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("path", ["/v1/responses", "/lmsp/v1/responses"])
def test_responses_report_drafted_and_accepted_tokens(srv, path):
    body = post(srv, path)
    decode = body["extensions"]["lmspd.decode"]
    assert set(decode["by_source"]) == {"grammar", "ngram"}
    assert decode["drafted"] == sum(s["drafted"] for s in decode["by_source"].values())
    # Asked to repeat code it was given, greedily, the model copies it: drafts are made and kept.
    assert 0 < decode["accepted"] <= decode["drafted"]
    assert "lmspd.cache" in body["extensions"]
    # (24 tokens, the request's max_output_tokens: it ended at that length.)
    srv.wait_for_log(rf"decode response={body['id']} seq=\d+ output=24 end=length decode_ms=[\d.]+ speculation "
                     rf"grammar=0/0 ngram={decode['accepted']}/{decode['drafted']}")


def drafted(server) -> int:
    return server.health()["models"][MODEL]["speculation"]["drafted"]


@pytest.mark.parametrize("path", ["/v1/responses", "/lmsp/v1/responses"])
def test_a_request_turns_speculation_off(srv, path):
    before = drafted(srv)
    body = post(srv, path, extensions={"lmspd.speculative": False})
    assert "lmspd.decode" not in body["extensions"]
    # The same request drafts when speculation is on (the test above): off, it drafted nothing.
    assert drafted(srv) == before
    srv.wait_for_log(rf"decode response={body['id']} seq=\d+ output=24 end=length decode_ms=[\d.]+\n")


def test_the_extension_takes_only_a_boolean(srv):
    r = httpx.post(srv.url + "/v1/responses", json={**BODY, "extensions": {"lmspd.speculative": "no"}}, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "extensions.lmspd.speculative"


def test_metrics_carry_the_host_cost_of_a_step_and_the_draft_counters(srv):
    post(srv, "/v1/responses")
    text = httpx.get(srv.url + "/metrics", headers=srv.admin_headers, timeout=30).text
    count = [line for line in text.splitlines() if line.startswith("lmspd_step_host_seconds_count")]
    assert count and float(count[0].split()[-1]) > 0
    assert 'lmspd_step_host_seconds_bucket{le="0.0005",model="%s"}' % MODEL in text
    assert f'lmspd_speculative_drafted_tokens_total{{model="{MODEL}",source="ngram"}}' in text
    assert f'lmspd_speculative_accepted_tokens_total{{model="{MODEL}",source="grammar"}}' in text


def test_the_server_flag_turns_it_off():
    server = ServerProcess("--ctx", "1024", "--parallel", "1", "--speculative", "off").start()
    try:
        body = post(server, "/v1/responses")
        assert "lmspd.decode" not in body.get("extensions", {})
        assert server.health()["models"][MODEL]["speculative"] == "off"
        assert drafted(server) == 0
    finally:
        server.stop()
