"""``./dev.sh``: a subcommand it does not know (or none) prints its usage and
exits 2 before installing anything; ``serve``, ``test`` and ``lint`` go on to
the install. Run on a copy whose Python is a fake that records being asked
to make the venv and then stops the script: nothing is installed."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from support.fake_cuda import ROOT


def _dev_sh(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    shutil.copy2(ROOT / "dev.sh", checkout / "dev.sh")
    for script in (ROOT / "scripts").glob("*.sh"):
        shutil.copy2(script, checkout / "scripts" / script.name)
    asked = tmp_path / "python-asked"
    python = tmp_path / "python3"
    python.write_text(f'#!/bin/sh\necho "$@" >> "{asked}"\nexit 7\n')
    python.chmod(0o755)
    env = {**os.environ, "PYTHON": str(python)}
    done = subprocess.run(["bash", str(checkout / "dev.sh"), *args], env=env, capture_output=True, text=True,
                          timeout=60)
    return done, asked


@pytest.mark.parametrize("args", [(), ("bogus",), ("--help",), ("Serve",)])
def test_an_unknown_subcommand_is_a_usage_error_before_any_install(tmp_path: Path, args: tuple[str, ...]) -> None:
    done, asked = _dev_sh(tmp_path, *args)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("usage: ./dev.sh serve [flags] | ./dev.sh test [pytest args] | ./dev.sh lint")
    assert not asked.exists() and not (tmp_path / "checkout" / ".venv").exists()


@pytest.mark.parametrize("command", ["serve", "test", "lint"])
def test_the_three_subcommands_go_on_to_install(tmp_path: Path, command: str) -> None:
    done, asked = _dev_sh(tmp_path, command, "--anything")
    # The fake Python refuses to make the venv: the install began, and stopped there.
    assert done.returncode == 7, done.stderr
    assert "creating a virtual environment" in done.stderr and "usage:" not in done.stderr
    assert asked.read_text().splitlines()[-1] == "-m venv .venv"
