"""Stored responses, previous_response_id chains, conversations and
item_reference through the whole app, in both dialects. The engine records
each conversation it was handed, so "the chain is the context" is asserted
on what the engine saw. (Reuse of the chain's KV needs the real model:
tests/e2e/test_stored_responses.py.)"""

from __future__ import annotations

from lmspd.core.events import Finished, TextDelta, Usage
from lmspd.engines.llama.speculation import DecodeStats
from support.engine import MODEL
from support.sse import parse_frames
from support.validate import check_openai_response, validate_lmsp_stream

SHORT = "What is 2+2?"


def body(text=SHORT, **extra):
    return {"model": MODEL, "input": text, "temperature": 0, "max_output_tokens": 24, **extra}


def texts(conversation) -> list[tuple[str, str]]:
    return [(getattr(i, "role", type(i).__name__), getattr(i, "text", "")) for i in conversation.items]


def test_stored_response_read_back_and_deleted(http):
    created = http.post("/v1/responses", json=body()).json()
    assert created["store"] is True  # OpenAI's default
    got = http.get(f"/v1/responses/{created['id']}")
    assert got.status_code == 200
    check_openai_response(got.json())
    assert got.json() == created

    items = http.get(f"/v1/responses/{created['id']}/input_items").json()
    assert items["object"] == "list" and items["has_more"] is False
    (item,) = items["data"]
    assert item["type"] == "message" and item["role"] == "user" and item["id"]
    assert item["content"] == [{"type": "input_text", "text": SHORT}]
    assert items["first_id"] == items["last_id"] == item["id"]

    # The same response in LMSP shapes.
    lm = http.get(f"/lmsp/v1/responses/{created['id']}")
    assert lm.status_code == 200 and lm.headers["lmsp-version"] == "1.0"
    assert lm.json()["output"][0]["content"][0]["text"] == created["output"][0]["content"][0]["text"]
    assert set(lm.json()) == {"id", "object", "created_at", "status", "model", "output", "usage", "error",
                              "incomplete_details"}

    deleted = http.delete(f"/v1/responses/{created['id']}")
    assert deleted.json() == {"id": created["id"], "object": "response.deleted", "deleted": True}
    for path in (f"/v1/responses/{created['id']}", f"/v1/responses/{created['id']}/input_items"):
        r = http.get(path)
        assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"
    assert http.delete(f"/v1/responses/{created['id']}").status_code == 404
    r = http.get(f"/lmsp/v1/responses/{created['id']}")
    assert r.status_code == 404 and r.json()["code"] == "response_not_found"
    assert r.headers["content-type"].startswith("application/problem+json")


def test_store_false_and_lmsp_default_keep_nothing(http):
    r = http.post("/v1/responses", json=body(store=False)).json()
    assert r["store"] is False
    assert http.get(f"/v1/responses/{r['id']}").status_code == 404
    lm = http.post("/lmsp/v1/responses", json=body()).json()  # LMSP: store defaults to false
    assert http.get(f"/lmsp/v1/responses/{lm['id']}").json()["code"] == "response_not_found"


def test_lmsp_stored_stream_and_chain(app, http):
    with http.stream("POST", "/lmsp/v1/responses", json=body(store=True, stream=True)) as r:
        frames = list(parse_frames(r.iter_lines()))
    summary = validate_lmsp_stream(frames)
    first_id = frames[0].json()["response_id"]
    got = http.get(f"/lmsp/v1/responses/{first_id}").json()
    assert got["status"] == summary["status"] and got["output"] == summary["output"]

    second = http.post("/lmsp/v1/responses", json=body("And 3+3?", store=True, previous_response_id=first_id))
    assert second.status_code == 200, second.text
    answer = summary["output"][0]["content"][0]["text"]
    assert texts(app.engine.conversations[-1]) == [("user", SHORT), ("assistant", answer), ("user", "And 3+3?")]

    r = http.post("/lmsp/v1/responses", json=body(previous_response_id="resp_nope"))
    assert r.status_code == 400 and r.json()["code"] == "previous_response_not_found"
    assert "resp_nope" in r.json()["detail"]


def test_three_turn_chain_is_the_context_and_input_items_are_the_turns_own(app, http):
    first = http.post("/v1/responses", json=body("My name is Ada.")).json()
    second = http.post("/v1/responses", json=body("What is my name?", previous_response_id=first["id"])).json()
    third = http.post("/v1/responses", json=body("Say it again.", previous_response_id=second["id"])).json()
    assert third["previous_response_id"] == second["id"]
    said = [r["output"][0]["content"][0]["text"] for r in (first, second)]
    assert texts(app.engine.conversations[-1]) == [
        ("user", "My name is Ada."), ("assistant", said[0]), ("user", "What is my name?"),
        ("assistant", said[1]), ("user", "Say it again.")]
    items = http.get(f"/v1/responses/{third['id']}/input_items").json()["data"]
    assert [i["content"][0]["text"] for i in items] == ["Say it again."]


def test_chain_errors_name_the_missing_response(http):
    r = http.post("/v1/responses", json=body(previous_response_id="resp_missing"))
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "previous_response_not_found" and err["param"] == "previous_response_id"
    assert "resp_missing" in err["message"]

    root = http.post("/v1/responses", json=body()).json()
    child = http.post("/v1/responses", json=body("Again.", previous_response_id=root["id"])).json()
    http.delete(f"/v1/responses/{root['id']}")
    r = http.post("/v1/responses", json=body("More.", previous_response_id=child["id"]))
    assert r.status_code == 400 and root["id"] in r.json()["error"]["message"]

    r = http.post("/v1/responses", json=body(previous_response_id=child["id"], conversation="conv_x"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"


def test_conversation_collects_turns(app, http):
    conv = http.post("/v1/conversations", json={"metadata": {"topic": "math"}, "items": [
        {"type": "message", "role": "system", "content": "Answer briefly."}]}).json()
    assert conv["object"] == "conversation" and conv["id"].startswith("conv_")
    assert conv["metadata"] == {"topic": "math"}

    first = http.post("/v1/responses", json=body(conversation=conv["id"])).json()
    assert first["conversation"] == {"id": conv["id"]}
    second = http.post("/v1/responses", json=body("And 3+3?", conversation={"id": conv["id"]})).json()
    assert second["conversation"] == {"id": conv["id"]}
    # The second turn's context is the conversation so far.
    assert [t[1] for t in texts(app.engine.conversations[-1]) if t[0] != "system"] == [
        SHORT, first["output"][0]["content"][0]["text"], "And 3+3?"]

    items = http.get(f"/v1/conversations/{conv['id']}/items", params={"order": "asc"}).json()["data"]
    kinds = [(i["type"], i["role"]) for i in items]
    assert kinds == [("message", "system"), ("message", "user"), ("message", "assistant"),
                     ("message", "user"), ("message", "assistant")]
    assert items[2]["id"] == first["output"][0]["id"]
    page = http.get(f"/v1/conversations/{conv['id']}/items", params={"limit": 2}).json()
    assert [i["id"] for i in page["data"]] == [items[4]["id"], items[3]["id"]] and page["has_more"]
    nxt = http.get(f"/v1/conversations/{conv['id']}/items", params={"limit": 2, "after": page["last_id"]}).json()
    assert [i["id"] for i in nxt["data"]] == [items[2]["id"], items[1]["id"]]

    added = http.post(f"/v1/conversations/{conv['id']}/items",
                      json={"items": [{"role": "user", "content": "Noted."}]}).json()
    (note,) = added["data"]
    assert http.get(f"/v1/conversations/{conv['id']}/items/{note['id']}").json() == note
    assert http.delete(f"/v1/conversations/{conv['id']}/items/{note['id']}").json()["id"] == conv["id"]
    assert http.get(f"/v1/conversations/{conv['id']}/items/{note['id']}").status_code == 404

    updated = http.post(f"/v1/conversations/{conv['id']}", json={"metadata": {"topic": "sums"}}).json()
    assert updated["metadata"] == {"topic": "sums"}
    assert http.delete(f"/v1/conversations/{conv['id']}").json() == {
        "id": conv["id"], "object": "conversation.deleted", "deleted": True}
    r = http.post("/v1/responses", json=body(conversation=conv["id"]))
    assert r.status_code == 404 and r.json()["error"]["code"] == "conversation_not_found"
    assert http.get(f"/v1/conversations/{conv['id']}").status_code == 404


def test_item_reference_resolves_stored_items(app, http):
    first = http.post("/v1/responses", json=body()).json()
    answer_id = first["output"][0]["id"]
    question_id = http.get(f"/v1/responses/{first['id']}/input_items").json()["data"][0]["id"]
    refs = [{"type": "item_reference", "id": question_id}, {"type": "item_reference", "id": answer_id},
            {"role": "user", "content": "And 3+3?"}]
    r = http.post("/v1/responses", json=body(refs))
    assert r.status_code == 200, r.text
    assert texts(app.engine.conversations[-1]) == [
        ("user", SHORT), ("assistant", first["output"][0]["content"][0]["text"]), ("user", "And 3+3?")]

    r = http.post("/v1/responses", json=body([{"type": "item_reference", "id": "msg_unknown"}]))
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "input[0]" and "msg_unknown" in err["message"]


def test_a_chain_through_a_compaction_is_the_reduced_window_in_both_dialects(app, http):
    """A stored chain holding a compaction item continues as the window it
    stands for (the client's own messages, the summary, what came after),
    whichever dialect continues it; never the turns it replaced."""
    from lmspd.core import compaction

    blob = compaction.seal(app.app.state.lmspd.sealer, "They asked about Oslo.")
    compacted = http.post("/v1/responses", json=body([
        {"role": "user", "content": "Tell me about Oslo."},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "OLD ANSWER"}]},
        {"type": "compaction", "encrypted_content": blob},
        {"role": "user", "content": "And Bergen?"},
    ]))
    assert compacted.status_code == 200, compacted.text
    first = compacted.json()["id"]
    for path in ("/v1/responses", "/lmsp/v1/responses"):
        extra = {"store": True} if path.startswith("/lmsp") else {}
        r = http.post(path, json=body("And Tromsø?", previous_response_id=first, **extra))
        assert r.status_code == 200, (path, r.text)
        seen = texts(app.engine.conversations[-1])
        assert ("assistant", "OLD ANSWER") not in seen, (path, seen)
        assert ("user", "Tell me about Oslo.") in seen and seen[-1] == ("user", "And Tromsø?")
        assert any(text.endswith("They asked about Oslo.") for _, text in seen)


def test_a_conversation_takes_a_compaction_item(app, http):
    """Conversation items are input items: a compaction item is accepted
    (opened with the server key, so a tampered one is a 400 naming it) and
    the conversation's next turn sees the window it stands for."""
    from lmspd.core import compaction

    blob = compaction.seal(app.app.state.lmspd.sealer, "They asked about Oslo.")
    items = [{"role": "user", "content": "Tell me about Oslo."},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "OLD ANSWER"}]},
             {"type": "compaction", "encrypted_content": blob}]
    r = http.post("/v1/conversations", json={"items": [*items[:2], {**items[2], "encrypted_content": blob[:-4]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "items[2].encrypted_content", r.text
    conv = http.post("/v1/conversations", json={"items": items[:2]}).json()
    added = http.post(f"/v1/conversations/{conv['id']}/items", json={"items": items[2:]})
    assert added.status_code == 200, added.text
    assert added.json()["data"][0]["type"] == "compaction"
    assert added.json()["data"][0]["encrypted_content"] == blob
    r = http.post("/v1/responses", json=body("And Bergen?", conversation=conv["id"]))
    assert r.status_code == 200, r.text
    seen = texts(app.engine.conversations[-1])
    assert ("assistant", "OLD ANSWER") not in seen and seen[0] == ("user", "Tell me about Oslo.")
    assert seen[1][1].endswith("They asked about Oslo.") and seen[-1] == ("user", "And Bergen?")


def test_a_stored_response_reads_back_with_its_precise_reason_and_extensions(http, engine):
    """What OpenAI's shape cannot say survives storage: the repetition
    guard's reason (/v1 says ``max_output_tokens``, its enum, and the reason
    itself in ``extensions["lmspd.incomplete"]``) and the lmspd extensions,
    which LMSP's GET rebuilds from the stored /v1 body."""
    stats = DecodeStats()
    stats.add("ngram", 4, 3)
    engine.script = lambda conversation: [TextDelta("again again"),
                                          Finished("repetition", Usage(input_tokens=3, output_tokens=2,
                                                                       decode_report=stats))]
    created = http.post("/v1/responses", json=body()).json()
    assert created["status"] == "incomplete"
    assert created["incomplete_details"] == {"reason": "max_output_tokens"}
    assert created["extensions"]["lmspd.incomplete"] == {"reason": "repetition"}
    assert created["extensions"]["lmspd.decode"] == stats.as_json()
    check_openai_response(created)
    assert http.get(f"/v1/responses/{created['id']}").json() == created

    lm = http.get(f"/lmsp/v1/responses/{created['id']}").json()
    assert lm["incomplete_details"] == {"reason": "repetition"}
    assert lm["extensions"] == {"lmspd.decode": stats.as_json()}

    posted = http.post("/lmsp/v1/responses", json=body(store=True)).json()
    assert posted["incomplete_details"] == {"reason": "repetition"}
    assert http.get(f"/lmsp/v1/responses/{posted['id']}").json() == posted


def test_a_response_cut_by_its_cap_carries_no_incomplete_extension(http):
    created = http.post("/v1/responses", json=body(max_output_tokens=2)).json()
    assert created["incomplete_details"] == {"reason": "max_output_tokens"}
    assert "lmspd.incomplete" not in (created.get("extensions") or {})
    lm = http.get(f"/lmsp/v1/responses/{created['id']}").json()
    assert lm["incomplete_details"] == {"reason": "max_output_tokens"}
