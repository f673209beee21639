"""Signals raised as exceptions in the main thread.

For the stretches of a process's life whose clean-up a signal's default
action would skip (a launch that must stop the server it started) or where
Python's own handling cannot reach (a model load inside llama.cpp, where a
KeyboardInterrupt raised in the log callback is swallowed by ctypes).
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterable, Iterator
from typing import Any


class Signalled(BaseException):
    """A signal that arrived while ``raised`` was in force.

    A BaseException, as KeyboardInterrupt is: an ``except Exception`` on the
    way must not swallow a request to stop."""

    def __init__(self, sig: int) -> None:
        super().__init__(sig)
        self.signal = sig

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name


@contextlib.contextmanager
def raised(error: type[Signalled], signals: Iterable[int]) -> Iterator[None]:
    """While the block runs, each of ``signals`` raises ``error(sig)`` in the
    main thread.

    - A signal the process was started ignoring stays ignored: whoever
      started it under ``nohup`` (or with SIGINT ignored, as a shell does
      for a background job) asked for that.
    - The first signal puts the previous handlers back before it raises, so
      the clean-up that follows runs undisturbed, and a second signal acts
      as it would have without this (a second Ctrl-C ends a stuck clean-up).
    - The previous handlers are back when the block ends, however it ends.
    """
    previous = {sig: signal.getsignal(sig) for sig in signals}

    def handler(sig: int, frame: Any) -> None:
        restore(previous)
        raise error(sig)

    for sig, before in previous.items():
        if before is not signal.SIG_IGN:
            signal.signal(sig, handler)
    try:
        yield
    finally:
        restore(previous)


def restore(handlers: dict[int, Any]) -> None:
    for sig, handler in handlers.items():
        # None: a handler not set from Python; the default is what stood.
        signal.signal(sig, signal.SIG_DFL if handler is None else handler)
