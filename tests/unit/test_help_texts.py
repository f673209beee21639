"""What ``lmspd serve --help`` and ``lmspd launch --help`` say: every flag
has a help text, and the defaults they name are the code's own."""

from __future__ import annotations

import re

import pytest

from lmspd.cli import main
from lmspd.config import Settings
from lmspd.engines.llama.models import DEFAULT_MODEL_ID


def help_of(capsys: pytest.CaptureFixture[str], *command: str) -> str:
    with pytest.raises(SystemExit) as exited:
        main([*command, "--help"])
    assert exited.value.code == 0
    # argparse wraps at the terminal's width: one line, single spaces.
    return re.sub(r"\s+", " ", capsys.readouterr().out)


def test_every_serve_flag_says_what_it_is(capsys: pytest.CaptureFixture[str]) -> None:
    text = help_of(capsys, "serve")
    for flag in ("--host", "--threads", "--data-dir", "--log-level"):
        described = re.search(re.escape(flag) + r" [A-Z{][^ ]* (\S+)", text)
        assert described is not None and not described.group(1).startswith("-"), f"{flag} has no help"
    s = Settings()
    assert f"default {s.host};" in text
    assert f"default: {DEFAULT_MODEL_ID}" in text
    assert f"(default {s.kv_disk_space_mb}; 0 turns the disk tier off)" in text
    assert f"(default {s.kv_ram_mb})" in text
    assert f"(default {s.kv_checkpoint_every}; 0: never)" in text
    assert "--kv-type is quantized" in text
    assert "env LMSPD_DATA_DIR, else ~/.lmspd" in text
    assert "default info;" in text


def test_launch_says_where_its_defaults_come_from(capsys: pytest.CaptureFixture[str]) -> None:
    text = help_of(capsys, "launch", "codex")
    assert "default: env LMSPD_URL, else http://127.0.0.1:8080" in text
    assert "default: env LMSPD_DATA_DIR, else ~/.lmspd" in text
    assert "--bin PATH the client's executable (default: its own name" in text
