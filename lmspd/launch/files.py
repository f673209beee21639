"""Writing a plan's files: only inside the client's lmspd-owned directory,
only when the content changed (so a second launch is a no-op), atomically
(a file is replaced whole or not at all), and saying what changed."""

from __future__ import annotations

import difflib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from lmspd.core.files import private_dir
from lmspd.launch.clients import Plan


@dataclass(frozen=True)
class Change:
    path: Path
    status: str  # "created", "changed", "unchanged"
    diff: str


def compare(plan: Plan) -> list[Change]:
    changes = []
    for name, content in plan.files.items():
        path = plan.directory / name
        try:
            old: str | None = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            old = None
        if old == content:
            changes.append(Change(path, "unchanged", ""))
            continue
        diff = "".join(difflib.unified_diff((old or "").splitlines(keepends=True), content.splitlines(keepends=True),
                                            str(path) if old is not None else "/dev/null", str(path)))
        changes.append(Change(path, "created" if old is None else "changed", diff))
    return changes


def write(plan: Plan) -> list[Change]:
    changes = compare(plan)
    # 0700, as the server makes the data dir (the launch may be first to).
    private_dir(plan.directory)
    for change in changes:
        if change.status == "unchanged":
            continue
        fd, tmp = tempfile.mkstemp(dir=plan.directory, prefix=f".{change.path.name}.")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.write(plan.files[change.path.name])
            os.replace(tmp, change.path)
        except BaseException:
            os.unlink(tmp)
            raise
    return changes
