"""/lmsp/v1/responses with httpx: LMSP 1.0 shapes, JSON and SSE."""

from __future__ import annotations

from support.server import MODEL
from support.sse import parse_frames
from support.validate import validate_lmsp_stream


def lmsp_body(**extra):
    return {"model": MODEL, "input": [{"type": "message", "role": "user",
                                       "content": [{"type": "input_text", "text": "Describe the sea in one sentence."}]}],
            "temperature": 0, **extra}


def test_json_response_shape(http):
    r = http.post("/lmsp/v1/responses", json=lmsp_body(max_output_tokens=40), headers={"LMSP-Version": "1.0"})
    assert r.status_code == 200, r.text
    assert r.headers["lmsp-version"] == "1.0"
    body = r.json()
    assert set(body) >= {"id", "object", "created_at", "status", "model", "output", "usage", "error",
                         "incomplete_details"}
    assert body["object"] == "response" and body["id"].startswith("resp_")
    assert body["status"] in ("completed", "incomplete") and body["error"] is None
    msg = body["output"][0]
    assert msg["type"] == "message" and msg["role"] == "assistant" and msg["id"].startswith("msg_")
    assert msg["content"][0]["type"] == "output_text" and msg["content"][0]["text"]
    u = body["usage"]
    assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"]


def test_stream_ids_and_events(http):
    with http.stream("POST", "/lmsp/v1/responses", json=lmsp_body(stream=True, max_output_tokens=40)) as r:
        assert r.status_code == 200
        assert r.headers["lmsp-version"] == "1.0"
        frames = list(parse_frames(r.iter_lines()))
    summary = validate_lmsp_stream(frames)
    names = summary["names"]
    assert names[:3] == ["response.created", "response.output_item.added", "response.output_text.delta"]
    assert set(names) <= {"response.created", "response.output_item.added", "response.output_text.delta",
                          "response.output_item.done", "response.completed", "response.incomplete"}
    created = frames[0].json()
    assert created["status"] == "in_progress" and set(created) == {"response_id", "status"}
    delta = frames[2].json()
    assert set(delta) == {"response_id", "item_id", "delta"}
    last = summary["data"]
    assert set(last) >= {"response_id", "status", "usage"}
    assert summary["output"][0]["content"][0]["text"]


def test_max_output_tokens_incomplete(http):
    with http.stream("POST", "/lmsp/v1/responses", json=lmsp_body(stream=True, max_output_tokens=3)) as r:
        frames = list(parse_frames(r.iter_lines()))
    summary = validate_lmsp_stream(frames)
    assert summary["terminal"] == "response.incomplete"
    assert summary["data"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert summary["data"]["usage"]["output_tokens"] == 3


def test_string_input_and_response_format_text(http):
    r = http.post("/lmsp/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 4,
                                              "response_format": {"type": "text"}, "store": False})
    assert r.status_code == 200, r.text
    body = r.json()
    # The string is one user message; the reply, plain text.
    [msg] = body["output"]
    assert msg["type"] == "message" and [c["type"] for c in msg["content"]] == ["output_text"]
    assert 0 < body["usage"]["output_tokens"] <= 4
    if body["status"] == "incomplete":
        assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    else:
        assert body["status"] == "completed"


def test_lmsp_version_1x_accepted(http):
    r = http.post("/lmsp/v1/responses", json=lmsp_body(max_output_tokens=2), headers={"LMSP-Version": "1.3"})
    assert r.status_code == 200
    # A 1.x client is answered in the version this server speaks.
    assert r.headers["lmsp-version"] == "1.0" and r.json()["object"] == "response"
