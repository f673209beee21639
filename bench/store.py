"""Store throughput: task events appended, and fanned out to readers, on
PostgreSQL against SQLite, for N concurrent tasks (default 16), in one run.

    .venv/bin/python bench/store.py                 # 16 tasks x 300 events per case
    .venv/bin/python bench/store.py --events 1000   # longer
    .venv/bin/python bench/store.py --dsn postgresql://...   # an existing server

Each case: N writer threads each append one task's events as fast as the
store takes them (``batch`` events per transaction: 1 is one commit per
token, what lmspd did before its writer batched; the task writer batches
whatever piled up, up to 128), then end the task with its terminal event.
N reader threads, on a *second* store object, follow each task the way
``TaskManager`` follows a task that runs elsewhere: wait for a notice, read
``events_after(last seq)``, until the terminal event. For PostgreSQL the
second store is another instance (its own pool and LISTEN connection); for
SQLite, whose notices never leave the process, it is the same store object.
The readers check order and completeness (every seq once, none missing).

Without ``--dsn`` a throwaway cluster (Debian's server binaries, as the
tests use) starts in a temp dir with its default durability (fsync on); the
store commits event appends with ``synchronous_commit = off`` and terminal
states durably, like SQLite's WAL with ``synchronous=NORMAL``/``FULL``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from lmspd.store import open_store  # noqa: E402
from lmspd.store.base import Store  # noqa: E402


def run_case(writer_store: Store, reader_store: Store, *, tasks: int, events: int, batch: int) -> dict[str, Any]:
    owner = "bench"
    run = uuid.uuid4().hex[:8]
    ids = [f"task_{run}_{i}" for i in range(tasks)]
    for task_id in ids:
        writer_store.create_task(owner, task_id, {"bench": True}, status="in_progress")
    wakes = {task_id: threading.Event() for task_id in ids}

    def heard(kind: str, task_id: str) -> None:
        if kind == "resync":
            for wake in wakes.values():
                wake.set()
        elif task_id in wakes:
            wakes[task_id].set()

    remove = reader_store.listen(heard)
    latencies: list[float] = []
    delivered = [0]
    done_at: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    start_gate = threading.Barrier(2 * tasks + 1)

    def reader(task_id: str) -> None:
        start_gate.wait()
        last = 0
        mine: list[float] = []
        while True:
            wakes[task_id].wait(1.0)
            wakes[task_id].clear()
            got = reader_store.events_after(owner, task_id, last, 512) or []
            now = time.perf_counter()
            for event in got:
                if event.seq != last + 1:
                    errors.append(f"{task_id}: seq {event.seq} after {last}")
                last = event.seq
                mine.append(now - event.data["t"])
            if last == events + 1:
                break
        with lock:
            latencies.extend(mine)
            delivered[0] += len(mine)
            done_at.append(time.perf_counter())

    def writer(task_id: str) -> None:
        start_gate.wait()
        seq = 0
        while seq < events:
            n = min(batch, events - seq)
            now = time.perf_counter()
            writer_store.append_events(
                task_id, [(seq + i + 1, "response.output_text.delta", {"delta": " tok", "t": now}) for i in range(n)])
            seq += n
        writer_store.set_task_status(owner, task_id, "completed", result={"ok": True},
                                     final_event=(seq + 1, "response.completed", {"t": time.perf_counter()}))

    readers = [threading.Thread(target=reader, args=(t,)) for t in ids]
    writers = [threading.Thread(target=writer, args=(t,)) for t in ids]
    for t in readers + writers:
        t.start()
    start_gate.wait()
    started = time.perf_counter()
    for t in writers:
        t.join()
    written = time.perf_counter()
    for t in readers:
        t.join()
    remove()
    total = tasks * (events + 1)
    if errors or delivered[0] != total:
        raise SystemExit(f"fan-out lost or reordered events: {errors[:5]} delivered {delivered[0]} of {total}")
    latencies.sort()
    return {
        "events": total,
        "append_per_s": total / (written - started),
        "fanout_per_s": total / (max(done_at) - started),
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": latencies[int(len(latencies) * 0.99) - 1] * 1000,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--events", type=int, default=300, help="events per task (plus its terminal event)")
    parser.add_argument("--batches", default="1,16", help="events per transaction, comma-separated")
    parser.add_argument("--dsn", default=None, help="an existing PostgreSQL database (default: a throwaway cluster)")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    cluster = None
    dsn = args.dsn
    if dsn is None:
        from support.postgres import PostgresCluster

        # The server's own durability defaults, not the tests' fsync=off.
        cluster = PostgresCluster({"fsync": "on", "synchronous_commit": "on", "full_page_writes": "on"}).start()
        dsn = cluster.dsn()
    rows: list[tuple[str, int, dict[str, Any]]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="lmspd-bench-store-") as tmp:
            sqlite = open_store(Path(tmp) / "bench.sqlite3")
            pg_a = open_store(dsn)
            pg_b = open_store(dsn)
            try:
                for batch in batches:
                    # Alternate the backends so drifting load hits both alike.
                    rows.append(("sqlite", batch, run_case(sqlite, sqlite, tasks=args.tasks, events=args.events,
                                                           batch=batch)))
                    rows.append(("postgresql", batch, run_case(pg_a, pg_b, tasks=args.tasks, events=args.events,
                                                               batch=batch)))
            finally:
                sqlite.close()
                pg_a.close()
                pg_b.close()
    finally:
        if cluster is not None:
            cluster.stop()

    print(f"\n{args.tasks} concurrent tasks x {args.events} events (+1 terminal) per case; "
          "fan-out = a reader per task on another store instance (PostgreSQL) / the same process (SQLite)\n")
    print("| backend | events/txn | events | appended ev/s | fanned out ev/s | delivery p50 ms | p99 ms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, batch, r in rows:
        print(f"| {name} | {batch} | {r['events']} | {r['append_per_s']:.0f} | {r['fanout_per_s']:.0f} | "
              f"{r['p50_ms']:.1f} | {r['p99_ms']:.1f} |")
    print()
    by = {(name, batch): r for name, batch, r in rows}
    for batch in batches:
        s, p = by[("sqlite", batch)], by[("postgresql", batch)]
        print(f"batch {batch}: PostgreSQL/SQLite appended {p['append_per_s'] / s['append_per_s']:.2f}x, "
              f"fanned out {p['fanout_per_s'] / s['fanout_per_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
