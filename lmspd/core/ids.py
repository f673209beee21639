"""Public identifiers: a type prefix, then a time-ordered random part.

Time-ordered so that ids sort by creation (handy for stores and logs);
random so that one credential cannot guess another's ids.
"""

from __future__ import annotations

import os
import time


def new_id(prefix: str) -> str:
    return f"{prefix}_{time.time_ns() // 1_000_000:012x}{os.urandom(10).hex()}"
