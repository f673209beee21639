"""A throwaway PostgreSQL cluster for tests: initdb into a temp dir, serve
on a Unix socket only (no TCP port to collide with), remove it afterwards.

Uses the server binaries of Debian's ``postgresql`` package (``./dev.sh``
installs it where missing). PostgreSQL refuses to run as root, so under root
(CI) the cluster is created and run as the ``postgres`` system user, which
the package creates.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path
from urllib.parse import quote

# Tuned for tests, not for keeping data: nothing here survives the run.
_SETTINGS = {
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "shared_buffers": "32MB",
    "max_connections": "200",
    "listen_addresses": "''",
    "max_wal_size": "256MB",
    "log_min_messages": "warning",
}


def find_bindir() -> Path | None:
    """The directory of ``initdb``/``pg_ctl``: $LMSPD_PG_BINDIR, PATH, or
    the newest /usr/lib/postgresql/*/bin."""
    explicit = os.environ.get("LMSPD_PG_BINDIR")
    if explicit:
        return Path(explicit)
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name))
    if candidates:
        return Path(candidates[-1])
    initdb = shutil.which("initdb")
    return Path(initdb).resolve().parent if initdb else None


class PostgresCluster:
    def __init__(self, settings: dict[str, str] | None = None) -> None:
        self.settings = {**_SETTINGS, **(settings or {})}
        self.bindir = find_bindir()
        if self.bindir is None or not (self.bindir / "initdb").exists():
            raise RuntimeError("no PostgreSQL server binaries (initdb) found; run ./dev.sh test to install them")
        self.root = Path(tempfile.mkdtemp(prefix="lmspd-pg-"))
        self.datadir = self.root / "data"
        self.sockdir = self.root / "sock"
        self._as: list[str] = []
        self.user = pwd.getpwuid(os.geteuid()).pw_name
        if os.geteuid() == 0:
            self.user = "postgres"
            pw = pwd.getpwnam(self.user)
            self._as = ["runuser", "-u", self.user, "--"]
            os.chmod(self.root, 0o755)
            self.sockdir.mkdir()
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
            os.chown(self.sockdir, pw.pw_uid, pw.pw_gid)
        else:
            self.sockdir.mkdir()
        self._started = False

    def _run(self, *cmd: str, timeout: float = 120) -> None:
        proc = subprocess.run([*self._as, *cmd], capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")

    def start(self) -> "PostgresCluster":
        self._run(str(self.bindir / "initdb"), "-D", str(self.datadir), "-U", self.user, "--auth=trust",
                  "--no-sync", "-E", "UTF8", "--locale=C")
        opts = " ".join(f"-c {k}={v}" for k, v in self.settings.items())
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.datadir), "-w", "-t", "60",
                  "-l", str(self.root / "server.log"), "-o", f"{opts} -k {self.sockdir}", "start")
        self._started = True
        return self

    def dsn(self, dbname: str = "postgres") -> str:
        return f"postgresql://{self.user}@/{dbname}?host={self.sockdir}"

    def log(self) -> str:
        try:
            return (self.root / "server.log").read_text()
        except OSError:
            return ""

    def stop(self) -> None:
        if self._started:
            try:
                self._run(str(self.bindir / "pg_ctl"), "-D", str(self.datadir), "-m", "immediate", "-w",
                          "stop", timeout=60)
            finally:
                self._started = False
        shutil.rmtree(self.root, ignore_errors=True)


class Databases:
    """Fresh, empty namespaces in one cluster, one per test: a schema of its
    own in a shared database (instant, unlike CREATE DATABASE), named by the
    DSN's ``search_path``; dropped afterwards."""

    DATABASE = "lmspd_tests"

    def __init__(self, cluster: PostgresCluster) -> None:
        self.cluster = cluster

    def create(self) -> str:
        import psycopg

        with psycopg.connect(self.cluster.dsn(), autocommit=True) as conn:
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (self.DATABASE,)).fetchone() is None:
                with contextlib.suppress(psycopg.errors.DuplicateDatabase):
                    conn.execute(f'CREATE DATABASE "{self.DATABASE}"')
        schema = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.cluster.dsn(self.DATABASE), autocommit=True) as conn:
            conn.execute(f'CREATE SCHEMA "{schema}"')
        return self.cluster.dsn(self.DATABASE) + "&options=" + quote(f"-csearch_path={schema}")

    def drop(self, dsn: str) -> None:
        import psycopg

        schema = dsn.rsplit("search_path%3D", 1)[1]
        with psycopg.connect(self.cluster.dsn(self.DATABASE), autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
