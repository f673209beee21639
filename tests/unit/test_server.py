"""``lmspd serve``'s process lifecycle without a model: the socket is bound
before anything loads, and a signal during the load ends the process at
once (the load runs in a thread of its own; the main thread waits)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import lmspd.server
from lmspd.cli import main

# A load as llama.cpp does one: the main thread inside C for as long as it
# takes, running Python only in a callback (llama.cpp's log callback). A
# KeyboardInterrupt raised there is swallowed by ctypes, and the load goes on.
SLOW_LOAD = """
import ctypes, sys, time
import lmspd.server

def slow_load(settings):
    libc = ctypes.CDLL(None)
    compare = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)

    def log_line(a, b):
        time.sleep(0.05)
        return 0

    callback = compare(log_line)
    print("loading", flush=True)
    items = (ctypes.c_int * 400)()
    libc.qsort(items, len(items), ctypes.sizeof(ctypes.c_int), callback)  # minutes of callbacks
    print("loaded", flush=True)
    raise SystemExit("the load ended")

lmspd.server.build_service = slow_load
from lmspd.cli import main
sys.exit(main(sys.argv[1:]))
"""


def start_loading(tmp_path: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_LOAD, "serve", "--port", "0", "--data-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # The test runner's own SIGINT disposition is not the server's.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout is not None
    assert proc.stdout.readline() == "loading\n"
    time.sleep(0.3)  # well inside the C call
    return proc


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_the_load_ends_the_process_at_once(tmp_path: Path, sig: int) -> None:
    """Ctrl-C during a load was ignored (the server then started); now the
    process ends at once, 128 + the signal, without a traceback."""
    proc = start_loading(tmp_path)
    sent = time.monotonic()
    proc.send_signal(sig)
    try:
        code = proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"still loading 5 s after {sig.name}:\n{out}{err[-2000:]}")
    out, err = proc.communicate()
    assert time.monotonic() - sent < 5
    assert code == 128 + sig, (code, err)
    assert f"lmspd: interrupted ({sig.name}) while loading" in err, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert "loaded" not in out


def refused_before_loading(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                           *flags: str) -> str:
    monkeypatch.setattr(lmspd.server, "build_service", lambda settings: pytest.fail("loaded the model"))
    assert main(["serve", *flags]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err


def test_a_port_in_use_is_said_before_the_model_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = refused_before_loading(monkeypatch, capsys, "--port", str(port), "--data-dir", str(tmp_path))
    assert f"lmspd: cannot listen on 127.0.0.1 port {port}: Address already in use" in err, err


def test_a_host_that_does_not_resolve_is_said_before_the_model_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    err = refused_before_loading(monkeypatch, capsys, "--host", "no-such-host.invalid", "--api-key", "k",
                                 "--port", "0", "--data-dir", str(tmp_path))
    assert "lmspd: cannot listen on no-such-host.invalid port 0: " in err, err


@pytest.mark.parametrize("port", ["70000", "-1", "http"])
def test_a_port_out_of_range_is_refused_by_the_parser(port: str, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(lmspd.server, "serve", lambda settings: pytest.fail("served"))
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--port", port])
    assert exited.value.code == 2
    assert f"--port: must be a number from 0 to 65535, not {port!r}" in capsys.readouterr().err


def test_the_sockets_are_bound_as_asyncio_binds_them() -> None:
    """Every address the host resolves to ("": IPv4 and IPv6 everywhere),
    bound but not listening: a client connecting during a load is refused
    at once rather than left waiting."""
    sockets = lmspd.server.bind("127.0.0.1", 0)
    try:
        (sock,) = sockets
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)
        with socket.socket() as client, pytest.raises(ConnectionRefusedError):
            client.connect(sock.getsockname())
    finally:
        for sock in sockets:
            sock.close()


def test_a_store_url_of_another_scheme_is_one_line_before_the_model_loads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """It became a SQLite file named after the URL, in the working directory."""
    monkeypatch.chdir(tmp_path)
    err = refused_before_loading(monkeypatch, capsys, "--port", "0", "--data-dir", str(tmp_path / "data"),
                                 "--store", "postgresql+pg8000://lmspd:s3cret@db.internal/lmspd")
    assert "postgresql://, postgres://, postgresql+psycopg://" in err and "s3cret" not in err, err
    assert [p.name for p in tmp_path.iterdir() if p.name != "data"] == []


def test_the_env_store_is_checked_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LMSPD_STORE", "mysql://lmspd:s3cret@db.internal/lmspd")
    err = refused_before_loading(monkeypatch, capsys, "--port", "0", "--data-dir", str(tmp_path / "data"))
    assert "mysql:// URLs" in err and "s3cret" not in err, err
    assert [p.name for p in tmp_path.iterdir() if p.name != "data"] == []


def test_serving_leaves_a_signal_the_process_was_started_ignoring_ignored() -> None:
    """As the load does (lmspd.signals): ``lmspd serve &`` in a script runs
    with SIGINT ignored, and a Ctrl-C meant for the script stopped the
    server once it served."""
    server = object.__new__(lmspd.server._Server)  # capture_signals reads only handle_exit
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with server.capture_signals():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) == server.handle_exit
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == before[signal.SIGTERM]
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
