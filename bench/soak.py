"""Soak and load: one ``lmspd serve`` under many mixed requests (issue 13).

``soak``: N mixed requests (JSON replies, streams, streams abandoned after
the first delta, stored reads, and bad inputs of every kind) from a few
clients at once. Passes when no reply is a 5xx, RSS grows less than 64 MiB
from the end of the warm-up to the end beyond what the KV cache's RAM tier
says it took (``lmspd_kv_ram_bytes``: it fills up to its budget, the
server's default unless ``--kv-ram-mb``), and the open file descriptors are
back to their warm-up count once the server is idle.

``load``: 48 clients at once against ``--max-queue 8``. Every client must
get a complete stream (one terminal event) or a 503 with ``Retry-After``,
and ``/health`` must answer within 2 s throughout.

    .venv/bin/python bench/soak.py soak --requests 1000
    .venv/bin/python bench/soak.py load --clients 48 --max-queue 8
    .venv/bin/python bench/soak.py all --quick

Exit status 0 when every check passes. The figures depend on the machine's
load (printed with them): on the shared 2-core development machine a run of
1,000 requests takes several minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESPONSES_TERMINAL, iter_sse, lmspd_server  # noqa: E402

MODEL = "smollm2-135m-instruct"
JSON = {"content-type": "application/json"}


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def fds(pid: int) -> dict[str, str]:
    """The process's open descriptors and what each one is."""
    found = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            found[fd] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            pass  # closed meanwhile
    return found


def kv_ram_bytes(client: httpx.Client) -> int:
    """What the continuation cache says it holds in RAM (all models)."""
    total = 0
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("lmspd_kv_ram_bytes{"):
            total += int(float(line.rsplit(" ", 1)[1]))
    return total


def wait_idle(client: httpx.Client, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        models = client.get("/health").json().get("models", {})
        if all(not m["busy"] and not m["pending"] for m in models.values()):
            return
        time.sleep(0.1)
    raise RuntimeError("server still busy")


# -- the mixed requests: each returns the HTTP status it got --------------------------


def _body(rng: random.Random, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": f"Say a word about {rng.randint(0, 10**6)}.", "max_output_tokens": 6,
            "temperature": 0.7, **extra}


def json_reply(c: httpx.Client, rng: random.Random) -> int:
    r = c.post("/v1/responses", json=_body(rng, store=rng.random() < 0.5))
    if r.status_code == 200 and r.json().get("store"):
        c.get(f"/v1/responses/{r.json()['id']}")
    return r.status_code


def stream(c: httpx.Client, rng: random.Random) -> int:
    path = rng.choice(["/v1/responses", "/lmsp/v1/responses", "/v1/chat/completions", "/v1/messages"])
    if path in ("/v1/chat/completions", "/v1/messages"):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "stream": True}
    else:
        body = _body(rng, stream=True)
    with c.stream("POST", path, json=body, headers={"LMSP-Version": "1.0"}) as r:
        for _ in iter_sse(r.iter_lines()):
            pass
        return r.status_code


def abandoned(c: httpx.Client, rng: random.Random) -> int:
    with c.stream("POST", "/v1/responses", json=_body(rng, stream=True, max_output_tokens=64)) as r:
        for name, _ in iter_sse(r.iter_lines()):
            if name == "response.output_text.delta":
                break  # leave mid-stream: the server must stop and clean up
        return r.status_code


BAD = [
    ("/v1/responses", b'{"model": "%s", "input": "x", "temperature": NaN}' % MODEL.encode(), JSON),
    ("/v1/responses", b'{"model": "x", "model": "%s", "input": "x"}' % MODEL.encode(), JSON),
    ("/v1/chat/completions", b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}'
     % MODEL.encode(), JSON),
    ("/v1/messages", b'{"model": "%s", "max_tokens": 1e400, "messages": []}' % MODEL.encode(), JSON),
    ("/lmsp/v1/responses", b"{not json", JSON),
    ("/v1/responses", b"{}", {"content-type": "text/plain"}),
    ("/v1/responses", b"\x1f\x8b garbage", {**JSON, "content-encoding": "gzip"}),
    ("/v1/responses", b"{}", {**JSON, "content-encoding": "br"}),
    ("/v1/responses/resp_nope", None, {}),
    ("/v1/conversations/conv_nope/items", None, {}),
    ("/lmsp/v1/tasks/task_nope/events", None, {}),
    ("/nope", None, {}),
]


def bad_input(c: httpx.Client, rng: random.Random) -> int:
    path, content, headers = rng.choice(BAD)
    if content is None:
        return c.get(path, headers={"LMSP-Version": "1.0"}).status_code
    return c.post(path, content=content, headers={"LMSP-Version": "1.0", **headers}).status_code


MIX: list[tuple[float, Callable[[httpx.Client, random.Random], int]]] = [
    (0.3, json_reply), (0.3, stream), (0.1, abandoned), (0.3, bad_input)]


def soak(args: argparse.Namespace) -> bool:
    data = Path(tempfile.mkdtemp(prefix="lmspd-soak-"))
    srv = lmspd_server(None, args.ctx, args.threads, data, data / "server.log", log_level="warning")
    # The continuation cache keeps KV sessions in RAM up to its own budget
    # (--kv-ram-mb, 1 GiB by default) and says how much it holds: growth
    # beyond that is a leak. --kv-ram-mb here runs it with a smaller budget.
    if args.kv_ram_mb is not None:
        srv.cmd += ["--kv-ram-mb", str(args.kv_ram_mb)]
    srv.start()
    pid = srv.pid
    assert pid is not None
    statuses: Counter[str] = Counter()
    lock = threading.Lock()
    rng = random.Random(args.seed)
    plan = [rng.choices([f for _, f in MIX], weights=[w for w, _ in MIX])[0] for _ in range(args.requests)]
    warm = max(1, args.requests // 10)

    def run(i: int, client: httpx.Client) -> None:
        code: int | str
        try:
            code = plan[i](client, random.Random(args.seed * 100_003 + i))
        except httpx.HTTPError as exc:
            code = f"{type(exc).__name__}"
        with lock:
            statuses[f"{plan[i].__name__} {code}"] += 1

    try:
        started = time.monotonic()
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            with ThreadPoolExecutor(args.concurrency) as pool:
                list(pool.map(lambda i: run(i, c), range(warm)))
            wait_idle(c)
            rss0, fd0, kv0 = rss_kib(pid), fds(pid), kv_ram_bytes(c)
            with ThreadPoolExecutor(args.concurrency) as pool:
                list(pool.map(lambda i: run(i, c), range(warm, args.requests)))
            wait_idle(c)
            time.sleep(1.0)  # abandoned connections finish closing
            rss1, fd1, kv1 = rss_kib(pid), fds(pid), kv_ram_bytes(c)
        elapsed = time.monotonic() - started
    finally:
        srv.stop()
    errors = {k: v for k, v in statuses.items() if not k.split()[-1].isdigit() or int(k.split()[-1]) >= 500}
    kv_growth = (kv1 - kv0) / 2**20
    growth = (rss1 - rss0) / 1024 - kv_growth
    budget = "the default" if args.kv_ram_mb is None else args.kv_ram_mb
    print(f"soak: {args.requests} requests ({warm} warm-up), {args.concurrency} clients, "
          f"--kv-ram-mb {budget}, {elapsed:.0f} s; "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| check | value | bound | ok |\n|---|---|---|---|")
    rows = [("5xx or transport errors", sum(errors.values()), 0, not errors),
            ("RSS growth after warm-up, less the KV RAM tier's (MiB)",
             f"{growth:.1f} (RSS {rss0 // 1024} -> {rss1 // 1024}, KV in RAM {kv0 / 2**20:.0f} -> {kv1 / 2**20:.0f})",
             "< 64", growth < 64),
            ("open fds after / at warm-up", f"{len(fd1)} / {len(fd0)}", "back to baseline", len(fd1) <= len(fd0))]
    for name, value, bound, ok in rows:
        print(f"| {name} | {value} | {bound} | {'yes' if ok else 'NO'} |")
    print("statuses:", json.dumps(dict(sorted(statuses.items()))))
    if len(fd1) > len(fd0):
        print("opened since the warm-up:", sorted(Counter(fd1.values()) - Counter(fd0.values())))
    return all(ok for *_, ok in rows)


def load(args: argparse.Namespace) -> bool:
    data = Path(tempfile.mkdtemp(prefix="lmspd-load-"))
    srv = lmspd_server(None, args.ctx, args.threads, data, data / "server.log", log_level="warning")
    srv.cmd += ["--max-queue", str(args.max_queue)]
    srv.start()
    outcomes: Counter[str] = Counter()
    health: list[float] = []
    done = threading.Event()
    barrier = threading.Barrier(args.clients)

    def client(i: int) -> None:
        body = {"model": MODEL, "input": f"Client {i}: say hello.", "max_output_tokens": args.tokens,
                "stream": True, "store": False}
        with httpx.Client(base_url=srv.url, timeout=300) as c:
            barrier.wait()
            try:
                with c.stream("POST", "/v1/responses", json=body) as r:
                    if r.status_code == 503:
                        r.read()
                        ok = "retry-after" in r.headers and r.json()["error"]["code"] == "server_overloaded"
                        outcomes["503 with Retry-After" if ok else "503 without Retry-After"] += 1
                        return
                    terminals = [n for n, _ in iter_sse(r.iter_lines()) if n in RESPONSES_TERMINAL]
                    outcomes["complete stream" if r.status_code == 200 and len(terminals) == 1
                             else f"bad: {r.status_code} {terminals}"] += 1
            except httpx.HTTPError as exc:
                outcomes[f"bad: {type(exc).__name__}"] += 1

    def poll() -> None:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            while not done.is_set():
                t = time.monotonic()
                try:
                    c.get("/health").raise_for_status()
                    health.append(time.monotonic() - t)
                except httpx.HTTPError:
                    health.append(float("inf"))
                time.sleep(0.25)

    try:
        poller = threading.Thread(target=poll)
        poller.start()
        started = time.monotonic()
        with ThreadPoolExecutor(args.clients) as pool:
            list(pool.map(client, range(args.clients)))
        elapsed = time.monotonic() - started
        done.set()
        poller.join()
    finally:
        srv.stop()
    bad = {k: v for k, v in outcomes.items() if k.startswith("bad") or "without" in k}
    worst = max(health) if health else float("inf")
    print(f"load: {args.clients} clients at once, --max-queue {args.max_queue}, {args.tokens} tokens each, "
          f"{elapsed:.0f} s; load average {os.getloadavg()[0]:.1f}")
    print("| check | value | bound | ok |\n|---|---|---|---|")
    rows = [("outcomes", json.dumps(dict(outcomes)), "complete or 503 + Retry-After", not bad),
            ("/health slowest answer (s)", f"{worst:.3f} over {len(health)} polls", "< 2", worst < 2.0)]
    for name, value, bound, ok in rows:
        print(f"| {name} | {value} | {bound} | {'yes' if ok else 'NO'} |")
    return all(ok for *_, ok in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["soak", "load", "all"])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--clients", type=int, default=48)
    parser.add_argument("--max-queue", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16, help="output tokens per load-test stream")
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--kv-ram-mb", type=int, default=None,
                        help="the server's RAM budget for KV sessions (default: the server's own, 1 GiB)")
    parser.add_argument("--quick", action="store_true", help="200 soak requests")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests = min(args.requests, 200)
    ok = True
    if args.mode in ("soak", "all"):
        ok = soak(args) and ok
    if args.mode in ("load", "all"):
        ok = load(args) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
