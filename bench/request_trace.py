#!/usr/bin/env python
"""Where a short request's time to first token goes, hop by hop.

Starts ``lmspd serve`` in a child process with timestamps at every hand-off
of a request (the child wraps the functions named below before serving; no
lmspd code changes), sends ``--requests`` short streaming requests one
after another (a fresh nonce each, so each prefills the same ~35 tokens),
and prints the median and p90 of each hop:

  send → handler          HTTP parse, routing (client → ``routes.responses._create``)
  handler → prepare       decode, validation, admission, hand-off to a prepare thread
  prepare                 render + tokenize (``LlamaEngine.prepare``, worker thread)
  prepare → submit        back to the event loop, the reply and its headers, ``Job`` built
                          (``response.created`` is written after the submit, beside the prompt)
  submit → placed         the scheduler thread wakes and plans (``Scheduler._start`` entered)
  placed → decode         diagnosis, ``cache.apply``, ``Generation`` built
  prefill decode          ``llama_decode`` of the prompt (llama.cpp itself)
  decode → flush          sample, text, events (``Outbox.flush``)
  flush → loop            thread hop to the event loop (``call_soon_threadsafe``)
  loop → written          stream session, encoder, SSE frame, coalesced write
  written → client        socket to the client's first ``output_text.delta``

With ``--mixed MODES`` it traces ``speculative.py``'s ``mixed`` scenario
instead (two ``edit`` and two ``chat`` sessions sent at once, 160 tokens
each, their prompts cached by a first round): one server per mode of the
comma-separated list (``off,auto,off``: ``--speculative`` of each), taking
turns round by round, and per round the slowest session's TTFT split into
when the last request was submitted to the scheduler (``gathered``), the
placements (``apply``: ``ContinuationCache.apply``, which keeps a state cut
short in RAM first), when the first step's decode began and how long it
took, when the first tokens were taken (``prefilled``), the median decode
of the next steps, and the round's tok/s.

Everything but ``prefill decode`` is what lmspd adds around llama.cpp
(bench/overhead.py measures the same total against llama-cpp-python in
process; this shows where it goes). The clock is CLOCK_MONOTONIC on both
sides (``time.perf_counter`` on Linux), so client and server timestamps
compare directly.

    .venv/bin/python bench/request_trace.py                  # 12 requests
    .venv/bin/python bench/request_trace.py --threads 2 --parallel 4 --ctx 4096
    .venv/bin/python bench/request_trace.py --threads 2 --mixed off,auto,off --rounds 6
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HOPS = [
    ("send → handler", "client_send", "handler"),
    ("handler → prepare", "handler", "prepare_start"),
    ("prepare", "prepare_start", "prepare_end"),
    ("prepare → submit", "prepare_end", "submit"),
    ("submit → placed", "submit", "start"),
    ("placed → decode", "start", "decode_start"),
    ("prefill decode", "decode_start", "decode_end"),
    ("decode → flush", "decode_end", "flush"),
    ("flush → loop", "flush", "deliver"),
    ("loop → written", "deliver", "written"),
    ("written → client", "written", "client_first_delta"),
]


# -- the child: lmspd serve with timestamps ---------------------------------------------


def _serve(trace_path: str, argv: list[str]) -> int:
    import llama_cpp

    out = open(trace_path, "a", buffering=1)  # noqa: SIM115 - lives as long as the server
    lock = threading.Lock()
    clock = time.perf_counter

    def mark(name: str) -> None:
        with lock:
            out.write(json.dumps({"t": clock(), "ev": name}) + "\n")

    def around(owner: Any, attr: str, before: str | None, after: str | None = None) -> None:
        original = getattr(owner, attr)
        if asyncio_function(original):
            async def wrapped_async(*a: Any, **kw: Any) -> Any:
                if before:
                    mark(before)
                try:
                    return await original(*a, **kw)
                finally:
                    if after:
                        mark(after)
            setattr(owner, attr, wrapped_async)
            return

        def wrapped(*a: Any, **kw: Any) -> Any:
            if before:
                mark(before)
            try:
                return original(*a, **kw)
            finally:
                if after:
                    mark(after)
        setattr(owner, attr, wrapped)

    import lmspd.engines.llama.engine as engine
    import lmspd.engines.llama.handover as handover
    import lmspd.engines.llama.scheduler as scheduler
    import lmspd.routes.responses as responses
    import lmspd.streaming.coalesce as coalesce
    from lmspd.cli import main

    around(responses, "_create", "handler")
    around(engine.LlamaEngine, "prepare", "prepare_start", "prepare_end")
    around(scheduler.Scheduler, "submit", "submit")
    around(scheduler.Scheduler, "_start", "start")
    import lmspd.cache.manager as manager
    around(scheduler.Scheduler, "_gather", "gather_start", "gather_end")
    around(scheduler.Scheduler, "_admit", "admit_start", "admit_end")
    around(manager.ContinuationCache, "plan", "plan_start", "plan_end")
    around(manager.ContinuationCache, "apply", "apply_start", "apply_end")
    around(scheduler.Scheduler, "_prefilled", "prefilled")
    around(llama_cpp, "llama_decode", "decode_start", "decode_end")
    around(handover, "_deliver", "deliver")
    around(coalesce._Coalescer, "_write", None, "written")
    flush = handover.Outbox.flush

    def traced_flush(self: Any, *a: Any, **kw: Any) -> None:
        if self._pending:
            mark("flush")
        flush(self, *a, **kw)
    handover.Outbox.flush = traced_flush  # type: ignore[method-assign]
    return main(argv)


def asyncio_function(f: Any) -> bool:
    import inspect
    return inspect.iscoroutinefunction(f)


# -- the client ------------------------------------------------------------------------


def first_after(events: list[dict[str, Any]], name: str, t: float) -> float | None:
    for e in events:
        if e["ev"] == name and e["t"] >= t:
            return e["t"]
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None, help="also write the per-request hops here")
    parser.add_argument("--deadline", type=float, default=60.0, help="give up on a request after this many seconds")
    parser.add_argument("--events", action="store_true",
                        help="also print every request's marks (ms from its send), the scheduler's included")
    parser.add_argument("--mixed", default=None, metavar="MODES",
                        help="trace speculative.py's mixed scenario on one server per --speculative mode (off,auto)")
    parser.add_argument("--rounds", type=int, default=5, help="with --mixed: measured rounds per server")
    args = parser.parse_args()
    if args.mixed:
        return mixed_main(args)

    import httpx

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import LMSPD_READY, ChildServer

    tmp = Path(tempfile.mkdtemp(prefix="lmspd-bench-trace-"))
    trace = tmp / "trace.jsonl"
    cmd = [sys.executable, str(Path(__file__).resolve()), "_serve", str(trace), "serve", "--port", "0",
           "--data-dir", str(tmp / "data"), "--ctx", str(args.ctx), "--threads", str(args.threads),
           "--parallel", str(args.parallel), "--log-level", "warning"]
    srv = ChildServer("lmspd", cmd, LMSPD_READY, tmp / "server.log").start()
    sent: list[tuple[float, float]] = []
    load = os.getloadavg()
    try:
        with httpx.Client(timeout=600) as client:
            model = client.get(srv.url + "/v1/models").json()["data"][0]["id"]
            for i in range(args.requests + 1):  # the first warms up
                body = {"model": model, "instructions": f"Session {random.randrange(10**6):06d}. Be brief.",
                        "input": "Name one colour.", "stream": True, "temperature": 0,
                        "max_output_tokens": args.max_tokens, "store": False}
                data = json.dumps(body).encode()
                t0 = time.perf_counter()
                first = None
                with client.stream("POST", srv.url + "/v1/responses", content=data,
                                   headers={"Content-Type": "application/json"}) as r:
                    for line in r.iter_lines():
                        if first is None and "response.output_text.delta" in line:
                            first = time.perf_counter()
                        if time.perf_counter() - t0 > args.deadline:
                            # Heartbeats keep a dead stream open: never wait forever (a broken wrapper
                            # ended the scheduler thread once, and the run held its machine for 15 min).
                            raise SystemExit(f"request {i} had no end after {args.deadline:g} s; server log:\n"
                                             + srv.log_tail())
                if i and first is not None:
                    sent.append((t0, first))
                time.sleep(0.3)
    finally:
        srv.stop()
    events = sorted((json.loads(line) for line in trace.read_text().splitlines()), key=lambda e: e["t"])
    rows: list[dict[str, float]] = []
    for t0, first in sent:
        window = [e for e in events if t0 <= e["t"] <= first] + [{"t": first, "ev": "client_first_delta"}]
        # Each hop ends at the first mark of its kind after it began (the
        # coalescer also wrote response.created before the prompt ran).
        at = {"client_send": t0}
        row = {}
        for label, a, b in HOPS:
            if a not in at:
                continue
            end = first_after(window, b, at[a])
            if end is not None:
                at[b] = end
                row[label] = (end - at[a]) * 1000
        row["TTFT"] = (first - t0) * 1000
        rows.append(row)
        if args.events:
            print(f"request {len(rows)}: " + " ".join(f"{e['ev']}@{(e['t'] - t0) * 1000:.1f}" for e in window))
    print(f"\n## request_trace — {args.requests} short requests, --threads {args.threads} --parallel {args.parallel} "
          f"--ctx {args.ctx}; load average at start {load[0]:.1f}\n")
    print("| hop | median ms | p90 ms |")
    print("|---|---|---|")
    for label in [h[0] for h in HOPS] + ["TTFT"]:
        values = sorted(r[label] for r in rows if label in r)
        if values:
            p90 = values[min(len(values) - 1, int(0.9 * len(values)))]
            print(f"| {label} | {statistics.median(values):.2f} | {p90:.2f} |")
    outside = sorted(r["TTFT"] - r.get("prefill decode", 0.0) for r in rows)
    if outside:
        print(f"| **TTFT − prefill decode** (lmspd's part) | **{statistics.median(outside):.2f}** "
              f"| {outside[min(len(outside) - 1, int(0.9 * len(outside)))]:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


MIXED_COLUMNS = ("TTFT", "gathered", "apply", "decode at", "first decode", "prefilled", "later decodes", "tok/s")


def mixed_main(args: argparse.Namespace) -> int:
    """``--mixed``: the mixed scenario's rounds, hop by hop, per server."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import speculative
    from _common import LMSPD_READY, ChildServer

    tmp = Path(tempfile.mkdtemp(prefix="lmspd-bench-trace-"))
    servers: dict[str, ChildServer] = {}
    load = os.getloadavg()
    try:
        for i, mode in enumerate(args.mixed.split(",")):
            name = f"{mode}#{i + 1}"
            cmd = [sys.executable, str(Path(__file__).resolve()), "_serve", str(tmp / f"trace{i}.jsonl"), "serve",
                   "--port", "0", "--data-dir", str(tmp / f"data{i}"), "--ctx", str(max(args.ctx, 4096)),
                   "--threads", str(args.threads), "--parallel", "4", "--speculative", mode,
                   "--served-model", "m", "--log-level", "warning"]
            servers[name] = ChildServer("lmspd", cmd, LMSPD_READY, tmp / f"server{i}.log").start()
        bodies = [{**b, "model": "m", "temperature": 0.0, "max_output_tokens": 160, "store": False}
                  for b in speculative.requests("mixed")]
        # Taking turns as speculative.py's servers do (its first round caches the prompts).
        rounds = speculative.measure_alternating({name: srv.url for name, srv in servers.items()}, bodies,
                                                 args.rounds, None, 2.0)
    finally:
        for srv in servers.values():
            srv.stop()
    print(f"\n## request_trace --mixed {args.mixed} — {args.rounds} rounds, --threads {args.threads}; "
          f"load average at start {load[0]:.1f}\n")
    print("ms from the round's requests sent; medians of the rounds (each round below)\n")
    print("| server | " + " | ".join(MIXED_COLUMNS) + " |")
    print("|---|" + "---|" * len(MIXED_COLUMNS))
    for i, name in enumerate(servers):
        events = sorted((json.loads(line) for line in (tmp / f"trace{i}.jsonl").read_text().splitlines()),
                        key=lambda e: e["t"])
        rows = [_mixed_round(events, min(r.sent_at for r in runs), runs) for runs in rounds[name]]
        medians = [statistics.median(r[c] for r in rows) for c in range(len(MIXED_COLUMNS))]
        print(f"| {name} | " + " | ".join(f"{v:.1f}" for v in medians) + " |")
        for row in rows:
            print("| | " + " | ".join(f"{v:.1f}" for v in row) + " |")
    return 0


def _mixed_round(events: list[dict[str, Any]], t0: float, runs: list[Any]) -> list[float]:
    """One round's ``MIXED_COLUMNS``: ms from ``t0`` (the first request sent)."""
    ev = [e for e in events if t0 <= e["t"] <= t0 + 5.0]

    def at(name: str) -> float:
        return next(((e["t"] - t0) * 1000 for e in ev if e["ev"] == name), float("nan"))

    def spans(a: str, b: str) -> list[float]:
        marks = [e for e in ev if e["ev"] in (a, b)]
        return [(y["t"] - x["t"]) * 1000 for x, y in zip(marks, marks[1:]) if x["ev"] == a and y["ev"] == b]

    submitted = [e for e in ev if e["ev"] == "submit"][:len(runs)]
    decodes = spans("decode_start", "decode_end")
    span = max(r.last_s for r in runs) - min(r.ttft_s for r in runs)
    return [max(r.ttft_s for r in runs) * 1000, (submitted[-1]["t"] - t0) * 1000 if submitted else float("nan"),
            sum(spans("apply_start", "apply_end")[:len(runs)]), at("decode_start"),
            decodes[0] if decodes else float("nan"), at("prefilled"),
            statistics.median(decodes[1:30]) if len(decodes) > 1 else float("nan"),
            sum(r.output_tokens for r in runs) / span]


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "_serve":
        sys.exit(_serve(sys.argv[2], sys.argv[3:]))
    sys.exit(main())
