"""llama.cpp's own log lines, through Python logging (``lmspd.llama_cpp``).

llama-cpp-python installs a log callback that prints every line to stderr
unless its logger's level says otherwise, and lmspd drives llama.cpp below
``Llama``, which is where that level is set. A running server then wrote
llama.cpp's graph dumps (~60 lines each time a new batch shape reserves a
graph) and "copying KV buffer" notes into its log between requests. Here
llama.cpp's warnings and errors are warnings and errors of the server's
log; its info and debug lines are debug lines, shown by ``--log-level debug``.

llama-cpp-python reports a failed load as "Failed to load model from file"
whatever the cause; llama.cpp's error lines say which (an unknown
architecture, a truncated file, a context too large for memory).
:func:`errors` keeps the last of them logged on the loading thread, and
:func:`built` puts them into the load's exception.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import llama_cpp

log = logging.getLogger("lmspd.llama_cpp")
T = TypeVar("T")

# ggml_log_level in the ggml.h this build ships: 0 none, 1 debug, 2 info,
# 3 warn, 4 error, 5 cont (the previous line goes on). llama-cpp-python's
# own table is an older order (1 info ... 4 debug).
_LEVELS = {3: logging.WARNING, 4: logging.ERROR}
_CONT = 5
# llama.cpp warnings of every normal load that lmspd has answered: a window
# past the trained length is lmspd's choice (stretched with YaRN unless
# --rope-scaling none; the placement line says so), and a mistyped control
# token is one llama.cpp corrects itself (Gemma 3's GGUFs). Debug lines, so
# that a load is quiet at --log-level info.
_ANSWERED = ("-- possible training context overflow", "was not control-type; this is probably a bug in the model")
# A line's pieces until its newline (llama.cpp writes some lines in parts),
# per thread: a decode on the scheduler thread and a load elsewhere may log at once.
_lines = threading.local()
# The error lines :func:`errors` keeps: the last few are the cause (llama.cpp
# logs the failure, then each caller up the stack adds a line of its own).
ERRORS_KEPT = 4


def route(level: int, text: bytes) -> None:
    """One call of llama.cpp's callback: emit each finished line at its level."""
    pending_level: int = getattr(_lines, "level", logging.DEBUG)
    pending: str = getattr(_lines, "text", "")
    lines: list[tuple[int, str]] = []
    if level != _CONT:
        new_level = _LEVELS.get(level, logging.DEBUG)
        # A message at another level starts a new line even if the last one
        # never ended (ggml writes some debug lines in pieces at one level).
        if new_level != pending_level and pending.strip():
            lines.append((pending_level, pending))
            pending = ""
        pending_level = new_level
    *done, rest = (pending + text.decode("utf-8", errors="replace")).split("\n")
    # The state is whole before anything is logged: emitting may run the
    # garbage collector, whose freeing of a llama.cpp object logs through
    # here again on this same thread.
    _lines.level, _lines.text = pending_level, rest
    lines += [(pending_level, line) for line in done]
    kept: deque[str] | None = getattr(_lines, "errors", None)
    for line_level, line in lines:
        if line.strip():
            if kept is not None and line_level >= logging.ERROR:
                kept.append(line.strip())
            if line_level == logging.WARNING and any(known in line for known in _ANSWERED):
                line_level = logging.DEBUG
            log.log(line_level, "%s", line.rstrip())


@contextmanager
def errors() -> Iterator[deque[str]]:
    """The error lines llama.cpp logs on this thread inside the block (the
    last ``ERRORS_KEPT``). Per thread: several models may load at once."""
    kept: deque[str] = deque(maxlen=ERRORS_KEPT)
    outer = getattr(_lines, "errors", None)
    _lines.errors = kept
    try:
        yield kept
    finally:
        _lines.errors = outer


def built(build: Callable[[], T]) -> T:
    """Build a llama-cpp-python model or context, its failure in llama.cpp's
    words: its exception says only "Failed to load model from file" or
    "Failed to create llama_context". Build it verbose: ``verbose=False``
    points the whole process's stdout and stderr at /dev/null meanwhile
    (not thread-safe: two models loading at once left the server's log
    there for good), and llama.cpp's lines already come here, its info at
    debug."""
    with errors() as kept:
        try:
            return build()
        except ValueError as exc:
            if not kept:
                raise
            raise ValueError(f"{exc}: {'; '.join(kept)}") from None


@llama_cpp.llama_log_callback
def _callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    try:
        route(level, text)
    except Exception:  # noqa: BLE001 - an exception must never cross into C
        pass


def install() -> None:
    """Send llama.cpp's log here (for the whole process; idempotent)."""
    llama_cpp.llama_log_set(_callback, ctypes.c_void_p(0))
