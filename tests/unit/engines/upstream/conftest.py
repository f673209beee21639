"""One scripted Chat Completions provider per test module (each module's own
autouse fixture clears what the one before queued and recorded)."""

from __future__ import annotations

import pytest

from support.provider import ScriptedProvider


@pytest.fixture(scope="module")
def provider():
    p = ScriptedProvider().start()
    yield p
    p.stop()
