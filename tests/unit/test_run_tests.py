"""scripts/run_tests.py (``./dev.sh test``): the ``alone`` tests run after the
others, in one process, and the two phases give one exit status."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "run_tests.py"
_spec = importlib.util.spec_from_file_location("run_tests", SCRIPT)
assert _spec is not None and _spec.loader is not None
run_tests = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_tests)


def test_the_alone_tests_run_second_in_one_process_with_the_arguments_passed_to_both():
    assert run_tests.phases(["tests/unit", "-q"]) == [
        ["-m", "not alone", "tests/unit", "-q"],
        ["-m", "alone", "-n", "0", "tests/unit", "-q"],
    ]


@pytest.mark.parametrize("chooser", [["-m", "slow"], ["-mslow"], ["-n", "0"], ["-n0"], ["--numprocesses=4"]])
def test_arguments_that_choose_markers_or_workers_run_as_given_once(chooser):
    args = ["tests/e2e", *chooser]
    assert run_tests.phases(args) == [args]


@pytest.mark.parametrize(("statuses", "status"), [
    ([0, 0], 0),
    ([0, 5], 0),   # a path without an alone test
    ([5, 0], 0),   # only alone tests selected
    ([5, 5], 5),
    ([1, 0], 1),
    ([0, 1], 1),
    ([1, 5], 1),
    ([2], 2),      # interrupted: the second phase did not run
])
def test_one_exit_status_for_the_phases(statuses, status):
    assert run_tests.outcome(statuses) == status


def phases_run(monkeypatch, args: list[str], statuses: list[int]) -> tuple[int, int]:
    """``main(args)`` with each phase's pytest answering the next of
    ``statuses``: its exit status, and how many phases ran."""
    answers = iter(statuses)
    ran: list[list[str]] = []

    def pytest_(phase: list[str]) -> int:
        ran.append(phase)
        return next(answers)

    monkeypatch.setattr(run_tests, "_pytest", pytest_)
    return run_tests.main(args), len(ran)


def test_a_failing_first_phase_still_runs_the_second_and_an_interrupted_one_does_not(monkeypatch):
    assert phases_run(monkeypatch, ["x"], [1, 0]) == (1, 2)
    assert phases_run(monkeypatch, ["x"], [2, 0]) == (2, 1)


@pytest.mark.parametrize("stop", ["-x", "--exitfirst", "--maxfail=2"])
def test_asked_to_stop_at_the_first_failure_a_failing_first_phase_ends_the_run(monkeypatch, stop):
    assert phases_run(monkeypatch, ["tests", stop], [1, 0]) == (1, 1)


def test_it_runs_pytest_for_real_on_a_selection(tmp_path: Path):
    """The script against pytest itself: a module with one ``alone`` test
    and one plain one, each phase running its own."""
    (tmp_path / "pyproject.toml").write_text(
        '[tool.pytest.ini_options]\nmarkers = ["alone: a test run by itself"]\naddopts = "-p no:cacheprovider"\n')
    (tmp_path / "test_two.py").write_text(
        "import pytest, os\n"
        "def test_plain():\n    open('plain', 'a').write('ran\\n')\n"
        "@pytest.mark.alone\n"
        "def test_by_itself():\n    open('alone', 'a').write('ran\\n')\n")
    done = subprocess.run([sys.executable, str(SCRIPT), "-p", "xdist", "-q", "test_two.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "plain").read_text() == "ran\n" and (tmp_path / "alone").read_text() == "ran\n"
    assert done.stdout.count("1 passed, 1 deselected") == 2, done.stdout


def test_ctrl_c_lets_pytest_finish_its_teardown(tmp_path: Path):
    """Ctrl-C reaches the script and pytest alike (one process group). The
    script waits for pytest to stop as pytest does: its fixtures' teardown
    (the suite's test servers and their data dirs) runs to the end.
    ``subprocess.call`` killed pytest 0.25 s after the interrupt."""
    (tmp_path / "pyproject.toml").write_text('[tool.pytest.ini_options]\naddopts = "-p no:cacheprovider"\n')
    (tmp_path / "test_slow.py").write_text(
        "import time, pytest\n"
        "@pytest.fixture\n"
        "def server():\n    yield\n    time.sleep(1.5)\n    open('torn_down', 'w').write('yes')\n"
        "def test_slow(server):\n    open('started', 'w').write('yes')\n    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "-p", "no:xdist", "-q", "test_slow.py"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "started").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    out = proc.communicate(timeout=60)[0].decode()
    assert (tmp_path / "torn_down").read_text() == "yes", out
    assert proc.returncode == 130, out


def test_sigterm_to_the_script_ends_pytest_too(tmp_path: Path):
    """A CI job's timeout (or a closed terminal) signals the process that
    ``./dev.sh test`` became: pytest, its child, went on running orphaned."""
    (tmp_path / "pyproject.toml").write_text('[tool.pytest.ini_options]\naddopts = "-p no:cacheprovider"\n')
    (tmp_path / "test_slow.py").write_text(
        "import os, time\n"
        "def test_slow():\n    open('pid', 'w').write(str(os.getpid()))\n    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "-p", "no:xdist", "-q", "test_slow.py"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not (tmp_path / "pid").exists() or not (tmp_path / "pid").read_text():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    pytest_pid = int((tmp_path / "pid").read_text())
    proc.send_signal(signal.SIGTERM)  # to the script alone, not its group
    proc.communicate(timeout=30)
    assert proc.returncode != 0
    for _ in range(100):
        try:
            os.kill(pytest_pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(pytest_pid, signal.SIGKILL)
    pytest.fail("pytest outlived the script it ran under")
