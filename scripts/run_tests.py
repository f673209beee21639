"""``./dev.sh test``: pytest in two phases (README: Tests).

The tests marked ``alone`` measure time against a bound, so on two workers
each waited for the other worker's current test to end (a Codex test runs
150 s): ~270 s of a CI run's ~1,000 were one worker idle. They now run after
the others, in one process, with nothing beside them:

1. ``pytest -m "not alone" ARGS`` (two workers, as ``pyproject.toml`` says);
2. ``pytest -m alone -n 0 ARGS``.

Arguments that choose the markers or the workers themselves (``-m``, ``-n``)
run as given, in one invocation: the ``alone`` lock (``tests/conftest.py``)
still keeps those tests to themselves there. A failing first phase still
runs the second (its report is worth having), unless the arguments ask to
stop at the first failure.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from typing import Any

NO_TESTS = 5  # pytest's exit status when nothing was selected
# A first phase that ended otherwise (interrupted, an internal or usage error) ends the run.
GO_ON = (0, 1, NO_TESTS)


def phases(args: list[str]) -> list[list[str]]:
    """The pytest argument lists to run, in order."""
    if any(_chooses_phase(arg) for arg in args):
        return [args]
    return [["-m", "not alone", *args], ["-m", "alone", "-n", "0", *args]]


def _chooses_phase(arg: str) -> bool:
    return arg.startswith(("-m", "-n", "--numprocesses"))


def outcome(statuses: list[int]) -> int:
    """One exit status for the phases: the first failure's, or 0; NO_TESTS
    only when no phase selected a test (a path with no ``alone`` test in it
    leaves the second phase nothing to run, which is no failure)."""
    ran = [status for status in statuses if status != NO_TESTS]
    if not ran:
        return NO_TESTS
    return next((status for status in ran if status != 0), 0)


def main(args: list[str]) -> int:
    statuses: list[int] = []
    # Asked to stop at the first failure (-x, --exitfirst, --maxfail=N): a
    # failing first phase is the run's end too.
    go_on = (0, NO_TESTS) if any(a == "-x" or a.startswith(("--exitfirst", "--maxfail")) for a in args) else GO_ON
    for phase in phases(args):
        if statuses and statuses[-1] not in go_on:
            break
        statuses.append(_pytest(phase))
    return outcome(statuses)


def _pytest(args: list[str]) -> int:
    """pytest's exit status. A Ctrl-C reaches pytest too (one process group):
    this waits for it to stop as it does, its teardown (the test servers it
    started, their data dirs) and its report included; ``subprocess.call``
    killed it a quarter of a second after the interrupt."""
    child = subprocess.Popen([sys.executable, "-m", "pytest", *args])

    def forward(sig: int, frame: Any) -> None:
        # SIGTERM or SIGHUP to this process (a CI job's timeout, a closed
        # terminal) is pytest's too: it was left running, orphaned.
        child.send_signal(sig)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGHUP)}
    interrupted = False
    try:
        while True:
            try:
                status = child.wait()
            except KeyboardInterrupt:
                interrupted = True
                continue
            return 130 if interrupted and status != 0 else status
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
