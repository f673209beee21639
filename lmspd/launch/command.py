"""``lmspd launch CLIENT [-- client args]``: the command line around
``clients.build`` and ``files.write``: find the server (or start one on
loopback, saying so), write the client's files, run the client, and stop a
server it started when the client exits."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from lmspd.launch import clients, files
from lmspd.launch.served import ServedModel, ServerRefused, ServerUnavailable, read_served

DEFAULT_URL = "http://127.0.0.1:8080"
# A local server loads its model before it answers /health as ready.
START_TIMEOUT_S = 600.0
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
# Any value on a loopback server without --api-key; the clients need one.
LOCAL_KEY = "lmspd-local"


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
    url = args.url.rstrip("/")
    key = args.api_key or os.environ.get("LMSPD_API_KEY") or LOCAL_KEY
    started: subprocess.Popen[bytes] | None = None
    try:
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
        # Ctrl-C belongs to the client while it runs (it shares the terminal).
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            return subprocess.run([executable, *command[1:]], env=env).returncode
        finally:
            signal.signal(signal.SIGINT, previous)
    except ServerRefused as exc:
        print(f"lmspd launch: {exc}", file=sys.stderr)
        return 2
    finally:
        if started is not None:
            _stop(started)


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
    log = data_dir / "launch" / "server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "lmspd", "serve", "--host", host, "--port", str(port), "--data-dir", str(data_dir)]
    print(f"lmspd launch: no server at {url}: starting `{shlex.join(cmd[2:])}` (log: {log}); "
          "it stops when the client exits", file=sys.stderr)
    with log.open("ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


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
