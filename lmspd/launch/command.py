"""``lmspd launch CLIENT [-- client args]``: the command line around
``clients.build`` and ``files.write``: find the server (or start one on
loopback, saying so), write the client's files, run the client, and stop a
server it started when the client exits, or when the launch is interrupted
(Ctrl-C while it waits) or told to end (SIGTERM, SIGHUP: passed on to the
client)."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from lmspd import signals
from lmspd.core.files import private_dir, private_file
from lmspd.launch import clients, files
from lmspd.launch.served import ServedModel, ServerRefused, ServerUnavailable, read_served

DEFAULT_URL = "http://127.0.0.1:8080"
# A local server loads its model before it answers /health as ready.
START_TIMEOUT_S = 600.0
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
# Any value on a loopback server without --api-key; the clients need one.
LOCAL_KEY = "lmspd-local"
# What ends a launch as its client's exit would (the started server stopped):
# SIGTERM, and SIGHUP (the terminal closed). The client hears it too.
TERMINATING = (signal.SIGTERM, signal.SIGHUP)
# How long a client told to end has before it is killed.
CLIENT_GRACE_S = 10.0


def add_parser(sub: argparse._SubParsersAction) -> None:
    launch = sub.add_parser(
        "launch", help="point an agent (codex, claude, pi, opencode) at lmspd and run it",
        usage="lmspd launch {codex,claude,pi,opencode} [flags] [-- CLIENT_ARGS]",
        description="Reads the models a running lmspd serves and their context windows, writes the client's "
                    "configuration into files lmspd owns (<data-dir>/launch/CLIENT/; your own configuration is "
                    "never edited), then runs the client. Arguments after -- go to the client.")
    launch.add_argument("client", choices=clients.CLIENTS)
    launch.add_argument("--url", default=os.environ.get("LMSPD_URL", DEFAULT_URL),
                        help=f"the lmspd server (default: env LMSPD_URL, else {DEFAULT_URL})")
    launch.add_argument("--api-key", default=None, help="the key the client sends (default: env LMSPD_API_KEY)")
    launch.add_argument("--model", default=None, metavar="ID", help="the served model to use (default: the first)")
    launch.add_argument("--small-model", default=None, metavar="ID",
                        help="the client's small/fast model, where it has one (default: --model)")
    launch.add_argument("--max-output-tokens", type=_positive, default=None, metavar="N",
                        help="the most output tokens the client asks for per answer (default: 8192, at most a "
                             "quarter of the model's window)")
    launch.add_argument("--print", action="store_true", dest="print_only",
                        help="only show what would be written and run")
    launch.add_argument("--no-start", action="store_true",
                        help="fail when no server answers instead of starting one")
    launch.add_argument("--data-dir", type=Path, default=None, metavar="DIR",
                        help="lmspd's data directory: the client's files go in DIR/launch/CLIENT/, a started "
                             "server's log in DIR/launch/server.log (default: env LMSPD_DATA_DIR, else ~/.lmspd)")
    launch.add_argument("--bin", default=None, metavar="PATH",
                        help="the client's executable (default: its own name, codex, claude, pi or opencode, "
                             "on PATH)")


def run(args: argparse.Namespace, client_args: list[str]) -> int:
    from lmspd.config import Settings

    data_dir = (args.data_dir or Settings().data_dir).expanduser()
    try:
        url = base_url(args.url)
    except ValueError as exc:
        print(f"lmspd launch: --url (or LMSPD_URL) {exc}", file=sys.stderr)
        return 2
    key = args.api_key or os.environ.get("LMSPD_API_KEY") or LOCAL_KEY
    started: subprocess.Popen[bytes] | None = None
    try:
        with signals.raised(_Terminated, TERMINATING):
            try:
                served = read_served(url, key)
            except ServerUnavailable as exc:
                if args.print_only or args.no_start or not _startable(url):
                    print(f"lmspd launch: {exc}; start one with `lmspd serve`"
                          + ("" if args.print_only or args.no_start else " (only a loopback server is started for you)"),
                          file=sys.stderr)
                    return 2
                started = _start_server(url, data_dir)
                served = _wait_ready(url, key, started)
            return _launch(args, client_args, served, url, key, data_dir)
    except ServerRefused as exc:
        print(f"lmspd launch: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # --data-dir names a file, or a directory not ours to write
        print(f"lmspd launch: {exc.filename}: {exc.strerror}" if exc.filename else f"lmspd launch: {exc}",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lmspd launch: interrupted" + (": stopping the server it started" if started else ""), file=sys.stderr)
        return 128 + signal.SIGINT
    except _Terminated as ended:
        print(f"lmspd launch: {ended.name}"
              + (": stopping the server it started" if started else ""), file=sys.stderr)
        return 128 + ended.signal
    finally:
        if started is not None:
            _stop(started)


def _launch(args: argparse.Namespace, client_args: list[str], served: list[ServedModel], url: str, key: str,
            data_dir: Path) -> int:
    """Write the client's files and run it (or, with --print, show them)."""
    if args.max_output_tokens is not None:
        served = [replace(m, max_output_tokens=args.max_output_tokens) for m in served]
    try:
        main = _pick(served, args.model, "--model")
        small = _pick(served, args.small_model, "--small-model") if args.small_model else main
    except ValueError as exc:
        print(f"lmspd launch: {exc}", file=sys.stderr)
        return 2
    plan = clients.build(args.client, served, main, small, url, data_dir / "launch" / args.client)
    command = [args.bin or plan.program, *plan.args, *client_args]
    if args.print_only:
        print(render(plan, served, url, client_args, files.compare(plan)), end="")
        return 0
    print(_header(plan, served, url), file=sys.stderr)
    for change in files.write(plan):
        print(f"{change.status}: {change.path}", file=sys.stderr)
        if change.diff:
            print(change.diff, end="" if change.diff.endswith("\n") else "\n", file=sys.stderr)
    executable = shutil.which(command[0])
    if executable is None:
        print(f"lmspd launch: {command[0]} is not installed (or not on PATH; --bin names it)", file=sys.stderr)
        return 127
    env = {**os.environ, **plan.env, plan.key_env: key}
    # Ctrl-C belongs to the client while it runs (it shares the terminal):
    # the launch lets it pass. A handler that does nothing, not SIG_IGN: an
    # ignored signal stays ignored across exec, and the client (with every
    # command it runs for the user) started deaf to Ctrl-C.
    # A launch started with it ignored (a background job) leaves it so.
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, _let_pass)
    try:
        client = subprocess.Popen([executable, *command[1:]], env=env)
        try:
            return client.wait()
        except _Terminated as ended:
            _end_client(client, ended.signal)
            raise
    finally:
        signals.restore({signal.SIGINT: previous})


def _let_pass(sig: int, frame: Any) -> None:
    """SIGINT while the client runs: the client's (the terminal sent it to both)."""


def base_url(url: str) -> str:
    """lmspd's root from ``--url``: given as such (``http://HOST:PORT``) or
    as the OpenAI base URL that clients are given (``.../v1``). Any other
    path is refused: lmspd serves its routes from the root, and a path
    joined before them answered 404 (or, with no server there, the launch
    started one and waited for it at the wrong path for 10 minutes)."""
    parts = urlsplit(url.strip())
    path = parts.path.rstrip("/")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r}: give the server's URL, http://HOST:PORT (or http://HOST:PORT/v1)")
    if path not in ("", "/v1") or parts.query or parts.fragment:
        raise ValueError(f"{url!r}: lmspd serves from the root: give http(s)://{parts.netloc} "
                         "(or its OpenAI base URL, .../v1), without another path")
    return urlunsplit((parts.scheme, parts.netloc, "", "", ""))


class _Terminated(signals.Signalled):
    """SIGTERM or SIGHUP: the launch ends, stopping what it started. Only a
    ``finally`` stops the started server, and these signals' default action
    skips it: the server (and the client) went on running."""


def _end_client(client: subprocess.Popen[bytes], sig: int) -> None:
    """Pass ``sig`` on to the client; kill it if it has not exited within
    ``CLIENT_GRACE_S``."""
    with contextlib.suppress(ProcessLookupError):
        client.send_signal(sig)
    try:
        client.wait(timeout=CLIENT_GRACE_S)
    except subprocess.TimeoutExpired:
        client.kill()
        client.wait()


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _pick(served: list[ServedModel], wanted: str | None, flag: str) -> ServedModel:
    if wanted is None:
        return served[0]
    for model in served:
        if model.id == wanted:
            return model
    raise ValueError(f"{flag} {wanted}: not served (served: {', '.join(m.id for m in served)})")


def _header(plan: clients.Plan, served: list[ServedModel], url: str) -> str:
    models = ", ".join(f"{m.id} ({m.context_window} tokens)" for m in served)
    return f"lmspd launch {plan.client}: {url} serves {models}\n{plan.summary}"


def render(plan: clients.Plan, served: list[ServedModel], url: str, client_args: list[str],
           changes: list[files.Change]) -> str:
    """What ``--print`` shows: every file as it would be written (a changed
    one as a diff too), then the command with its environment (the key by
    the name of its variable, never its value)."""
    out = [_header(plan, served, url) + "\n"]
    for change in changes:
        status = {"created": "would be created", "changed": "would change", "unchanged": "unchanged"}[change.status]
        out.append(f"\n--- {change.path} ({status})\n")
        out.append(plan.files[change.path.name])
        if change.status == "changed":
            out.append(change.diff)
    env = [f"{name}={shlex.quote(value)}" for name, value in plan.env.items()]
    env.append(f"{plan.key_env}=${plan.key_env}")
    out.append("\nrun: " + " ".join([*env, shlex.join([plan.program, *plan.args, *client_args])]) + "\n")
    return "".join(out)


def _startable(url: str) -> bool:
    parts = urlsplit(url)
    return parts.scheme == "http" and (parts.hostname or "") in LOOPBACK


def _start_server(url: str, data_dir: Path) -> subprocess.Popen[bytes]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    log = private_dir(data_dir / "launch") / "server.log"
    cmd = [sys.executable, "-m", "lmspd", "serve", "--host", host, "--port", str(port), "--data-dir", str(data_dir)]
    print(f"lmspd launch: no server at {url}: starting `{shlex.join(cmd[2:])}` (log: {log}); "
          "it stops when the client exits", file=sys.stderr)
    private_file(log)  # the server makes its data dir's files its owner's alone; its log too
    with log.open("ab") as out:
        # A session of its own: the terminal's Ctrl-C (sent to its whole
        # foreground process group) is the client's, and stopped the server
        # mid-request under a client in the terminal's cooked mode (`codex
        # exec`, `claude -p`). The launch stops it itself (``_stop``), and
        # the kernel when the launch dies (``_dies_with_this_process``).
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=_dies_with_this_process())


def _dies_with_this_process() -> Callable[[], None] | None:
    """On Linux, what the server's child process runs before lmspd starts:
    SIGTERM to it when this process ends, however it ends (a SIGKILL leaves
    no clean-up to run). Elsewhere, or beside other threads, None: the
    launch's own clean-up only."""
    if not sys.platform.startswith("linux") or threading.active_count() > 1:
        return None  # a forked child of a threaded process may deadlock in Python code
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not in the forked child
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    pr_set_pdeathsig = 1

    def arm() -> None:
        prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the launch ended before the child could ask: start nothing
            os._exit(1)

    return arm


def _wait_ready(url: str, key: str, proc: subprocess.Popen[bytes]) -> list[ServedModel]:
    deadline = time.monotonic() + START_TIMEOUT_S
    shown = 0.0
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerRefused(f"the server started for {url} exited with {proc.returncode} (see its log)")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return read_served(url, key)
        except (httpx.HTTPError, ServerUnavailable):
            pass
        if time.monotonic() - shown > 10:
            shown = time.monotonic()
            print("lmspd launch: waiting for the server to load its model…", file=sys.stderr)
        time.sleep(0.5)
    raise ServerRefused(f"the server started for {url} was not ready within {START_TIMEOUT_S:.0f} s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
