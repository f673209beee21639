"""Every refusal: status, code, dialect shape, and no generation started."""

from __future__ import annotations

import pytest
from support.server import MODEL


def gens(server):
    return server.generations()


def assert_openai_error(r, status, code, param=None):
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param


def assert_problem(r, status, code):
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    assert r.headers["lmsp-version"] == "1.0"
    p = r.json()
    assert p["status"] == status and p["code"] == code and p["title"] and p["detail"] and p["type"]


CASES = [
    # (description, request kwargs, status, code)
    ("invalid json", dict(content=b'{"model": ', headers={"content-type": "application/json"}), 400, "invalid_json"),
    ("not an object", dict(content=b'[1,2]', headers={"content-type": "application/json"}), 400, "invalid_json"),
    ("wrong media type", dict(content=b'{"model":"x","input":"hi"}', headers={"content-type": "text/plain"}),
     415, "unsupported_media_type"),
    ("too large", dict(content=b'{"input":"' + b"a" * (9 * 1024 * 1024) + b'"}',
                       headers={"content-type": "application/json"}), 413, "request_too_large"),
    ("unknown model", dict(json={"model": "no-such-model", "input": "hi"}), 404, "model_not_found"),
    ("context exceeded", dict(json={"model": MODEL, "input": "hi", "max_output_tokens": 100000}),
     400, "context_length_exceeded"),
    ("input too long", dict(json={"model": MODEL, "input": "word " * 6000}), 400, "context_length_exceeded"),
    ("deep json", dict(content=b'{"model":"x","metadata":' + b'[' * 100 + b']' * 100 + b'}',
                       headers={"content-type": "application/json"}), 400, "invalid_json"),
    ("bad temperature", dict(json={"model": MODEL, "input": "hi", "temperature": 5}), 400, "invalid_request"),
    ("media part", dict(json={"model": MODEL, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]}), 400, "unsupported_capability"),
]


@pytest.mark.parametrize("desc,kwargs,status,code", CASES, ids=[c[0] for c in CASES])
def test_openai_errors(server, http, desc, kwargs, status, code):
    before = gens(server)
    assert_openai_error(http.post("/v1/responses", **kwargs), status, code)
    assert gens(server) == before, "a refused request must not generate"


@pytest.mark.parametrize("desc,kwargs,status,code", CASES, ids=[c[0] for c in CASES])
def test_lmsp_errors(server, http, desc, kwargs, status, code):
    before = gens(server)
    assert_problem(http.post("/lmsp/v1/responses", **kwargs), status, code)
    assert gens(server) == before


def test_unknown_parameter_is_named(http):
    r = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "frobnicate": 1})
    assert_openai_error(r, 400, "unsupported_parameter", "frobnicate")
    r = http.post("/lmsp/v1/responses", json={"model": MODEL, "input": "hi", "instructions": "x"})
    assert_problem(r, 400, "unsupported_parameter")
    assert r.json()["param"] == "instructions"


def test_missing_required_field(http):
    assert_openai_error(http.post("/v1/responses", json={"input": "hi"}), 400, "invalid_request", "model")


def test_unsupported_lmsp_version(server, http):
    before = gens(server)
    r = http.post("/lmsp/v1/responses", json={"model": MODEL, "input": "hi"}, headers={"LMSP-Version": "2.0"})
    assert_problem(r, 400, "unsupported_version")
    assert gens(server) == before


def test_unknown_route_and_method(http):
    assert_openai_error(http.get("/v1/nothing"), 404, "not_found")
    assert_problem(http.delete("/lmsp/v1/models"), 405, "method_not_allowed")


def test_models_and_health(http):
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    lm = http.get("/lmsp/v1/models").json()["data"][0]
    assert lm["id"] == MODEL and lm["context_window"] == 4096
    assert set(lm["capabilities"]) >= {"streaming", "tools", "structured_output", "conversations", "reasoning",
                                       "tasks"}
    assert http.get("/health").json()["status"] == "ok"
