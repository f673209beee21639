"""The continuation KV cache against a real server: where each request's
prefix came from (``cache_source``) and how many tokens it prefilled.

Every test runs on both bundled models: SmolLM2 (plain attention, its KV
can be cut anywhere) and Gemma 3 270M (sliding-window attention, a KV that
cannot be trimmed below its window: lmspd keeps exact-state checkpoints).
One server per model for the module; tests that need their own flags start
their own on the same model."""

from __future__ import annotations

import json

import httpx
import pytest

from support.server import MODEL as SMOLLM2
from support.server import ServerProcess

GEMMA3 = "gemma3-270m"

WEATHER = {"type": "function", "name": "get_weather", "description": "Get the weather for a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}, "strict": True}


@pytest.fixture(scope="module")
def kv_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kv")


@pytest.fixture(scope="module", params=[SMOLLM2, GEMMA3])
def model(request):
    return request.param


def serve(model, *args):
    server = ServerProcess("--model", model, *args)
    server.model = model  # type: ignore[attr-defined]
    return server.start(timeout=180)


@pytest.fixture(scope="module")
def srv(kv_dir, model):
    server = serve(model, "--ctx", "2048", "--kv-disk-dir", str(kv_dir / model), "--max-queue", "4")
    yield server
    server.stop()


def post(server, body, **extra):
    r = httpx.post(server.url + "/v1/responses", json={"model": server.model, "temperature": 0, **body, **extra},
                   timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def last(server):
    return server.health()["models"][server.model]


def replay(items, response):
    """What a stateless client sends back: its input, then the output items verbatim."""
    return items + response["output"]


def test_tool_loop_continues_by_call_ids(srv):
    # On Gemma 3 the grammar of tool_choice "required" ends the call with
    # <eos>, where a replay renders <end_of_turn>: that token stays out of
    # the KV, so the call's state still ends where the replay goes on.
    items = [{"role": "user", "content": "What is the weather in Oslo?"}]
    first = post(srv, {"input": items, "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False})
    call = first["output"][-1]
    assert call["type"] == "function_call"
    context_tokens = last(srv)["last_reused_tokens"] + last(srv)["last_prefilled_tokens"]
    items = replay(items, first) + [{"type": "function_call_output", "call_id": call["call_id"],
                                     "output": json.dumps({"temp_c": 3})}]
    second = post(srv, {"input": items, "tools": [WEATHER], "max_output_tokens": 8})
    stats = last(srv)
    assert stats["last_cache_source"] == "tool-output-ids" and stats["last_cache_detail"] == "ids=1"
    # Only the tool-result turn is prefilled: the prompt and the sampled call stay in the KV.
    assert stats["last_prefilled_tokens"] < 100, stats  # the turn markup, the call id, the result
    assert stats["last_reused_tokens"] >= context_tokens + first["usage"]["output_tokens"]
    assert second["usage"]["input_tokens_details"]["cached_tokens"] == stats["last_reused_tokens"]


def test_a_branch_after_a_sampled_call_keeps_the_whole_call_turn(srv):
    # The client re-runs the tool and replays the call with another result:
    # a branch that parts from the live state after the call. The KV holds
    # the model's own tokens of the call, which a re-tokenized replay does
    # not reproduce (SmolLM2: the token prefix ends inside the call); the
    # point where the tool-result turn began still lets the branch keep it
    # all (Gemma 3: the checkpoint at the end of the call turn).
    items = [{"role": "user", "content": "What is the weather in Bergen?"}]
    first = post(srv, {"input": items, "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False})
    call = first["output"][-1]
    assert call["type"] == "function_call"

    def result(temp_c):
        return replay(items, first) + [{"type": "function_call_output", "call_id": call["call_id"],
                                        "output": json.dumps({"temp_c": temp_c})}]

    post(srv, {"input": result(3), "tools": [WEATHER], "max_output_tokens": 8})
    whole_call_turn = last(srv)["last_reused_tokens"]
    branch = post(srv, {"input": result(-12), "tools": [WEATHER], "max_output_tokens": 8})
    stats = last(srv)
    assert stats["last_reused_tokens"] == whole_call_turn, stats
    assert branch["usage"]["input_tokens_details"]["cached_tokens"] == whole_call_turn
    assert stats["last_prefilled_tokens"] < 100, stats  # only the tool-result turn


def test_tool_output_only_request_continues_live_state(srv):
    first = post(srv, {"input": "Weather in Lima?", "tools": [WEATHER], "tool_choice": "required",
                       "parallel_tool_calls": False})
    call = first["output"][-1]
    post(srv, {"input": [{"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}],
               "tools": [WEATHER], "max_output_tokens": 4})
    assert last(srv)["last_cache_source"] == "tool-output-ids"
    assert last(srv)["last_prefilled_tokens"] < 100


def test_codex_style_full_visible_replay(srv):
    items = [{"type": "message", "role": "developer", "id": "msg_dev",
              "content": [{"type": "input_text", "text": "You are a terse assistant."}]},
             {"type": "message", "role": "user", "id": "msg_u1",
              "content": [{"type": "input_text", "text": "Name a planet."}]}]
    first = post(srv, {"input": items, "max_output_tokens": 12, "store": False, "prompt_cache_key": "thread-a"})
    items = replay(items, first) + [{"type": "message", "role": "user", "id": "msg_u2",
                                     "content": [{"type": "input_text", "text": "Another one."}]}]
    second = post(srv, {"input": items, "max_output_tokens": 6, "store": False, "prompt_cache_key": "thread-a"})
    stats = last(srv)
    assert stats["last_cache_source"] == "visible-prefix", stats
    assert stats["last_prefilled_tokens"] < 20
    assert second["usage"]["input_tokens_details"]["cached_tokens"] > first["usage"]["input_tokens"]


def session_turns(prefix: str):
    return [{"role": "user", "content": f"{prefix}: tell me one fact about rivers."}]


def test_two_sessions_interleaved_stay_resident(srv):
    """Each session keeps its own sequence: switching between them neither
    captures nor restores a KV."""
    a_items, b_items = session_turns("Alice"), session_turns("Bob")
    a1 = post(srv, {"input": a_items, "max_output_tokens": 10})
    b1 = post(srv, {"input": b_items, "max_output_tokens": 10})
    before = last(srv)["cache"]
    a_items = replay(a_items, a1) + [{"role": "user", "content": "And lakes?"}]
    post(srv, {"input": a_items, "max_output_tokens": 4})
    stats = last(srv)
    assert stats["last_cache_source"] == "visible-prefix" and stats["last_prefilled_tokens"] < 20, stats
    b_items = replay(b_items, b1) + [{"role": "user", "content": "And seas?"}]
    post(srv, {"input": b_items, "max_output_tokens": 4})
    stats = last(srv)
    assert stats["last_cache_source"] == "visible-prefix" and stats["last_prefilled_tokens"] < 20, stats
    after = stats["cache"]
    assert (after["evictions"], after["ram_restores"]) == (before["evictions"], before["ram_restores"])


def test_two_sessions_on_one_sequence_continue_from_ram(model):
    """With --parallel 1 the other session's turn evicts the first to RAM;
    its next turn is restored from there and prefills only the new suffix."""
    srv = serve(model, "--ctx", "1024", "--parallel", "1", "--kv-disk-space-mb", "0")
    try:
        a_items, b_items = session_turns("Alice"), session_turns("Bob")
        a1 = post(srv, {"input": a_items, "max_output_tokens": 10})
        b1 = post(srv, {"input": b_items, "max_output_tokens": 10})
        a_items = replay(a_items, a1) + [{"role": "user", "content": "And lakes?"}]
        post(srv, {"input": a_items, "max_output_tokens": 4})
        stats = last(srv)
        assert stats["last_cache_source"] == "ram" and stats["last_prefilled_tokens"] < 20, stats
        b_items = replay(b_items, b1) + [{"role": "user", "content": "And seas?"}]
        post(srv, {"input": b_items, "max_output_tokens": 4})
        stats = last(srv)
        assert stats["last_cache_source"] == "ram" and stats["last_prefilled_tokens"] < 20, stats
        assert stats["cache"]["ram_restores"] == 2
    finally:
        srv.stop()


def text_of(response):
    return response["output"][0]["content"][0]["text"]


def test_restart_resumes_from_disk_and_restores_exactly(kv_dir, model):
    """Turn 2 of one conversation, generated at temperature 0 three ways:
    continuing the live KV, restored from a RAM session, restored from a
    disk checkpoint after a restart. The restored KV is byte-identical to
    the live one, so all three generate the same text. One sequence each
    (--parallel 1): the unrelated question must evict the first session."""
    r1 = [{"role": "system", "content": "You answer in one short sentence. " * 6},
          {"role": "user", "content": "What is a volcano?"}]
    reference = serve(model, "--ctx", "2048", "--parallel", "1", "--kv-disk-space-mb", "0")
    try:
        first = post(reference, {"input": r1, "max_output_tokens": 12})
        r2 = replay(r1, first) + [{"role": "user", "content": "Where are they found?"}]
        live = post(reference, {"input": r2, "max_output_tokens": 12})
        assert last(reference)["last_cache_source"] == "visible-prefix"
    finally:
        reference.stop()

    disk = kv_dir / f"restart-{model}"
    a = serve(model, "--ctx", "2048", "--parallel", "1", "--kv-disk-dir", str(disk))
    try:
        assert text_of(post(a, {"input": r1, "max_output_tokens": 12})) == text_of(first)
        post(a, {"input": "An unrelated question about trees.", "max_output_tokens": 4})
        from_ram = post(a, {"input": r2, "max_output_tokens": 12})
        stats = last(a)
        assert stats["last_cache_source"] == "ram" and stats["cache"]["ram_restores"] == 1, stats
        assert a.terminate() in (0, -15)  # the shutdown checkpoint is written here
    finally:
        a.stop()

    b = serve(model, "--ctx", "2048", "--parallel", "1", "--kv-disk-dir", str(disk))
    try:
        from_disk = post(b, {"input": r2, "max_output_tokens": 12})
        stats = last(b)
        # Gemma 3 (non-trimmable) also left the end-of-input checkpoint of r2
        # on disk, which matches it whole: restored from disk either way.
        assert stats["last_cache_source"] == "disk" or stats["last_cache_detail"].startswith("at=input from=disk"), stats
        assert stats["cache"]["disk_restores"] == 1
        # The history came back from disk; only the new user turn was prefilled.
        assert stats["last_prefilled_tokens"] < 20, stats
    finally:
        b.stop()
    assert text_of(from_ram) == text_of(live)
    assert text_of(from_disk) == text_of(live)


def test_no_prefix_cache_flag_prefills_everything(model):
    srv = serve(model, "--ctx", "1024", "--no-prefix-cache")
    try:
        items = [{"role": "user", "content": "Say one word."}]
        first = post(srv, {"input": items, "max_output_tokens": 4})
        post(srv, {"input": replay(items, first) + [{"role": "user", "content": "Again."}], "max_output_tokens": 4})
        stats = last(srv)
        assert stats["last_cache_source"] == "cold" and stats["last_reused_tokens"] == 0
        assert stats["cache"]["enabled"] is False
    finally:
        srv.stop()


def test_tool_output_for_replaced_state_is_refused(model):
    """With no RAM to keep it, a tool-output-only request whose live state was
    replaced gets a clear 400 instead of a prompt that starts with an orphan."""
    srv = serve(model, "--ctx", "1024", "--parallel", "1", "--kv-ram-mb", "0", "--kv-disk-space-mb", "0")
    try:
        first = post(srv, {"input": "Weather in Quito?", "tools": [WEATHER], "tool_choice": "required",
                           "parallel_tool_calls": False})
        call_id = first["output"][-1]["call_id"]
        post(srv, {"input": "Something else entirely.", "max_output_tokens": 2})
        r = httpx.post(srv.url + "/v1/responses", json={
            "model": model, "tools": [WEATHER],
            "input": [{"type": "function_call_output", "call_id": call_id, "output": "rain"}]}, timeout=60)
        assert r.status_code == 400, r.text
        assert "replay" in r.json()["error"]["message"].lower()
    finally:
        srv.stop()
