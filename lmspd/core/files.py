"""Files only their owner may read: the store, KV checkpoints (which hold
prompt text), keys. Created 0600 in directories created 0700, whatever the
process's umask (the default 022 would make them world-readable)."""

from __future__ import annotations

import os
from pathlib import Path

FILE_MODE = 0o600
DIR_MODE = 0o700


def private_dir(path: str | os.PathLike[str]) -> Path:
    """``mkdir -p``; every directory it creates is 0700."""
    path = Path(path)
    missing: list[Path] = []
    at = path
    while not at.exists() and at != at.parent:
        missing.append(at)
        at = at.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=DIR_MODE)
        except FileExistsError:
            continue
        os.chmod(directory, DIR_MODE)  # mkdir's mode is masked by the umask, which may add nothing back
    return path


def private_file(path: str | os.PathLike[str]) -> None:
    """Create ``path`` empty if it is missing, and make it 0600 either way
    (a file an older version left readable is closed too)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    finally:
        os.close(fd)
