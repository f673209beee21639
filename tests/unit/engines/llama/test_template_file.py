"""A chat template file named on the command line (``--chat-template``, for
``serve`` and ``render``) is read bounded and refused with its name when it
cannot be used: unreadable, over 1 MiB, not UTF-8. ``serve`` refuses it
before loading anything (a ConfigError, said at start)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lmspd.config import Settings
from lmspd.engines.llama.template import MAX_TEMPLATE_FILE_BYTES, read_template_file
from lmspd.engines.specs import ConfigError, LlamaSpec, build_engine


def test_a_template_file_is_read_as_utf8(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }} — é", encoding="utf-8")
    assert read_template_file(path) == "{{ messages[0]['content'] }} — é"


@pytest.mark.parametrize("content,message", [
    (b"\xff\xfe{{ x }}", "is not UTF-8 text (byte 0)"),
    (b"x" * (MAX_TEMPLATE_FILE_BYTES + 1), f"is over {MAX_TEMPLATE_FILE_BYTES} bytes"),
])
def test_a_template_file_that_cannot_be_used_is_refused_by_name(tmp_path: Path, content: bytes,
                                                                 message: str) -> None:
    path = tmp_path / "t.jinja"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=re.escape(f"chat template {path} {message}")):
        read_template_file(path)


def test_a_missing_template_file_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read chat template .*nope.jinja: No such file or directory"):
        read_template_file(tmp_path / "nope.jinja")


def test_serve_refuses_it_before_loading_the_model(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_bytes(b"\xff{{ x }}")
    settings = Settings(data_dir=tmp_path)
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        build_engine(LlamaSpec(chat_template=str(path)), settings, placement=object())
