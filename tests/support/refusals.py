"""The two Responses dialects' error shapes, asserted the same way by the
in-process and the end-to-end tests."""

from __future__ import annotations


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
