"""The npm-installed agent clients the end-to-end tests drive.

``dev_client``: the Codex CLI and Claude Code that ``./dev.sh test``
installs into ``.tools/`` at the versions it pins. The others are installed
once into a cache directory (``$LMSPD_TEST_CACHE/npm``, default
``~/.cache/lmspd-tests/npm``) at the versions the client captures in
shared/clients/ were made with, and reused while those versions stay the
same. Without npm the caller skips; an install that fails is a failure.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

PACKAGES = {
    "@openai/codex": "0.171.0",
    "@mariozechner/pi-coding-agent": "0.73.1",
    "ai": "6.0.326",
    "@ai-sdk/openai": "3.0.141",
    "zod": "4.6.7",
}


class NpmMissing(Exception):
    pass


def cache_dir() -> Path:
    root = os.environ.get("LMSPD_TEST_CACHE") or os.path.expanduser("~/.cache/lmspd-tests")
    return Path(root) / "npm"


def install(timeout: float = 900) -> Path:
    """Install (or reuse) the clients; return the npm prefix."""
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        raise NpmMissing("npm/node are not installed")
    prefix = cache_dir()
    specs = [f"{name}@{version}" for name, version in sorted(PACKAGES.items())]
    stamp = prefix / f".installed-{hashlib.sha256(' '.join(specs).encode()).hexdigest()[:16]}"
    if stamp.exists():
        return prefix
    prefix.mkdir(parents=True, exist_ok=True)
    # Two test workers (pytest-xdist) may both get here: one installs.
    with open(prefix / ".install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.exists():
            return prefix
        result = subprocess.run(
            [npm, "install", "--no-audit", "--no-fund", "--loglevel=error", "--prefix", str(prefix), *specs],
            capture_output=True, text=True, timeout=timeout,
        )
        if result.returncode != 0:
            raise RuntimeError(f"npm install failed ({result.returncode}):\n{result.stderr[-3000:]}")
        stamp.touch()
    return prefix


def codex(prefix: Path) -> Path:
    return prefix / "node_modules" / ".bin" / "codex"


def pi_cli(prefix: Path) -> Path:
    return prefix / "node_modules" / "@mariozechner" / "pi-coding-agent" / "dist" / "cli.js"


def dev_client(name: str, env: str, what: str) -> tuple[Path, pytest.MarkDecorator]:
    """``.tools/<name>``'s binary (``env`` names another one) and the mark
    that skips a test module without it."""
    path = Path(os.environ.get(env, Path(__file__).resolve().parents[2] / f".tools/{name}/node_modules/.bin/{name}"))
    return path, pytest.mark.skipif(not path.exists(), reason=f"{what} is not installed at {path} "
                                                              "(./dev.sh test installs it when npm is available)")
