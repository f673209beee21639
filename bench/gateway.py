"""lmspd's upstream engine against the LiteLLM proxy's Responses endpoint.

Both gateways sit in front of the same fast scripted Chat Completions
provider and turn its stream into Responses events. One run measures, at 1
and at 64 concurrent streams:

- added time to first event: the client's time to the first text delta
  through a gateway, minus the same time straight from the provider (p50),
  against a provider that sends a whole stream at once (the gateway is the
  bottleneck: at 64 streams this is mostly queueing behind other streams'
  events) and one that paces tokens like a fast model (1 and 64 streams);
- events per second the client receives (and text deltas per second);
- the gateway's memory (peak RSS of its process tree while under load).

    python bench/gateway.py                      # both gateways, default sizes
    python bench/gateway.py --litellm-python .venv-bench/bin/python

LiteLLM is run from its own virtual environment: ``litellm[proxy]`` pins
``rich<14`` (lmspd pins rich 15) and pulls in uvloop, which would change
lmspd's own event loop if installed next to it. Create it with::

    python -m venv .venv-bench && .venv-bench/bin/pip install 'litellm[proxy]==1.108.7'

The client and the provider are lean asyncio code on raw sockets in their
own processes, so that the gateways are what is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import die_with_parent  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# -- the provider (a child process: `gateway.py provider PORT DELTAS`) ---------------------


def _provider_events(deltas: int) -> list[bytes]:
    def sse(obj: dict) -> bytes:
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    base = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1, "model": "bench-upstream"}
    events = [sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "tok0 "},
                                        "finish_reason": None}]})]
    events += [sse({**base, "choices": [{"index": 0, "delta": {"content": f"tok{i} "}, "finish_reason": None}]})
               for i in range(1, deltas)]
    events.append(sse({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))
    events.append(sse({**base, "choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": deltas,
                                                        "total_tokens": 12 + deltas}}))
    events.append(b"data: [DONE]\n\n")
    return events


class _ProviderProtocol(asyncio.Protocol):
    HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
            b"transfer-encoding: chunked\r\nconnection: keep-alive\r\n\r\n")
    MODELS = b'{"object":"list","data":[{"id":"bench-upstream","object":"model"}]}'

    def __init__(self, chunks: list[bytes], interval_s: float) -> None:
        self.chunks = chunks
        self.body = b"".join(chunks)
        self.interval_s = interval_s
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buf[:end]).decode("latin-1")
            m = re.search(r"(?im)^content-length:\s*(\d+)", head)
            size = int(m.group(1)) if m else 0
            if len(self.buf) < end + 4 + size:
                return
            del self.buf[: end + 4 + size]
            assert self.transport is not None
            if head.startswith("GET"):
                self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                                     + str(len(self.MODELS)).encode() + b"\r\n\r\n" + self.MODELS)
            elif not self.interval_s:
                self.transport.write(self.HEAD + self.body)
            else:
                self.transport.write(self.HEAD + self.chunks[0])
                self._pace(1)

    def _pace(self, i: int) -> None:
        # One event per interval, like a model generating tokens.
        if self.transport is None or self.transport.is_closing() or i >= len(self.chunks):
            return
        self.transport.write(self.chunks[i])
        asyncio.get_running_loop().call_later(self.interval_s, self._pace, i + 1)


def run_provider(port: int, deltas: int, interval_ms: float = 0.0) -> None:
    # Every event is its own HTTP chunk, as a real provider flushes them; the
    # body ends right after [DONE], as it does when a server's generator ends.
    chunks = [b"%x\r\n%s\r\n" % (len(e), e) for e in _provider_events(deltas)]
    chunks[-1] += b"0\r\n\r\n"

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(
            lambda: _ProviderProtocol(chunks, interval_ms / 1000), "127.0.0.1", port)
        print("provider ready", flush=True)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


# -- the floor (a child process: `gateway.py relay PORT UPSTREAM_PORT`) -------------------


def run_relay(port: int, upstream_port: int) -> None:
    """A byte pipe: what one more process hop costs on this machine, with no
    work at all. A gateway's added latency is measured against it too."""

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1 << 16):
                writer.write(data)
        finally:
            writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", upstream_port)
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer), return_exceptions=True)

    async def serve() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    asyncio.run(serve())


# -- the client (a child process: `gateway.py client ...`, prints JSON) -------------------


@dataclass
class Sample:
    first_delta_s: float
    total_s: float
    events: int
    deltas: int


async def _one_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes,
                       delta_marker: bytes) -> Sample:
    started = time.perf_counter()
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    status = head.split(b" ", 2)[1]
    if status != b"200":
        raise RuntimeError(f"HTTP {status.decode()}: {head[:200]!r}")
    if b"transfer-encoding: chunked" not in head.lower():
        raise RuntimeError("expected a chunked event stream")
    first = 0.0
    events = deltas = 0
    tail = b""
    while True:
        size = int((await reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            break
        data = tail + (await reader.readexactly(size + 2))[:-2]
        parts = data.split(b"\n\n")
        tail = parts.pop()
        for event in parts:
            if not event.startswith((b"data:", b"event:")):
                continue
            events += 1
            if delta_marker in event:
                deltas += 1
                if not first:
                    first = time.perf_counter() - started
    return Sample(first, time.perf_counter() - started, events, deltas)


async def _worker(port: int, request: bytes, marker: bytes, count: int, out: list[Sample]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 22)
    try:
        for _ in range(count):
            out.append(await _one_request(reader, writer, request, marker))
    finally:
        writer.close()


async def _client(port: int, path: str, body: dict, marker: bytes, concurrency: int, count: int) -> dict:
    data = json.dumps(body).encode()
    request = (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
               f"authorization: Bearer bench\r\naccept: text/event-stream\r\ncontent-length: {len(data)}\r\n\r\n"
               ).encode() + data
    samples: list[Sample] = []
    started = time.perf_counter()
    await asyncio.gather(*(_worker(port, request, marker, count, samples) for _ in range(concurrency)))
    wall = time.perf_counter() - started
    firsts = sorted(s.first_delta_s for s in samples)
    return {
        "requests": len(samples),
        "wall_s": wall,
        "events_per_s": sum(s.events for s in samples) / wall,
        "deltas_per_s": sum(s.deltas for s in samples) / wall,
        "events_per_request": statistics.mean(s.events for s in samples),
        "first_delta_p50_ms": statistics.median(firsts) * 1000,
        "first_delta_p90_ms": firsts[max(0, int(len(firsts) * 0.9) - 1)] * 1000,
        "total_p50_ms": statistics.median(s.total_s for s in samples) * 1000,
    }


def run_client(argv: list[str]) -> None:
    port, path, body, marker, concurrency, count = argv
    result = asyncio.run(_client(int(port), path, json.loads(body), marker.encode(), int(concurrency), int(count)))
    print(json.dumps(result))


# -- orchestration --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree(pid: int) -> list[int]:
    found, pending = [], [pid]
    while pending:
        p = pending.pop()
        found.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                pending += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return found


def rss_tree_kib(pid: int) -> int:
    """Resident memory of a process and all its descendants."""
    total = 0
    for p in _tree(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return total


def cpu_tree_s(pid: int) -> float:
    """User + system CPU seconds of a process and its descendants so far."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in _tree(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return total


class Sampler:
    """Peak RSS of a process tree while a phase runs."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_tree_kib(self.pid))
            self._stop.wait(0.05)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Gateway:
    name: str
    port: int
    proc: subprocess.Popen
    results: dict = field(default_factory=dict)


def wait_http(port: int, path: str, timeout: float, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"process exited early; see {log}:\n" + log.read_text()[-2000:])
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(f"GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode())
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.25)
    raise SystemExit(f"not ready after {timeout}s; see {log}")


def start(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(die_with_parent(cmd), stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})}, start_new_session=True)


def client(port: int, path: str, body: dict, marker: str, concurrency: int, count: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "client", str(port), path, json.dumps(body), marker,
                          str(concurrency), str(count)], capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"client failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deltas", type=int, default=200, help="text deltas per stream from the burst provider")
    ap.add_argument("--requests-1", type=int, default=60, help="sequential requests at concurrency 1")
    ap.add_argument("--requests-64", type=int, default=4, help="requests per stream at concurrency 64")
    ap.add_argument("--paced-interval-ms", type=float, default=5.0,
                    help="the paced provider's time between tokens (first-event latency is measured on it too)")
    ap.add_argument("--paced-deltas", type=int, default=20)
    ap.add_argument("--litellm-python", default=str(ROOT / ".venv-bench" / "bin" / "python"))
    ap.add_argument("--only", choices=["lmspd", "litellm"], default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()

    logs = Path(tempfile.mkdtemp(prefix="lmspd-bench-gateway-"))
    procs: list[subprocess.Popen] = []
    try:
        # Two providers: one that sends its whole stream at once (the gateway
        # is the bottleneck: throughput), one that paces tokens like a fast
        # model (the first token is not followed by a burst to decode).
        ports = {}
        for name, deltas, interval in (("burst", args.deltas, 0.0),
                                       ("paced", args.paced_deltas, args.paced_interval_ms)):
            ports[name] = free_port()
            log = logs / f"provider-{name}.log"
            proc = start([sys.executable, __file__, "provider", str(ports[name]), str(deltas), str(interval)], log)
            procs.append(proc)
            wait_http(ports[name], "/v1/models", 20, proc, log)
        upstream = {name: f"http://127.0.0.1:{port}/v1" for name, port in ports.items()}
        gateways: list[Gateway] = []

        if args.only in (None, "lmspd"):
            port = free_port()
            cfg = logs / "lmspd.json"
            cfg.write_text(json.dumps({"models": {
                model: {"engine": "upstream", "url": upstream[name], "upstream_model": "bench-upstream"}
                for model, name in (("bench", "burst"), ("bench-paced", "paced"))}}))
            proc = start([sys.executable, "-m", "lmspd", "serve", "--port", str(port), "--log-level", "warning",
                          "--data-dir", str(logs / "lmspd-data"), "--config", str(cfg)],
                         logs / "lmspd.log", env={"PYTHONPATH": str(ROOT)})
            procs.append(proc)
            wait_http(port, "/health", 60, proc, logs / "lmspd.log")
            gateways.append(Gateway("lmspd", port, proc))

        if args.only in (None, "litellm"):
            if not Path(args.litellm_python).exists():
                raise SystemExit(f"no LiteLLM interpreter at {args.litellm_python} (see this file's docstring)")
            port = free_port()
            cfg = logs / "litellm.yaml"
            # custom_openai: an OpenAI-compatible provider with no native
            # Responses API, so LiteLLM's own Chat Completions bridge runs.
            cfg.write_text("model_list:\n" + "".join(
                f"  - model_name: {model}\n    litellm_params:\n      model: custom_openai/bench-upstream\n"
                f"      api_base: {upstream[name]}\n      api_key: sk-bench\n"
                for model, name in (("bench", "burst"), ("bench-paced", "paced"))))
            launch = "import sys; from litellm import run_server; sys.exit(run_server())"
            proc = start([args.litellm_python, "-c", launch,
                          "--config", str(cfg), "--port", str(port), "--host", "127.0.0.1", "--num_workers", "1"],
                         logs / "litellm.log",
                         env={"LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true", "LITELLM_LOG": "ERROR"})
            procs.append(proc)
            wait_http(port, "/health/liveliness", 180, proc, logs / "litellm.log")
            gateways.append(Gateway("litellm", port, proc))

        chat = {"model": "bench-upstream", "messages": [{"role": "user", "content": "Say something."}],
                "stream": True}
        # store: false, as Codex sends it: the gateways are compared, not a database.
        def responses(model: str) -> dict:
            return {"model": model, "input": "Say something.", "stream": True, "store": False}

        direct = {name: client(port, "/v1/chat/completions", chat, '"content"', 1, args.requests_1 if name == "burst"
                               else max(10, args.requests_1 // 2)) for name, port in ports.items()}
        direct["paced64"] = client(ports["paced"], "/v1/chat/completions", chat, '"content"', 64, args.requests_64)
        rport = free_port()
        relay = start([sys.executable, __file__, "relay", str(rport), str(ports["burst"])], logs / "relay.log")
        procs.append(relay)
        wait_http(rport, "/v1/models", 20, relay, logs / "relay.log")
        relayed = client(rport, "/v1/chat/completions", chat, '"content"', 1, args.requests_1)
        for gw in gateways:
            client(gw.port, "/v1/responses", responses("bench"), "output_text.delta", 4, 5)  # warm up
            idle = rss_tree_kib(gw.proc.pid)
            for key, concurrency, count in (("c1", 1, args.requests_1), ("c64", 64, args.requests_64)):
                cpu = cpu_tree_s(gw.proc.pid)
                with Sampler(gw.proc.pid) as sampler:
                    r = client(gw.port, "/v1/responses", responses("bench"), "output_text.delta", concurrency, count)
                r["cpu_us_per_event"] = (cpu_tree_s(gw.proc.pid) - cpu) / (r["events_per_s"] * r["wall_s"]) * 1e6
                r["rss_peak_mib"] = sampler.peak / 1024
                gw.results[key] = r
            gw.results["paced"] = client(gw.port, "/v1/responses", responses("bench-paced"), "output_text.delta", 1,
                                         max(10, args.requests_1 // 2))
            # 64 streams at model speed: busy, not saturated (the burst rows
            # above saturate the gateway, so their first-event time is queueing).
            gw.results["paced64"] = client(gw.port, "/v1/responses", responses("bench-paced"), "output_text.delta",
                                           64, args.requests_64)
            gw.results["rss_idle_mib"] = idle / 1024
        report(args, direct, relayed, gateways)
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def report(args: argparse.Namespace, direct: dict, relayed: dict, gateways: list[Gateway]) -> None:
    base = direct["burst"]["first_delta_p50_ms"]
    paced_base = direct["paced"]["first_delta_p50_ms"]
    floor = relayed["first_delta_p50_ms"] - base
    print(f"\nburst provider: {args.deltas} text deltas per stream at once; first delta p50 {base:.2f} ms straight "
          f"from it, +{floor:.2f} ms through a do-nothing byte relay")
    print(f"paced provider: {args.paced_deltas} deltas, one per {args.paced_interval_ms:g} ms; first delta p50 "
          f"{paced_base:.2f} ms straight from it ({direct['paced64']['first_delta_p50_ms']:.2f} ms at 64 streams)\n")
    print(f"{'gateway':8} {'streams':>7} {'events/s':>10} {'deltas/s':>10} {'ev/req':>7} {'CPU/event':>10} "
          f"{'1st delta p50':>14} {'added p50':>10} {'p90':>8} {'peak RSS':>9}")
    for gw in gateways:
        for c in ("c1", "c64"):
            r = gw.results[c]
            print(f"{gw.name:8} {c[1:]:>7} {r['events_per_s']:>10.0f} {r['deltas_per_s']:>10.0f} "
                  f"{r['events_per_request']:>7.0f} {r['cpu_us_per_event']:>7.1f} us "
                  f"{r['first_delta_p50_ms']:>11.2f} ms {r['first_delta_p50_ms'] - base:>7.2f} ms "
                  f"{r['first_delta_p90_ms']:>5.1f} ms {r['rss_peak_mib']:>5.0f} MiB")
        for key, label in (("paced", "1 paced"), ("paced64", "64 paced")):
            r, b = gw.results[key], direct[key]["first_delta_p50_ms"]
            print(f"{gw.name:8} {label:>8} {r['events_per_s']:>9.0f} {r['deltas_per_s']:>10.0f} {'':>7} {'':>10} "
                  f"{r['first_delta_p50_ms']:>11.2f} ms {r['first_delta_p50_ms'] - b:>7.2f} ms "
                  f"{r['first_delta_p90_ms']:>5.1f} ms")
        print(f"{gw.name:8} {'idle':>7} {'':>10} {'':>10} {'':>7} {'':>10} {'':>14} {'':>10} {'':>8} "
              f"{gw.results['rss_idle_mib']:>5.0f} MiB")
    named = {gw.name: gw.results for gw in gateways}
    if {"lmspd", "litellm"} <= named.keys():
        lm, ll = named["lmspd"], named["litellm"]
        print("\nlmspd / LiteLLM:")
        for c in ("c1", "c64"):
            print(f"  {c[1:]:>2} streams: throughput x{lm[c]['deltas_per_s'] / ll[c]['deltas_per_s']:.2f} "
                  f"(deltas/s), x{lm[c]['events_per_s'] / ll[c]['events_per_s']:.2f} (events/s), "
                  f"x{ll[c]['cpu_us_per_event'] / lm[c]['cpu_us_per_event']:.2f} (CPU per event); "
                  f"peak RSS {lm[c]['rss_peak_mib']:.0f} vs {ll[c]['rss_peak_mib']:.0f} MiB")
        paced64_base = direct["paced64"]["first_delta_p50_ms"]
        print(f"  added first-delta latency p50: burst {lm['c1']['first_delta_p50_ms'] - base:.2f} ms vs "
              f"{ll['c1']['first_delta_p50_ms'] - base:.2f} ms; paced "
              f"{lm['paced']['first_delta_p50_ms'] - paced_base:.2f} ms vs "
              f"{ll['paced']['first_delta_p50_ms'] - paced_base:.2f} ms; 64 paced streams "
              f"{lm['paced64']['first_delta_p50_ms'] - paced64_base:.2f} ms vs "
              f"{ll['paced64']['first_delta_p50_ms'] - paced64_base:.2f} ms")
    if args.json:
        args.json.write_text(json.dumps({"direct": direct, "relay": relayed,
                                         **{gw.name: gw.results for gw in gateways}}, indent=2))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "provider":
        run_provider(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]) if len(sys.argv) > 4 else 0.0)
    elif len(sys.argv) > 1 and sys.argv[1] == "relay":
        run_relay(int(sys.argv[2]), int(sys.argv[3]))
    elif len(sys.argv) > 1 and sys.argv[1] == "client":
        run_client(sys.argv[2:])
    else:
        main()
