"""Every request real clients sent (../shared/clients/*/captured, copied into tests/fixtures/clients) replayed
against a real server with the bundled model, and accepted (issue 3).

A replay keeps the captured body as it is (ids, reasoning items with
``encrypted_content``, ``item_reference`` items, custom / namespace /
web_search / tool_search tools, ``include``, ``prompt_cache_key``,
``client_metadata``...) except for ``model`` (the bundled model) and a small
``max_output_tokens`` cap. It must give 200 and a complete, valid stream (or
a valid Response for JSON requests).

Two kinds of captured request continue state the capture server kept, which
this server never saw:

- ``previous_response_id`` (openai-agents ``run_prev_id``): replayed as is it
  gets 400 ``previous_response_not_found`` naming the parameter;
- ``item_reference`` (Vercel AI SDK with ``store`` left on): replayed as is
  it gets 400 ``invalid_request`` naming ``input[i]`` and the id, because
  nothing is stored under that id (DESIGN.md: clear 400s, no silent
  rebuilds; OpenAI answers an unknown reference the same way).

Both are then replayed as the chain the client made: the predecessor request
(the previous file of the same capture) runs here first, forced to call its
tool where the capture server's reply was a call, and the captured ids of
that reply (response, items, call ids) are mapped to the ones this server
minted. A reference to a reasoning item (this model has none) points at the
predecessor's first output item. Those replays get 200.

Codex's requests carry a ~20k-character developer prompt and ~8k characters
of tool schemas: 8.2k-9.1k tokens in this model's fallback tool format, more
than the shared server's 4096-token window and more than the model's 8192
(llama.cpp runs past the trained length; only acceptance is checked). They
run on the server with the default window (no ``--ctx``: what ``./dev.sh serve``
gives Codex out of the box) that the Codex CLI's tests share, paired so
that the second request of each pair reuses the first one's prefix from the
KV cache.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from support.clients import CLIENTS
from support.server import MODEL
from support.sse import parse_frames
from support.validate import check_openai_response, validate_openai_stream

FIXTURES = sorted(CLIENTS.glob("*/captured/**/*-request.json"))
CODEX = [f for f in FIXTURES if f.relative_to(CLIENTS).parts[0] == "codex-cli"]
OTHERS = [f for f in FIXTURES if f not in CODEX]
MAX_OUTPUT_TOKENS = 16
CODEX_MAX_OUTPUT_TOKENS = 4
MARKUP = re.compile(r"</?tool_(call|response)")


def fixture_id(path: Path) -> str:
    rel = path.relative_to(CLIENTS)
    return "/".join((rel.parts[0], *rel.parts[2:-1], rel.name.split("-")[0]))


def captured(path: Path) -> tuple[str, dict[str, Any]]:
    wire = json.loads(path.read_text())
    assert wire["method"] == "POST" and wire["path"] == "/v1/responses"
    body = wire["body"] if isinstance(wire["body"], dict) else json.loads(wire["body"])
    return wire["path"], body


def replay_body(body: dict[str, Any], cap: int = MAX_OUTPUT_TOKENS) -> dict[str, Any]:
    return {**body, "model": MODEL, "max_output_tokens": min(body.get("max_output_tokens") or cap, cap)}


def references(body: dict[str, Any]) -> list[tuple[int, str]]:
    items = body.get("input") if isinstance(body.get("input"), list) else []
    return [(i, it["id"]) for i, it in enumerate(items) if isinstance(it, dict) and it.get("type") == "item_reference"]


def needs_stored_state(body: dict[str, Any]) -> bool:
    return bool(body.get("previous_response_id") or references(body))


def send(http, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """One replay: 200 and a complete stream (or Response); the final Response."""
    if body.get("stream"):
        with http.stream("POST", path, json=body) as r:
            assert r.status_code == 200, r.read()
            assert r.headers["content-type"].startswith("text/event-stream")
            frames = list(parse_frames(r.iter_lines()))
        assert frames[-1].data == "[DONE]"
        events = [f.json() for f in frames[:-1]]
        final = validate_openai_stream(events)
    else:
        r = http.post(path, json=body)
        assert r.status_code == 200, r.text
        final = r.json()
        check_openai_response(final)
    assert final["status"] in ("completed", "incomplete"), final.get("error")
    assert final["error"] is None
    for item in final["output"]:
        if item["type"] == "message":
            assert not MARKUP.search(item["content"][0]["text"]), item
    return final


@pytest.fixture(scope="module")
def http(server):
    """The shared server, with room for a cold 1.5k-token prefill (pi's
    prompts) on a loaded machine."""
    with httpx.Client(base_url=server.url, timeout=600) as client:
        yield client


@pytest.mark.parametrize("path", OTHERS, ids=[fixture_id(f) for f in OTHERS])
def test_replay(http, path):
    wire_path, body = captured(path)
    body = replay_body(body)
    if not needs_stored_state(body):
        send(http, wire_path, body)
        return
    r = http.post(wire_path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    if body.get("previous_response_id"):
        assert err["code"] == "previous_response_not_found" and err["param"] == "previous_response_id"
        assert body["previous_response_id"] in err["message"]
    else:
        [(index, ref)] = references(body)
        assert err["code"] == "invalid_request" and err["param"] == f"input[{index}]"
        assert ref in err["message"] and "not stored" in err["message"]


# -- chains: the predecessor first, then the request with this server's ids -------------


def predecessor(path: Path) -> Path:
    number = int(path.name.split("-")[0])
    [prev] = path.parent.glob(f"{number - 1:03d}-*-request.json")
    return prev


def captured_reply(request: Path) -> dict[str, Any]:
    """The capture server's final Response for a captured request."""
    stem = request.name.split("-")[0]
    [reply] = request.parent.glob(f"{stem}-*-reply.*")
    if reply.suffix == ".json":
        return json.loads(reply.read_text())
    frames = [f for f in parse_frames(reply.read_text().splitlines()) if f.data != "[DONE]"]
    return [f.json() for f in frames if f.json()["type"] == "response.completed"][0]["response"]


def id_map(theirs: dict[str, Any], ours: dict[str, Any]) -> dict[str, str]:
    """Captured ids -> this server's: the response, items of the same type in
    order, and call ids; an item with no counterpart (reasoning) maps to our
    first output item."""
    mapping = {theirs["id"]: ours["id"]}
    for kind in {i["type"] for i in theirs["output"]}:
        their_items = [i for i in theirs["output"] if i["type"] == kind]
        our_items = [i for i in ours["output"] if i["type"] == kind]
        for k, item in enumerate(their_items):
            mine = our_items[k] if k < len(our_items) else ours["output"][0]
            mapping[item["id"]] = mine["id"]
            if "call_id" in item and "call_id" in mine:
                mapping[item["call_id"]] = mine["call_id"]
    return mapping


def remap(value: Any, mapping: dict[str, str]) -> Any:
    if isinstance(value, dict):
        return {k: (mapping.get(v, v) if k in ("id", "call_id", "previous_response_id") and isinstance(v, str)
                    else remap(v, mapping)) for k, v in value.items()}
    if isinstance(value, list):
        return [remap(v, mapping) for v in value]
    return value


CHAINED = [f for f in OTHERS if needs_stored_state(captured(f)[1])]


@pytest.mark.parametrize("path", CHAINED, ids=[fixture_id(f) for f in CHAINED])
def test_replay_as_a_chain(http, path):
    first = predecessor(path)
    first_path, first_body = captured(first)
    theirs = captured_reply(first)
    # Greedy: the captured bodies leave temperature at its default (1.0),
    # and a sampled ``city`` string now and then ran past the cap, leaving
    # the predecessor incomplete (CI, 2026-12-01). The chain is under test
    # here, not sampling.
    first_body = replay_body(first_body, cap=60) | {"temperature": 0}
    if any(i["type"] == "function_call" for i in theirs["output"]):
        first_body |= {"tool_choice": "required", "parallel_tool_calls": False}
    assert first_body.get("store") is not False, "a chain needs its predecessor stored"
    ours = send(http, first_path, first_body)
    assert ours["status"] == "completed"

    wire_path, body = captured(path)
    mapped = remap(replay_body(body), id_map(theirs, ours))
    for index, ref in references(mapped):
        assert ref in {i["id"] for i in ours["output"]}, (index, ref)
    if body.get("previous_response_id"):
        assert mapped["previous_response_id"] == ours["id"]
    final = send(http, wire_path, mapped)
    assert final["previous_response_id"] == mapped.get("previous_response_id")


# -- Codex: prompts larger than the shared server's window -------------------------------


@pytest.fixture(scope="module")
def codex_http(default_server):
    """The server with the default window (tests/conftest.py), which the other
    Codex tests share: Codex's instructions are prefilled there once per
    run. No ``--ctx``: what ``./dev.sh serve`` gives Codex out of the box."""
    with httpx.Client(base_url=default_server.url, timeout=1800) as client:
        yield client


@pytest.mark.slow
@pytest.mark.parametrize("path", CODEX, ids=[fixture_id(f) for f in CODEX])
def test_replay_codex(codex_http, path):
    wire_path, body = captured(path)
    assert body["stream"] is True and {"web_search"} <= {t["type"] for t in body["tools"]}
    final = send(codex_http, wire_path, replay_body(body, cap=CODEX_MAX_OUTPUT_TOKENS))
    assert final["usage"]["input_tokens"] > 8000
