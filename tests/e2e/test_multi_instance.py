"""Two lmspd instances on one PostgreSQL store (``--store postgresql://``):
a task started on A is followed live, resumed and cancelled through B; one
Idempotency-Key sent to both at once runs once; and when A dies (kill -9),
B fails its task within the lease instead of leaving it running."""

from __future__ import annotations

import threading
import time
import uuid

import httpx
import pytest

from support.follow import LONG, follow, wait_for
from support.postgres import Databases
from support.server import MODEL, ServerProcess
from support.validate import validate_lmsp_stream

LEASE_S = 3.0


def body(text: str = LONG, **extra):
    return {"model": MODEL, "input": text, "temperature": 0, "max_output_tokens": 64, **extra}


@pytest.fixture(scope="module")
def shared_dsn(pg_cluster):
    dbs = Databases(pg_cluster)
    dsn = dbs.create()
    yield dsn
    dbs.drop(dsn)


@pytest.fixture(scope="module")
def pair(shared_dsn):
    """Instances A and B on one database (A may be killed by the last test)."""
    # One thread each: two llama.cpp processes on a shared 2-core machine
    # stall at every OpenMP barrier otherwise (see bench/README.md).
    args = ("--ctx", "1024", "--threads", "1", "--store", shared_dsn, "--store-lease-s", str(LEASE_S))
    a = ServerProcess(*args).start()
    try:
        b = ServerProcess(*args).start()
    except BaseException:
        a.stop()
        raise
    yield a, b
    a.stop()
    b.stop()


def timed_follow(client: httpx.Client, path: str, out: dict, **kw) -> None:
    """``follow``, noting when each frame arrived."""
    from support.sse import parse_frames

    frames, times = [], []
    with client.stream("GET", path, **kw) as r:
        out["status"] = r.status_code
        for frame in parse_frames(r.iter_lines()):
            frames.append(frame)
            times.append(time.monotonic())
    out["frames"], out["times"] = frames, times


def test_task_on_a_is_followed_live_and_resumed_through_b(pair):
    a, b = pair
    with httpx.Client(base_url=a.url, timeout=300) as on_a, httpx.Client(base_url=b.url, timeout=300) as on_b:
        r = on_a.post("/lmsp/v1/tasks", json=body(max_output_tokens=48))
        assert r.status_code == 202, r.text
        task_id = r.json()["id"]
        events = f"/lmsp/v1/tasks/{task_id}/events"
        from_a: dict = {}
        from_b: dict = {}
        readers = [threading.Thread(target=timed_follow, args=(on_a, events, from_a)),
                   threading.Thread(target=timed_follow, args=(on_b, events, from_b))]
        for t in readers:
            t.start()
        # A reader on B drops after three events and resumes with Last-Event-ID.
        status, head, _ = follow(on_b, events, stop_after=3)
        assert status == 200 and [f.id for f in head] == ["1", "2", "3"]
        _, rest, _ = follow(on_b, events, headers={"Last-Event-ID": "3"})
        for t in readers:
            t.join(300)

        whole_a, whole_b = from_a["frames"], from_b["frames"]
        summary = validate_lmsp_stream(whole_a)
        assert summary["terminal"] == "response.completed" or summary["terminal"] == "response.incomplete"
        as_tuples = lambda frames: [(f.id, f.event, f.data) for f in frames]  # noqa: E731
        # In order, without gap or duplicate, the very events A wrote.
        assert as_tuples(whole_b) == as_tuples(whole_a)
        assert rest[0].id == "4" and as_tuples(head + rest) == as_tuples(whole_a)
        assert [int(f.id) for f in whole_b] == list(range(1, len(whole_b) + 1))
        # Live: B delivered the first text before A had written the last event.
        first_delta = next(i for i, f in enumerate(whole_b) if f.event == "response.output_text.delta")
        assert from_b["times"][first_delta] < from_a["times"][-1]
        # Both instances read the same finished task.
        done = wait_for(lambda: (t := on_b.get(f"/lmsp/v1/tasks/{task_id}").json())["finished_at"] and t)
        assert done["last_event_id"] == len(whole_a)
        assert on_a.get(f"/lmsp/v1/tasks/{task_id}").json() == done
        assert a.generations() >= 1 and b.generations() == 0, "B only read; A ran the task"


def test_cancel_through_b_reaches_the_task_on_a(pair):
    a, b = pair
    with httpx.Client(base_url=a.url, timeout=300) as on_a, httpx.Client(base_url=b.url, timeout=300) as on_b:
        task_id = on_a.post("/lmsp/v1/tasks", json=body(max_output_tokens=400)).json()["id"]
        events = f"/lmsp/v1/tasks/{task_id}/events"
        _, head, _ = follow(on_b, events, stop_after=4)
        assert head[-1].event == "response.output_text.delta", "the task is generating on A"
        started = time.monotonic()
        r = on_b.post(f"/lmsp/v1/tasks/{task_id}/cancel")
        assert r.status_code == 200, r.text
        # B answers once A has ended the task, not before.
        assert r.json()["status"] == "cancelled" and r.json()["finished_at"] is not None
        assert time.monotonic() - started < 10
        _, log, _ = follow(on_b, events)
        summary = validate_lmsp_stream(log)
        assert summary["terminal"] == "response.cancelled"
        assert on_a.get(f"/lmsp/v1/tasks/{task_id}").json()["status"] == "cancelled"
        a.wait_idle(300)


def test_one_idempotency_key_on_both_instances_runs_once(pair):
    a, b = pair
    key = {"Idempotency-Key": f"pair-{uuid.uuid4()}"}
    request = {"model": MODEL, "input": "Say hello.", "temperature": 0, "max_output_tokens": 8}
    before = a.generations() + b.generations()
    barrier = threading.Barrier(2)
    replies: dict[str, httpx.Response] = {}

    def post(name: str, url: str) -> None:
        with httpx.Client(base_url=url, timeout=300) as client:
            barrier.wait()
            replies[name] = client.post("/v1/responses", json=request, headers=key)

    threads = [threading.Thread(target=post, args=("a", a.url)), threading.Thread(target=post, args=("b", b.url))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    codes = sorted(r.status_code for r in replies.values())
    # One ran; the other either saw it running (409) or got its reply back.
    assert codes in ([200, 409], [200, 200]), [(r.status_code, r.text) for r in replies.values()]
    first = next(r for r in replies.values() if r.status_code == 200)
    a.wait_idle(300)
    b.wait_idle(300)
    for url in (a.url, b.url):
        again = httpx.post(url + "/v1/responses", json=request, headers=key, timeout=300)
        assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true"
        assert again.content == first.content
    assert a.generations() + b.generations() == before + 1, "the key ran exactly once, on one instance"


def test_kill_9_of_a_is_noticed_by_b_within_the_lease(pair):
    a, b = pair
    with httpx.Client(base_url=a.url, timeout=300) as on_a, httpx.Client(base_url=b.url, timeout=300) as on_b:
        task_id = on_a.post("/lmsp/v1/tasks", json=body(max_output_tokens=400)).json()["id"]
        events = f"/lmsp/v1/tasks/{task_id}/events"
        _, head, _ = follow(on_b, events, stop_after=5)
        assert head[-1].event == "response.output_text.delta"
        # A reader on B stays attached through A's death.
        attached: dict = {}
        reader = threading.Thread(target=timed_follow, args=(on_b, events, attached),
                                  kwargs={"headers": {"Last-Event-ID": "5"}})
        reader.start()
        time.sleep(0.2)
        a.proc.kill()
        a.proc.wait(30)
        killed = time.monotonic()
        reader.join(60)
        assert not reader.is_alive(), "B's reader was left hanging"
        rest = attached["frames"]
        ended = attached["times"][-1]
        summary = validate_lmsp_stream(head + rest)  # every item closed, one terminal event
        assert summary["terminal"] == "response.failed"
        assert summary["data"]["error"]["code"] == "server_restarted"
        # A's last renewal may have come just before its death, so its lease
        # runs a whole lease on; B's next sweep (a quarter lease later) fails
        # the task. Plus the reader's own wake-up slack on a loaded machine.
        assert ended - killed <= 1.25 * LEASE_S + 2, f"took {ended - killed:.1f}s"
        task = on_b.get(f"/lmsp/v1/tasks/{task_id}").json()
        assert task["status"] == "failed" and task["error"]["code"] == "server_restarted"
        assert task["result"]["status"] == "failed"
        # B logs the sweep after its writes commit, so the reader can see the
        # terminal event before the line is printed.
        wait_for(lambda: "recovered from an unclean stop" in b.log(), timeout=10)
