"""Every refusal the core makes, in each Responses dialect: status, code,
the dialect's error shape, and no generation started. (Refusals that depend
on the real model's tokenizer and context window, and the model listing,
stay in tests/e2e/test_errors.py.)"""

from __future__ import annotations

import pytest

from support.engine import MODEL
from support.refusals import assert_openai_error, assert_problem

CASES = [
    # (description, request kwargs, status, code)
    ("invalid json", dict(content=b'{"model": ', headers={"content-type": "application/json"}), 400, "invalid_json"),
    ("not an object", dict(content=b'[1,2]', headers={"content-type": "application/json"}), 400, "invalid_json"),
    ("wrong media type", dict(content=b'{"model":"x","input":"hi"}', headers={"content-type": "text/plain"}),
     415, "unsupported_media_type"),
    ("too large", dict(content=b'{"input":"' + b"a" * (9 * 1024 * 1024) + b'"}',
                       headers={"content-type": "application/json"}), 413, "request_too_large"),
    ("unknown model", dict(json={"model": "no-such-model", "input": "hi"}), 404, "model_not_found"),
    ("deep json", dict(content=b'{"model":"x","metadata":' + b'[' * 100 + b']' * 100 + b'}',
                       headers={"content-type": "application/json"}), 400, "invalid_json"),
    ("bad temperature", dict(json={"model": MODEL, "input": "hi", "temperature": 5}), 400, "invalid_request"),
    ("media part", dict(json={"model": MODEL, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]}), 400, "unsupported_capability"),
]


@pytest.mark.parametrize("desc,kwargs,status,code", CASES, ids=[c[0] for c in CASES])
def test_openai_errors(app, http, desc, kwargs, status, code):
    assert_openai_error(http.post("/v1/responses", **kwargs), status, code)
    assert app.engine.prepared == app.generations() == 0, "a refused request must not reach the engine"


@pytest.mark.parametrize("desc,kwargs,status,code", CASES, ids=[c[0] for c in CASES])
def test_lmsp_errors(app, http, desc, kwargs, status, code):
    assert_problem(http.post("/lmsp/v1/responses", **kwargs), status, code)
    assert app.engine.prepared == app.generations() == 0


def test_unknown_parameter_is_named(http):
    r = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "frobnicate": 1})
    assert_openai_error(r, 400, "unsupported_parameter", "frobnicate")
    r = http.post("/lmsp/v1/responses", json={"model": MODEL, "input": "hi", "instructions": "x"})
    assert_problem(r, 400, "unsupported_parameter")
    assert r.json()["param"] == "instructions"


def test_missing_required_field(http):
    assert_openai_error(http.post("/v1/responses", json={"input": "hi"}), 400, "invalid_request", "model")


def test_null_is_the_default_of_every_optional_field(http):
    """OpenAI's schema makes its optional fields nullable, and clients built
    from it (or from LMSP's) send ``null`` for what they leave unset."""
    from lmspd.dialects.openai_responses import CreateResponse

    optional = [name for name, f in CreateResponse.model_fields.items() if not f.is_required()]
    for name in optional:
        r = http.post("/v1/responses", json={"model": MODEL, "input": "hi", name: None})
        assert r.status_code == 200, (name, r.text)
        assert r.headers["content-type"].startswith("application/json"), "stream: null is not a stream"
    for name in ("stream", "store", "max_output_tokens", "temperature", "tools", "previous_response_id"):
        r = http.post("/lmsp/v1/responses", json={"model": MODEL, "input": "hi", name: None})
        assert r.status_code == 200, (name, r.text)
        assert r.json()["id"] and r.headers["content-type"].startswith("application/json")
    # store: null on LMSP is LMSP's default, false: nothing kept.
    rid = r.json()["id"]
    assert http.get(f"/lmsp/v1/responses/{rid}").status_code == 404
    kept = http.post("/lmsp/v1/responses", json={"model": MODEL, "input": "hi", "store": True}).json()["id"]
    assert http.get(f"/lmsp/v1/responses/{kept}").status_code == 200


def test_unsupported_lmsp_version(app, http):
    r = http.post("/lmsp/v1/responses", json={"model": MODEL, "input": "hi"}, headers={"LMSP-Version": "2.0"})
    assert_problem(r, 400, "unsupported_version")
    assert app.generations() == 0


def test_unknown_route_and_method(http):
    assert_openai_error(http.get("/v1/nothing"), 404, "not_found")
    assert_problem(http.delete("/lmsp/v1/models"), 405, "method_not_allowed")


def test_an_accepted_request_does_reach_the_engine(app, http):
    """The counters the refusals above assert on do count."""
    assert http.post("/v1/responses", json={"model": MODEL, "input": "hi"}).status_code == 200
    assert app.engine.prepared == app.generations() == 1
