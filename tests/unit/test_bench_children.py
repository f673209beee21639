"""The benchmarks' child processes (servers, CPU hogs) end when the
benchmark does, however it ends (``bench/_common.py: die_with_parent``):
one that crashed in llama.cpp left an ``lmspd serve`` running for an hour
and a half. A stand-in benchmark starts a child in a session of its own (as
``ChildServer`` does, out of reach of a terminal's Ctrl-C) and dies at once
without cleaning up."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def _orphan(wrap: bool) -> int:
    """The pid of the child a benchmark left when it died by SIGKILL."""
    script = (f"import os, subprocess, sys; sys.path.insert(0, {str(BENCH)!r}); from _common import die_with_parent\n"
              f"cmd = {SLEEPER!r}\n"
              f"p = subprocess.Popen(die_with_parent(cmd) if {wrap} else cmd, start_new_session=True,\n"
              "                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
              "__import__('time').sleep(0.5)  # past the prctl\n"
              "print(p.pid, flush=True)\n"
              "os.kill(os.getpid(), 9)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == -9, done.stderr
    return int(done.stdout.split()[0])


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended; only its parent has not reaped it


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_ends_with_the_benchmark_that_started_it() -> None:
    pid = _orphan(wrap=True)
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)
    # Without it the same child outlives the benchmark.
    pid = _orphan(wrap=False)
    try:
        time.sleep(0.5)
        assert _alive(pid)
    finally:
        os.kill(pid, 9)
