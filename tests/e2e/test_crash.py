"""kill -9 while a task streams, then restart on the same data directory:
nothing stays running, nothing finished is lost, the database is sound."""

from __future__ import annotations

import sqlite3
import uuid
from pathlib import Path

import httpx

from support.follow import LONG, SHORT, follow, openai_events, wait_for
from support.server import MODEL, ServerProcess
from support.validate import validate_lmsp_stream, validate_openai_stream


def body(text: str = SHORT, **extra):
    return {"model": MODEL, "input": text, "temperature": 0, "max_output_tokens": 16, **extra}


def test_kill_9_while_a_task_streams(tmp_path: Path):
    data_dir = tmp_path / "data"
    key = {"Idempotency-Key": f"crash-{uuid.uuid4()}"}
    srv = ServerProcess("--ctx", "1024", data_dir=str(data_dir)).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as http:
            # Finished before the crash: a task, a stored response, a keyed reply.
            sibling = http.post("/lmsp/v1/tasks", json=body()).json()
            _, sibling_log, _ = follow(http, f"/lmsp/v1/tasks/{sibling['id']}/events")
            validate_lmsp_stream(sibling_log)
            sibling_done = wait_for(lambda: (t := http.get(f"/lmsp/v1/tasks/{sibling['id']}").json())["finished_at"]
                                    and t)
            stored = http.post("/v1/responses", json=body()).json()
            keyed = http.post("/v1/responses", json=body(), headers=key)
            assert keyed.status_code == 200

            # Cut off: a task mid-stream, and a background response queued behind it.
            running = http.post("/lmsp/v1/tasks", json=body(LONG, max_output_tokens=400)).json()
            queued = http.post("/v1/responses", json=body(LONG, background=True, max_output_tokens=400)).json()
            _, head, _ = follow(http, f"/lmsp/v1/tasks/{running['id']}/events", stop_after=5)
            assert [f.event for f in head][-1] == "response.output_text.delta"
        srv.proc.kill()
        srv.proc.wait(30)
    finally:
        srv.stop()

    srv = ServerProcess("--ctx", "1024", data_dir=str(data_dir)).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as http:
            task = http.get(f"/lmsp/v1/tasks/{running['id']}").json()
            assert task["status"] == "failed" and task["finished_at"] is not None
            assert task["error"]["code"] == "server_restarted"
            assert task["result"]["status"] == "failed"
            _, log, _ = follow(http, f"/lmsp/v1/tasks/{running['id']}/events")
            summary = validate_lmsp_stream(log)  # every item closed, one terminal event
            assert summary["terminal"] == "response.failed"
            assert summary["data"]["error"]["code"] == "server_restarted"
            assert [(f.id, f.data) for f in log[:5]] == [(f.id, f.data) for f in head]
            assert task["result"]["output"] == summary["output"]

            bg = http.get(f"/v1/responses/{queued['id']}").json()
            assert bg["status"] == "failed" and bg["error"]["code"] == "server_restarted"
            _, frames, _ = follow(http, f"/v1/responses/{queued['id']}", params={"stream": "true"})
            assert validate_openai_stream(openai_events(frames)) == bg

            # Everything finished before the crash is as it was.
            assert http.get(f"/lmsp/v1/tasks/{sibling['id']}").json() == sibling_done
            _, again, _ = follow(http, f"/lmsp/v1/tasks/{sibling['id']}/events")
            assert [(f.id, f.event, f.data) for f in again] == [(f.id, f.event, f.data) for f in sibling_log]
            assert http.get(f"/v1/responses/{stored['id']}").json() == stored
            replay = http.post("/v1/responses", json=body(), headers=key)
            assert replay.content == keyed.content and replay.headers["idempotent-replayed"] == "true"
            assert srv.generations() == 0, "nothing was generated again after the restart"
    finally:
        srv.stop()

    with sqlite3.connect(data_dir / "lmspd.sqlite3") as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        running_rows = db.execute("SELECT COUNT(*) FROM tasks WHERE status IN ('queued', 'in_progress')").fetchone()
        assert running_rows[0] == 0
