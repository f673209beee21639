"""One credential never reaches another's stored responses, tasks,
conversations or idempotency keys, and learns nothing from the 404 (the
KV-cache side of ownership needs the real model: tests/e2e/
test_idempotency_and_owners.py)."""

from __future__ import annotations

import uuid

from support.engine import MODEL, ScriptedEngine
from support.follow import follow
from support.inprocess import serving
from support.validate import validate_lmsp_stream


def body(text: str = "What is 2+2?", **extra):
    return {"model": MODEL, "input": text, "temperature": 0, "max_output_tokens": 16, **extra}


def test_one_credential_cannot_reach_anothers_state(tmp_path):
    # Long enough that the task and background response still run while Bob tries.
    engine = ScriptedEngine(tuple(f" w{i}" for i in range(400)), delay_s=0.01, max_concurrency=4)
    with serving(tmp_path, engine=engine, keys=["alice-key", "bob-key"], key="alice-key") as app:
        alice, bob, nobody = app.http, app.as_("bob-key"), app.as_(None)
        stored = alice.post("/v1/responses", json=body(max_output_tokens=3)).json()
        task = alice.post("/lmsp/v1/tasks", json=body(max_output_tokens=400)).json()
        background = alice.post("/v1/responses", json=body(background=True, max_output_tokens=400)).json()
        conv = alice.post("/v1/conversations", json={}).json()

        def gone(r, code):
            assert r.status_code == 404, r.text
            err = r.json().get("error", r.json())
            assert err["code"] == code

        rid, tid, bid, cid = stored["id"], task["id"], background["id"], conv["id"]
        gone(bob.get(f"/v1/responses/{rid}"), "response_not_found")
        gone(bob.get(f"/v1/responses/{rid}/input_items"), "response_not_found")
        gone(bob.get(f"/lmsp/v1/responses/{rid}"), "response_not_found")
        gone(bob.delete(f"/v1/responses/{rid}"), "response_not_found")
        gone(bob.get(f"/v1/responses/{bid}", params={"stream": "true"}), "response_not_found")
        gone(bob.post(f"/v1/responses/{bid}/cancel"), "response_not_found")
        gone(bob.get(f"/lmsp/v1/tasks/{tid}"), "task_not_found")
        gone(bob.get(f"/lmsp/v1/tasks/{tid}/events", params={"after": 0}), "task_not_found")
        gone(bob.post(f"/lmsp/v1/tasks/{tid}/cancel"), "task_not_found")
        gone(bob.get(f"/v1/conversations/{cid}"), "conversation_not_found")
        gone(bob.post(f"/v1/conversations/{cid}/items", json={"items": []}), "conversation_not_found")
        gone(bob.delete(f"/v1/conversations/{cid}"), "conversation_not_found")
        r = bob.post("/v1/responses", json=body(previous_response_id=rid))
        assert r.status_code == 400 and r.json()["error"]["code"] == "previous_response_not_found"
        r = bob.post("/v1/responses", json=body([{"type": "item_reference", "id": stored["output"][0]["id"]}]))
        assert r.status_code == 400
        r = bob.post("/v1/responses", json=body(conversation=cid))
        assert r.status_code == 404 and r.json()["error"]["code"] == "conversation_not_found"
        # The same message for an id that never existed: nothing is revealed.
        assert bob.get(f"/v1/responses/{rid}").json()["error"]["message"].replace(rid, "X") == \
            bob.get("/v1/responses/resp_never").json()["error"]["message"].replace("resp_never", "X")

        # Alice still has everything, and her work ran undisturbed until she stops it.
        assert alice.get(f"/v1/responses/{rid}").json() == stored
        assert alice.get(f"/lmsp/v1/tasks/{tid}").json()["finished_at"] is None
        assert alice.post(f"/lmsp/v1/tasks/{tid}/cancel").json()["status"] == "cancelled"
        assert alice.post(f"/v1/responses/{bid}/cancel").json()["status"] == "cancelled"
        _, frames, _ = follow(alice, f"/lmsp/v1/tasks/{tid}/events")
        assert validate_lmsp_stream(frames)["terminal"] == "response.cancelled"

        # Keys are per credential too: Bob's key does not replay Alice's reply.
        k = {"Idempotency-Key": f"test-{uuid.uuid4()}"}
        assert alice.post("/v1/responses", json=body(max_output_tokens=3), headers=k).status_code == 200
        r = bob.post("/v1/responses", json=body(max_output_tokens=3), headers=k)
        assert r.status_code == 200 and "idempotent-replayed" not in r.headers
        assert alice.delete(f"/v1/responses/{rid}").json()["deleted"] is True
        assert alice.get(f"/v1/conversations/{cid}").status_code == 200
        assert bob.get("/v1/responses/resp_x").status_code == 404
        assert nobody.get(f"/v1/responses/{bid}").status_code == 401
