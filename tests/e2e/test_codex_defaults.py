"""Codex out of the box: ``lmspd serve`` with no ``--ctx`` accepts Codex's
first request (the captures in tests/fixtures/clients/codex-cli), which the old
default of 8192 refused with ``context_length_exceeded``, and reports the
window it has where Codex and LMSP clients read it.

Acceptance is checked up to the stream's start (200 and
``response.created``, after every refusal would have happened); the whole
replay, prefill and all, is ``test_client_fixtures.py::test_replay_codex``
(slow: a cold ~9k-token prefill takes many minutes on a loaded machine).
``default_server`` (tests/conftest.py) is started without ``--ctx`` (its
one flag is an output ceiling), so the context window is the default.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from lmspd.config import DEFAULT_CTX
from support.clients import CODEX_CAPTURES
from support.server import MODEL
from support.sse import parse_frames

CAPTURES = sorted(CODEX_CAPTURES.glob("*/*-request.json"))


def codex_body(path: Path) -> dict:
    wire = json.loads(path.read_text())
    body = wire["body"] if isinstance(wire["body"], dict) else json.loads(wire["body"])
    return {**body, "model": MODEL, "max_output_tokens": 4}


@pytest.mark.parametrize("path", CAPTURES, ids=[f"{p.parent.name}/{p.name[:3]}" for p in CAPTURES])
def test_codex_request_is_accepted_with_the_default_context(default_server, path):
    body = codex_body(path)
    with httpx.Client(base_url=default_server.url, timeout=120) as client:
        counted = client.post("/v1/responses/input_tokens", json=body).json()["input_tokens"]
        # About the old default window (the largest capture is past it),
        # well inside the new one.
        assert 8000 < counted < DEFAULT_CTX - 4096
        with client.stream("POST", "/v1/responses", json=body) as r:
            assert r.status_code == 200, r.read()
            first = next(parse_frames(r.iter_lines()))
            assert first.event == "response.created"
        # Leaving cancels the generation (the full replay is the slow test).


def test_the_largest_capture_did_not_fit_the_old_default(default_server):
    with httpx.Client(base_url=default_server.url, timeout=120) as client:
        counts = [client.post("/v1/responses/input_tokens", json=codex_body(p)).json()["input_tokens"]
                  for p in CAPTURES]
    assert max(counts) > 8192, counts


def test_the_default_window_is_reported_everywhere(default_server):
    with httpx.Client(base_url=default_server.url, timeout=60) as client:
        v1 = client.get("/v1/models").json()
        lmsp = client.get("/lmsp/v1/models").json()
    assert v1["data"][0]["context_window"] == DEFAULT_CTX == 32768
    assert v1["models"][0]["context_window"] == DEFAULT_CTX
    assert lmsp["data"][0]["context_window"] == DEFAULT_CTX
