from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import sys
import tempfile
import time

import httpx
import pytest
from hypothesis import HealthCheck, settings

from support.server import ALICE, BOB, LAUNCHES, ServerProcess

# default_server's ceiling on output for requests that give none (its docstring).
DEFAULT_SERVER_OUTPUT_CEILING = 512

# Property tests share two cores with the other test worker and a model
# server: a per-example deadline or a "too slow" check measures the machine.
settings.register_profile("lmspd", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("lmspd")

# A suite started in the background by a shell without job control
# (``nohup ./dev.sh test &``) inherits SIGINT ignored, and hands that on to
# every process it starts; lmspd keeps an ignored signal ignored, so the tests
# of Ctrl-C (test_lifecycle's SIGINT, test_launch's, test_run_tests') found
# nothing to interrupt. Their processes start as from a terminal instead: a
# handler of Python's own is reset to the default at exec.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Launches reported back by pytest-xdist's workers (pytest_testnodedown).
_WORKER_LAUNCHES: list[tuple[str, ...]] = []
# Seconds spent by ``alone`` tests, this process's and the workers': waiting
# for the other worker's test to end, and running (``_turn``).
_ALONE = {"tests": 0, "waited_s": 0.0, "ran_s": 0.0}
# The workers' turn-lock folders (``_turn_dir``), removed when the run ends.
_TURN_DIRS: set[str] = set()


# The modules whose tests use ``default_server``: one pytest-xdist group.
CODEX_MODULES = frozenset({"tests/e2e/test_client_fixtures.py", "tests/e2e/test_codex_defaults.py",
                           "tests/e2e/test_codex_exec.py", "tests/e2e/test_launch_codex.py",
                           "tests/e2e/test_launch_claude.py"})


def _scope(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return "codex" if path in CODEX_MODULES else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """The suite's two workers (README: Tests) take whole groups: each module
    is one, so that a module-scoped server starts once, and the modules of
    ``default_server`` are one (``codex``), so that Codex's ~9k-token
    instructions are prefilled once a run, not once a worker. (xdist's own
    ``xdist_group`` marks rename node ids, which pytest 9 no longer allows.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)

    return ByModule(config, log)


def _turn_dir() -> str | None:
    """The folder of this run's turn locks (``_turn``), under pytest-xdist."""
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    return None if run_id is None else os.path.join(tempfile.gettempdir(), f"lmspd-tests-{run_id}")


@contextlib.contextmanager
def _turn(alone: bool):
    """The other worker's tests, kept off the cores while a test marked
    ``alone`` runs (README: Tests). Every test holds ``run.lock`` shared, an
    ``alone`` test exclusively; each takes ``gate.lock`` first, so that a
    worker waiting to run alone is not overtaken by the other's next test."""
    folder = _turn_dir()
    if folder is None:  # one process: nothing runs beside it
        yield
        return
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "gate.lock"), "a") as gate, open(os.path.join(folder, "run.lock"), "a") as run:
        asked = time.monotonic()
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(run, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            if not alone:
                fcntl.flock(gate, fcntl.LOCK_UN)
        got = time.monotonic()
        try:
            yield
        finally:
            fcntl.flock(run, fcntl.LOCK_UN)
            fcntl.flock(gate, fcntl.LOCK_UN)
            if alone:
                _ALONE["tests"] += 1
                _ALONE["waited_s"] += got - asked
                _ALONE["ran_s"] += time.monotonic() - got


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test marked ``alone`` measures time against a bound (a stream's
    largest gap, a latency, whether drafting pays): on two workers the other
    worker's decode took its core, and such tests failed by chance. Setup
    and teardown are inside the turn: a module's server starts in its first
    test's setup."""
    with _turn(item.get_closest_marker("alone") is not None):
        yield


def pytest_itemcollected(item):
    """A test that uses ``default_server`` outside ``CODEX_MODULES`` would
    start a second one on the other worker: refused, saying where to add it."""
    if "default_server" in getattr(item, "fixturenames", ()) and _scope(item.nodeid) != "codex":
        raise pytest.UsageError(f"{item.nodeid} uses default_server: add its module to CODEX_MODULES (conftest.py)")


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["lmspd_launches"] = [list(args) for args in LAUNCHES]
        workeroutput["lmspd_alone"] = dict(_ALONE)
        workeroutput["lmspd_turn_dir"] = _turn_dir()
    else:  # the workers are done: their turn locks go (one folder a run was left in /tmp)
        for folder in _TURN_DIRS:
            shutil.rmtree(folder, ignore_errors=True)


def pytest_testnodedown(node, error):
    output = getattr(node, "workeroutput", {})
    _WORKER_LAUNCHES.extend(tuple(args) for args in output.get("lmspd_launches", []))
    for key, value in output.get("lmspd_alone", {}).items():
        _ALONE[key] += value
    if output.get("lmspd_turn_dir"):
        _TURN_DIRS.add(output["lmspd_turn_dir"])


def pytest_terminal_summary(terminalreporter):
    """How many model-loading ``lmspd serve`` processes this run started:
    the number that keeps the suite's wall time down (share one where the
    test allows it)."""
    launches = LAUNCHES + _WORKER_LAUNCHES
    if launches:
        terminalreporter.write_line(f"lmspd serve processes started: {len(launches)} "
                                    f"({len(set(launches))} distinct flag sets)")
    # What running them alone cost: the other worker idles while one runs,
    # and the one waiting idles until the other's test ends.
    if _ALONE["tests"]:
        terminalreporter.write_line(f"tests run alone: {_ALONE['tests']}, {_ALONE['ran_s']:.0f} s running, "
                                    f"{_ALONE['waited_s']:.0f} s waiting for the other worker's test to end")


@pytest.fixture(scope="session")
def server():
    """One real lmspd process with the bundled model, shared by every test
    that does not need its own configuration."""
    srv = ServerProcess("--ctx", "4096").start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def openai_client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused-locally", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="session")
def default_server():
    """One process started as ``./dev.sh serve`` starts it: the default
    context window, sequences and KV budgets, for the Codex tests, whose
    point is that Codex works against those defaults. Shared so that
    Codex's ~9k-token instructions are prefilled once per run, not once per
    module: a cold prefill of them takes minutes on two cores, and on a
    fresh machine (CI) every one is cold. Each test stays correct whichever
    of them runs first; only the time depends on the order.

    Its one flag is an output ceiling for requests that give none, as Codex's
    do: 512 tokens, not the default 8192. Past its trained 8192 tokens the
    bundled model, sampled at Codex's temperature (the server's 1.0), now
    and then writes on for thousands of tokens: 4,234 (14 minutes on a
    loaded machine) for "Say hello in one short sentence.", where the next
    two runs took 90 s. What Codex is told of a capped answer is checked
    (support/codex.py); how long the model writes is not what these tests
    are about."""
    srv = ServerProcess("--max-output-tokens-default", str(DEFAULT_SERVER_OUTPUT_CEILING)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def small_server():
    """A second process with a tiny context window, one sequence and a
    one-deep queue, for tests about limits and queueing (cheap to fill,
    cheap to prefill)."""
    srv = ServerProcess("--ctx", "512", "--parallel", "1", "--max-queue", "1").start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def keyed_server():
    """One real process that requires a key, shared by every test about
    credentials against the real model (owners of KV state, the console's
    key prompt, x-api-key, keys kept out of the log). Tests count
    generations as differences, never from zero."""
    srv = ServerProcess("--ctx", "1024", "--api-key", ALICE, "--api-key", BOB).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def pg_cluster():
    """A throwaway PostgreSQL cluster (tests/support/postgres.py) for the
    whole run, started on first use and removed at the end. In CI a server
    that cannot start fails the tests that need it; elsewhere they skip,
    saying why."""
    import os

    from support.postgres import PostgresCluster

    try:
        cluster = PostgresCluster().start()
    except Exception as exc:
        reason = f"PostgreSQL test server could not start: {exc}"
        if os.environ.get("CI"):
            pytest.fail(reason)
        print("\n" + "!" * 20 + " " + reason, file=sys.stderr)
        pytest.skip(reason)
    yield cluster
    cluster.stop()


@pytest.fixture
def pg_database(pg_cluster):
    """A fresh, empty namespace in the shared cluster: its DSN."""
    from support.postgres import Databases

    dbs = Databases(pg_cluster)
    dsn = dbs.create()
    yield dsn
    dbs.drop(dsn)
