"""Ownership of KV state against the real model: one credential's request
never continues from (or reports cached tokens of) another's KV.

Idempotency-Key and ownership of stored state (responses, tasks,
conversations, keys) are protocol behaviour, tested in-process:
tests/unit/routes/test_route_idempotency.py and test_route_owners.py.
"""

from __future__ import annotations

import httpx

from support.server import ALICE, BOB, MODEL

WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Get the weather for a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
                "strict": True}


def test_one_credential_never_continues_anothers_kv_state(keyed_server):
    """The KV cache is per credential: Bob's identical prompt is prefilled
    cold (a cached-token count would reveal Alice's prompt), and a tool
    output for Alice's call finds no state for Bob to continue."""
    srv = keyed_server
    with httpx.Client(base_url=srv.url, timeout=120, headers={"Authorization": f"Bearer {ALICE}"}) as alice, \
            httpx.Client(base_url=srv.url, timeout=120, headers={"Authorization": f"Bearer {BOB}"}) as bob:
        kv_state_stays_per_credential(srv, alice, bob)


def kv_state_stays_per_credential(srv, alice: httpx.Client, bob: httpx.Client) -> None:
    srv.wait_idle()

    def usage(client, text: str) -> dict:
        r = client.post("/v1/responses", json={"model": MODEL, "input": text, "temperature": 0,
                                               "max_output_tokens": 4, "store": False})
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    # Long enough (> 64 tokens) that a repeated prompt may reuse a trimmed
    # sequence at all (shorter shared prefixes are prefilled, not trimmed).
    secret = ("Alice's secret plan for the weekend: buy seven blue kites and fly them over the harbour, "
              "then row to the island, count the lighthouses, and write every number in a green notebook "
              "that nobody else may read.")
    prompt_tokens = usage(alice, secret)["input_tokens"]
    usage(bob, "Hello there.")  # Bob's own state: it shares only the template's opening with the secret
    bob_cached = usage(bob, secret)["input_tokens_details"]["cached_tokens"]
    alice_cached = usage(alice, secret)["input_tokens_details"]["cached_tokens"]
    assert alice_cached >= prompt_tokens - 1  # hers is still remembered for her
    assert bob_cached < prompt_tokens - 12, (bob_cached, prompt_tokens)  # none of Alice's words

    first = alice.post("/v1/responses", json={
        "model": MODEL, "input": "Weather in Oslo?", "tools": [WEATHER_TOOL], "tool_choice": "required",
        "parallel_tool_calls": False, "temperature": 0, "max_output_tokens": 32, "store": False}).json()
    call = next(o for o in first["output"] if o["type"] == "function_call")
    only_output = {"model": MODEL, "tools": [WEATHER_TOOL], "temperature": 0, "max_output_tokens": 4, "store": False,
                   "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": "Sunny"}]}
    r = bob.post("/v1/responses", json=only_output)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].call_id", r.text
    r = alice.post("/v1/responses", json=only_output)
    assert r.status_code == 200 and r.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0, r.text
