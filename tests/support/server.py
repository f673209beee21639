"""Start a real ``lmspd serve`` process on a free port and stop it again."""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx

# The id the bundled model is served under.
MODEL = "smollm2-135m-instruct"
# The two credentials of the shared keyed process (tests/conftest.py: keyed_server).
ALICE, BOB = "alice-key", "bob-key"
URL_LINE = re.compile(r"lmspd serving .* at (http://\S+)")


# Set to a file path to get one line per ``lmspd serve`` launch (its flags
# and the test that asked for it): how the suite's process count is measured.
LAUNCH_LOG_ENV = "LMSPD_TEST_SERVER_LOG"
# Set to a directory to keep each server's log there when it stops (one file
# per launch): what each test prefilled and reused, for profiling the suite.
OUTPUT_DIR_ENV = "LMSPD_TEST_SERVER_OUTPUT"


# ``--ctx auto`` plans with the memory it finds free; the suite's servers
# plan for this machine's (and CI's) 24 GiB whatever else runs beside them,
# so that a busy machine does not quietly give a test three sequences
# instead of four. A test that is about the fitting states its own figure.
PLANNED_MEMORY = {} if "LMSPD_FREE_MEMORY_MB" in os.environ else {"LMSPD_FREE_MEMORY_MB": "24576"}


# Every launch in this pytest process (the terminal summary prints the count).
LAUNCHES: list[tuple[str, ...]] = []


def _log_launch(args: list[str]) -> None:
    LAUNCHES.append(tuple(args))
    path = os.environ.get(LAUNCH_LOG_ENV)
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"{time.time():.3f}\t{test}\t{' '.join(args)}\n")


def thread_share() -> int | None:
    """Under pytest-xdist the workers' servers share the cores: each gets its
    share, since llama.cpp's threads spin at every barrier and a server
    with a thread per core beside another such server starves both. None:
    one worker, lmspd's own default."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return None if workers <= 1 else max(1, (os.cpu_count() or 2) // workers)


def _threads(args: list[str]) -> list[str]:
    # A --config file sets each model's threads (lmspd refuses --threads beside
    # it): a test whose file has a local model gives it ``thread_share()``.
    # An upstream engine has no local model to thread (lmspd refuses it too).
    share = thread_share()
    if share is None or "--threads" in args or "--config" in args or "upstream" in args:
        return []
    return ["--threads", str(share)]


class ServerProcess:
    def __init__(self, *args: str, data_dir: str | None = None, env: dict[str, str] | None = None,
                 entry: list[str] | None = None) -> None:
        """``entry``: what runs lmspd's command line instead of ``-m lmspd``
        (a bench's wrapper script and its arguments, before ``serve``)."""
        if data_dir is None:
            data_dir = tempfile.mkdtemp(prefix="lmspd-test-")
            # Removed when the test process exits, not in stop(): a test may
            # stop and start the same server to see what survived a restart.
            # Left behind, each run leaked its stores and KV checkpoints
            # (23 GB in /tmp after a few days of runs).
            atexit.register(shutil.rmtree, data_dir, True)
        self.data_dir = data_dir
        self.args = list(args)
        self.env = env or {}
        self.entry = entry or ["-m", "lmspd"]
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.output: list[str] = []
        self._ready = threading.Event()
        self._pump_thread: threading.Thread | None = None

    def start(self, timeout: float = 90.0) -> "ServerProcess":
        cmd = [sys.executable, *self.entry, "serve", "--port", "0", "--data-dir", self.data_dir,
               "--log-level", "info", *self.args, *_threads(self.args)]
        _log_launch(self.args)
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, **PLANNED_MEMORY, **self.env},
        )
        self._pump_thread = threading.Thread(target=self._pump, daemon=True)
        self._pump_thread.start()
        if not self._ready.wait(timeout) or not self.url:
            self.stop()
            raise RuntimeError("lmspd did not start:\n" + "".join(self.output[-50:]))
        return self

    def _pump(self) -> None:
        assert self.proc and self.proc.stdout
        for line in self.proc.stdout:
            self.output.append(line)
            m = URL_LINE.search(line)
            if m and not self.url:
                self.url = m.group(1)
                self._ready.set()
        self._ready.set()

    def log(self) -> str:
        return "".join(self.output)

    def wait_for_log(self, pattern: str, timeout: float = 10.0) -> re.Match[str]:
        """The first match of ``pattern`` (a regex) in the log, waiting for it:
        the server may print a line after the reply it belongs to (a stream's
        last event, a status flip), and its output reaches ``output`` through
        a reader thread."""
        deadline = time.monotonic() + timeout
        while True:
            if m := re.search(pattern, self.log()):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"no log line matching {pattern!r}:\n{self.log()[-3000:]}")
            time.sleep(0.05)

    @property
    def admin_headers(self) -> dict[str, str]:
        """A credential with every scope (the first ``--api-key`` given without
        scopes), for the engine internals /health shows only to ``admin``."""
        keys = [self.args[i + 1] for i, a in enumerate(self.args[:-1]) if a == "--api-key"]
        plain = [k for k in keys if ":" not in k]
        return {"Authorization": f"Bearer {plain[0]}"} if plain else {}

    def health(self) -> dict:
        return httpx.get(self.url + "/health", headers=self.admin_headers, timeout=30).json()

    def generations(self, model: str = "smollm2-135m-instruct") -> int:
        return self.health()["models"][model]["generations"]

    def wait_idle(self, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            h = self.health()
            if all(not m["busy"] and not m["pending"] for m in h["models"].values()):
                return h
            time.sleep(0.02)
        raise AssertionError(f"server still busy after {timeout}s: {self.health()}")

    def terminate(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        assert self.proc
        self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        # The process is gone: the pump reads to EOF, then the pipe is
        # closed here (left to the garbage collector it is a ResourceWarning).
        if self._pump_thread is not None:
            self._pump_thread.join(10)
        pumping = self._pump_thread is not None and self._pump_thread.is_alive()
        if self.proc.stdout is not None and not self.proc.stdout.closed and not pumping:
            self.proc.stdout.close()
        if out_dir := os.environ.get(OUTPUT_DIR_ENV):
            os.makedirs(out_dir, exist_ok=True)
            name = f"{time.time():.3f}-{self.proc.pid}.log"
            with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
                f.write(" ".join(self.args) + "\n" + self.log())
