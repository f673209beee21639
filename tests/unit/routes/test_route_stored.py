"""Stored responses, previous_response_id chains, conversations and
item_reference through the whole app, in both dialects. The engine records
each conversation it was handed, so "the chain is the context" is asserted
on what the engine saw. (Reuse of the chain's KV needs the real model:
tests/e2e/test_stored_responses.py.)"""

from __future__ import annotations

import pytest

from lmspd.core.events import Finished, TextDelta, Usage
from lmspd.engines.llama.speculation import DecodeStats
from lmspd.store import open_store
from support.engine import MODEL
from support.inprocess import serving
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


def test_deleting_a_background_response_takes_its_task_and_events_and_a_retry_replays_nothing(app, http):
    """Its task (the request, the result) and its event log went on for
    days after a DELETE, and an Idempotency-Key retry of the create
    replayed the deleted output."""
    import json

    create = body("my private prompt", background=True, stream=True)
    with http.stream("POST", "/v1/responses", json=create, headers={"Idempotency-Key": "k1"}) as r:
        first = [f for f in parse_frames(r.iter_lines()) if f.data != "[DONE]"]
    response_id = json.loads(first[0].data)["response"]["id"]
    assert first[-1].event == "response.completed"
    assert app.store.get_task("local", response_id) is not None

    assert http.delete(f"/v1/responses/{response_id}").status_code == 200
    assert app.store.get_task("local", response_id) is None
    assert app.store.events_after("local", response_id, 0) is None
    with http.stream("POST", "/v1/responses", json=create, headers={"Idempotency-Key": "k1"}) as r:
        retried = r.read().decode()
        assert r.status_code == 404, retried
    assert json.loads(retried)["error"]["code"] == "response_not_found"


def test_delete_through_v1_leaves_an_lmsp_task_of_that_id_alone(tmp_path):
    """DELETE /v1/responses/<an LMSP task's id>: no such response, so a 404,
    and the task it names runs on (it was cancelled, then answered 404)."""
    from support.engine import ScriptedEngine
    from support.follow import wait_for
    from support.inprocess import serving

    engine = ScriptedEngine(tuple(f" w{i}" for i in range(100)), delay_s=0.005)
    with serving(tmp_path, engine=engine) as app:
        http = app.http
        task = http.post("/lmsp/v1/tasks", json=body(max_output_tokens=200)).json()
        wait_for(lambda: http.get(f"/lmsp/v1/tasks/{task['id']}").json()["status"] == "in_progress", timeout=10)
        r = http.delete(f"/v1/responses/{task['id']}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"
        done = wait_for(lambda: (t := http.get(f"/lmsp/v1/tasks/{task['id']}").json())["finished_at"] and t,
                        timeout=10)
    assert done["status"] == "completed" and engine.cancelled == 0


def test_a_background_response_whose_task_expired_is_still_one(tmp_path):
    """A background response is kept longer (30 days) than its task (7
    days): its stream then is 410 (its events are gone), and cancelling it
    returns it as it is, not a 400 saying it was not a background response."""
    import time

    from support.engine import ScriptedEngine
    from support.follow import wait_for
    from support.inprocess import serving

    with serving(tmp_path, engine=ScriptedEngine((" a",))) as app:
        http = app.http
        response_id = http.post("/v1/responses", json=body(background=True)).json()["id"]
        done = wait_for(lambda: (r := http.get(f"/v1/responses/{response_id}").json())["status"] == "completed"
                        and r, timeout=10)
        wait_for(lambda: app.store.get_task("local", response_id).terminal, timeout=10)  # its end written after
        pruned = app.store.prune(now=time.time() + 8 * 86400)
        assert pruned["tasks"] == 1 and pruned["responses"] == 0
        assert http.get(f"/v1/responses/{response_id}").json() == done

        r = http.get(f"/v1/responses/{response_id}", params={"stream": "true"})
        assert r.status_code == 410 and r.json()["error"]["code"] == "event_history_expired"
        assert r.json()["error"]["message"] == (f"The events of {response_id!r} are no longer kept; "
                                                "read the final result instead.")
        r = http.post(f"/v1/responses/{response_id}/cancel")
        assert r.status_code == 200 and r.json() == done


def test_conversation_item_ids_are_unique_so_the_sdk_pages_through_all(app, http):
    """A turn whose input references an item of its conversation added a
    second item of that id, and POST .../items took a client id twice: the
    listing, which resumes after an id, then skipped items (the SDK's
    auto-paging returned 3 of 6)."""
    from openai import OpenAI

    client = OpenAI(base_url="http://localhost/v1", api_key="unused", http_client=http, max_retries=0)
    conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": f"m{i}"}
                                              for i in range(3)])
    first = next(iter(client.conversations.items.list(conv.id, order="asc"))).id
    turn = client.responses.create(model=MODEL, conversation=conv.id, max_output_tokens=24,
                                   input=[{"type": "item_reference", "id": first},
                                          {"type": "message", "role": "user", "content": "again"}])
    # What the model saw is what the conversation lists: the referenced item twice.
    seen = [t[1] for t in texts(app.engine.conversations[-1]) if t[0] != "system"]
    assert seen == ["m0", "m1", "m2", "m0", "again"]
    whole = [i.id for i in client.conversations.items.list(conv.id, order="asc", limit=100)]
    assert len(whole) == len(set(whole)) == 6 and whole[-1] == turn.output[0].id
    for order in ("asc", "desc"):
        paged = [i.id for i in client.conversations.items.list(conv.id, order=order, limit=1)]
        assert paged == (whole if order == "asc" else whole[::-1])
    listed = http.get(f"/v1/conversations/{conv.id}/items", params={"order": "asc", "limit": 100}).json()["data"]
    assert [i["content"][0]["text"] for i in listed[:5]] == seen

    same = {"type": "message", "role": "user", "content": "d", "id": "msg_same"}
    for items, where in (([same, same], "items[1].id"), ([{**same, "id": "msg_new"}, {**same, "id": first}],
                                                          "items[1].id")):
        r = http.post(f"/v1/conversations/{conv.id}/items", json={"items": items})
        assert r.status_code == 400 and r.json()["error"]["param"] == where, r.text
    r = http.post("/v1/conversations", json={"items": [same, same]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "items[1].id"
    assert [i.id for i in client.conversations.items.list(conv.id, order="asc", limit=100)] == whole


def test_conversation_metadata_null_clears_it(http):
    """The SDK declares ``metadata`` Required[Optional[...]]: null clears it."""
    from openai import OpenAI

    client = OpenAI(base_url="http://localhost/v1", api_key="unused", http_client=http, max_retries=0)
    conv = client.conversations.create(metadata={"topic": "math"})
    assert client.conversations.update(conv.id, metadata=None).metadata == {}
    assert client.conversations.retrieve(conv.id).metadata == {}
    r = http.post(f"/v1/conversations/{conv.id}", json={})
    assert r.status_code == 400 and r.json()["error"]["param"] == "metadata"


# An id holding a NUL, in a path, a query or a body, and the answer it gets:
# that of an unknown id, whichever store is behind the app.
NUL_ID_REQUESTS = [
    ("GET", "/v1/responses/resp_%00x", None, (404, "response_not_found")),
    ("GET", "/v1/responses/resp_%00x/input_items", None, (404, "response_not_found")),
    ("DELETE", "/v1/responses/resp_%00x", None, (404, "response_not_found")),
    ("POST", "/v1/responses/resp_%00x/cancel", None, (404, "response_not_found")),
    ("GET", "/v1/responses/{response}/input_items?after=a%00", None, (400, "invalid_request")),
    ("GET", "/lmsp/v1/responses/resp_%00x", None, (404, "response_not_found")),
    ("GET", "/v1/conversations/conv_%00x", None, (404, "conversation_not_found")),
    ("POST", "/v1/conversations/conv_%00x", {"metadata": {}}, (404, "conversation_not_found")),
    ("DELETE", "/v1/conversations/conv_%00x", None, (404, "conversation_not_found")),
    ("GET", "/v1/conversations/conv_%00x/items", None, (404, "conversation_not_found")),
    ("POST", "/v1/conversations/conv_%00x/items", {"items": []}, (404, "conversation_not_found")),
    ("GET", "/v1/conversations/{conversation}/items?after=a%00", None, (400, "invalid_request")),
    ("GET", "/v1/conversations/{conversation}/items/msg_%00", None, (404, "not_found")),
    ("DELETE", "/v1/conversations/{conversation}/items/msg_%00", None, (404, "not_found")),
    ("GET", "/lmsp/v1/tasks/task_%00x", None, (404, "task_not_found")),
    ("GET", "/lmsp/v1/tasks/task_%00x/events", None, (404, "task_not_found")),
    ("POST", "/lmsp/v1/tasks/task_%00x/cancel", None, (404, "task_not_found")),
    ("POST", "/v1/responses", body(previous_response_id="resp_\0"), (400, "previous_response_not_found")),
    ("POST", "/lmsp/v1/responses", body(previous_response_id="resp_\0"), (400, "previous_response_not_found")),
    ("POST", "/v1/responses", body(conversation="conv_\0"), (404, "conversation_not_found")),
    ("POST", "/v1/responses", body(conversation={"id": "conv_\0"}), (404, "conversation_not_found")),
    ("POST", "/v1/responses", body([{"type": "item_reference", "id": "msg_\0"}]), (400, "invalid_request")),
]


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_an_id_holding_a_nul_is_unknown_on_either_store(tmp_path, request, backend):
    """PostgreSQL's text cannot hold a NUL: psycopg refused each of these
    lookups (DataError, a 500 and a traceback) where SQLite found nothing."""
    target = str(tmp_path / "lmspd.db") if backend == "sqlite" else request.getfixturevalue("pg_database")
    with serving(tmp_path, store=open_store(target)) as app:
        http = app.http
        ids = {"response": http.post("/v1/responses", json=body()).json()["id"],
               "conversation": http.post("/v1/conversations", json={}).json()["id"]}
        for method, path, sent, expected in NUL_ID_REQUESTS:
            r = http.request(method, path.format(**ids), json=sent, headers={"LMSP-Version": "1.0"})
            problem = r.json()
            code = problem["error"]["code"] if "error" in problem else problem["code"]
            assert (r.status_code, code) == expected, (method, path, sent, r.text)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_an_item_id_holding_a_nul_is_replaced_on_either_store(tmp_path, request, backend):
    """A client's item id PostgreSQL cannot hold: the response, generated,
    could not be stored (a 503 losing it), and items added to a
    conversation were a 500. Each gets an id of its own, as an item sent
    without one does."""
    target = str(tmp_path / "lmspd.db") if backend == "sqlite" else request.getfixturevalue("pg_database")
    item = {"type": "message", "role": "user", "content": "a\0b", "id": "msg_\0"}
    with serving(tmp_path, store=open_store(target)) as app:
        http = app.http
        conversation = http.post("/v1/conversations", json={"items": [item], "metadata": {"k\0": "v\0"}})
        assert conversation.status_code == 200, conversation.text
        conversation_id = conversation.json()["id"]
        added = http.post(f"/v1/conversations/{conversation_id}/items", json={"items": [item]})
        assert added.status_code == 200, added.text
        created = http.post("/v1/responses", json=body([item], conversation=conversation_id))
        assert created.status_code == 200, created.text
        inputs = http.get(f"/v1/responses/{created.json()['id']}/input_items").json()["data"]
        items = http.get(f"/v1/conversations/{conversation_id}/items", params={"order": "asc"}).json()["data"]
    assert [i["content"][0]["text"] for i in inputs] == ["a\0b"]
    assert [i.get("content", [{}])[0].get("text") for i in items][:3] == ["a\0b"] * 3
    ids = [i["id"] for i in inputs + items]
    assert all(i.startswith("msg_") and "\0" not in i for i in ids) and len(set(ids)) == len(items)


def test_polling_a_running_background_response_reads_its_live_state_not_the_store(tmp_path):
    """A client polls GET /v1/responses/{id} while it runs: the answer is
    the live state (the output so far), and the stored body, as large as
    the request's echo and parsed holding the interpreter lock, is not
    read for it. An LMSP task's id is still no /v1 response."""
    from support.engine import ScriptedEngine
    from support.follow import wait_for

    engine = ScriptedEngine(tuple(f" w{i}" for i in range(200)), delay_s=0.01)
    with serving(tmp_path, engine=engine) as app:
        http = app.http
        response_id = http.post("/v1/responses", json=body(background=True, max_output_tokens=300)).json()["id"]
        task = http.post("/lmsp/v1/tasks", json=body(max_output_tokens=300)).json()
        wait_for(lambda: http.get(f"/v1/responses/{response_id}").json()["status"] == "in_progress", timeout=10)
        reads: list[str] = []
        store = app.app.state.lmspd.store  # what the routes call (the metrics' timing wrapper)
        get_response = store.get_response

        def counted(owner, rid):
            reads.append(rid)
            return get_response(owner, rid)

        store.get_response = counted
        polled = http.get(f"/v1/responses/{response_id}").json()
        assert polled["status"] == "in_progress" and polled["id"] == response_id
        assert reads == []
        r = http.get(f"/v1/responses/{task['id']}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"
        done = wait_for(lambda: (r := http.get(f"/v1/responses/{response_id}").json())["status"] == "completed"
                        and r, timeout=30)
    assert done["output"][0]["content"][0]["text"].startswith(" w0 w1")
