"""Refusals that depend on the real model (its tokenizer and context
window), and the model listing: status, code, dialect shape, and no
generation started. Every other refusal is tested in-process, in each
dialect: tests/unit/routes/test_route_errors.py."""

from __future__ import annotations

import pytest

from support.refusals import assert_openai_error, assert_problem
from support.server import MODEL


def gens(server):
    return server.generations()


CASES = [
    # (description, request kwargs, status, code)
    ("context exceeded", dict(json={"model": MODEL, "input": "hi", "max_output_tokens": 100000}),
     400, "context_length_exceeded"),
    ("input too long", dict(json={"model": MODEL, "input": "word " * 6000}), 400, "context_length_exceeded"),
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


def test_models_and_health(http):
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    lm = http.get("/lmsp/v1/models").json()["data"][0]
    assert lm["id"] == MODEL and lm["context_window"] == 4096
    assert set(lm["capabilities"]) >= {"streaming", "tools", "structured_output", "conversations", "reasoning",
                                       "tasks"}
    assert http.get("/health").json()["status"] == "ok"
