"""One stream validator per dialect, run on every streamed test.

They check what real clients depend on (see shared/clients/README.md):
numbering, exactly one terminal event, item lifecycle and identity, deltas
that add up to the final text, and the final output equal to the items that
were done. The OpenAI one also validates every event and the final Response
against the ``openai`` SDK's own pydantic types.
"""

from __future__ import annotations

import re
import typing
from typing import Any

from openai.types.responses import Response, ResponseError, ResponseStreamEvent
from pydantic import TypeAdapter

_EVENT = TypeAdapter(ResponseStreamEvent)

# The SDK types ``response.error.code`` as a closed enum; lmspd's failure
# codes (upstream_timeout, undeclared_tool, server_shutting_down, ...) are
# documented strings outside it, which clients read as strings (Codex maps
# some of them). The shape is checked with a stand-in code, the code itself
# as a plain machine token.
_SDK_ERROR_CODES = set(typing.get_args(ResponseError.model_fields["code"].annotation))


def _sdk_view(resp: dict[str, Any]) -> dict[str, Any]:
    error = resp.get("error")
    if isinstance(error, dict) and error.get("code") not in _SDK_ERROR_CODES:
        assert re.fullmatch(r"[a-z][a-z0-9_]{0,63}", str(error.get("code"))), f"bad error code {error!r}"
        return {**resp, "error": {**error, "code": "server_error"}}
    return resp

OPENAI_TERMINAL = {"response.completed", "response.incomplete", "response.failed"}
LMSP_TERMINAL = {"response.completed", "response.incomplete", "response.failed", "response.cancelled"}

# Open Responses ResponseResource: every key required (nullable ones as null).
RESPONSE_RESOURCE_REQUIRED = {
    "id", "object", "created_at", "completed_at", "status", "incomplete_details", "model",
    "previous_response_id", "instructions", "output", "error", "tools", "tool_choice", "truncation",
    "parallel_tool_calls", "text", "top_p", "presence_penalty", "frequency_penalty", "top_logprobs",
    "temperature", "reasoning", "user", "usage", "max_output_tokens", "max_tool_calls", "store",
    "background", "service_tier", "metadata", "safety_identifier", "prompt_cache_key",
}


def check_openai_response(resp: dict[str, Any]) -> None:
    missing = RESPONSE_RESOURCE_REQUIRED - resp.keys()
    assert not missing, f"Response lacks required keys {missing}"
    Response.model_validate(_sdk_view(resp))
    for item in resp["output"]:
        assert isinstance(item.get("id"), str) and item["id"], item
        if item["type"] == "message":
            for part in item["content"]:
                assert part["annotations"] == [] and part["logprobs"] == [], part
    if resp["usage"] is not None:
        u = resp["usage"]
        assert set(u["input_tokens_details"]) >= {"cached_tokens", "cache_write_tokens"}
        assert "reasoning_tokens" in u["output_tokens_details"]
        assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"]


def validate_openai_stream(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Validate a whole /v1/responses stream; return the final Response dict."""
    assert events, "empty stream"
    for i, ev in enumerate(events):
        assert ev["sequence_number"] == i, f"event {i} has sequence_number {ev['sequence_number']}"
        _EVENT.validate_python({**ev, "response": _sdk_view(ev["response"])} if "response" in ev else ev)
        assert "error" not in ev or ev["type"] == "error", "a normal event must not carry a top-level 'error'"
    assert events[0]["type"] == "response.created"
    # A background response that ends before the model takes it (cancelled
    # or cut off while queued) goes straight from created to its end.
    never_started = len(events) == 2 and events[0]["response"]["status"] == "queued"
    assert events[1]["type"] in ("response.in_progress", "response.queued") or never_started
    terminal = [e for e in events if e["type"] in OPENAI_TERMINAL]
    assert len(terminal) == 1 and terminal[0] is events[-1], [e["type"] for e in events]
    response_id = events[0]["response"]["id"]
    for ev in events:
        if "response" in ev:
            assert ev["response"]["id"] == response_id, "response identity changed"
            check_openai_response(ev["response"])

    added: list[dict] = []
    done: dict[int, dict] = {}
    text: dict[int, str] = {}
    args: dict[int, str] = {}
    custom: dict[int, str] = {}
    parts: set[int] = set()
    announced: dict[int, int] = {}
    for ev in events:
        kind = ev["type"]
        idx = ev.get("output_index")
        if kind == "response.output_item.added":
            assert idx == len(added), f"output_index {idx} added out of order"
            added.append(ev["item"])
        elif kind == "response.output_item.done":
            assert idx < len(added) and idx not in done
            assert ev["item"]["id"] == added[idx]["id"], "item identity changed between added and done"
            assert ev["item"]["type"] == added[idx]["type"]
            done[idx] = ev["item"]
        elif kind == "response.content_part.added":
            assert idx < len(added) and idx not in done
            # Each part is announced once: the item as added holds the parts
            # before it (a client appends each announced part).
            had = len(added[idx].get("content") or []) + announced.get(idx, 0)
            assert ev["content_index"] == had, f"content_index {ev['content_index']} announced after {had} parts"
            announced[idx] = announced.get(idx, 0) + 1
            parts.add(idx)
        elif kind == "response.output_text.delta":
            assert idx in parts, "output_text.delta before content_part.added"
            assert ev["item_id"] == added[idx]["id"] and idx not in done
            text[idx] = text.get(idx, "") + ev["delta"]
        elif kind == "response.output_text.done":
            assert ev["text"] == text.get(idx, ""), "output_text.done differs from the deltas"
        elif kind == "response.content_part.done":
            if ev["part"]["type"] == "output_text":
                assert ev["part"]["text"] == text.get(idx, "")
        elif kind == "response.function_call_arguments.delta":
            assert ev["item_id"] == added[idx]["id"] and idx not in done
            args[idx] = args.get(idx, "") + ev["delta"]
        elif kind == "response.function_call_arguments.done":
            assert ev["arguments"] == args.get(idx, ""), "arguments.done differs from the deltas"
        elif kind == "response.custom_tool_call_input.delta":
            custom[idx] = custom.get(idx, "") + ev["delta"]
        elif kind == "response.custom_tool_call_input.done":
            assert ev["input"] == custom.get(idx, "")
    assert set(done) == set(range(len(added))), "an item was added but never done"
    final = events[-1]["response"]
    assert final["output"] == [done[i] for i in range(len(added))], "final output differs from the done items"
    for i, item in done.items():
        if item["type"] == "message":
            assert "".join(p["text"] for p in item["content"]) == text.get(i, "")
        elif item["type"] == "function_call":
            assert item["arguments"] == args.get(i, "")
    return final


def validate_lmsp_stream(frames: list[Any]) -> dict[str, Any]:
    """Validate an LMSP stream of parsed SSE frames; return a summary."""
    assert frames, "empty stream"
    ids = [int(f.id) for f in frames]
    assert ids == list(range(1, len(frames) + 1)), f"event ids must be 1..n, got {ids}"
    names = [f.event for f in frames]
    assert names[0] == "response.created"
    terminal = [n for n in names if n in LMSP_TERMINAL]
    assert len(terminal) == 1 and names[-1] == terminal[0], names
    datas = [f.json() for f in frames]
    response_id = datas[0]["response_id"]
    assert all(d.get("response_id") == response_id for d in datas), "response_id changed"
    items: dict[int, dict] = {}
    done: dict[int, dict] = {}
    text: dict[str, str] = {}
    for name, d in zip(names, datas, strict=False):
        if name == "response.output_item.added":
            assert d["output_index"] == len(items)
            items[d["output_index"]] = d["item"]
        elif name == "response.output_text.delta":
            text[d["item_id"]] = text.get(d["item_id"], "") + d["delta"]
        elif name == "response.output_item.done":
            assert d["item"]["id"] == items[d["output_index"]]["id"]
            done[d["output_index"]] = d["item"]
    assert set(done) == set(items)
    for item in done.values():
        if item["type"] == "message":
            assert "".join(p["text"] for p in item["content"]) == text.get(item["id"], "")
    return {"status": datas[-1]["status"], "terminal": names[-1], "data": datas[-1],
            "output": [done[i] for i in sorted(done)], "names": names}
