#!/usr/bin/env python
"""Where 16 requests released together go, hop by hop (issue 30).

Starts ``lmspd serve --parallel 16`` (scenario 6's flags, bench/concurrency.py
``decode16``) in a child process that timestamps each request's hops and
each scheduler step (the child wraps the functions below before serving;
no lmspd code changes), sends ``--rounds`` bursts of 16 streaming
``/v1/chat/completions`` requests released together (one warm-up first),
and prints, per burst and request (by its prompt), ms from the release:

  handler   the route handler entered (``compat.chat_create``; in order of entry, not by request)
  parsed    its body decoded (``chat_completions.decode_request``)
  prep      ``LlamaEngine.prepare`` start–end (a preparing thread)
  submit    ``Scheduler.submit`` (back on the event loop, the ``Job`` built)
  placed    ``Scheduler._start`` (the scheduler thread placed it)
  step      the scheduler step that finished its prefill (its number in the burst)
  ttft      the client's first content delta

then the steps: start, ``llama_decode`` ms, prefilling and decoding
sequences, prefill tokens; and the ``_gather`` waits.

    .venv/bin/python bench/burst_trace.py                   # 3 bursts
    .venv/bin/python bench/burst_trace.py --rounds 5 --tokens 32
    .venv/bin/python bench/burst_trace.py --source /tmp/old  # another tree's lmspd (bench/_common.git_tree)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from concurrency import LONG_PROMPTS_16  # noqa: E402


def _key(text: str) -> int:
    for i, p in enumerate(LONG_PROMPTS_16):
        if p in text:
            return i
    return -1


def _conversation_key(conversation: Any) -> int:
    return _key(" ".join(str(getattr(item, "text", "") or "") for item in conversation.items))


# -- the child: lmspd serve with timestamps ---------------------------------------------


def _serve(trace_path: str, argv: list[str]) -> int:
    import llama_cpp

    out = open(trace_path, "a", buffering=1)  # noqa: SIM115 - lives as long as the server
    lock = threading.Lock()
    clock = time.perf_counter

    def mark(ev: str, **kw: Any) -> None:
        with lock:
            out.write(json.dumps({"t": clock(), "ev": ev, **kw}) + "\n")

    import lmspd.dialects.chat_completions as cc
    import lmspd.engines.llama.engine as engine
    import lmspd.engines.llama.scheduler as scheduler
    import lmspd.routes.compat as compat
    from lmspd.cli import main

    chat_create = compat.chat_create

    async def traced_create(request: Any) -> Any:
        mark("handler")
        return await chat_create(request)
    compat.chat_create = traced_create  # the route table is built at serve time, after this

    decode_request = cc.decode_request

    def traced_decode(raw: Any, *a: Any, **kw: Any) -> Any:
        r = decode_request(raw, *a, **kw)
        mark("parsed", k=_key(json.dumps(raw)))
        return r
    cc.decode_request = traced_decode

    prepare = engine.LlamaEngine.prepare

    def traced_prepare(self: Any, conversation: Any, *a: Any, **kw: Any) -> Any:
        k = _conversation_key(conversation)
        mark("prep_start", k=k)
        try:
            return prepare(self, conversation, *a, **kw)
        finally:
            mark("prep_end", k=k)
    engine.LlamaEngine.prepare = traced_prepare  # type: ignore[method-assign]

    submit = scheduler.Scheduler.submit

    def traced_submit(self: Any, job: Any) -> None:
        mark("submit", k=_conversation_key(job.prepared.conversation))
        submit(self, job)
    scheduler.Scheduler.submit = traced_submit  # type: ignore[method-assign]

    start = scheduler.Scheduler._start

    def traced_start(self: Any, job: Any, plan: Any) -> None:
        k = _conversation_key(job.prepared.conversation)
        mark("placed", k=k, suffix=len(plan.suffix))
        w, c = clock(), time.thread_time()
        start(self, job, plan)
        mark("start_cost", k=k, wall=(clock() - w) * 1000, cpu=(time.thread_time() - c) * 1000)
    scheduler.Scheduler._start = traced_start  # type: ignore[method-assign]

    import lmspd.cache.manager as manager

    def timed(owner: Any, attr: str) -> None:
        original = getattr(owner, attr)

        def wrapped(*a: Any, **kw: Any) -> Any:
            w, c = clock(), time.thread_time()
            try:
                return original(*a, **kw)
            finally:
                mark("cost", what=attr, wall=(clock() - w) * 1000, cpu=(time.thread_time() - c) * 1000)
        setattr(owner, attr, wrapped)
    for attr in ("diagnose", "apply"):
        timed(manager.ContinuationCache, attr)
    plan = manager.ContinuationCache.plan

    def traced_plan(self: Any, req: Any, **kw: Any) -> Any:
        w, c = clock(), time.thread_time()
        p = plan(self, req, **kw)
        mark("cost", what="plan", wall=(clock() - w) * 1000, cpu=(time.thread_time() - c) * 1000)
        res = self.residency
        mark("planned", k=_key(req.text), source=None if p is None else p.source,
             seq=None if p is None else p.seq, copy_from=None if p is None else p.copy_from,
             suffix=None if p is None else len(p.suffix), busy=sum(1 for r in res.residents if r.busy),
             copying=len(res.copying))
        return p
    manager.ContinuationCache.plan = traced_plan  # type: ignore[method-assign]
    timed(scheduler, "Generation")
    timed(scheduler, "SequenceSpeculation")

    gather = scheduler.Scheduler._gather

    def traced_gather(self: Any, *a: Any, **kw: Any) -> Any:
        mark("gather_start", inbox=len(self._inbox))
        try:
            return gather(self, *a, **kw)
        finally:
            mark("gather_end", inbox=len(self._inbox))
    scheduler.Scheduler._gather = traced_gather  # type: ignore[method-assign]

    step = scheduler.Scheduler._step

    def traced_step(self: Any) -> Any:
        running = list(self._running)
        pre = [(_conversation_key(r.job.prepared.conversation), len(r.pending)) for r in running if r.prefilling]
        mark("step_start", prefilling=pre, decoding=sum(1 for r in running if not r.prefilling),
             waiting=len(self._waiting), inbox=len(self._inbox))
        try:
            return step(self)
        finally:
            done = [_conversation_key(r.job.prepared.conversation) for r in running
                    if not r.prefilling and any(k == _conversation_key(r.job.prepared.conversation) for k, _ in pre)]
            mark("step_end", finished=done)
    scheduler.Scheduler._step = traced_step  # type: ignore[method-assign]

    llama_decode = llama_cpp.llama_decode

    def traced_decode_c(*a: Any) -> Any:
        mark("decode_start")
        try:
            return llama_decode(*a)
        finally:
            mark("decode_end")
    llama_cpp.llama_decode = traced_decode_c
    return main(argv)


# -- the client ------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--source", type=Path, default=None, help="run this tree's lmspd package instead")
    args = parser.parse_args()

    import httpx

    from _common import LMSPD_READY, ChildServer, Sample, stream_chat_completions

    tmp = Path(tempfile.mkdtemp(prefix="lmspd-bench-burst-"))
    trace = tmp / "trace.jsonl"
    cmd = [sys.executable, *(["-P"] if args.source else []), str(Path(__file__).resolve()), "_serve", str(trace),
           "serve", "--port", "0", "--data-dir", str(tmp / "data"), "--ctx", str(args.ctx),
           "--threads", str(args.threads), "--parallel", "16", "--kv-disk-space-mb", "0", "--max-queue", "64",
           "--repetition-window", "0", "--log-level", "warning"]
    env = {"PYTHONPATH": f"{args.source}:{Path(__file__).resolve().parent}"} if args.source else None
    srv = ChildServer("lmspd", cmd, LMSPD_READY, tmp / "server.log", env=env).start()
    bursts: list[tuple[float, list[Sample]]] = []
    try:
        model = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
        for rnd in range(args.rounds + 1):  # the first warms up
            go = threading.Barrier(16)
            out: list[Sample] = [Sample("lmspd", rnd) for _ in range(16)]
            sent = [0.0] * 16

            def one(i: int, go: threading.Barrier = go, out: list[Sample] = out, sent: list[float] = sent) -> None:
                with httpx.Client(timeout=600) as client:
                    go.wait()
                    sent[i] = time.perf_counter()
                    body = {"model": model, "messages": [{"role": "user", "content": LONG_PROMPTS_16[i]}],
                            "stream": True, "temperature": 0, "max_tokens": args.tokens}
                    stream_chat_completions(client, srv.url + "/v1/chat/completions", body, out[i])

            threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if rnd:
                bursts.append((min(sent), [s for s in out]))
                for i, s in enumerate(out):
                    s.extra["ttft_abs"] = sent[i] + (s.first_delta or 0) - min(sent)
            time.sleep(1.0)
    finally:
        srv.stop()
    events = sorted((json.loads(line) for line in trace.read_text().splitlines()), key=lambda e: e["t"])
    load = os.getloadavg()[0]
    ttfts: list[float] = []
    for b, (t0, samples) in enumerate(bursts):
        t_end = t0 + max((s.terminal or 0) for s in samples) + 0.5
        window = [e for e in events if t0 - 0.01 <= e["t"] <= t_end]

        def ms(e: dict[str, Any], t0: float = t0) -> float:
            return (e["t"] - t0) * 1000
        steps = []
        cur: dict[str, Any] | None = None
        for e in window:
            if e["ev"] == "step_start":
                cur = {"start": ms(e), "prefilling": e["prefilling"], "decoding": e["decoding"]}
            elif e["ev"] == "decode_end" and cur is not None:
                cur["decode_ms"] = ms(e) - cur.get("decode_at", cur["start"])
            elif e["ev"] == "decode_start" and cur is not None:
                cur["decode_at"] = ms(e)
            elif e["ev"] == "step_end" and cur is not None:
                cur["end"] = ms(e)
                cur["finished"] = e["finished"]
                steps.append(cur)
                cur = None
        per: dict[int, dict[str, Any]] = {i: {} for i in range(16)}
        handlers = [ms(e) for e in window if e["ev"] == "handler"]
        for e in window:
            k = e.get("k")
            if k is None or k < 0:
                continue
            name = {"parsed": "parsed", "prep_start": "prep0", "prep_end": "prep1", "submit": "submit",
                    "placed": "placed"}.get(e["ev"])
            if name and name not in per[k]:
                per[k][name] = ms(e)
        for n, st in enumerate(steps):
            for k in st["finished"]:
                per[k].setdefault("step", n)
        for i, s in enumerate(samples):
            per[i]["ttft"] = s.extra["ttft_abs"] * 1000
            ttfts.append(s.ttft_ms or 0)
        print(f"\n### burst {b + 1} (ms from the release; handler entries: "
              f"{', '.join(f'{h:.0f}' for h in handlers)})\n")
        print("| req | parsed | prep start–end | submit | placed | prefill done in step | ttft |")
        print("|---|---|---|---|---|---|---|")
        for k in sorted(per, key=lambda k: per[k].get("parsed", 1e9)):
            p = per[k]

            def f(name: str, p: dict[str, Any] = p) -> str:
                return f"{p[name]:.0f}" if name in p else "—"
            print(f"| {k} | {f('parsed')} | {f('prep0')}–{f('prep1')} | {f('submit')} | {f('placed')} "
                  f"| {p.get('step', '—')} | {f('ttft')} |")
        planned = [e for e in window if e["ev"] == "planned"]
        print("\nplans, in order: " + ", ".join(
            f"{e['k']}:{e['source'] or 'NONE'}"
            + (f"(seq{e['seq']}<-seq{e['copy_from']})" if e["copy_from"] is not None else f"(seq{e['seq']})"
               if e["seq"] is not None else "") + f"[busy {e['busy']} copying {e['copying']}]"
            for e in planned[:24]))
        gathers = [e for e in window if e["ev"] in ("gather_start", "gather_end")]
        print("\ngather: " + ", ".join(f"{e['ev'].removeprefix('gather_')}@{ms(e):.0f} (inbox {e['inbox']})"
                                        for e in gathers))
        print("\n| step | start | decode ms | prefilling (req:pending) | decoding |")
        print("|---|---|---|---|---|")
        for n, st in enumerate(steps[:8]):
            print(f"| {n} | {st['start']:.0f} | {st.get('decode_ms', 0):.0f} "
                  f"| {' '.join(f'{k}:{p}' for k, p in st['prefilling'])} | {st['decoding']} |")
    costs: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        if e["ev"] in ("cost", "start_cost"):
            costs.setdefault(e.get("what", "_start"), []).append((e["wall"], e["cpu"]))
    print("\n| placing (all bursts) | n | wall ms median | p90 | cpu ms median |")
    print("|---|---|---|---|---|")
    for what, xs in costs.items():
        walls = sorted(x[0] for x in xs)
        print(f"| {what} | {len(xs)} | {statistics.median(walls):.2f} | {walls[int(0.9 * len(walls))]:.2f} "
              f"| {statistics.median(x[1] for x in xs):.2f} |")
    q = sorted(ttfts)
    print(f"\nTTFT over {len(bursts)} bursts: median {statistics.median(q):.0f} ms, "
          f"p90 {q[int(0.9 * len(q))]:.0f} ms, max {q[-1]:.0f} ms; load average {load:.1f}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "_serve":
        sys.exit(_serve(sys.argv[2], sys.argv[3:]))
    sys.exit(main())
