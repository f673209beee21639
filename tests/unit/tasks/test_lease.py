"""An instance's lease does not depend on its event loop: a loop that stalls
longer than the lease (a long decode, a store call on the loop) must not let
another instance of a shared store take it for dead and fail its live tasks
(and release its idempotency keys, so that retried work runs twice)."""

from __future__ import annotations

import threading
import time

from starlette.testclient import TestClient

from lmspd.store.postgres import PostgresStore
from lmspd.tasks.recovery import reap
from support.engine import ScriptedEngine
from support.inprocess import MODEL, make_app

LEASE_S = 1.0


def test_a_stalled_event_loop_keeps_its_tasks(tmp_path, pg_database) -> None:
    here = PostgresStore(pg_database, lease_s=LEASE_S)
    elsewhere = PostgresStore(pg_database, lease_s=LEASE_S)
    engine = ScriptedEngine(tuple(f" w{i}" for i in range(80)), delay_s=0.05)
    app, _ = make_app(tmp_path, store=here, engine=engine)
    reaped: list[int] = []
    with TestClient(app, base_url="http://localhost") as http:
        r = http.post("/lmsp/v1/tasks", json={"model": MODEL, "input": "hi"}, headers={"LMSP-Version": "1.0"})
        assert r.status_code == 202, r.text
        task_id = r.json()["id"]
        # Another instance sweeps for dead instances while this one's loop
        # is stalled for three leases.
        sweeper = threading.Timer(2.5 * LEASE_S, lambda: reaped.append(reap(elsewhere)))
        sweeper.start()
        assert http.portal is not None
        http.portal.call(time.sleep, 3 * LEASE_S)
        sweeper.join()
        assert reaped == [0], "the other instance took this one's running task for a dead instance's"
        deadline = time.monotonic() + 30
        while (task := http.get(f"/lmsp/v1/tasks/{task_id}").json())["status"] not in ("completed", "failed"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert task["status"] == "completed", task
    elsewhere.close()
