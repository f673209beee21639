"""Cache-miss diagnostics against a real server: each reason lmspd names,
with the divergence point, in ``extensions["lmspd.cache"]`` (Responses) and
Anthropic's ``diagnostics.cache_miss_reason`` (/v1/messages); and the two
cache-killer repairs (Claude Code's ``cch=`` billing line, a reordered tool
list), on by default, each with its flag to turn it off."""

from __future__ import annotations

import httpx
import pytest

from support.server import MODEL, ServerProcess

SYSTEM = "You are a careful assistant. Answer in one short sentence, plainly. " * 6
TOOLS = [{"type": "function", "name": name, "description": f"Tool {name}.",
          "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}
         for name in ("alpha", "beta", "gamma")]


@pytest.fixture(scope="module")
def srv():
    server = ServerProcess("--ctx", "2048").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def unrepaired():
    server = ServerProcess("--ctx", "2048", "--keep-billing-header", "--keep-tool-order").start()
    yield server
    server.stop()


def post(server, body):
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL, "temperature": 0, "max_output_tokens": 4,
                                                       "store": False, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def cache_of(response):
    return response["extensions"]["lmspd.cache"]


def messages(server, body):
    r = httpx.post(server.url + "/v1/messages", json={"model": MODEL, "max_tokens": 4, "temperature": 0, **body},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_continuation_reports_no_miss(srv):
    items = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a colour."}]
    first = post(srv, {"input": items})
    second = post(srv, {"input": items + first["output"] + [{"role": "user", "content": "Another."}]})
    cache = cache_of(second)
    assert cache["source"] == "visible-prefix" and cache["miss_reason"] is None, cache
    assert cache["reused"] == second["usage"]["input_tokens_details"]["cached_tokens"]


def test_edited_earlier_message_is_messages_changed_at_its_item(srv):
    items = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a fruit, please."}]
    first = post(srv, {"input": items})
    post(srv, {"input": items + first["output"] + [{"role": "user", "content": "And a vegetable?"}]})
    edited = [items[0], {"role": "user", "content": "Name a tree, please."}] + first["output"]
    cache = cache_of(post(srv, {"input": edited + [{"role": "user", "content": "And a vegetable?"}]}))
    assert cache["miss_reason"] == "messages_changed", cache
    assert cache["divergence"]["item"] == 1, cache
    # The prompts part inside item 1: everything before it was reused.
    assert cache["divergence"]["token"] == cache["longest_prefix"] > 64
    assert abs(cache["reused"] - cache["divergence"]["token"]) <= 1, cache


def test_changed_system_prompt_is_system_changed(srv):
    items = [{"role": "system", "content": "You are terse. " + SYSTEM}, {"role": "user", "content": "Hi there."}]
    post(srv, {"input": items})
    changed = [{"role": "system", "content": "You are verbose. " + SYSTEM}, items[1]]
    cache = cache_of(post(srv, {"input": changed}))
    assert cache["miss_reason"] == "system_changed", cache
    assert cache["divergence"]["token"] > 0 and cache["prefilled"] > 64


def test_reuse_off_is_reported(srv):
    items = [{"role": "user", "content": "Say yes."}]
    first = post(srv, {"input": items})
    cache = cache_of(post(srv, {"input": items + first["output"] + [{"role": "user", "content": "Again."}],
                                "extensions": {"lmspd.cache": {"reuse": False}}}))
    assert cache["source"] == "cold" and cache["miss_reason"] == "reuse_off", cache


def test_reordered_tools_hit_the_cache(srv):
    items = [{"role": "user", "content": "Which tool fits sorting a list?"}]
    first = post(srv, {"input": items, "tools": TOOLS})
    second = post(srv, {"input": items + first["output"] + [{"role": "user", "content": "Why?"}],
                        "tools": list(reversed(TOOLS))})
    cache = cache_of(second)
    assert cache["source"] == "visible-prefix" and cache["miss_reason"] is None, cache


def test_reordered_tools_without_the_repair_are_tools_reordered(unrepaired):
    items = [{"role": "user", "content": "Which tool fits sorting a list?"}]
    first = post(unrepaired, {"input": items, "tools": TOOLS})
    second = post(unrepaired, {"input": items + first["output"] + [{"role": "user", "content": "Why?"}],
                               "tools": list(reversed(TOOLS))})
    cache = cache_of(second)
    assert cache["miss_reason"] == "tools_reordered", cache


def claude_code_system(nonce):
    """Claude Code's system blocks: the billing line first, with a nonce
    that changes on every request."""
    return [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.3.abc; cc_entrypoint=cli; cch={nonce};"},
            {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude. " + SYSTEM,
             "cache_control": {"type": "ephemeral"}}]


def claude_code_turns(server):
    turn1 = [{"role": "user", "content": [{"type": "text", "text": "List the files."}]}]
    first = messages(server, {"system": claude_code_system("a1b2c"), "messages": turn1})
    turn2 = turn1 + [{"role": "assistant", "content": first["content"]},
                     {"role": "user", "content": [{"type": "text", "text": "Now the hidden ones."}]}]
    return first, messages(server, {"system": claude_code_system("f9e8d"), "messages": turn2})


def test_claude_code_billing_nonce_is_stripped_and_turn_two_hits(srv):
    first, second = claude_code_turns(srv)
    assert second["usage"]["cache_read_input_tokens"] > first["usage"]["input_tokens"], second["usage"]
    assert "diagnostics" not in second


def test_claude_code_billing_nonce_without_the_repair_is_a_system_miss(unrepaired):
    _first, second = claude_code_turns(unrepaired)
    assert second["diagnostics"]["cache_miss_reason"]["type"] == "system_changed", second
    assert second["diagnostics"]["cache_miss_reason"]["cache_missed_input_tokens"] > 64
    unrepaired.wait_for_log("miss_reason=system_nonce")


def test_a_state_another_session_evicted_is_named():
    """One sequence and no RAM or disk to keep a state in: session B's turn
    takes A's sequence, and A's next turn says so (log line included)."""
    server = ServerProcess("--ctx", "2048", "--parallel", "1", "--kv-ram-mb", "0", "--kv-disk-space-mb", "0").start()
    try:
        items = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Session A: name a river."}]
        first = post(server, {"input": items})
        post(server, {"input": "Session B: something else entirely."})
        again = post(server, {"input": items + first["output"] + [{"role": "user", "content": "Another."}]})
        cache = cache_of(again)
        assert cache["miss_reason"] == "state_evicted" and cache["evicted_by"] == "another_session", cache
        assert cache["divergence"]["token"] > 64 and cache["reused"] < 16, cache  # the template's opening at most
        server.wait_for_log("miss_reason=state_evicted .*evicted_by=another_session")
    finally:
        server.stop()
