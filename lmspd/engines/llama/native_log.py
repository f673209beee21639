"""llama.cpp's own log lines, through Python logging (``lmspd.llama_cpp``).

llama-cpp-python installs a log callback that prints every line to stderr
unless its logger's level says otherwise, and lmspd drives llama.cpp below
``Llama``, which is where that level is set. A running server then wrote
llama.cpp's graph dumps (~60 lines each time a new batch shape reserves a
graph) and "copying KV buffer" notes into its log between requests. Here
llama.cpp's warnings and errors are warnings and errors of the server's
log; its info and debug lines are debug lines, shown by ``--log-level debug``.
"""

from __future__ import annotations

import ctypes
import logging
import threading

import llama_cpp

log = logging.getLogger("lmspd.llama_cpp")

# ggml_log_level in the ggml.h this build ships: 0 none, 1 debug, 2 info,
# 3 warn, 4 error, 5 cont (the previous line goes on). llama-cpp-python's
# own table is an older order (1 info ... 4 debug).
_LEVELS = {3: logging.WARNING, 4: logging.ERROR}
_CONT = 5
# A line's pieces until its newline (llama.cpp writes some lines in parts),
# per thread: a decode on the scheduler thread and a load elsewhere may log at once.
_lines = threading.local()


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
    for line_level, line in lines:
        if line.strip():
            log.log(line_level, "%s", line.rstrip())


@llama_cpp.llama_log_callback
def _callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    try:
        route(level, text)
    except Exception:  # noqa: BLE001 - an exception must never cross into C
        pass


def install() -> None:
    """Send llama.cpp's log here (for the whole process; idempotent)."""
    llama_cpp.llama_log_set(_callback, ctypes.c_void_p(0))
